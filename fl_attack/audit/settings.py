"""The auditor's settings, in four groups, each checked when it is made.

:class:`AttackSettings` says what each attack is aimed at, told and allowed;
:class:`ExecutionSettings` where and how many attacks run; :class:`SamplingSettings` which
updates of a round are attacked; :class:`SecAggSettings` the simulated secure aggregation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from fl_attack.simulate.secagg import SecAggPlusQuantization
from fl_attack.types import LayerAttack
from fl_attack.validation import check_batch_size, check_time_budget

from .device_share import check_gpu_memory_share
from .workers import WORKER_PRIORITIES, AttackRunner, make_runner

#: Where attacks run: a worker process or thread per pool worker, or Ray tasks.
BACKENDS = ("local", "ray")


@dataclass(frozen=True, kw_only=True)
class AttackSettings:
    """What each attack is aimed at, told and allowed.

    Parameters
    ----------
    weight_key, bias_key : str or None (default: None)
        The attacked layer; None (or ``""``) picks the first 2-D weight followed by its bias.
    batch_size : int or None (default: None)
        Batch size per client told to the attacker; None lets it estimate.
    time_budget : float or None (default: None)
        Seconds each attack may spend.
    timeout : float or None (default: None)
        Hard limit per attack, after which it is stopped and recorded as a timeout.
    fallback : str or LayerAttack or None (default: None)
        Approximate second attack on updates not recovered exactly (:mod:`fl_attack.audit.fallback`):
        a registered attack's name, a :class:`fl_attack.types.LayerAttack`, or None / ``""`` /
        ``"none"`` for none.

    Raises
    ------
    ValueError
        On a batch size, time budget or timeout out of range, or a fallback of another kind.
    """

    weight_key: str | None = None
    bias_key: str | None = None
    batch_size: int | None = None
    time_budget: float | None = None
    timeout: float | None = None
    fallback: str | LayerAttack | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_key", self.weight_key or None)
        object.__setattr__(self, "bias_key", self.bias_key or None)
        check_batch_size(self.batch_size)
        check_time_budget(self.time_budget)
        check_time_budget(self.timeout, name="timeout")
        fallback = self.fallback
        if fallback is not None and not isinstance(fallback, (str, LayerAttack)):
            raise ValueError(f"fallback must be an attack name, a LayerAttack or None, got {fallback!r}")


@dataclass(frozen=True, kw_only=True)
class ExecutionSettings:
    """Where attacks run and how many at once.

    Parameters
    ----------
    isolation : str (default: "thread")
        ``"thread"`` or ``"process"`` (a worker process killed on timeout).
    priority : str (default: "idle")
        CPU priority of local worker processes: ``"idle"`` (only CPU time the federation
        leaves) or ``"low"`` (nice 19); see :data:`fl_attack.audit.workers.WORKER_PRIORITIES`.
    workers : int (default: 0)
        Attacks that run at once off the round's critical path (:class:`~fl_attack.audit.pool.AttackPool`);
        0 runs each attack inside :meth:`~fl_attack.audit.Auditor.audit_round`. With workers, call
        :meth:`~fl_attack.audit.Auditor.drain` or :meth:`~fl_attack.audit.Auditor.close` before
        reading the results.
    queue_size : int or None (default: None)
        Attacks that may wait for a worker; None: unbounded.
    queue_policy : str (default: "block")
        ``"block"``, ``"drop-oldest"`` or ``"sample"`` when the queue is full; a dropped attack
        is recorded with status and verdict ``dropped``.
    backend : str (default: "local")
        ``"local"`` (a worker process or thread per pool worker) or ``"ray"`` (each attack a
        Ray task with ``attack_cpus`` / ``attack_gpus``, on the running Ray or ``ray_address``).
    ray_address : str or None (default: None)
        Ray cluster to connect to when Ray is not initialised yet (None: a local Ray).
    attack_cpus, attack_gpus : float (default: 1.0, 0.0)
        Ray resources of one attack.
    attack_gpu_memory : float or None (default: None)
        For attacks on CUDA: the share of the GPU's memory, in (0, 1], that each process running
        attacks may use (:func:`fl_attack.audit.device_share.cap_gpu_memory`), so that an attack
        needing more ends as ``"out-of-memory"`` instead of starving the others. It caps the
        process, not one attack: a local worker process (``isolation="process"``); with
        ``isolation="thread"`` the server process itself, shared by its ``workers`` concurrent
        attacks and anything else it runs on that GPU; on Ray each task's worker process. None: no
        cap, except on Ray with 0 < ``attack_gpus`` < 1, where each task is held to its
        ``attack_gpus`` share (Ray's fractional GPUs do not limit memory by themselves).
    progress : bool (default: False)
        Show the queue's progress on stderr.

    Raises
    ------
    ValueError
        On an unknown priority or backend, a negative or non-integer number of workers, or a GPU
        memory share outside (0, 1].
    """

    isolation: str = "thread"
    priority: str = "idle"
    workers: int = 0
    queue_size: int | None = None
    queue_policy: str = "block"
    backend: str = "local"
    ray_address: str | None = None
    attack_cpus: float = 1.0
    attack_gpus: float = 0.0
    attack_gpu_memory: float | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.priority not in WORKER_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(WORKER_PRIORITIES)}, got {self.priority!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'local' or 'ray', got {self.backend!r}")
        workers = self.workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be a non-negative integer, got {workers!r}")
        check_gpu_memory_share(self.attack_gpu_memory)

    def make_runner(self, attacker: LayerAttack, *, companions: Sequence[LayerAttack] = ()) -> AttackRunner:
        """A runner of ``attacker`` on this backend: a Ray task runner, or a local thread or process
        (a worker process also runs ``companions``: :meth:`AttackRunner.sharing`)."""
        if self.backend == "ray":
            from .ray_runner import RayAttackRunner  # Ray is imported only when asked for

            return RayAttackRunner(
                attacker,
                address=self.ray_address,
                num_cpus=self.attack_cpus,
                num_gpus=self.attack_gpus,
                gpu_memory=self.attack_gpu_memory,
            )
        return make_runner(
            attacker,
            self.isolation,
            priority=self.priority,
            companions=companions,
            gpu_memory=self.attack_gpu_memory,
        )


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Which updates of a round are attacked.

    Parameters
    ----------
    attack_fraction : float (default: 1.0)
        Fraction of the eligible updates attacked each round, drawn at random.
    attack_partitions : Collection[int] or None (default: None)
        Attack only clients reporting one of these partition ids (kept as a frozenset); None
        attacks all.

    Raises
    ------
    ValueError
        On a fraction outside [0, 1].
    """

    attack_fraction: float = 1.0
    attack_partitions: Collection[int] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.attack_fraction <= 1.0:
            raise ValueError(f"attack_fraction must be in [0, 1], got {self.attack_fraction}")
        if self.attack_partitions is not None:
            object.__setattr__(self, "attack_partitions", frozenset(self.attack_partitions))


@dataclass(frozen=True, kw_only=True)
class SecAggSettings:
    """Simulated secure aggregation: the server only sees sums of groups of clients.

    Parameters
    ----------
    group_size : int (default: 1)
        The server only sees the sum of each group of this many clients (in partition order);
        each sum is attacked as one batch. 1: no secure aggregation.
    quantization : SecAggPlusQuantization or None (default: None)
        With groups, Flower's SecAgg+ sum (clip, quantize, modular sum, dequantize;
        :func:`fl_attack.simulate.secagg.secagg_observed_sum`) instead of a float sum; dropped
        (None) when ``group_size`` is 1.

    Raises
    ------
    ValueError
        On a group size that is not a positive integer.
    """

    group_size: int = 1
    quantization: SecAggPlusQuantization | None = None

    def __post_init__(self) -> None:
        size = self.group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"secagg_group_size must be a positive integer, got {size!r}")
        if size == 1:
            object.__setattr__(self, "quantization", None)
