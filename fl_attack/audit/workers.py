"""Run an attacker on one observed update without ever letting it break the FL run.

Two runners share one interface:

* :class:`ThreadAttackRunner` calls the attacker in a daemon thread of the server
  process. Cheap, and it sees in-memory attacker objects, but an attack that exceeds
  the timeout can only be abandoned: it keeps its CPU and memory until it returns.
* :class:`ProcessAttackRunner` keeps the attacker in a separate worker process
  (started once and reused: forked for a CPU attack, :func:`worker_start_method`). An attack that exceeds the timeout is killed, which
  frees its CPU and (GPU) memory, and even a worker killed by the operating system's
  out-of-memory killer only costs that one attack.

Either way an attack stopped at the timeout keeps what it had found: the partial results it
reported (:mod:`fl_attack.progress`) wait in a checkpoint (:mod:`fl_attack.audit.checkpoint`),
and the last one comes back with the ``"timeout"`` result, never as a complete batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.progress import as_partial, report_progress, reporting_to
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import OPTIONAL_PARTS, LayerAttack, LayerUpdate
from fl_attack.vocabulary import (
    STATUS_ERROR,
    STATUS_KILLED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    STATUS_TIMEOUT,
)

from .checkpoint import (
    CheckpointFile,
    LatestPartial,
    checkpoint_directory,
    read_checkpoint,
    remove_checkpoint,
)
from .device_share import cap_gpu_memory, check_gpu_memory_share, own_stream
from .memory import release_freed_memory
from .next_layer_stage import with_next_layer

#: The worker process's name in ``ps`` and ``/proc/<pid>/comm`` (a forked worker's command line is
#: the server's own).
WORKER_PROCESS_NAME = "fl-attack-work"

#: How often an idle worker process checks that the server that started it is still alive.
PARENT_CHECK_SECONDS = 1.0

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
        What the attacker returned when ``status`` is ``"ok"``; for a ``"timeout"`` or
        ``"killed"``, the last partial result it reported (:func:`fl_attack.progress.as_partial`:
        never complete), or None; None otherwise.
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
    attacker: LayerAttack,
    update: LayerUpdate[np.ndarray],
    batch_size: int | None,
    time_budget: float | None,
    gpu_memory: float | None = None,
) -> Any:
    """The only call into the attacker: the observed update with the parts it uses
    (:func:`offered_update`) and the attack's one budget, started here (in the worker) once per
    attack: ``time_budget`` seconds, else the attacker's own ``time_budget``; then the
    next-layer route where it applies (:mod:`fl_attack.audit.next_layer_stage`), on the same
    budget. On CUDA the process is first held to ``gpu_memory`` of the device's memory (None: no
    cap) and the whole attack runs on a stream of its own (:mod:`fl_attack.audit.device_share`);
    on the CPU neither changes anything."""
    cap_gpu_memory(gpu_memory, attacker)
    with own_stream(attacker):
        budget = Budget.start(
            time_budget if time_budget is not None else getattr(attacker, "time_budget", None)
        )
        route_may_follow = update.next_weight_update is not None and update.after_layers
        reconstruction = attacker.attack(
            offered_update(attacker, update),
            batch_size=batch_size,
            budget=budget.exact_attack_share() if route_may_follow else budget,
        )
        if not route_may_follow:
            return reconstruction
        report_progress(reconstruction)  # kept should the next-layer route not finish in time
        return with_next_layer(reconstruction, update, budget=budget, seed=getattr(attacker, "seed", None))


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
    timeout: float | None,
    seconds: float,
    how: str,
    cpu_seconds: float | None = None,
    *,
    partial: Reconstruction | None = None,
    runner: str = "it",
    cpu_unknown: str | None = None,
) -> AttackResult:
    """The result of an attack stopped at ``timeout``: with the CPU time ``runner`` (the
    worker, the attack's thread or its Ray task) got, or why it is not known (``cpu_unknown``,
    then only the wall time is said), and the last partial result it reported."""
    if cpu_seconds is not None:
        got = f"; {runner} got {_seconds(cpu_seconds)} of CPU in {_seconds(seconds)} of wall time"
    elif cpu_unknown is not None:
        got = f"; {cpu_unknown}, so only its wall time is known: {_seconds(seconds)}"
    else:
        got = ""
    return AttackResult(
        status=STATUS_TIMEOUT,
        reconstruction=None if partial is None else as_partial(partial),
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
    return _cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(native_id: int) -> float | None:
    """CPU seconds the thread ``native_id`` of this process has used so far; None where unknown.

    Only the thread itself: the work of torch's own pool threads on its behalf is not counted.
    """
    return _cpu_seconds(f"/proc/{os.getpid()}/task/{native_id}/stat")


def _cpu_seconds(stat_path: str) -> float | None:
    try:
        with open(stat_path, encoding="ascii") as stat:
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
    gpu_memory: float | None = None,
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
        Seconds the attacker is asked to stay within (None: the attacker's own ``time_budget``):
        the attack's one :class:`fl_attack.Budget`, started in the worker just before the call.
    timeout : float or None (default: None)
        Hard limit in seconds after which the attack is abandoned (its thread keeps
        running until the attacker returns) with the last partial result it reported;
        None waits for the attacker.
    gpu_memory : float or None (default: None)
        For an attacker on CUDA: the share of the device's memory this process may use
        (:func:`fl_attack.audit.device_share.cap_gpu_memory`; the cap is the whole process's,
        here the caller's); None sets none.

    Returns
    -------
    AttackResult
    """
    outcome: dict[str, Any] = {}
    partials = LatestPartial()

    def target() -> None:
        try:
            with reporting_to(partials):
                outcome["value"] = _invert(attacker, update, batch_size, time_budget, gpu_memory)
        except BaseException as error:  # pylint: disable=broad-exception-caught
            outcome["error"] = error
            outcome["traceback"] = traceback.format_exc()

    start = time.perf_counter()
    worker = threading.Thread(target=target, name="fl-attack-inversion", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - start
    if worker.is_alive():
        used = None if worker.native_id is None else thread_cpu_seconds(worker.native_id)
        return _timed_out(timeout, seconds, "abandoned", used, partial=partials.latest(), runner="its thread")
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

    def sharing(self, attacker: LayerAttack) -> AttackRunner | None:
        """A runner of ``attacker`` in this runner's own worker, or None when this runner has none
        to share or was not made for ``attacker`` (:meth:`ProcessAttackRunner.sharing`): the
        caller then makes its own runner."""
        del attacker
        return None

    def prestart(self) -> None:  # noqa: B027 - a runner without a worker has nothing to start
        """Start what the runner needs before its first attack, where starting it early saves
        memory (:meth:`ProcessAttackRunner.prestart`)."""

    def close(self) -> None:  # noqa: B027 - a runner without resources has nothing to release
        """Release the runner's resources; it can still be used afterwards."""


class ThreadAttackRunner(AttackRunner):
    """Run the attacker in a daemon thread of this process (see :func:`run_attack`).

    Several of these (one per pool thread) run several attacks at once in this one process: on
    CUDA each attack has a stream of its own (:func:`fl_attack.audit.device_share.own_stream`), so
    ``workers`` clients' attacks share one GPU with their kernels free to overlap.

    Parameters
    ----------
    attacker : LayerAttack
        The attack.
    gpu_memory : float or None (default: None)
        For an attacker on CUDA: the share of the device's memory, in (0, 1], that *this process*
        (the server's, with every attack it runs and anything else it does on that device) may
        use; set before each attack. None sets no cap.
    """

    def __init__(self, attacker: LayerAttack, *, gpu_memory: float | None = None) -> None:
        check_gpu_memory_share(gpu_memory)
        super().__init__(attacker)
        self.gpu_memory = gpu_memory

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
            self.attacker,
            update,
            batch_size=batch_size,
            time_budget=time_budget,
            timeout=timeout,
            gpu_memory=self.gpu_memory,
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


def _worker_main(
    connection: Connection,
    attackers: tuple[LayerAttack, ...],
    priority: str = "idle",
    gpu_memory: float | None = None,
) -> None:
    """Worker loop: receive ``(attacker index, update, batch_size, time_budget, checkpoint)``,
    send pickled results; the attack's partial results go to the file ``checkpoint`` meanwhile.
    An attack on CUDA holds this process to ``gpu_memory`` of the device's memory."""
    _yield_the_cores(priority)
    _name_this_process(WORKER_PROCESS_NAME)
    # Ctrl-C reaches the whole process group: the server handles it and stops its workers (a
    # forked worker would otherwise run the server's own handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = os.getppid()
    connection.send(("ready", None, None))
    while True:
        try:
            # other workers forked later hold copies of this pipe's server end, so a server that
            # died leaves no end-of-file here: its worker notices that it was re-parented instead
            while not connection.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != server:
                    return
            job = connection.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        index, update, batch_size, time_budget, checkpoint = job
        try:
            with reporting_to(CheckpointFile(checkpoint)):
                payload = pickle.dumps(_invert(attackers[index], update, batch_size, time_budget, gpu_memory))
            connection.send(("ok", payload, None))
            release_freed_memory()  # the attack's temporaries, freed in whatever order
        except BaseException as error:  # pylint: disable=broad-exception-caught
            kind = "out-of-memory" if is_out_of_memory(error) else "error"
            _release_accelerator_memory()
            connection.send((kind, f"{type(error).__name__}: {error}", traceback.format_exc()))


def _name_this_process(name: str) -> None:
    """Set the calling process's name as ``ps`` shows it (Linux; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # the name is only cosmetic
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _fork_from_a_fresh_thread(process: Any) -> None:
    """Start the forked ``process`` from a new thread that has run no torch operation.

    torch's OpenMP runtime (libgomp) keeps a team of helper threads per thread that ran a
    parallel operation; a child forked from such a thread has only that thread, and its first
    parallel operation waits for the missing helpers forever (a server that had trained or
    evaluated a model before the audit started hung its worker that way). A fresh thread has no
    team, so the child builds its own.
    """
    failures: list[BaseException] = []

    def start() -> None:
        try:
            process.start()
        except BaseException as error:  # pylint: disable=broad-exception-caught
            failures.append(error)

    starter = threading.Thread(target=start, name="fl-attack-fork")
    starter.start()
    starter.join()
    if failures:
        raise failures[0]


def worker_start_method(attacker: LayerAttack, *companions: LayerAttack) -> str:
    """How a worker process for ``attacker`` starts: ``"fork"`` for a CPU attack on Linux, else
    ``"spawn"``.

    A forked worker shares the server's pages (torch's libraries alone take ~300 MiB in every new
    process that imports them) and only its own work is new memory: +32 MiB of the two processes'
    proportional set size after a SPEAR++ attack on a 200 x 3072 layer, against +387 MiB for a
    spawned worker. It also never
    re-runs the server's ``__main__`` module, as ``spawn`` does. A CUDA attack needs ``spawn``: a
    forked child cannot use a CUDA context its parent holds. A worker that also runs
    ``companions`` (:class:`ProcessAttackRunner`) is forked only when every one of them could be.
    """
    if companions:
        methods = {worker_start_method(each) for each in (attacker, *companions)}
        return "spawn" if "spawn" in methods else "fork"
    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    import torch  # pylint: disable=import-outside-toplevel

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "spawn"
    device = str(getattr(attacker, "device", "cpu"))
    if device == "cpu":
        return "fork"
    return "spawn" if device.startswith("cuda") or torch.cuda.is_available() else "fork"


class ProcessAttackRunner(AttackRunner):
    """Run the attacker in a persistent worker process that is killed on timeout.

    The worker starts when the first attack does (:func:`worker_start_method`: forked from the
    server process for a CPU attack, ``spawn``ed with the pickled attacker otherwise); it is
    reused for later attacks and restarted after a timeout or
    a crash. Worker start-up time does not count against the timeout. The attack's partial
    results are checkpointed to a private file (:class:`fl_attack.audit.checkpoint.CheckpointFile`)
    that the runner reads when it kills the worker at the timeout.

    Parameters
    ----------
    attacker : LayerAttack
        A picklable attacker (e.g. ``fl_attack.SpearPlusPlus``).
    start_method : str or None (default: None)
        ``multiprocessing`` start method; None chooses :func:`worker_start_method`.
    priority : str (default: "idle")
        The worker's CPU priority, ``"idle"`` or ``"low"`` (see :data:`WORKER_PRIORITIES`).
    companions : Sequence[LayerAttack] (default: ())
        Further attackers the same worker runs, each through :meth:`sharing` (the auditor's
        fallback attack): one worker process, forked once, instead of one per attacker. A
        companion's attack stopped at the timeout stops the worker, as the attacker's own does.
    gpu_memory : float or None (default: None)
        For an attack on CUDA: the share of the device's memory, in (0, 1], the worker process
        may use (set in the worker before each attack); one that needs more ends with the
        ``"out-of-memory"`` status. None sets no cap.
    """

    def __init__(
        self,
        attacker: LayerAttack,
        *,
        start_method: str | None = None,
        priority: str = "idle",
        companions: Sequence[LayerAttack] = (),
        gpu_memory: float | None = None,
    ) -> None:
        if priority not in WORKER_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(WORKER_PRIORITIES)}, got {priority!r}")
        check_gpu_memory_share(gpu_memory)
        super().__init__(attacker)
        self.priority = priority
        self.gpu_memory = gpu_memory
        self.attackers: tuple[LayerAttack, ...] = (attacker, *companions)
        self.start_method = start_method or worker_start_method(attacker, *companions)
        self._context: Any = multiprocessing.get_context(self.start_method)
        self._process: Any = None
        self._connection: Connection | None = None
        self._checkpoints: Path | None = None
        self._jobs = 0

    def prestart(self) -> None:
        """Fork the worker now rather than at the first attack.

        A forked worker keeps, as its own memory, every page of the server that the server
        changes after the fork; forked while the server is small (when the audit is set up,
        before any client's reply arrives) it keeps little. A spawned worker starts at the first
        attack as before (its imports take seconds). A failed start is retried at the first attack.
        """
        if self.start_method == "fork" and (self._process is None or not self._process.is_alive()):
            if self._start() is not None:
                self._stop(kill=True)

    def _start(self) -> str | None:
        """Start the worker; return why it failed, or None."""
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child, self.attackers, self.priority, self.gpu_memory),
            name="fl-attack-worker",
            daemon=True,
        )
        if self.start_method == "fork":
            _fork_from_a_fresh_thread(process)
        else:
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
        return self.run_as(0, update, batch_size=batch_size, time_budget=time_budget, timeout=timeout)

    def sharing(self, attacker: LayerAttack) -> AttackRunner | None:
        """A runner of ``attacker`` in this runner's worker when it is one of its companions (by
        identity); None otherwise."""
        for index, companion in enumerate(self.attackers[1:], start=1):
            if companion is attacker:
                return _CompanionRunner(self, index)
        return None

    def run_as(
        self,
        index: int,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update with ``self.attackers[index]`` in the worker; a timed-out attack is killed."""
        if self._process is None or not self._process.is_alive():
            self._stop(kill=True)
            failure = self._start()
            if failure is not None:
                return AttackResult(status=STATUS_ERROR, reconstruction=None, seconds=0.0, error=failure)
        assert self._connection is not None and self._process is not None
        checkpoint = self._next_checkpoint()
        start = time.perf_counter()
        cpu_before = process_cpu_seconds(self._process.pid)
        try:
            self._connection.send((index, update, batch_size, time_budget, checkpoint))
            ready = self._connection.poll(timeout)
            seconds = time.perf_counter() - start
            if not ready:
                cpu_after = process_cpu_seconds(self._process.pid)
                self._stop(kill=True)
                used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
                # read once the worker is dead: the checkpoint no longer changes
                partial = read_checkpoint(checkpoint)
                remove_checkpoint(checkpoint)
                return _timed_out(timeout, seconds, "worker killed", used, partial=partial)
            kind, payload, trace = self._connection.recv()
        except (EOFError, OSError, BrokenPipeError):
            return self._crashed(time.perf_counter() - start, checkpoint=checkpoint)
        remove_checkpoint(checkpoint)  # the job is over: its partial results are not needed
        seconds = time.perf_counter() - start
        if kind == STATUS_OK:
            return _success(pickle.loads(payload), seconds)
        status = STATUS_OUT_OF_MEMORY if kind == STATUS_OUT_OF_MEMORY else STATUS_ERROR
        return AttackResult(
            status=status, reconstruction=None, seconds=seconds, error=payload, traceback=trace
        )

    def _next_checkpoint(self) -> Path:
        """A fresh checkpoint path for the next job (never a stale result); the last job's goes."""
        if self._checkpoints is None or not self._checkpoints.is_dir():
            self._checkpoints = checkpoint_directory()
        remove_checkpoint(self._checkpoints / f"job-{self._jobs}.pickle")
        self._jobs += 1
        return self._checkpoints / f"job-{self._jobs}.pickle"

    def _crashed(self, seconds: float, *, checkpoint: Path | None = None) -> AttackResult:
        """The result of a worker that died during the job; one killed by a signal keeps the
        job's last checkpoint (``checkpoint``), as one killed at the timeout does."""
        process = self._process
        if process is not None:
            process.join(5.0)
        code = None if process is None else process.exitcode
        self._stop(kill=True)
        partial = None if checkpoint is None else read_checkpoint(checkpoint)
        if checkpoint is not None:
            remove_checkpoint(checkpoint)
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return AttackResult(
                status=STATUS_KILLED,
                reconstruction=None if partial is None else as_partial(partial),
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
        """Stop the worker process and remove its checkpoints (a later :meth:`run` starts a new one)."""
        self._stop(kill=False)
        if self._checkpoints is not None:
            shutil.rmtree(self._checkpoints, ignore_errors=True)
            self._checkpoints = None


class _CompanionRunner(AttackRunner):
    """Runs a companion attacker of a :class:`ProcessAttackRunner` in that runner's worker."""

    def __init__(self, owner: ProcessAttackRunner, index: int) -> None:
        super().__init__(owner.attackers[index])
        self._owner, self._index = owner, index

    def run(
        self,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update in the owner's worker (see :meth:`ProcessAttackRunner.run_as`)."""
        return self._owner.run_as(
            self._index, update, batch_size=batch_size, time_budget=time_budget, timeout=timeout
        )


def make_runner(
    attacker: LayerAttack,
    isolation: str,
    *,
    priority: str = "idle",
    companions: Sequence[LayerAttack] = (),
    gpu_memory: float | None = None,
) -> AttackRunner:
    """A runner for ``isolation`` ``"thread"`` or ``"process"`` (a worker at ``priority``, which
    also runs ``companions``: :meth:`AttackRunner.sharing`; a thread runner runs none), whose
    process a CUDA attack holds to ``gpu_memory`` of the device's memory (None: no cap)."""
    if isolation == "thread":
        return ThreadAttackRunner(attacker, gpu_memory=gpu_memory)
    if isolation == "process":
        return ProcessAttackRunner(attacker, priority=priority, companions=companions, gpu_memory=gpu_memory)
    raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
