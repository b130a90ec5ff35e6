"""Run an attacker on one observed update without ever letting it break the FL run.

Two runners share one interface:

* :class:`ThreadAttackRunner` calls the attacker in a daemon thread of the server
  process. Cheap, and it sees in-memory attacker objects, but an attack that exceeds
  the timeout can only be abandoned: it keeps its CPU and memory until it returns.
* :class:`ProcessAttackRunner` keeps the attacker in a separate worker process
  (``spawn``ed once and reused). An attack that exceeds the timeout is killed, which
  frees its CPU and (GPU) memory, and even a worker killed by the operating system's
  out-of-memory killer only costs that one attack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from fl_attack.types import OPTIONAL_PARTS, LayerAttack, LayerUpdate
from fl_attack.vocabulary import (
    STATUS_ERROR,
    STATUS_KILLED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    STATUS_TIMEOUT,
)

from .next_layer_stage import exact_attack_budget, with_next_layer

#: Seconds a new worker process may take to import the attack before it is given up.
WORKER_STARTUP_TIMEOUT = 300.0


@dataclass(frozen=True)
class AttackResult:
    """Outcome of one guarded attack.

    Attributes
    ----------
    status : str
        ``"ok"``, ``"error"``, ``"timeout"`` or ``"out-of-memory"``.
    reconstruction : Any
        What the attacker returned (None unless ``status`` is ``"ok"``).
    seconds : float
        Wall-clock time until the attack returned, failed or was given up.
    error : str or None
        Description of the failure.
    traceback : str or None
        Formatted traceback of an exception raised by the attacker.
    """

    status: str
    reconstruction: Any
    seconds: float
    error: str | None = None
    traceback: str | None = None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` reports exhausted host or accelerator memory."""
    if isinstance(error, MemoryError):
        return True
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _release_accelerator_memory() -> None:
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def offered_update(attacker: LayerAttack, update: LayerUpdate[np.ndarray]) -> LayerUpdate[np.ndarray]:
    """``update`` as the attacker is given it: of its optional parts only those it uses
    (:attr:`fl_attack.LayerAttack.uses`), and no next-layer update that is frozen or unreadable
    (it holds no activations)."""
    following = update.next_weight_update
    unreadable = following is not None and not (np.isfinite(following).all() and np.any(following != 0))
    left_out: dict[str, Any] = {
        name: None
        for name in OPTIONAL_PARTS
        if getattr(update, name) is not None
        and (name not in attacker.uses or (name == "next_weight_update" and unreadable))
    }
    return dataclasses.replace(update, **left_out) if left_out else update  # nothing left out: no copy


def _invert(
    attacker: LayerAttack, update: LayerUpdate[np.ndarray], batch_size: int | None, time_budget: float | None
) -> Any:
    """The only call into the attacker: the observed update with the parts it uses
    (:func:`offered_update`); then the next-layer route where it applies
    (:mod:`fl_attack.audit.next_layer_stage`)."""
    budget = time_budget if time_budget is not None else getattr(attacker, "time_budget", None)
    route_may_follow = update.next_weight_update is not None and update.after_layers
    started = time.perf_counter()
    reconstruction = attacker.attack(
        offered_update(attacker, update),
        batch_size=batch_size,
        time_budget=exact_attack_budget(budget) if route_may_follow else time_budget,
    )
    if not route_may_follow:
        return reconstruction
    left = None if budget is None else budget - (time.perf_counter() - started)
    return with_next_layer(reconstruction, update, time_budget=left, seed=getattr(attacker, "seed", None))


def _failure(error: BaseException, seconds: float, trace: str | None) -> AttackResult:
    if is_out_of_memory(error):
        _release_accelerator_memory()
        status = STATUS_OUT_OF_MEMORY
    else:
        status = STATUS_ERROR
    return AttackResult(
        status=status,
        reconstruction=None,
        seconds=seconds,
        error=f"{type(error).__name__}: {error}",
        traceback=trace,
    )


def _success(reconstruction: Any, seconds: float) -> AttackResult:
    if getattr(reconstruction, "inputs", None) is None:
        return AttackResult(
            status=STATUS_ERROR,
            reconstruction=None,
            seconds=seconds,
            error=f"attacker returned {type(reconstruction).__name__} without inputs",
        )
    return AttackResult(status=STATUS_OK, reconstruction=reconstruction, seconds=seconds)


def _timed_out(
    timeout: float | None, seconds: float, how: str, cpu_seconds: float | None = None
) -> AttackResult:
    got = (
        ""
        if cpu_seconds is None
        else f"; it got {_seconds(cpu_seconds)} of CPU in {_seconds(seconds)} of wall time"
    )
    return AttackResult(
        status=STATUS_TIMEOUT,
        reconstruction=None,
        seconds=seconds,
        error=f"attack did not finish within the {timeout:g} s timeout ({how}{got})",
    )


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system) process ``pid`` has used so far; None where unknown.

    Read from ``/proc`` (Linux): a starved worker, at idle priority on a busy machine, can reach
    its hard limit having had a fraction of the wall time on a core, and its timeout says so.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / ticks  # utime and stime: fields 14 and 15 of stat


def run_attack(
    attacker: LayerAttack,
    update: LayerUpdate[np.ndarray],
    *,
    batch_size: int | None = None,
    time_budget: float | None = None,
    timeout: float | None = None,
) -> AttackResult:
    """Invert one update in a daemon thread, turning every failure into an AttackResult.

    Parameters
    ----------
    attacker : LayerAttack
        The attack, e.g. ``fl_attack.SpearPlusPlus``.
    update : LayerUpdate[np.ndarray]
        The client's first-layer update and the global layer it started from.
    batch_size : int or None (default: None)
        Batch size handed to the attacker; None lets it estimate the batch size.
    time_budget : float or None (default: None)
        Seconds the attacker is asked to stay within.
    timeout : float or None (default: None)
        Hard limit in seconds after which the attack is abandoned (its thread keeps
        running until the attacker returns); None waits for the attacker.

    Returns
    -------
    AttackResult
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = _invert(attacker, update, batch_size, time_budget)
        except BaseException as error:  # pylint: disable=broad-exception-caught
            outcome["error"] = error
            outcome["traceback"] = traceback.format_exc()

    start = time.perf_counter()
    worker = threading.Thread(target=target, name="fl-attack-inversion", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - start
    if worker.is_alive():
        return _timed_out(timeout, seconds, "abandoned")
    if "error" in outcome:
        return _failure(outcome["error"], seconds, outcome.get("traceback"))
    return _success(outcome.get("value"), seconds)


class AttackRunner(ABC):
    """Runs an attacker on observed updates; every failure becomes an AttackResult."""

    def __init__(self, attacker: LayerAttack) -> None:
        self.attacker = attacker

    @abstractmethod
    def run(
        self,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update (see :func:`run_attack` for the parameters)."""

    def close(self) -> None:  # noqa: B027 - a runner without resources has nothing to release
        """Release the runner's resources; it can still be used afterwards."""


class ThreadAttackRunner(AttackRunner):
    """Run the attacker in a daemon thread of this process (see :func:`run_attack`)."""

    def run(
        self,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update in a thread; a timed-out attack is abandoned."""
        return run_attack(
            self.attacker, update, batch_size=batch_size, time_budget=time_budget, timeout=timeout
        )


#: CPU priorities of a local worker process (``attack-priority``).
WORKER_PRIORITIES = ("idle", "low")


def lower_thread_priority() -> bool:
    """Give the calling thread nice 19 (Linux only, where nice is per thread); whether it worked.

    For the server's pool threads, which judge, score and store finished attacks: the server's
    own thread and the clients of a Ray simulation (nice 15) come first. Not ``SCHED_IDLE``:
    these threads take the GIL, and one that waits indefinitely while holding it would stall
    the server.
    """
    if not sys.platform.startswith("linux"):
        return False  # elsewhere, setpriority on a thread id would change the whole process
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        return False
    return True


def _yield_the_cores(priority: str, pid: int = 0) -> None:
    """Lower the CPU priority of worker process ``pid`` (0: this one) below the federation's.

    ``"idle"``: Linux ``SCHED_IDLE``, the worker takes only CPU time that nothing else wants
    (a weight of 3 against 36 for Ray's client actors, which run at nice 15), so rounds run at
    nearly their own speed; an attack started while every core trains may then use up its
    budget. ``"low"``: nice 19 (weight 15), so the attack also progresses during busy rounds,
    and takes about 15 / (15 + 36) of a core that a client wants. Where ``SCHED_IDLE`` is not
    available, ``"idle"`` falls back to nice 19. The parent applies it as soon as the worker
    starts, so that its imports (seconds of CPU) already run in the background.
    """
    if priority == "idle":
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined,unused-ignore]
            return
    with contextlib.suppress(AttributeError, OSError):  # best effort: some systems refuse it
        os.setpriority(os.PRIO_PROCESS, pid, 19)


def _worker_main(connection: Connection, attacker: LayerAttack, priority: str = "idle") -> None:
    """Worker loop: receive ``(update, batch_size, time_budget)``, send pickled results."""
    _yield_the_cores(priority)
    connection.send(("ready", None, None))
    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        update, batch_size, time_budget = job
        try:
            payload = pickle.dumps(_invert(attacker, update, batch_size, time_budget))
            connection.send(("ok", payload, None))
        except BaseException as error:  # pylint: disable=broad-exception-caught
            kind = "out-of-memory" if is_out_of_memory(error) else "error"
            _release_accelerator_memory()
            connection.send((kind, f"{type(error).__name__}: {error}", traceback.format_exc()))


class ProcessAttackRunner(AttackRunner):
    """Run the attacker in a persistent worker process that is killed on timeout.

    The attacker object is pickled into a ``spawn``ed worker when the first attack
    starts; the worker is reused for later attacks and restarted after a timeout or
    a crash. Worker start-up time does not count against the timeout.

    Parameters
    ----------
    attacker : LayerAttack
        A picklable attacker (e.g. ``fl_attack.SpearPlusPlus``).
    start_method : str (default: "spawn")
        ``multiprocessing`` start method; ``spawn`` is safe with threads and CUDA.
    priority : str (default: "idle")
        The worker's CPU priority, ``"idle"`` or ``"low"`` (see :data:`WORKER_PRIORITIES`).
    """

    def __init__(self, attacker: LayerAttack, *, start_method: str = "spawn", priority: str = "idle") -> None:
        if priority not in WORKER_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(WORKER_PRIORITIES)}, got {priority!r}")
        super().__init__(attacker)
        self.priority = priority
        self._context: Any = multiprocessing.get_context(start_method)
        self._process: Any = None
        self._connection: Connection | None = None

    def _start(self) -> str | None:
        """Start the worker; return why it failed, or None."""
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child, self.attacker, self.priority),
            name="fl-attack-worker",
            daemon=True,
        )
        process.start()
        _yield_the_cores(self.priority, process.pid)
        child.close()
        self._process, self._connection = process, parent
        try:
            if parent.poll(WORKER_STARTUP_TIMEOUT):
                parent.recv()
                return None
        except (EOFError, OSError):
            pass
        self._stop(kill=True)
        return f"the attack worker process did not start (exit code {process.exitcode})"

    def _stop(self, *, kill: bool) -> None:
        process, connection = self._process, self._connection
        self._process, self._connection = None, None
        if connection is not None:
            if not kill:
                try:
                    connection.send(None)
                except (BrokenPipeError, OSError):
                    pass
            connection.close()
        if process is not None:
            if kill:
                process.kill()
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)

    def run(
        self,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update in the worker; a timed-out attack is killed."""
        if self._process is None or not self._process.is_alive():
            self._stop(kill=True)
            failure = self._start()
            if failure is not None:
                return AttackResult(status=STATUS_ERROR, reconstruction=None, seconds=0.0, error=failure)
        assert self._connection is not None and self._process is not None
        start = time.perf_counter()
        cpu_before = process_cpu_seconds(self._process.pid)
        try:
            self._connection.send((update, batch_size, time_budget))
            ready = self._connection.poll(timeout)
            seconds = time.perf_counter() - start
            if not ready:
                cpu_after = process_cpu_seconds(self._process.pid)
                self._stop(kill=True)
                used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
                return _timed_out(timeout, seconds, "worker killed", used)
            kind, payload, trace = self._connection.recv()
        except (EOFError, OSError, BrokenPipeError):
            return self._crashed(time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if kind == STATUS_OK:
            return _success(pickle.loads(payload), seconds)
        status = STATUS_OUT_OF_MEMORY if kind == STATUS_OUT_OF_MEMORY else STATUS_ERROR
        return AttackResult(
            status=status, reconstruction=None, seconds=seconds, error=payload, traceback=trace
        )

    def _crashed(self, seconds: float) -> AttackResult:
        process = self._process
        if process is not None:
            process.join(5.0)
        code = None if process is None else process.exitcode
        self._stop(kill=True)
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return AttackResult(
                status=STATUS_KILLED,
                reconstruction=None,
                seconds=seconds,
                error=f"the attack worker was killed by {name} (the out-of-memory killer sends SIGKILL)",
            )
        return AttackResult(
            status=STATUS_ERROR,
            reconstruction=None,
            seconds=seconds,
            error=f"the attack worker exited unexpectedly (exit code {code})",
        )

    def close(self) -> None:
        """Stop the worker process (a later :meth:`run` starts a new one)."""
        self._stop(kill=False)


def make_runner(attacker: LayerAttack, isolation: str, *, priority: str = "idle") -> AttackRunner:
    """A runner for ``isolation`` ``"thread"`` or ``"process"`` (a worker at ``priority``)."""
    if isolation == "thread":
        return ThreadAttackRunner(attacker)
    if isolation == "process":
        return ProcessAttackRunner(attacker, priority=priority)
    raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
