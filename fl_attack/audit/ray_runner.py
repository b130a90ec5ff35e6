"""Run attacks as Ray tasks: on Flower's Ray simulation backend or any Ray cluster.

Each attack is one task with its own CPU / GPU resources, so a deployment whose audit
outgrows one machine scales out on Ray. A task that outlives its timeout is cancelled with
``force=True`` (its worker process is killed), as the local process runner kills its worker.
"""

from __future__ import annotations

import pickle
import time
import traceback
from typing import Any

import numpy as np

from fl_attack.types import LayerAttack, LayerUpdate
from fl_attack.vocabulary import STATUS_ERROR, STATUS_KILLED, STATUS_OK, STATUS_OUT_OF_MEMORY

from .workers import AttackResult, AttackRunner, _invert, _success, _timed_out, is_out_of_memory

#: Seconds ``ray.init`` may take before the audit gives up on Ray (it must never hang a run).
RAY_START_TIMEOUT = 60.0


def _remote_invert(
    attacker: LayerAttack, update: LayerUpdate[np.ndarray], batch_size: int | None, time_budget: float | None
) -> tuple[str, Any, str | None]:
    """The task body: never raises, so that Ray's own errors mean a lost worker."""
    try:
        return STATUS_OK, pickle.dumps(_invert(attacker, update, batch_size, time_budget)), None
    except BaseException as error:
        status = STATUS_OUT_OF_MEMORY if is_out_of_memory(error) else STATUS_ERROR
        return status, f"{type(error).__name__}: {error}", traceback.format_exc()


class RayAttackRunner(AttackRunner):
    """Run each attack as a Ray task.

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
    """

    def __init__(
        self,
        attacker: LayerAttack,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
    ) -> None:
        super().__init__(attacker)
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError(
                f"Ray resources must be non-negative, got num_cpus={num_cpus}, num_gpus={num_gpus}"
            )
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self._task: Any = None

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
            reference = self._remote().remote(self.attacker, update, batch_size, time_budget)
        except Exception as error:
            return AttackResult(
                STATUS_ERROR, None, time.perf_counter() - start, f"{type(error).__name__}: {error}"
            )
        ready, _ = ray.wait([reference], timeout=timeout)
        seconds = time.perf_counter() - start
        if not ready:
            ray.cancel(reference, force=True)
            return _timed_out(timeout, seconds, "Ray task cancelled")
        try:
            status, payload, trace = ray.get(reference)
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.TaskCancelledError) as error:
            return AttackResult(
                STATUS_KILLED, None, seconds, f"the attack's Ray worker died: {type(error).__name__}"
            )
        except ray.exceptions.OutOfMemoryError as error:
            return AttackResult(STATUS_OUT_OF_MEMORY, None, seconds, f"Ray: {error}")
        except ray.exceptions.RayError as error:
            return AttackResult(STATUS_ERROR, None, seconds, f"Ray: {type(error).__name__}: {error}")
        if status == STATUS_OK:
            return _success(pickle.loads(payload), seconds)
        return AttackResult(status, None, seconds, payload, trace)
