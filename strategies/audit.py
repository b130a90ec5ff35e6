"""Honest-but-curious server: aggregate normally, invert every client's first layer.

The wrapper follows the style of Flower's differential-privacy strategy wrappers: it
holds an inner strategy, delegates every decision to it, and only observes. In
``configure_train`` it keeps the global layer it sends; in ``aggregate_train`` it
computes each selected client's layer update, hands it to the attacker, scores and
stores the reconstruction, and then lets the inner strategy aggregate the replies.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np

from clients.protocol import AUDIT_KEY, TRAIN_MODE_KEY
from fl_attack.evaluation.metrics import APPROX_PSNR_DB, EXACT_PSNR_DB
from fl_attack.results.store import AttackRecord, ReconstructionStore
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from .attack_runner import STATUS_ERROR, STATUS_OK, Attacker, AttackResult, make_runner
from .ground_truth import (
    ClientIdentity,
    ReconstructionScorer,
    Scored,
    audit_record,
    client_identity,
    sample_indices,
)
from .layer import LayerKeys, LayerUpdate, layer_parameters, layer_update, select_layer

#: A reply with its sender.
Member = tuple[Message, ClientIdentity]


class HonestButCuriousStrategy(Strategy):
    """Strategy wrapper that audits how much each client update leaks.

    Training is exactly that of the inner strategy: the replies it aggregates are the
    clients' replies without the simulation-only audit record. Every failure of the
    attack (exception, timeout, out-of-memory, unreadable reply) is recorded for that
    (round, client) and training goes on.

    Parameters
    ----------
    strategy : Strategy
        The strategy that actually trains (e.g. ``FedAvg``).
    attacker : Attacker
        Gradient-inversion attack with ``invert(weight_grad, bias_grad, *, weight, bias,
        batch_size, time_budget)`` (e.g. ``fl_attack.SpearPlusPlus``).
    store : ReconstructionStore or None (default: None)
        Where reconstructions and their quality are written; None keeps them in
        :attr:`records` only.
    scorer : ReconstructionScorer or None (default: None)
        Renders reconstructions as images and, when clients report their sample
        indices, scores them against the ground truth. None stores raw inputs only.
    weight_key : str or None (default: None)
        ArrayRecord key of the attacked weight; None picks the first 2-D weight
        followed by its bias. An Opacus ``_module.`` prefix is ignored.
    bias_key : str or None (default: None)
        Key of the attacked bias; None derives it from ``weight_key``.
    attack_fraction : float (default: 1.0)
        Fraction of the (eligible) replies attacked in each round, drawn at random.
    attack_partitions : Collection[int] or None (default: None)
        Attack only clients reporting one of these partition ids; None attacks all.
    batch_size : int or None (default: None)
        Batch size told to the attacker; None lets it estimate the batch size.
    time_budget : float or None (default: None)
        Seconds each attack is asked to stay within.
    timeout : float or None (default: None)
        Hard limit in seconds per attack, after which it is recorded as a timeout.
    isolation : str (default: "thread")
        ``"thread"`` runs the attacker in this process (a timed-out attack is
        abandoned); ``"process"`` runs it in a worker process that is killed on
        timeout (the attacker must be picklable). Call :meth:`close` at the end.
    audit_key : str (default: "audit")
        Name of the simulation-only ConfigRecord that clients add to their replies.
    seed : int (default: 0)
        Seed for drawing the attacked replies when ``attack_fraction < 1``.
    secagg_group_size : int (default: 1)
        Simulates secure aggregation: the server only observes the sum of the updates
        of each group of this many clients (eligible replies in partition order, the
        last group possibly smaller). Each sum is attacked as one batch, named
        ``secagg-<member>_<member>...``, and scored per member client.
    """

    # pylint: disable=too-many-arguments,too-many-instance-attributes
    def __init__(
        self,
        strategy: Strategy,
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
        audit_key: str = AUDIT_KEY,
        seed: int = 0,
        secagg_group_size: int = 1,
    ) -> None:
        super().__init__()
        if not 0.0 <= attack_fraction <= 1.0:
            raise ValueError(f"attack_fraction must be in [0, 1], got {attack_fraction}")
        if secagg_group_size < 1:
            raise ValueError(f"secagg_group_size must be at least 1, got {secagg_group_size}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be positive or None, got {batch_size}")
        for name, value in (("time_budget", time_budget), ("timeout", timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        self.strategy = strategy
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
        self.audit_key = audit_key
        self.seed = seed
        self.secagg_group_size = secagg_group_size
        self.layer: LayerKeys | None = None
        self.records: list[AttackRecord] = []
        self._global_layer: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __repr__(self) -> str:
        """Compute a string representation of the strategy."""
        return f"HonestButCuriousStrategy({self.strategy!r})"

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        log(INFO, "\t├──> Honest-but-curious audit:")
        log(INFO, "\t│\t├── Attacker: %s", type(self.attacker).__name__)
        log(
            INFO,
            "\t│\t├── Attacked layer: %s",
            "first linear layer" if self.weight_key is None else self.weight_key,
        )
        log(
            INFO,
            "\t│\t├── Attacked replies: fraction %.2f, partitions %s",
            self.attack_fraction,
            "all" if self.attack_partitions is None else sorted(self.attack_partitions),
        )
        log(
            INFO,
            "\t│\t├── Time budget / timeout: %s s / %s s (%s)",
            self.time_budget,
            self.timeout,
            type(self.runner).__name__,
        )
        if self.secagg_group_size > 1:
            log(INFO, "\t│\t├── Secure aggregation: sums of %d clients", self.secagg_group_size)
        log(
            INFO,
            "\t│\t└── Store: %s",
            "memory only" if self.store is None else self.store.directory,
        )
        self.strategy.summary()

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Keep the global layer sent in this round, then let the inner strategy configure.

        Raises
        ------
        LayerNotFoundError
            In the first round, if the configured layer is not in ``arrays`` (a
            configuration error, reported before any client trains).
        """
        if self.layer is None:
            self.layer = select_layer(arrays, weight_key=self.weight_key, bias_key=self.bias_key)
            log(INFO, "Auditing layer %s / %s", self.layer.weight, self.layer.bias)
        self._global_layer = {server_round: layer_parameters(arrays, self.layer)}
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Attack the selected replies, then aggregate them with the inner strategy."""
        replies_list = list(replies)
        global_layer = self._global_layer.pop(server_round, None)
        if global_layer is None or self.layer is None:
            log(WARNING, "aggregate_train: round %s was not configured here; no attack", server_round)
        else:
            for members in self._select(server_round, replies_list):
                try:
                    record = self._audit_members(server_round, members, global_layer)
                except Exception as error:  # pylint: disable=broad-exception-caught
                    record = self._failed(
                        server_round,
                        _unit_name(members),
                        _identities(members),
                        f"audit failed: {type(error).__name__}: {error}",
                    )
                self._keep(record)
        for reply in replies_list:
            if reply.has_content() and audit_record(reply.content, self.audit_key) is not None:
                del reply.content[self.audit_key]
        return self.strategy.aggregate_train(server_round, replies_list)

    def close(self) -> None:
        """Stop the attack worker process, if any."""
        self.runner.close()

    # ---------------------------------------------------------------- evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of federated evaluation."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> MetricRecord | None:
        """Aggregate MetricRecords in the received Messages."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------------------------- helpers

    def _select(self, server_round: int, replies: list[Message]) -> list[list[Member]]:
        """The updates to attack in this round: single replies, or secure-aggregation groups."""
        eligible: list[Member] = []
        for reply in replies:
            if reply.has_error() or not reply.has_content():
                continue
            identity = client_identity(reply.content, reply.metadata.src_node_id, self.audit_key)
            if self.attack_partitions is not None and identity.partition_id not in self.attack_partitions:
                continue
            eligible.append((reply, identity))
        eligible.sort(key=lambda item: (item[1].partition_id is None, item[1].partition_id or 0, item[1].node_id))
        size = self.secagg_group_size
        units = [eligible[start : start + size] for start in range(0, len(eligible), size)]
        count = math.ceil(self.attack_fraction * len(units))
        if count >= len(units):
            return units
        chosen = random.Random(f"{self.seed}-{server_round}").sample(range(len(units)), count)
        return [units[index] for index in sorted(chosen)]

    def _audit_members(
        self,
        server_round: int,
        members: list[Member],
        global_layer: tuple[np.ndarray, np.ndarray],
    ) -> AttackRecord:
        """Attack one reply (or the sum of a group's replies), then score it; never raises."""
        name = _unit_name(members)
        details = self._details(members)
        try:
            updates = [
                layer_update(
                    self._reply_arrays(reply),
                    layer=self.layer,  # type: ignore[arg-type]
                    weight=global_layer[0],
                    bias=global_layer[1],
                )
                for reply, _ in members
            ]
        except Exception as error:  # pylint: disable=broad-exception-caught
            return self._failed(server_round, name, details, f"unreadable update: {error}")
        update = updates[0]
        if len(updates) > 1:
            update = LayerUpdate(
                weight_delta=np.sum([item.weight_delta for item in updates], axis=0),
                bias_delta=np.sum([item.bias_delta for item in updates], axis=0),
                weight=update.weight,
                bias=update.bias,
            )

        # The attacker sees the observed update and the global layer, nothing else.
        result = self.runner.run(
            update,
            batch_size=None if self.batch_size is None else self.batch_size * len(members),
            time_budget=self.time_budget,
            timeout=self.timeout,
        )
        if result.status != STATUS_OK:
            log(WARNING, "Attack on %s in round %s: %s (%s)", name, server_round, result.status, result.error)
            if result.traceback:
                details["traceback"] = result.traceback
            return AttackRecord(
                server_round=server_round,
                client=name,
                status=result.status,
                seconds=result.seconds,
                error=result.error,
                details=details,
            )
        return self._scored_record(server_round, members, result, details)

    def _scored_record(
        self,
        server_round: int,
        members: list[Member],
        result: AttackResult,
        details: dict[str, Any],
    ) -> AttackRecord:
        """Render and score a successful reconstruction against the ground truth."""
        name = _unit_name(members)
        reconstruction = result.reconstruction
        inputs = np.asarray(_to_numpy(reconstruction.inputs), dtype=np.float64)
        attack_summary = reconstruction.summary() if hasattr(reconstruction, "summary") else {}
        scored: Scored | None = None
        error: str | None = None
        if self.scorer is not None:
            try:
                per_member = [sample_indices(reply.content, self.audit_key) for reply, _ in members]
                if any(indices is None for indices in per_member):
                    scored = self.scorer.render(inputs)
                else:
                    union = [index for indices in per_member for index in indices]  # type: ignore[union-attr]
                    scored = self.scorer.score(inputs, union)
                    if len(members) > 1 and scored.psnr is not None:
                        details["members"] = _member_quality(members, per_member, union, scored.psnr)  # type: ignore[arg-type]
            except Exception as failure:  # pylint: disable=broad-exception-caught
                error = f"scoring failed: {type(failure).__name__}: {failure}"
                log(WARNING, "Scoring %s in round %s: %s", name, server_round, error)
        if scored is not None and scored.psnr is not None:
            log(
                INFO,
                "Attack on %s in round %s: %d inputs, mean PSNR %.1f dB, %.0f%% exact (%.1fs)",
                name,
                server_round,
                len(inputs),
                scored.quality.get("mean_psnr", float("nan")),
                100.0 * scored.quality.get("exact_fraction", 0.0),
                result.seconds,
            )
        else:
            log(
                INFO,
                "Attack on %s in round %s: %d inputs recovered, complete=%s (%.1fs)",
                name,
                server_round,
                len(inputs),
                attack_summary.get("complete"),
                result.seconds,
            )
        return AttackRecord(
            server_round=server_round,
            client=name,
            status=STATUS_OK,
            seconds=result.seconds,
            inputs=inputs,
            reconstructed_images=None if scored is None else scored.reconstructed_images,
            reference_images=None if scored is None else scored.reference_images,
            attack=attack_summary,
            quality={} if scored is None else scored.quality,
            psnr=None if scored is None else scored.psnr,
            error=error,
            details=details,
        )

    def _reply_arrays(self, reply: Message) -> ArrayRecord:
        records = reply.content.array_records
        if len(records) != 1:
            raise ValueError(f"expected exactly one ArrayRecord in the reply, found {len(records)}")
        return next(iter(records.values()))

    def _details(self, members: list[Member]) -> dict[str, Any]:
        details = _identities(members)
        modes = {
            str(record[TRAIN_MODE_KEY])
            for record in (audit_record(reply.content, self.audit_key) for reply, _ in members)
            if record is not None and TRAIN_MODE_KEY in record
        }
        if len(modes) == 1:
            details["train_mode"] = modes.pop()
        if self.layer is not None:
            details["layer"] = {"weight": self.layer.weight, "bias": self.layer.bias}
        return details

    def _failed(
        self, server_round: int, name: str, details: dict[str, Any], error: str
    ) -> AttackRecord:
        log(WARNING, "Attack on %s in round %s: %s", name, server_round, error)
        return AttackRecord(
            server_round=server_round,
            client=name,
            status=STATUS_ERROR,
            seconds=0.0,
            error=error,
            details=details,
        )

    def _keep(self, record: AttackRecord) -> None:
        """Remember a record and write it to the store; a failing store is logged."""
        self.records.append(record)
        if self.store is None:
            return
        try:
            self.store.save(record)
        except Exception as error:  # pylint: disable=broad-exception-caught
            log(
                WARNING,
                "Could not store the attack on %s in round %s: %s",
                record.client,
                record.server_round,
                error,
            )


def _unit_name(members: list[Member]) -> str:
    """Store name of an attacked update: the client's, or ``secagg-<a>_<b>...`` for a sum."""
    if len(members) == 1:
        return members[0][1].name
    return "secagg-" + "_".join(identity.name for _, identity in members)


def _identities(members: list[Member]) -> dict[str, Any]:
    if len(members) == 1:
        identity = members[0][1]
        return {"node_id": identity.node_id, "partition_id": identity.partition_id}
    return {
        "node_id": [identity.node_id for _, identity in members],
        "partition_id": [identity.partition_id for _, identity in members],
        "secagg_group_size": len(members),
    }


def _member_quality(
    members: list[Member], per_member: list[list[int]], union: list[int], psnr: list[float]
) -> dict[str, dict[str, Any]]:
    """Per-client recovery inside a secure-aggregation sum (the union is scored once)."""
    by_index = dict(zip(dict.fromkeys(union), psnr))
    report: dict[str, dict[str, Any]] = {}
    for (_, identity), indices in zip(members, per_member):
        values = [by_index[index] for index in dict.fromkeys(indices)]
        report[identity.name] = {
            "samples": len(values),
            "mean_psnr": float(np.mean(values)) if values else None,
            "exact_fraction": float(np.mean([value > EXACT_PSNR_DB for value in values])) if values else None,
            "approx_fraction": float(np.mean([value > APPROX_PSNR_DB for value in values])) if values else None,
        }
    return report


def _to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return values.detach().cpu().numpy()
    return np.asarray(values)
