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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fl_attack.results.store import AttackRecord, ReconstructionStore
from fl_attack.types import LayerAttack, LayerUpdate
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
from .records import RecordKeeper
from .selection import select_units
from .settings import AttackSettings, ExecutionSettings, SamplingSettings, SecAggSettings
from .signature import UpdateSignature, magnitude_concentration, update_signature
from .spectrum_check import SpectrumCheck, check_spectrum, spectrum_guided
from .spill import SPILL_FOLDER, QueueSpill
from .thread_runners import RunnerPerThread
from .training_facts import ObservedTraining
from .units import Prepared, attack_summary, total_examples, unit_name
from .verdict import Verdict, decide_verdict
from .workers import AttackResult, AttackRunner

if TYPE_CHECKING:
    import numpy as np

    from fl_attack.evaluation.scoring import ReconstructionScorer

logger = logging.getLogger(__name__)


class Auditor:
    """Attack the first-layer updates of a federated round and keep what leaked.

    Parameters
    ----------
    attacker : LayerAttack
        The gradient-inversion attack run on each update (e.g. ``fl_attack.SpearPlusPlus``):
        ``attack(update, batch_size=..., budget=...)`` (:class:`fl_attack.types.LayerAttack`).
    store : ReconstructionStore or None (default: None)
        Where reconstructions, verdicts and quality are written; None keeps them in
        :attr:`records` only. With a store, records keep no arrays (bounded memory).
    scorer : ReconstructionScorer or None (default: None)
        Renders reconstructions and scores them when clients sent ground truth.
    attack : AttackSettings or None (default: None, the defaults of :class:`AttackSettings`)
        The attacked layer, the batch size, time budget and timeout each attack gets, and the
        approximate fallback attack (:mod:`fl_attack.audit.fallback`).
    execution : ExecutionSettings or None (default: None, the defaults of :class:`ExecutionSettings`)
        Where attacks run (a thread, a worker process or Ray) and how many at once, off the
        round's critical path; with workers, call :meth:`drain` or :meth:`close` before
        reading the results.
    sampling : SamplingSettings or None (default: None, the defaults of :class:`SamplingSettings`)
        Which updates of a round are attacked (a random fraction, chosen partitions).
    secagg : SecAggSettings or None (default: None, the defaults of :class:`SecAggSettings`)
        Simulated secure aggregation: groups of clients whose sum is attacked as one batch.
    seed : int (default: 0)
        Seeds the draw of attacked updates when ``sampling.attack_fraction < 1``, the queue's
        ``"sample"`` policy, SecAgg+'s stochastic rounding and a fallback built by name.
    """

    def __init__(
        self,
        attacker: LayerAttack,
        *,
        store: ReconstructionStore | None = None,
        scorer: ReconstructionScorer | None = None,
        attack: AttackSettings | None = None,
        execution: ExecutionSettings | None = None,
        sampling: SamplingSettings | None = None,
        secagg: SecAggSettings | None = None,
        seed: int = 0,
    ) -> None:
        self.attacker = attacker
        attack = AttackSettings() if attack is None else attack
        execution = ExecutionSettings() if execution is None else execution
        self.attack, self.execution = attack, execution
        self.sampling = SamplingSettings() if sampling is None else sampling
        self.secagg = SecAggSettings() if secagg is None else secagg
        self.seed = seed
        #: Describes, scores, stores and remembers every record, the fallback's too.
        self.keeper = RecordKeeper(store=store, scorer=scorer)
        #: SPEAR-family attackers: an update whose spectrum rules them out is not attacked.
        self._spectrum_guided = spectrum_guided(attacker)
        #: The optional parts of an update the attacker reads (the train config reaches it only then).
        self._uses: frozenset[str] = frozenset(getattr(attacker, "uses", frozenset()))
        self.fallback = build_fallback(attack, seed=seed, execution=execution, keeper=self.keeper)
        # the fallback runs in the exact attack's worker: one process forked at start-up, not a
        # second one forked at the first fallback, while the server holds a round's replies
        companions = self.fallback.companions
        self.runner = execution.make_runner(attacker, companions=companions)
        self._pool_runners = RunnerPerThread(
            functools.partial(execution.make_runner, attacker, companions=companions)
        )
        self.pool = (
            AttackPool(
                workers=execution.workers,
                queue_size=execution.queue_size,
                policy=execution.queue_policy,
                progress=execution.progress,
                seed=seed,
            )
            if execution.workers > 0
            else None
        )
        self._spill = (
            None if store is None or self.pool is None else QueueSpill(store.directory / SPILL_FOLDER)
        )
        self._global_layer: dict[int, GlobalLayer] = {}
        # a forked worker started now, while the server holds no client's reply yet, keeps little
        # of the server's later memory as its own (ProcessAttackRunner.prestart)
        if self.pool is not None:
            self._pool_runners.prestart()
        else:
            self.runner.prestart()

    @property
    def store(self) -> ReconstructionStore | None:
        """Where records are written (None: :attr:`records` only)."""
        return self.keeper.store

    @property
    def scorer(self) -> ReconstructionScorer | None:
        """Renders and scores reconstructions (None: not scored)."""
        return self.keeper.scorer

    @property
    def layer(self) -> LayerKeys | None:
        """The attacked layer, once :meth:`select_layer` has chosen it."""
        return self.keeper.layer

    @property
    def records(self) -> list[AttackRecord]:
        """Every record so far (without arrays when a store keeps them)."""
        return self.keeper.records

    @property
    def store_failures(self) -> list[str]:
        """Why results could not be stored (a full disk, ...): the run must not end as a success."""
        return self.keeper.store_failures

    # ---------------------------------------------------------------- round API

    def select_layer(self, global_arrays: NamedArrays) -> LayerKeys:
        """Fix the attacked layer from the model's arrays (once); raises LayerNotFoundError."""
        layer = self.keeper.layer
        if layer is None:
            layer = select_layer(
                global_arrays, weight_key=self.attack.weight_key, bias_key=self.attack.bias_key
            )
            self.keeper.layer = layer
            logger.info("Auditing layer %s / %s (%s)", layer.weight, layer.bias, layer.input_space)
        return layer

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
                produced.append(self.keeper.keep(prepared))
            elif self.pool is None:
                prepared = prepared.materialized()
                record = self.fallback.annotate(prepared, self._run_job(prepared, time.time()))
                produced.append(self.keeper.keep(record))
                produced.extend(self.fallback.run(prepared, produced[-1], beside=self.runner))
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
            produced.append(self.keeper.keep(self._failed(server_round, [member], f"no update: {why}", None)))
        return produced

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued attack has finished (a no-op without workers)."""
        return True if self.pool is None else self.pool.drain(timeout)

    def _pool_job(self, prepared: Prepared, queued_at: float) -> None:
        runner: AttackRunner | None = None
        try:
            runner = self._pool_runners.get()
            # the float64 update exists only while its attack (and the fallback) runs
            prepared = prepared.materialized()
            record = self._run_job(prepared, queued_at, runner=runner)
        except Exception as error:  # never lose an attack to a bug: record it
            record = self._failed(
                prepared.server_round,
                prepared.members,
                f"audit failed: {type(error).__name__}: {error}",
                None,
            )
        self.fallback.run(prepared, self.keeper.keep(self.fallback.annotate(prepared, record)), beside=runner)
        del prepared, record
        # queued updates are freed in the order attacks finish: give their pages back
        release_freed_memory()

    def _dropped_job(self, prepared: Prepared, queued_at: float) -> None:
        assert self.layer is not None
        prepared.discard()
        self.keeper.keep(
            AttackRecord(
                server_round=prepared.server_round,
                client=unit_name(prepared.members),
                status=STATUS_DROPPED,
                seconds=0.0,
                error=f"the attack queue was full (policy {self.pool.policy if self.pool else '?'})",
                details=self.keeper.details(prepared.members),
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
            partitions=self.sampling.attack_partitions,
            group_size=self.secagg.group_size,
            fraction=self.sampling.attack_fraction,
            seed=self.seed,
        )

    def close(self) -> None:
        """Wait for every queued attack, then stop the attack workers."""
        if self.pool is not None:
            self.pool.close()
        if self._spill is not None:
            self._spill.close()
        self.runner.close()
        self._pool_runners.close()
        self.fallback.close()

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
            quantization=self.secagg.quantization,
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
        batch_size = None if self.attack.batch_size is None else self.attack.batch_size * len(members)
        training = ObservedTraining.of_members(
            [member.num_examples for member in members], [member.train_config for member in members]
        )
        started_at = time.time()
        signature: Callable[[], UpdateSignature] = functools.cache(
            functools.partial(update_signature, delta.weight_update)
        )  # computed once, and only when needed
        spectrum = self._spectrum(delta, members, signature) if batch_size is None else None
        ruled_out = None if spectrum is None else spectrum.ruling
        reported_batch = None
        if batch_size is None and spectrum is not None:
            # num-examples only where the spectrum shows it: a count of mini-batches never reaches the attack
            reported_batch = batch_size = training.batch_size_for(spectrum_rank=spectrum.rank)
        modes = {member.train_mode for member in members if member.train_mode}
        mode = modes.pop() if len(modes) == 1 else None
        known = training.known_training(train_mode=mode) if "local_training" in self._uses else None
        delta = dataclasses.replace(delta, local_training=known) if known is not None else delta
        if ruled_out is not None:
            result = AttackResult(STATUS_NOT_RUN, None, time.time() - started_at, None)
            verdict = Verdict(VERDICT_NOT_APPLICABLE, ruled_out.reason)
        else:
            result = (runner or self.runner).run(
                delta, batch_size=batch_size, time_budget=self.attack.time_budget, timeout=self.attack.timeout
            )
        finished_at = time.time()
        summary = {"attack": getattr(self.attacker, "name", None), **attack_summary(result)}
        if ruled_out is not None:
            summary["low_rank"] = ruled_out.low_rank
            if ruled_out.batch_size is not None:
                summary["batch_size"] = (
                    ruled_out.batch_size
                )  # the spectrum's estimate, as the attack's would be
        if training.num_examples is not None:
            summary["reported_examples"] = training.num_examples
        if ruled_out is None:
            verdict = self._verdict(result, summary, delta, members, signature)
            basis = training.basis(
                batch_size=reported_batch,
                config_used=known is not None,
                spectrum_rank=None if spectrum is None else spectrum.rank,
            )
            if basis is not None:
                summary["known_training"] = basis
                verdict = Verdict(verdict.verdict, f"{verdict.reason}; {basis}")
        name = unit_name(members)
        level = logging.INFO if result.status in (STATUS_OK, STATUS_NOT_RUN) else logging.WARNING
        logger.log(
            level, "Attack on %s in round %s: %s (%s)", name, server_round, verdict.verdict, verdict.reason
        )
        details = self.keeper.details(members)
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
        return self.keeper.finished_record(record_fields, result, members, details)

    def _spectrum(
        self,
        delta: LayerUpdate[np.ndarray],
        members: list[ClientUpdate],
        signature: Callable[[], UpdateSignature],
    ) -> SpectrumCheck | None:
        """What the spectrum says of an update (:mod:`.spectrum_check`): its rank, and why it is
        ruled out where it is; None for an attacker it does not guide, or an update it cannot read."""
        if not self._spectrum_guided:
            return None
        modes = {member.train_mode for member in members if member.train_mode}
        try:
            return check_spectrum(
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
            time_budget=self.attack.time_budget,
            num_examples=total_examples(members),
        )

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
            details=self.keeper.details(members),
            verdict=decided.verdict,
            verdict_reason=decided.reason,
            input_space=self.keeper.input_space,
        )
