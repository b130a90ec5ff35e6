"""One attack's time budget: every share of it, and the deadlines the stages check.

A :class:`Budget` is made once per attack, when the attack starts (:meth:`Budget.start`). It owns
every share of the budget that a stage or a caller needs: the decomposition's, the search's (what
is left once the selection's finishing work is set aside), the pruning grace past the budget, the
exact attack's share when the next-layer route may follow it, and (:func:`hard_limit`) the hard
limit after which an audit gives the worker up. Stages receive a :class:`Deadline` (a point in time) from it and ask
:meth:`Deadline.expired` between bounded chunks of work (:mod:`.deadline`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from fl_attack.validation import check_time_budget

#: The decomposition must end within this share of the budget, else the attack stops there; the
#: rest is left (as the search leaves it) for the scorer, the final selection and the self-check.
DECOMPOSITION_SHARE = 0.95
#: At most this share of the budget is set aside, after the search, for the selection's finish.
FINISH_FRACTION = 0.05
#: Seconds past the budget a running selection may spend pruning: at most this many, ...
PRUNE_GRACE = 30.0
#: ... and at most this share of the budget: with the stages' own overrun (one chunk of work
#: each), the attack returns within 110% of its budget.
PRUNE_GRACE_FRACTION = 0.05
#: The next-layer route's share when it may follow the exact attack (the exact attack gets the rest).
NEXT_LAYER_SHARE = 0.5
#: The hard limit of a guarded attack: this many times the budget ...
TIMEOUT_FACTOR = 1.5
#: ... plus this many seconds (process start, import, hand-back).
TIMEOUT_GRACE = 15.0


def now() -> float:
    """The clock every deadline and budget reads (``time.perf_counter()``), read in this one place."""
    return time.perf_counter()


@dataclass(frozen=True, order=True)
class Deadline:
    """A point in time (a :func:`now` value) by which a stage must stop; ``math.inf``: never.

    Attributes
    ----------
    at : float
        The :func:`now` value of the deadline.
    """

    at: float = math.inf

    @classmethod
    def never(cls) -> Deadline:
        """A deadline that never passes."""
        return cls(math.inf)

    @classmethod
    def in_seconds(cls, seconds: float | None) -> Deadline:
        """The deadline ``seconds`` from now (None or ``math.inf``: never)."""
        if seconds is None or seconds == math.inf:
            return cls.never()
        return cls(now() + seconds)

    @property
    def bounded(self) -> bool:
        """Whether the deadline can pass at all."""
        return math.isfinite(self.at)

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return now() > self.at

    def remaining(self) -> float:
        """Seconds left (negative once passed; ``math.inf`` for a deadline that never passes)."""
        return self.at - now()

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` of work started now end by the deadline."""
        return now() + seconds <= self.at

    def within(self, seconds: float) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now (a stage's own share of the time left)."""
        return Deadline(min(self.at, now() + seconds))


@dataclass(frozen=True)
class Budget:
    """One attack's time budget: its start, its length and the shares the stages get.

    Attributes
    ----------
    seconds : float or None
        The budget's length; None for an attack without a time limit.
    started : float
        The :func:`now` value at which the attack started.
    """

    seconds: float | None
    started: float

    @classmethod
    def start(cls, seconds: float | None) -> Budget:
        """The budget of an attack that starts now.

        Raises
        ------
        ValueError
            Unless ``seconds`` is a positive number of seconds, ``math.inf`` or None (no limit).
        """
        if seconds is not None and seconds != math.inf:
            seconds = check_time_budget(seconds)
        return cls(seconds=seconds, started=now())

    @property
    def bounded(self) -> bool:
        """Whether the budget has a finite length."""
        return self.seconds is not None and math.isfinite(self.seconds)

    def elapsed(self) -> float:
        """Seconds since the attack started."""
        return now() - self.started

    def _after(self, seconds: float) -> Deadline:
        return Deadline(self.started + seconds) if self.bounded else Deadline.never()

    @property
    def deadline(self) -> Deadline:
        """The end of the budget."""
        return self._after(self.seconds or math.inf)

    def expired(self) -> bool:
        """Whether the whole budget is spent."""
        return self.deadline.expired()

    def remaining(self) -> float:
        """Seconds left of the budget (``math.inf`` without a limit)."""
        return self.deadline.remaining()

    @property
    def decomposition(self) -> Deadline:
        """The decomposition's deadline: :data:`DECOMPOSITION_SHARE` of the budget."""
        return self._after(DECOMPOSITION_SHARE * (self.seconds or math.inf))

    def search(self, finishing_seconds: float) -> Deadline:
        """The search's deadline: the budget less the selection's finishing work, of which at
        most :data:`FINISH_FRACTION` of the budget is set aside."""
        seconds = self.seconds or math.inf
        return self._after(seconds - min(FINISH_FRACTION * seconds, finishing_seconds))

    @property
    def pruning(self) -> Deadline:
        """The deadline of a running selection's pruning: the budget plus a grace of at most
        :data:`PRUNE_GRACE` seconds and :data:`PRUNE_GRACE_FRACTION` of the budget."""
        seconds = self.seconds or math.inf
        return self._after(seconds + min(PRUNE_GRACE, PRUNE_GRACE_FRACTION * seconds))

    def exact_attack_share(self) -> Budget:
        """The exact attack's budget when the next-layer route may follow it (same start)."""
        if not self.bounded:
            return self
        assert self.seconds is not None
        return Budget(seconds=(1.0 - NEXT_LAYER_SHARE) * self.seconds, started=self.started)


def hard_limit(seconds: float) -> float:
    """The wall-clock limit after which an audit gives up an attack with a ``seconds`` budget."""
    return TIMEOUT_FACTOR * seconds + TIMEOUT_GRACE
