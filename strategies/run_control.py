"""Stopping an audit from outside its ServerApp: a stop event, the run's stores and a Grid that obeys both.

``fl-attack-audit`` runs the ServerApp in a thread of its own process. When the simulation
runtime fails to start, or the command receives SIGTERM, that thread would otherwise wait for
client replies that never come (Flower waits up to an hour per round) and keep the process
alive. :class:`RunControl` is what the command hands to the ServerApp: setting its stop event
makes every Grid call of the app raise :class:`AuditStopped` (the app then closes its attack
workers and writes no history and no report), and :meth:`RunControl.request_stop` closes the
stores so that nothing is left half-written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fl_attack.results.store import ReconstructionStore

#: Seconds between two polls for replies (Flower's in-memory Grid polls every 0.1 s too).
POLL_SECONDS = 0.1


class AuditStopped(RuntimeError):
    """The audit was asked to stop (a signal, or the simulation runtime failed)."""


@dataclass
class RunControl:
    """What a command running the ServerApp in-process keeps to stop it.

    Attributes
    ----------
    stop : threading.Event
        Set to stop the run: every later Grid call of the app raises :class:`AuditStopped`.
    stores : list[ReconstructionStore]
        The stores the app opened (it registers them as it builds them).
    """

    stop: threading.Event = field(default_factory=threading.Event)
    stores: list[ReconstructionStore] = field(default_factory=list)
    _claim: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _claimed_by: int | None = field(default=None, repr=False)

    def claim_stop(self) -> bool:
        """Whether the calling thread serves the run's stop: the first caller does, and may ask again.

        The main thread normally serves a stop signal; a watchdog thread does when the main
        thread is stuck in native code (:mod:`strategies.stuck_stop`). Exactly one of them
        stops the run and reports it.
        """
        with self._claim:
            if self._claimed_by is None:
                self._claimed_by = threading.get_ident()
            return self._claimed_by == threading.get_ident()

    def register(self, store: ReconstructionStore) -> None:
        """Remember a store of the run; a store registered after a stop is closed at once."""
        self.stores.append(store)
        if self.stop.is_set():
            store.close(timeout=0.0)

    def request_stop(self, *, store_timeout: float = 5.0) -> bool:
        """Stop the run and close its stores.

        Parameters
        ----------
        store_timeout : float (default: 5.0)
            Seconds to wait, per store, for a record being written to be complete.

        Returns
        -------
        bool
            True when no store is still writing.
        """
        self.stop.set()
        settled = [store.close(timeout=store_timeout) for store in list(self.stores)]
        return all(settled)


class StoppableGrid(Grid):
    """A Grid that forwards to another and raises :class:`AuditStopped` once ``stop`` is set.

    Parameters
    ----------
    grid : Grid
        The Grid given to the ServerApp.
    stop : threading.Event
        The run's stop event.
    """

    def __init__(self, grid: Grid, stop: threading.Event) -> None:
        self._grid = grid
        self._stop = stop

    def _check(self) -> None:
        if self._stop.is_set():
            raise AuditStopped("the audit was stopped before it finished")

    def set_run(self, run: Run) -> None:
        """Set the run of the wrapped Grid."""
        self._check()
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped Grid's run."""
        return self._grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message with the wrapped Grid."""
        self._check()
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped Grid's node ids."""
        self._check()
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push with the wrapped Grid."""
        self._check()
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull with the wrapped Grid."""
        self._check()
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and pull their replies until all came, ``timeout`` passed, or the run stops.

        Raises
        ------
        AuditStopped
            When the stop event is set before every reply came.
        """
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            received = list(self.pull_messages(pending))
            replies.extend(received)
            pending.difference_update(reply.metadata.reply_to_message_id for reply in received)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            if self._stop.wait(POLL_SECONDS):
                self._check()
        return replies
