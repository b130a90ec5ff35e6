"""An attack's best result so far, handed to whoever runs it: kept when the attack is stopped.

An attack reports each improved partial result with :func:`report_progress`; the code that runs
it (the audit's workers, :mod:`fl_attack.audit.workers`) installs a :class:`ProgressSink` around
the call with :func:`reporting_to`. When the attack is then killed or abandoned at its hard
limit, the last partial result is what is kept, marked by :func:`as_partial`.

The sink travels in a context variable rather than as an argument of ``invert`` or an attribute
of the attacker: ``invert``'s signature stays as users know it, and one attacker object shared by
several pool threads (thread isolation) reports each call to its own thread's sink, never to
another's. Without a sink, reporting costs one context-variable lookup.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from fl_attack.reconstruction import Reconstruction


class ProgressSink(Protocol):
    """Receives an attack's partial results, the better one last."""

    def report(self, partial: Reconstruction) -> None:
        """Keep ``partial`` in place of the partial result reported before it."""


@dataclass(frozen=True)
class ActiveSink:
    """The sink of the running attack and when it was installed (``time.perf_counter()``)."""

    sink: ProgressSink
    started: float

    def seconds(self) -> float:
        """Seconds since the sink was installed: how long the attack has run."""
        return time.perf_counter() - self.started

    def report(self, partial: Reconstruction) -> None:
        """Hand ``partial`` to the sink."""
        self.sink.report(partial)


_ACTIVE: ContextVar[ActiveSink | None] = ContextVar("fl_attack_progress_sink", default=None)


@contextmanager
def reporting_to(sink: ProgressSink | None) -> Iterator[None]:
    """Send the partial results of the attacks run inside this block (in this thread) to ``sink``.

    Parameters
    ----------
    sink : ProgressSink or None
        Where partial results go; None reports nowhere.
    """
    token = _ACTIVE.set(None if sink is None else ActiveSink(sink, time.perf_counter()))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_sink() -> ActiveSink | None:
    """The sink installed around the running attack, or None (then nothing needs to be built)."""
    return _ACTIVE.get()


def report_progress(partial: Reconstruction) -> None:
    """Hand ``partial``, the attack's best result so far, to the installed sink (if any)."""
    active = _ACTIVE.get()
    if active is not None:
        active.report(partial)


def as_partial(reconstruction: Reconstruction) -> Reconstruction:
    """``reconstruction`` as the result of an attack stopped before it finished.

    Never complete, whatever the attack had reported (its batch was not verified), and
    ``stats["partial"]`` says that it is a partial result.
    """
    return dataclasses.replace(
        reconstruction, complete=False, stats={**reconstruction.stats, "partial": True}
    )
