"""A Ray attack task's progress, kept by a small actor where the runner reads it at the timeout.

A Ray task given up at its timeout has its worker process killed, possibly on another node, where
a checkpoint file (:mod:`fl_attack.audit.checkpoint`) would be out of the runner's reach. The task
sends its partial results (:mod:`fl_attack.progress`) to the runner's progress board instead, an
actor that any node reaches through Ray, with where it runs (node, process id and that process's
CPU time when the attack started). When the runner gives the task up it reads the board: the last
partial result is kept, and on the runner's own node the task's CPU time is measured as the local
process runner measures its worker's.

The board's class is made inside a function so that Ray ships its code by value: the actor's
process then imports only the standard library, never fl_attack (whose torch import costs seconds
of CPU and hundreds of MiB for a process that only holds bytes).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

from fl_attack.reconstruction import Reconstruction

from .workers import process_cpu_seconds

logger = logging.getLogger(__name__)

#: Seconds the runner waits for the board's answer before it goes on without the task's progress.
BOARD_READ_TIMEOUT = 30.0

#: Where a task runs, as it tells the board: node id, process id, the process's CPU seconds then.
Start = tuple[str, int, float | None]


@functools.cache
def board_class() -> type:
    """The progress board's class (see the module docstring for why it is made here)."""

    class ProgressBoard:
        """The latest job of one runner: where its task started and its last partial result (pickled).

        Jobs are numbered by the runner; a message about an older job (a task that outlived its
        runner's interest) is ignored.
        """

        def __init__(self) -> None:
            self.job = 0
            self.start: Start | None = None
            self.payload: bytes | None = None

        def started(self, job: int, start: Start) -> None:
            if job >= self.job:
                self.job, self.start, self.payload = job, start, None

        def report(self, job: int, payload: bytes) -> None:
            if job == self.job:
                self.payload = payload

        def latest(self, job: int) -> tuple[Start | None, bytes | None]:
            return (self.start, self.payload) if job == self.job else (None, None)

        def forget(self, job: int) -> None:
            if job == self.job:
                self.payload = None

    return ProgressBoard


def make_board() -> Any:
    """A new progress board actor (no CPU of its own, never restarted) on the running Ray."""
    import ray  # pylint: disable=import-outside-toplevel

    return ray.remote(board_class()).options(num_cpus=0, max_restarts=0).remote()


class BoardSink:
    """A progress sink in a Ray task: each partial result is sent to the runner's board.

    Sending never waits for the board; one that fails loses that partial result, never the attack.

    Parameters
    ----------
    board : Any
        The runner's board (a Ray actor handle).
    job : int
        The runner's number for this task.
    """

    def __init__(self, board: Any, job: int) -> None:
        self.board = board
        self.job = job
        self._failed = False

    def report(self, partial: Reconstruction) -> None:
        """Send ``partial`` to the board in place of the one before."""
        try:
            self.board.report.remote(self.job, pickle.dumps(partial, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as error:  # the board is gone: the attack goes on without checkpoints
            if not self._failed:
                logger.warning("could not send the attack's partial result to its progress board: %r", error)
            self._failed = True


def announce(board: Any, job: int) -> BoardSink | None:
    """Tell ``board`` that task ``job`` starts its attack here; the sink for its partial results.

    None (no sink) when there is no board or it cannot be told.
    """
    if board is None:
        return None
    import ray  # pylint: disable=import-outside-toplevel

    try:
        start: Start = (
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
            process_cpu_seconds(os.getpid()),
        )
        board.started.remote(job, start)
    except Exception as error:  # the board is gone: the attack runs without checkpoints
        logger.warning("could not reach the attack's progress board: %r", error)
        return None
    return BoardSink(board, job)


@dataclass(frozen=True)
class TaskProgress:
    """What the board knew of a task when the runner gave it up.

    Attributes
    ----------
    start : Start or None
        Where the task started its attack (node id, process id, that process's CPU seconds then),
        or None when it had not told the board (it had not started).
    partial : Reconstruction or None
        The last partial result it reported.
    unread : str or None
        Why the board could not be read (then nothing else is known).
    """

    start: Start | None = None
    partial: Reconstruction | None = None
    unread: str | None = None

    def cpu_seconds(self, *, here: str) -> float | None:
        """CPU seconds the task's process used since the attack started, measured on this node
        (``here``: its Ray node id); None when the task ran elsewhere or it cannot be read."""
        if self.start is None:
            return None
        node, pid, before = self.start
        after = process_cpu_seconds(pid) if node == here else None
        return None if before is None or after is None else max(after - before, 0.0)

    def cpu_unknown(self, *, here: str) -> str:
        """Why :meth:`cpu_seconds` is None (the timeout then says only the wall time)."""
        if self.unread is not None:
            return f"its progress could not be read ({self.unread})"
        if self.start is not None and self.start[0] != here:
            return "it ran on another node"
        return "its CPU time could not be read"


def read_board(board: Any, job: int, *, timeout: float = BOARD_READ_TIMEOUT) -> TaskProgress:
    """What ``board`` holds of task ``job``: never raises (an unreadable board is said in ``unread``)."""
    import ray  # pylint: disable=import-outside-toplevel

    try:
        start, payload = ray.get(board.latest.remote(job), timeout=timeout)
        partial = None if payload is None else pickle.loads(payload)
    except Exception as error:  # a lost board or a payload this module did not write
        return TaskProgress(unread=f"{type(error).__name__}: {error}")
    return TaskProgress(start=start, partial=partial if isinstance(partial, Reconstruction) else None)
