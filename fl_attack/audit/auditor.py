"""The honest-but-curious auditor: select, attack, judge, score and store, with no FL framework.

A framework's strategy wrapper calls :meth:`Auditor.start_round` with the global arrays it
sends and :meth:`Auditor.audit_round` with the clients' replies; everything else happens
here. The attacker sees the observed layer update and the global layer, nothing more; the
ground truth, when a client sent it, is used afterwards for scoring only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_attack.results.store import AttackRecord, ReconstructionStore
from fl_attack.simulate.secagg import SecAggPlusQuantization
from fl_attack.types import LayerAttack, LayerUpdate
from fl_attack.validation import check_batch_size, check_time_budget
from fl_attack.vocabulary import (
    STATUS_DROPPED,
    STATUS_ERROR,
    STATUS_NOT_RUN,
    STATUS_OK,
    VERDICT_DROPPED,
    VERDICT_NOT_APPLICABLE,
)

from .fallback import build_fallback
from .layer import LayerKeys, NamedArrays, SentLayer, select_layer
from .memory import release_freed_memory
from .observations import ClientIdentity, ClientUpdate
from .pool import AttackPool
from .prepare import GlobalLayer, finite_layer, prepare_unit, round_layer
from .selection import select_units
from .signature import UpdateSignature, magnitude_concentration, update_signature
from .spectrum_check import SpectrumRuling, ruled_out_by_spectrum, spectrum_guided
from .spill import SPILL_FOLDER, QueueSpill
from .units import (
    Prepared,
    attack_summary,
    member_quality,
    to_numpy,
    total_examples,
    unit_details,
    unit_name,
)
from .verdict import Verdict, decide_verdict
from .workers import WORKER_PRIORITIES, AttackResult, AttackRunner, make_runner

if TYPE_CHECKING:
    from fl_attack.evaluation.scoring import ReconstructionScorer, Scored

logger = logging.getLogger(__name__)


class Auditor:
    """Attack the first-layer updates of a federated round and keep what leaked.

    Parameters
    ----------
    attacker : LayerAttack
        The gradient-inversion attack run on each update (e.g. ``fl_attack.SpearPlusPlus``).
    store : ReconstructionStore or None (default: None)
        Where reconstructions, verdicts and quality are written; None keeps them in
        :attr:`records` only. With a store, records keep no arrays (bounded memory).
    scorer : ReconstructionScorer or None (default: None)
        Renders reconstructions and scores them when clients sent ground truth.
    weight_key, bias_key : str or None (default: None)
        The attacked layer; None picks the first 2-D weight followed by its bias.
    attack_fraction : float (default: 1.0)
        Fraction of the eligible updates attacked each round, drawn at random.
    attack_partitions : Collection[int] or None (default: None)
        Attack only clients reporting one of these partition ids; None attacks all.
    batch_size : int or None (default: None)
        Batch size per client told to the attacker; None lets it estimate.
    time_budget : float or None (default: None)
        Seconds each attack may spend.
    timeout : float or None (default: None)
        Hard limit per attack, after which it is stopped and recorded as a timeout.
    isolation : str (default: "thread")
        ``"thread"`` or ``"process"`` (a worker process killed on timeout).
    priority : str (default: "idle")
        CPU priority of local worker processes: ``"idle"`` (only CPU time the federation
        leaves) or ``"low"`` (nice 19); see :data:`fl_attack.audit.workers.WORKER_PRIORITIES`.
    seed : int (default: 0)
        Seeds the draw of attacked updates when ``attack_fraction < 1``.
    secagg_group_size : int (default: 1)
        Simulated secure aggregation: the server only sees the sum of each group of this
        many clients (in partition order); each sum is attacked as one batch.
    secagg_quantization : SecAggPlusQuantization or None (default: None)
        With groups, Flower's SecAgg+ sum (clip, quantize, modular sum, dequantize;
        :func:`fl_attack.simulate.secagg.secagg_observed_sum`) instead of a float sum.
    workers : int (default: 0)
        Attacks that run at once off the round's critical path (:class:`AttackPool`); 0 runs
        each attack inside :meth:`audit_round`. With workers, call :meth:`drain` or
        :meth:`close` before reading the results.
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
    progress : bool (default: False)
        Show the queue's progress on stderr.
    fallback : str or LayerAttack or None (default: None)
        Approximate second attack on updates not recovered exactly (:mod:`fl_attack.audit.fallback`).
    """

    def __init__(
        self,
        attacker: LayerAttack,
        *,
        store: ReconstructionStore | None = None,
        scorer: ReconstructionScorer | None = None,
        weight_key: str | None = None,
        bias_key: str | None = None,
        attack_fraction: float = 1.0,
        attack_partitions: Collection[int] | None = None,
        batch_size: int | None = None,
        time_budget: float | None = None,
        timeout: float | None = None,
        isolation: str = "thread",
        priority: str = "idle",
        seed: int = 0,
        secagg_group_size: int = 1,
        secagg_quantization: SecAggPlusQuantization | None = None,
        workers: int = 0,
        queue_size: int | None = None,
        queue_policy: str = "block",
        backend: str = "local",
        ray_address: str | None = None,
        attack_cpus: float = 1.0,
        attack_gpus: float = 0.0,
        progress: bool = False,
        fallback: str | LayerAttack | None = None,
    ) -> None:
        if not 0.0 <= attack_fraction <= 1.0:
            raise ValueError(f"attack_fraction must be in [0, 1], got {attack_fraction}")
        if (
            isinstance(secagg_group_size, bool)
            or not isinstance(secagg_group_size, int)
            or secagg_group_size < 1
        ):
            raise ValueError(f"secagg_group_size must be a positive integer, got {secagg_group_size!r}")
        check_batch_size(batch_size)
        check_time_budget(time_budget)
        check_time_budget(timeout, name="timeout")
        if priority not in WORKER_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(WORKER_PRIORITIES)}, got {priority!r}")
        if backend not in ("local", "ray"):
            raise ValueError(f"backend must be 'local' or 'ray', got {backend!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be a non-negative integer, got {workers!r}")
        self.attacker = attacker
        #: SPEAR-family attackers: an update whose spectrum rules them out is not attacked.
        self._spectrum_guided = spectrum_guided(attacker)
        self.fallback = build_fallback(fallback, seed=seed, time_budget=time_budget)
        self.isolation, self.priority = isolation, priority
        self.backend = backend
        self.ray_address = ray_address
        self.attack_cpus = attack_cpus
        self.attack_gpus = attack_gpus
        self.runner = self._make_runner()
        self._runners: list[AttackRunner] = [self.runner]
        self._thread_runner = threading.local()
        self._store_lock = threading.Lock()
        self.pool = (
            AttackPool(
                workers=workers, queue_size=queue_size, policy=queue_policy, progress=progress, seed=seed
            )
            if workers > 0
            else None
        )
        self.store = store
        self._spill = (
            None if store is None or self.pool is None else QueueSpill(store.directory / SPILL_FOLDER)
        )
        self.scorer = scorer
        self.weight_key = weight_key or None
        self.bias_key = bias_key or None
        self.attack_fraction = attack_fraction
        self.attack_partitions = None if attack_partitions is None else frozenset(attack_partitions)
        self.batch_size = batch_size
        self.time_budget = time_budget
        self.timeout = timeout
        self.seed = seed
        self.secagg_group_size = secagg_group_size
        self.secagg_quantization = secagg_quantization if secagg_group_size > 1 else None
        self.layer: LayerKeys | None = None
        self.records: list[AttackRecord] = []
        #: Why results could not be stored (a full disk, ...): the run must not end as a success.
        self.store_failures: list[str] = []
        self._global_layer: dict[int, GlobalLayer] = {}

    # ---------------------------------------------------------------- round API

    def select_layer(self, global_arrays: NamedArrays) -> LayerKeys:
        """Fix the attacked layer from the model's arrays (once); raises LayerNotFoundError."""
        if self.layer is None:
            self.layer = select_layer(global_arrays, weight_key=self.weight_key, bias_key=self.bias_key)
            logger.info(
                "Auditing layer %s / %s (%s)", self.layer.weight, self.layer.bias, self.layer.input_space
            )
        return self.layer

    def start_round(self, server_round: int, global_arrays: NamedArrays) -> None:
        """Remember the global layer (and the layer that directly follows it) sent in ``server_round``."""
        self._global_layer[server_round] = round_layer(global_arrays, self.select_layer(global_arrays))

    def audit_round(self, server_round: int, updates: Sequence[ClientUpdate]) -> list[AttackRecord]:
        """Attack the selected updates of a round; never raises for a single failed attack.

        Returns
        -------
        list[AttackRecord]
            The records of this round (also appended to :attr:`records`).
        """
        global_layer = self._global_layer.pop(server_round, None)
        if global_layer is None or self.layer is None:
            logger.warning("round %s was not started on the auditor; nothing attacked", server_round)
            return []
        produced = []
        global_finite = finite_layer(global_layer)
        for members in self.select(server_round, updates):
            try:
                prepared = self._prepare(server_round, members, global_layer, global_finite=global_finite)
            except Exception as error:  # an audit must never stop training
                prepared = self._failed(
                    server_round, members, f"audit failed: {type(error).__name__}: {error}", None
                )
            if isinstance(prepared, AttackRecord):
                produced.append(self._keep(prepared))
            elif self.pool is None:
                prepared = prepared.materialized()
                record = self.fallback.annotate(self, prepared, self._run_job(prepared, time.time()))
                produced.append(self._keep(record))
                produced.extend(self.fallback.run(self, prepared, produced[-1]))
            else:
                self.pool.submit(
                    unit_name(members),
                    functools.partial(self._pool_job, prepared),
                    functools.partial(self._dropped_job, prepared),
                )
                if self._spill is not None and isinstance(prepared.update, SentLayer):
                    self._spill.add(prepared.update, queued=self.pool.pending)
        return produced

    def record_vanished(self, server_round: int, failures: Sequence[tuple[int, str]]) -> list[AttackRecord]:
        """Record the clients whose training reply was an error: no update, nothing to attack."""
        produced = []
        for node_id, why in failures:
            member = ClientUpdate(identity=ClientIdentity(node_id=node_id), arrays=None, error=why)
            produced.append(self._keep(self._failed(server_round, [member], f"no update: {why}", None)))
        return produced

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued attack has finished (a no-op without workers)."""
        return True if self.pool is None else self.pool.drain(timeout)

    def _make_runner(self) -> AttackRunner:
        if self.backend == "ray":
            from .ray_runner import RayAttackRunner

            return RayAttackRunner(
                self.attacker, address=self.ray_address, num_cpus=self.attack_cpus, num_gpus=self.attack_gpus
            )
        return make_runner(self.attacker, self.isolation, priority=self.priority)

    def _pool_runner(self) -> AttackRunner:
        runner = getattr(self._thread_runner, "value", None)
        if runner is None:
            runner = self._make_runner()
            self._thread_runner.value = runner
            with self._store_lock:
                self._runners.append(runner)
        return runner

    def _pool_job(self, prepared: Prepared, queued_at: float) -> None:
        try:
            # the float64 update exists only while its attack (and the fallback) runs
            prepared = prepared.materialized()
            record = self._run_job(prepared, queued_at, runner=self._pool_runner())
        except Exception as error:  # never lose an attack to a bug: record it
            record = self._failed(
                prepared.server_round,
                prepared.members,
                f"audit failed: {type(error).__name__}: {error}",
                None,
            )
        self.fallback.run(self, prepared, self._keep(self.fallback.annotate(self, prepared, record)))
        del prepared, record
        # queued updates are freed in the order attacks finish: give their pages back
        release_freed_memory()

    def _dropped_job(self, prepared: Prepared, queued_at: float) -> None:
        assert self.layer is not None
        prepared.discard()
        self._keep(
            AttackRecord(
                server_round=prepared.server_round,
                client=unit_name(prepared.members),
                status=STATUS_DROPPED,
                seconds=0.0,
                error=f"the attack queue was full (policy {self.pool.policy if self.pool else '?'})",
                details=self._details(prepared.members),
                verdict=VERDICT_DROPPED,
                verdict_reason="the attack queue was full and its policy dropped this update",
                input_space=self.layer.input_space,
                queued_at=queued_at,
            )
        )

    def select(self, server_round: int, updates: Sequence[ClientUpdate]) -> list[list[ClientUpdate]]:
        """The units attacked this round: single updates, or secure-aggregation groups."""
        return select_units(
            updates,
            server_round=server_round,
            partitions=self.attack_partitions,
            group_size=self.secagg_group_size,
            fraction=self.attack_fraction,
            seed=self.seed,
        )

    def close(self) -> None:
        """Wait for every queued attack, then stop the attack workers."""
        if self.pool is not None:
            self.pool.close()
        if self._spill is not None:
            self._spill.close()
        for runner in self._runners:
            runner.close()

    # ------------------------------------------------------------------ one unit

    def _prepare(
        self,
        server_round: int,
        members: list[ClientUpdate],
        global_layer: GlobalLayer,
        *,
        global_finite: bool | None = None,
    ) -> AttackRecord | Prepared:
        """The observed update of one unit (:func:`prepare_unit`), or the record of why it cannot be attacked."""
        assert self.layer is not None
        prepared = prepare_unit(
            server_round,
            members,
            global_layer,
            layer=self.layer,
            quantization=self.secagg_quantization,
            seed=self.seed,
            global_finite=global_finite,
        )
        return self._failed(server_round, members, prepared, None) if isinstance(prepared, str) else prepared

    def _run_job(
        self, prepared: Prepared, queued_at: float, runner: AttackRunner | None = None
    ) -> AttackRecord:
        """Attack one prepared unit, judge and score it (in a pool thread when there is a pool)."""
        assert self.layer is not None
        server_round, members, delta = prepared.server_round, prepared.members, prepared.delta
        batch_size = None if self.batch_size is None else self.batch_size * len(members)
        started_at = time.time()
        signature: Callable[[], UpdateSignature] = functools.cache(
            functools.partial(update_signature, delta.weight_update)
        )  # computed once, and only when needed
        ruled_out = self._ruled_out(delta, members, signature) if batch_size is None else None
        if ruled_out is not None:
            result = AttackResult(STATUS_NOT_RUN, None, time.time() - started_at, None)
            verdict = Verdict(VERDICT_NOT_APPLICABLE, ruled_out.reason)
        else:
            result = (runner or self.runner).run(
                delta, batch_size=batch_size, time_budget=self.time_budget, timeout=self.timeout
            )
        finished_at = time.time()
        summary = {"attack": getattr(self.attacker, "name", None), **attack_summary(result)}
        if ruled_out is not None:
            summary["low_rank"] = ruled_out.low_rank
            if ruled_out.batch_size is not None:
                summary["batch_size"] = (
                    ruled_out.batch_size
                )  # the spectrum's estimate, as the attack's would be
        if ruled_out is None:
            verdict = self._verdict(result, summary, delta, members, signature)
        name = unit_name(members)
        level = logging.INFO if result.status in (STATUS_OK, STATUS_NOT_RUN) else logging.WARNING
        logger.log(
            level, "Attack on %s in round %s: %s (%s)", name, server_round, verdict.verdict, verdict.reason
        )
        details = self._details(members)
        if result.traceback:
            details["traceback"] = result.traceback
        record_fields: dict[str, Any] = {
            "server_round": server_round,
            "client": name,
            "status": result.status,
            "seconds": result.seconds,
            "error": result.error,
            "attack": summary,
            "details": details,
            "verdict": verdict.verdict,
            "verdict_reason": verdict.reason,
            "input_space": self.layer.input_space,
            "queued_at": queued_at,
            "started_at": started_at,
            "finished_at": finished_at,
        }
        return self._finished_record(record_fields, result, members, details)

    def _finished_record(
        self,
        fields: dict[str, Any],
        result: AttackResult,
        members: list[ClientUpdate],
        details: dict[str, Any],
    ) -> AttackRecord:
        """The record of a finished attack, scored against the members' ground truth when it returned inputs."""
        if result.status != STATUS_OK:
            return AttackRecord(**fields)
        inputs = np.asarray(to_numpy(result.reconstruction.inputs), dtype=np.float64)
        scored, scoring_error = self._score(inputs, members, details)
        if scoring_error is not None:
            fields["error"] = scoring_error
        return AttackRecord(
            **fields,
            inputs=inputs,
            reconstructed_images=None if scored is None else scored.reconstructed_images,
            reference_images=None if scored is None else scored.reference_images,
            quality={} if scored is None else scored.quality,
            psnr=None if scored is None else scored.psnr,
        )

    def _ruled_out(
        self,
        delta: LayerUpdate[np.ndarray],
        members: list[ClientUpdate],
        signature: Callable[[], UpdateSignature],
    ) -> SpectrumRuling | None:
        """What the spectrum says of an update it rules out (:mod:`.spectrum_check`), or None."""
        if not self._spectrum_guided:
            return None
        modes = {member.train_mode for member in members if member.train_mode}
        try:
            return ruled_out_by_spectrum(
                delta,
                signature=signature,
                train_mode=modes.pop() if len(modes) == 1 else None,
                num_examples=total_examples(members),
            )
        except ValueError:  # an update the check cannot read: the attack reports it
            return None

    def _verdict(
        self,
        result: AttackResult,
        summary: Mapping[str, Any],
        delta: LayerUpdate[np.ndarray],
        members: list[ClientUpdate],
        signature: Callable[[], UpdateSignature],
    ) -> Verdict:
        modes = {member.train_mode for member in members if member.train_mode}
        return decide_verdict(
            status=result.status,
            error=result.error,
            attack=summary,
            signature=signature,
            magnitude_concentration=magnitude_concentration(delta.weight_update),
            input_space=self.layer.input_space if self.layer else None,
            train_mode=modes.pop() if len(modes) == 1 else None,
            time_budget=self.time_budget,
            num_examples=total_examples(members),
        )

    def _score(
        self, inputs: np.ndarray, members: list[ClientUpdate], details: dict[str, Any]
    ) -> tuple[Scored | None, str | None]:
        """Render and, with every member's ground truth, score; a failure is returned, not raised."""
        if self.scorer is None:
            return None, None
        try:
            truths = [member.ground_truth for member in members]
            if any(truth is None for truth in truths):
                return self.scorer.render(inputs), None
            references = [self.scorer.references(truth) for truth in truths if truth is not None]
            scored = self.scorer.score_against(inputs, np.concatenate(references))
            if len(members) > 1:
                details["members"] = member_quality(members, [len(r) for r in references], scored)
            return scored, None
        except Exception as failure:  # scoring is the experimenter's side: never stop the run
            error = f"scoring failed: {type(failure).__name__}: {failure}"
            logger.warning("%s", error)
            return None, error

    def _details(self, members: list[ClientUpdate]) -> dict[str, Any]:
        return unit_details(members, self.layer)

    def _failed(
        self, server_round: int, members: list[ClientUpdate], error: str, verdict: Verdict | None
    ) -> AttackRecord:
        logger.warning("Attack on %s in round %s: %s", unit_name(members), server_round, error)
        decided = verdict or Verdict("failed", error)
        return AttackRecord(
            server_round=server_round,
            client=unit_name(members),
            status=STATUS_ERROR,
            seconds=0.0,
            error=error,
            details=self._details(members),
            verdict=decided.verdict,
            verdict_reason=decided.reason,
            input_space=None if self.layer is None else self.layer.input_space,
        )

    def _keep(self, record: AttackRecord) -> AttackRecord:
        """Write a record to the store and remember it, without its arrays once stored.

        A store that fails (a full disk) is logged and remembered in :attr:`store_failures`;
        training goes on, but the run must report the loss (the ServerApp raises at its end).
        """
        with self._store_lock:
            if self.store is not None:
                try:
                    self.store.save(record)
                    record = dataclasses.replace(
                        record, inputs=None, reconstructed_images=None, reference_images=None
                    )
                except Exception as error:  # the FL run goes on; the failure is loud
                    message = f"round {record.server_round} {record.client}: {type(error).__name__}: {error}"
                    self.store_failures.append(message)
                    logger.error("Could not store the attack on %s", message)
            self.records.append(record)
        return record
