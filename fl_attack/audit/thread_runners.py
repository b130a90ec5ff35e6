"""One attack runner per pool thread, made on the thread's first attack and closed together."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .workers import AttackRunner


class RunnerPerThread:
    """The calling thread's runner (each thread has its own: a worker process is not shared).

    Parameters
    ----------
    make : Callable[[], AttackRunner]
        Makes a runner, once per thread that asks for one.
    """

    def __init__(self, make: Callable[[], AttackRunner]) -> None:
        self._make = make
        self._local = threading.local()
        self._made: list[AttackRunner] = []
        self._lock = threading.Lock()

    def get(self) -> AttackRunner:
        """This thread's runner, made on first use."""
        runner: AttackRunner | None = getattr(self._local, "value", None)
        if runner is None:
            runner = self._make()
            self._local.value = runner
            with self._lock:
                self._made.append(runner)
        return runner

    def close(self) -> None:
        """Stop every runner made so far, in the order they were made."""
        with self._lock:
            made = list(self._made)
        for runner in made:
            runner.close()
