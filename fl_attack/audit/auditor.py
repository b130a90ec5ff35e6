"""The honest-but-curious auditor: select, attack, judge, score and store, with no FL framework.

A framework's strategy wrapper calls :meth:`Auditor.start_round` with the global arrays it
sends and :meth:`Auditor.audit_round` with the clients' replies; everything else happens
here. The attacker sees the observed layer update and the global layer, nothing more; the
ground truth, when a client sent it, is used afterwards for scoring only.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_attack.results.store import AttackRecord, ReconstructionStore
from fl_attack.simulate.secagg import SecAggPlusQuantization, secagg_observed_sum
from fl_attack.vocabulary import APPROX_PSNR_DB, EXACT_PSNR_DB, STATUS_ERROR, STATUS_OK

from .layer import LayerDelta, LayerKeys, NamedArrays, layer_delta, layer_parameters, select_layer
from .observations import ClientUpdate
from .signature import UpdateSignature, magnitude_concentration, update_signature
from .verdict import Verdict, decide_verdict
from .workers import Attacker, AttackResult, make_runner

if TYPE_CHECKING:
    from fl_attack.evaluation.scoring import ReconstructionScorer, Scored

logger = logging.getLogger(__name__)


class Auditor:
    """Attack the first-layer updates of a federated round and keep what leaked.

    Parameters
    ----------
    attacker : Attacker
        Gradient-inversion attack with ``invert(weight_grad, bias_grad, *, weight, bias,
        batch_size, time_budget)`` (e.g. ``fl_attack.SpearPlusPlus``).
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
    seed : int (default: 0)
        Seeds the draw of attacked updates when ``attack_fraction < 1``.
    secagg_group_size : int (default: 1)
        Simulated secure aggregation: the server only sees the sum of each group of this
        many clients (in partition order); each sum is attacked as one batch.
    secagg_quantization : SecAggPlusQuantization or None (default: None)
        With groups, model Flower's SecAgg+ instead of a float sum: the members' parameters
        are clipped, quantized, summed modulo and dequantized as the protocol does
        (:func:`fl_attack.simulate.secagg.secagg_observed_sum`); None sums floats.
    """

    def __init__(
        self,
        attacker: Attacker,
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
        seed: int = 0,
        secagg_group_size: int = 1,
        secagg_quantization: SecAggPlusQuantization | None = None,
    ) -> None:
        if not 0.0 <= attack_fraction <= 1.0:
            raise ValueError(f"attack_fraction must be in [0, 1], got {attack_fraction}")
        if (
            isinstance(secagg_group_size, bool)
            or not isinstance(secagg_group_size, int)
            or secagg_group_size < 1
        ):
            raise ValueError(f"secagg_group_size must be a positive integer, got {secagg_group_size!r}")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        for name, value in (("time_budget", time_budget), ("timeout", timeout)):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive finite number of seconds or None, got {value!r}")
        self.attacker = attacker
        self.runner = make_runner(attacker, isolation)
        self.store = store
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
        self.secagg_quantization = secagg_quantization
        self.layer: LayerKeys | None = None
        self.records: list[AttackRecord] = []
        #: Why results could not be stored (a full disk, ...): the run must not end as a success.
        self.store_failures: list[str] = []
        self._global_layer: dict[int, tuple[np.ndarray, np.ndarray]] = {}

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
        """Remember the global layer sent to the clients in ``server_round``."""
        layer = self.select_layer(global_arrays)
        self._global_layer[server_round] = layer_parameters(global_arrays, layer)

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
        for members in self.select(server_round, updates):
            try:
                record = self._audit_unit(server_round, members, global_layer)
            except Exception as error:  # an audit must never stop training
                record = self._failed(
                    server_round, members, f"audit failed: {type(error).__name__}: {error}", None
                )
            produced.append(self._keep(record))
        return produced

    def select(self, server_round: int, updates: Sequence[ClientUpdate]) -> list[list[ClientUpdate]]:
        """The units attacked this round: single updates, or secure-aggregation groups."""
        eligible = [
            update
            for update in updates
            if self.attack_partitions is None or update.identity.partition_id in self.attack_partitions
        ]
        eligible.sort(
            key=lambda item: (
                item.identity.partition_id is None,
                item.identity.partition_id or 0,
                item.identity.node_id,
            )
        )
        size = self.secagg_group_size
        units = [eligible[start : start + size] for start in range(0, len(eligible), size)]
        count = math.ceil(self.attack_fraction * len(units))
        if count >= len(units):
            return units
        chosen = random.Random(f"{self.seed}-{server_round}").sample(range(len(units)), count)
        return [units[index] for index in sorted(chosen)]

    def close(self) -> None:
        """Stop the attack workers."""
        self.runner.close()

    # ------------------------------------------------------------------ one unit

    def _audit_unit(
        self,
        server_round: int,
        members: list[ClientUpdate],
        global_layer: tuple[np.ndarray, np.ndarray],
    ) -> AttackRecord:
        assert self.layer is not None
        deltas: list[LayerDelta] = []
        for member in members:
            if member.arrays is None:
                return self._failed(server_round, members, f"unreadable update: {member.error}", None)
            try:
                deltas.append(
                    layer_delta(member.arrays, layer=self.layer, weight=global_layer[0], bias=global_layer[1])
                )
            except ValueError as error:
                return self._failed(server_round, members, f"unreadable update: {error}", None)
        delta = deltas[0]
        for other in deltas[1:]:
            delta = delta + other
        if not (np.isfinite(delta.weight_delta).all() and np.isfinite(delta.bias_delta).all()):
            return self._failed(
                server_round, members, "unreadable update: it contains NaN or Inf entries", None
            )
        if self.secagg_quantization is not None and self.secagg_group_size > 1:
            weight_sum, bias_sum = secagg_observed_sum(
                [(each.weight_delta, each.bias_delta) for each in deltas],
                start=(delta.weight, delta.bias),
                num_examples=[member.num_examples for member in members],
                settings=self.secagg_quantization,
                seed=(self.seed, server_round, *(member.identity.node_id for member in members)),
            )
            delta = LayerDelta(
                weight_delta=weight_sum, bias_delta=bias_sum, weight=delta.weight, bias=delta.bias
            )

        queued_at = time.time()
        batch_size = None if self.batch_size is None else self.batch_size * len(members)
        result = self.runner.run(
            delta, batch_size=batch_size, time_budget=self.time_budget, timeout=self.timeout
        )
        finished_at = time.time()
        summary = _attack_summary(result)
        verdict = self._verdict(result, summary, delta, members)
        name = unit_name(members)
        level = logging.INFO if result.status == STATUS_OK else logging.WARNING
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
            "started_at": finished_at - result.seconds,
            "finished_at": finished_at,
        }
        if result.status != STATUS_OK:
            return AttackRecord(**record_fields)
        inputs = np.asarray(_to_numpy(result.reconstruction.inputs), dtype=np.float64)
        scored, scoring_error = self._score(inputs, members, details)
        if scoring_error is not None:
            record_fields["error"] = scoring_error
        return AttackRecord(
            **record_fields,
            inputs=inputs,
            reconstructed_images=None if scored is None else scored.reconstructed_images,
            reference_images=None if scored is None else scored.reference_images,
            quality={} if scored is None else scored.quality,
            psnr=None if scored is None else scored.psnr,
        )

    def _verdict(
        self, result: AttackResult, summary: Mapping[str, Any], delta: LayerDelta, members: list[ClientUpdate]
    ) -> Verdict:
        cache: dict[str, UpdateSignature] = {}

        def signature() -> UpdateSignature:
            if "value" not in cache:
                cache["value"] = update_signature(delta.weight_delta)
            return cache["value"]

        modes = {member.train_mode for member in members if member.train_mode}
        return decide_verdict(
            status=result.status,
            error=result.error,
            attack=summary,
            signature=signature,
            magnitude_concentration=magnitude_concentration(delta.weight_delta),
            input_space=self.layer.input_space if self.layer else None,
            train_mode=modes.pop() if len(modes) == 1 else None,
            time_budget=self.time_budget,
            num_examples=_total_examples(members),
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
            if len(members) > 1 and scored.psnr is not None:
                details["members"] = _member_quality(members, [len(r) for r in references], scored.psnr)
            return scored, None
        except Exception as failure:  # scoring is the experimenter's side: never stop the run
            error = f"scoring failed: {type(failure).__name__}: {failure}"
            logger.warning("%s", error)
            return None, error

    def _details(self, members: list[ClientUpdate]) -> dict[str, Any]:
        details: dict[str, Any]
        if len(members) == 1:
            identity = members[0].identity
            details = {"node_id": identity.node_id, "partition_id": identity.partition_id}
        else:
            details = {
                "node_id": [member.identity.node_id for member in members],
                "partition_id": [member.identity.partition_id for member in members],
                "members": [member.identity.name for member in members],
                "secagg_group_size": len(members),
            }
        modes = {member.train_mode for member in members if member.train_mode}
        if len(modes) == 1:
            details["train_mode"] = modes.pop()
        if self.layer is not None:
            details["layer"] = {
                "weight": self.layer.weight,
                "bias": self.layer.bias,
                "input_space": self.layer.input_space,
            }
        return details

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
        """Write a record to the store (a failing store is logged) and remember it."""
        if self.store is not None:
            try:
                self.store.save(record)
            except Exception as error:  # the FL run goes on; the failure is loud
                logger.error(
                    "Could not store the attack on %s in round %s: %s",
                    record.client,
                    record.server_round,
                    error,
                )
        self.records.append(record)
        return record


def unit_name(members: Sequence[ClientUpdate]) -> str:
    """Name of an attacked update: the client's, or ``secagg-<a>_<b>...`` for a sum."""
    if len(members) == 1:
        return members[0].identity.name
    return "secagg-" + "_".join(member.identity.name for member in members)


def _total_examples(members: Sequence[ClientUpdate]) -> int | None:
    counts = [member.num_examples for member in members]
    return None if any(count is None for count in counts) else sum(count or 0 for count in counts)


def _attack_summary(result: AttackResult) -> dict[str, Any]:
    reconstruction = result.reconstruction
    if reconstruction is None or not hasattr(reconstruction, "summary"):
        return {}
    return dict(reconstruction.summary())


def _member_quality(
    members: list[ClientUpdate], sizes: list[int], psnr: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Per-client recovery inside a secure-aggregation sum (references were concatenated)."""
    report: dict[str, dict[str, Any]] = {}
    start = 0
    for member, size in zip(members, sizes, strict=True):
        values = [float(value) for value in psnr[start : start + size]]
        start += size
        report[member.identity.name] = {
            "samples": len(values),
            "mean_psnr": float(np.mean(values)) if values else None,
            "exact_fraction": float(np.mean([v > EXACT_PSNR_DB for v in values])) if values else None,
            "approx_fraction": float(np.mean([v > APPROX_PSNR_DB for v in values])) if values else None,
        }
    return report


def _to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)
