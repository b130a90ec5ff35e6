"""Attacks off the round's critical path: a bounded queue served by a pool of workers.

Each pool thread owns one runner (a worker process by default, see
:mod:`fl_attack.audit.workers`), or hands its job to Ray, so ``attack-workers`` attacks run
at once while the federation trains on. The queue is bounded; when it is full its policy
decides, and a dropped job is reported to the caller, never lost silently.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .workers import lower_thread_priority

QUEUE_POLICIES = ("block", "drop-oldest", "sample")

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One queued attack. ``run`` and ``dropped`` hold the attack's arrays: both are released
    (set to None) as soon as the job has run or been dropped, so that a finished job holds none."""

    name: str
    run: Callable[[float], Any] | None
    dropped: Callable[[float], Any] | None
    queued_at: float = field(default_factory=time.time)
    future: Future[Any] | None = None
    started: bool = False

    def release(self) -> None:
        """Drop the callbacks (and with them the arrays they hold)."""
        self.run = self.dropped = None


class AttackPool:
    """Run attack jobs on ``workers`` threads behind a queue of ``queue_size`` waiting jobs.

    Parameters
    ----------
    workers : int
        Jobs that run at once (each thread drives one runner or one Ray task).
    queue_size : int or None (default: None)
        Jobs that may wait; None waits without bound.
    policy : str (default: "block")
        When the queue is full: ``"block"`` waits for a free place, ``"drop-oldest"`` drops
        the longest-waiting job, ``"sample"`` drops a waiting job (or the new one) at random,
        so that the queue holds a uniform sample. A dropped job's ``dropped`` callback runs.
    progress : bool (default: False)
        Show queued / running / done on stderr.
    seed : int (default: 0)
        Seeds the ``"sample"`` policy.
    """

    def __init__(
        self,
        *,
        workers: int,
        queue_size: int | None = None,
        policy: str = "block",
        progress: bool = False,
        seed: int = 0,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if queue_size is not None and (
            isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1
        ):
            raise ValueError(f"queue_size must be a positive integer or None, got {queue_size!r}")
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy must be one of {', '.join(QUEUE_POLICIES)}; got {policy!r}")
        self.workers = workers
        self.queue_size = queue_size
        self.policy = policy
        # the pool threads judge, score and store finished attacks: the round's own work goes first
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="fl-attack-pool", initializer=lower_thread_priority
        )
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []
        self._random = random.Random(seed)
        self._bar = tqdm(total=0, desc="attacks", unit="attack", disable=not progress, leave=True)
        self.dropped = 0
        self.done = 0

    def submit(self, name: str, run: Callable[[float], Any], dropped: Callable[[float], Any]) -> None:
        """Queue one job: ``run(queued_at)`` on a worker, or ``dropped(queued_at)`` if the policy drops it."""
        job = _Job(name=name, run=run, dropped=dropped)
        victim = self._make_room(job)
        if victim is job:
            self._drop(job)
            return
        if victim is not None:
            self._drop(victim)
        with self._lock:
            self._jobs.append(job)
            self._bar.total += 1
            self._bar.refresh()
        job.future = self._executor.submit(self._execute, job)

    def _waiting(self) -> list[_Job]:
        return [
            job for job in self._jobs if not job.started and job.future is not None and not job.future.done()
        ]

    def _make_room(self, job: _Job) -> _Job | None:
        """The job to drop so that ``job`` fits (``job`` itself, a waiting one, or None)."""
        if self.queue_size is None:
            return None
        while True:
            with self._lock:
                waiting = self._waiting()
                if len(waiting) < self.queue_size:
                    return None
                if self.policy == "drop-oldest":
                    candidates = [waiting[0]]
                elif self.policy == "sample":
                    index = self._random.randrange(len(waiting) + 1)
                    if index == len(waiting):
                        return job
                    candidates = [waiting[index]]
                else:
                    candidates = []
                for candidate in candidates:
                    if candidate.future is not None and candidate.future.cancel():
                        self._jobs.remove(candidate)
                        return candidate
                futures = [item.future for item in self._jobs if item.future is not None]
            wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)

    def _drop(self, job: _Job) -> None:
        self.dropped += 1
        dropped = job.dropped
        job.release()
        if dropped is not None:
            dropped(job.queued_at)
        self._bar.set_postfix(dropped=self.dropped)

    def _execute(self, job: _Job) -> None:
        job.started = True
        self._update_bar()
        run = job.run
        job.release()
        try:
            if run is not None:
                run(job.queued_at)
        except Exception as error:  # jobs record their own failures: this is a bug in a job, never fatal
            logger.error("the attack job on %s raised: %r", job.name, error)
        finally:
            del run  # the job's arrays go now, not when the thread takes its next job
            with self._lock:
                self.done += 1
                # a finished job leaves the pool: the pool holds only waiting and running jobs
                if job in self._jobs:
                    self._jobs.remove(job)
            self._update_bar(advance=True)

    def _update_bar(self, *, advance: bool = False) -> None:
        with self._lock:
            running = sum(
                1 for job in self._jobs if job.started and job.future is not None and not job.future.done()
            )
            queued = len(self._waiting())
            if advance:
                self._bar.update(1)
            self._bar.set_postfix(queued=queued, running=running, dropped=self.dropped)

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return sum(1 for job in self._jobs if job.future is not None and not job.future.done())

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has finished; return whether all did within ``timeout``."""
        with self._lock:
            futures = [job.future for job in self._jobs if job.future is not None]
        _, unfinished = wait(futures, timeout=timeout)
        return not unfinished

    def close(self) -> None:
        """Drain the queue and stop the threads."""
        self.drain()
        self._executor.shutdown(wait=True)
        self._bar.close()
