"""Run attacks as Ray tasks: on Flower's Ray simulation backend or any Ray cluster.

Each attack is one task with its own CPU / GPU resources, so a deployment whose audit
outgrows one machine scales out on Ray. A task that outlives its timeout is cancelled with
``force=True`` (its worker process is killed), as the local process runner kills its worker, and
keeps what it had found: its partial results wait on the runner's progress board
(:mod:`fl_attack.audit.ray_progress`), from whichever node it ran on.

Ray's fractional GPUs only share out a GPU's scheduling, not its memory: a task given
``num_gpus=0.25`` may still take the whole device's memory. A runner with a fraction below one
therefore also holds each task's process to that share of the memory
(:func:`fl_attack.audit.device_share.cap_gpu_memory`), unless told another share.
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from typing import Any

import numpy as np

from fl_attack.progress import as_partial, reporting_to
from fl_attack.types import LayerAttack, LayerUpdate
from fl_attack.vocabulary import STATUS_ERROR, STATUS_KILLED, STATUS_OK, STATUS_OUT_OF_MEMORY

from .device_share import check_gpu_memory_share
from .ray_progress import TaskProgress, announce, make_board, read_board
from .workers import AttackResult, AttackRunner, _invert, _success, _timed_out, is_out_of_memory

logger = logging.getLogger(__name__)

#: Seconds ``ray.init`` may take before the audit gives up on Ray (it must never hang a run).
RAY_START_TIMEOUT = 60.0


def gpu_share_cap(num_gpus: float) -> float | None:
    """The memory share that goes with a Ray GPU share: ``num_gpus`` when it is a fraction of one
    GPU (0 < ``num_gpus`` < 1), else None (no GPU, or whole GPUs of the task's own)."""
    return float(num_gpus) if 0.0 < num_gpus < 1.0 else None


def _remote_invert(
    attacker: LayerAttack,
    update: LayerUpdate[np.ndarray],
    batch_size: int | None,
    time_budget: float | None,
    board: Any = None,
    job: int = 0,
    gpu_memory: float | None = None,
) -> tuple[str, Any, str | None]:
    """The task body: never raises, so that Ray's own errors mean a lost worker. Its partial
    results go to ``board`` (None: nowhere) as job ``job``; an attack on CUDA first holds the
    task's worker process to ``gpu_memory`` of the device's memory (None: no cap)."""
    try:
        with reporting_to(announce(board, job)):
            reconstruction = _invert(attacker, update, batch_size, time_budget, gpu_memory)
            return STATUS_OK, pickle.dumps(reconstruction), None
    except BaseException as error:
        status = STATUS_OUT_OF_MEMORY if is_out_of_memory(error) else STATUS_ERROR
        return status, f"{type(error).__name__}: {error}", traceback.format_exc()


class RayAttackRunner(AttackRunner):
    """Run each attack as a Ray task; one given up at its timeout keeps its last partial result.

    The tasks report their partial results to one progress board per runner, a Ray actor without
    CPUs of its own (:mod:`fl_attack.audit.ray_progress`), so a task on any node keeps them; its
    CPU time is said in the timeout when it ran on the runner's node.

    Parameters
    ----------
    attacker : LayerAttack
        A picklable attack.
    address : str or None (default: None)
        Ray cluster address, used only when Ray is not initialised in this process yet
        (inside a Flower simulation it already is); None starts a local Ray.
    num_cpus, num_gpus : float (default: 1.0, 0.0)
        Resources of one attack task. Under Flower's Ray simulation, leave CPUs free for
        them (the clients' actors hold theirs), or a task waits until its timeout.
    gpu_memory : float or None (default: None)
        Share of the GPU's memory, in (0, 1], each task's process may use when the attack runs on
        CUDA; None: ``num_gpus`` when it is a fraction below one (so a fractional GPU also limits
        memory), else no cap. Read it back as :attr:`gpu_memory`.

    Raises
    ------
    ValueError
        On negative resources or a memory share outside (0, 1].
    """

    def __init__(
        self,
        attacker: LayerAttack,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        gpu_memory: float | None = None,
    ) -> None:
        super().__init__(attacker)
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError(
                f"Ray resources must be non-negative, got num_cpus={num_cpus}, num_gpus={num_gpus}"
            )
        check_gpu_memory_share(gpu_memory)
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        #: The memory share each task's process is held to on CUDA (None: no cap).
        self.gpu_memory = gpu_memory if gpu_memory is not None else gpu_share_cap(num_gpus)
        self._task: Any = None
        self._board: Any = None
        self._board_failure: str | None = None
        self._jobs = 0

    def _remote(self) -> Any:
        import ray

        if not ray.is_initialized():
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            except Exception as error:
                raise RuntimeError(
                    f"Ray could not start or connect ({type(error).__name__}: {error})"
                ) from error
        if self._task is None:
            self._task = ray.remote(_remote_invert).options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=0
            )
        return self._task

    def _progress_board(self) -> Any:
        """The runner's progress board, made on first use; None when Ray could not make it (the
        attacks then run without checkpoints, and a timeout says so)."""
        if self._board is None and self._board_failure is None:
            try:
                self._board = make_board()
            except Exception as error:  # the attack itself can still run
                self._board_failure = f"no progress board: {type(error).__name__}: {error}"
                logger.warning("the Ray attack tasks run without checkpoints (%s)", self._board_failure)
        return self._board

    def run(
        self,
        update: LayerUpdate[np.ndarray],
        *,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
    ) -> AttackResult:
        """Invert one update in a Ray task; a timed-out task is cancelled and its worker killed."""
        import ray

        start = time.perf_counter()
        try:
            task = self._remote()
            board = self._progress_board()
            self._jobs += 1
            reference = task.remote(
                self.attacker, update, batch_size, time_budget, board, self._jobs, self.gpu_memory
            )
        except Exception as error:
            return AttackResult(
                STATUS_ERROR, None, time.perf_counter() - start, f"{type(error).__name__}: {error}"
            )
        ready, _ = ray.wait([reference], timeout=timeout)
        seconds = time.perf_counter() - start
        if not ready:
            return self._give_up(reference, timeout, seconds)
        try:
            status, payload, trace = ray.get(reference)
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.TaskCancelledError) as error:
            partial = self._progress().partial  # the worker is dead: the board no longer changes
            return AttackResult(
                STATUS_KILLED,
                None if partial is None else as_partial(partial),
                seconds,
                f"the attack's Ray worker died: {type(error).__name__}",
            )
        except ray.exceptions.OutOfMemoryError as error:
            return AttackResult(STATUS_OUT_OF_MEMORY, None, seconds, f"Ray: {error}")
        except ray.exceptions.RayError as error:
            return AttackResult(STATUS_ERROR, None, seconds, f"Ray: {type(error).__name__}: {error}")
        finally:
            self._forget()
        if status == STATUS_OK:
            return _success(pickle.loads(payload), seconds)
        return AttackResult(status, None, seconds, payload, trace)

    def _give_up(self, reference: Any, timeout: float | None, seconds: float) -> AttackResult:
        """Cancel the task at its timeout, with its CPU time (read before it is killed) and the last
        partial result it reported."""
        import ray

        progress = self._progress()
        here = ray.get_runtime_context().get_node_id()
        cpu = progress.cpu_seconds(here=here)
        ray.cancel(reference, force=True)
        self._forget()
        if progress.start is None and progress.unread is None and self._board is not None:
            how = (
                "Ray task cancelled before it started the attack: it waited for a Ray worker and free "
                "resources"
            )
            return _timed_out(timeout, seconds, how)
        unknown = self._board_failure or progress.cpu_unknown(here=here)
        return _timed_out(
            timeout, seconds, "Ray task cancelled", cpu, partial=progress.partial, cpu_unknown=unknown
        )

    def _progress(self) -> TaskProgress:
        """What the board holds of the current job (nothing without a board)."""
        return TaskProgress() if self._board is None else read_board(self._board, self._jobs)

    def _forget(self) -> None:
        """Let the board drop the current job's partial result (the runner has what it needs)."""
        if self._board is not None:
            try:
                self._board.forget.remote(self._jobs)
            except Exception as error:  # a lost board holds nothing any more
                logger.debug("could not clear the progress board: %r", error)

    def close(self) -> None:
        """Stop the progress board (a later :meth:`run` makes a new one)."""
        board, self._board, self._board_failure = self._board, None, None
        if board is None:
            return
        import ray

        if ray.is_initialized():
            try:
                ray.kill(board)
            except Exception as error:  # already gone with its node
                logger.debug("could not stop the progress board: %r", error)
