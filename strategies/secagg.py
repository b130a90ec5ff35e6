"""Audit a legacy Flower strategy, as SecAgg+ runs it: attack the aggregate Flower delivers.

Flower's SecAgg+ runs only on the legacy path: a ``flwr.server.strategy.Strategy`` inside
``LegacyContext``, driven by ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``, with
clients running ``secaggplus_mod``. One line audits it::

    strategy = audit_secagg(FedAvg(...), context)          # instead of strategy = FedAvg(...)

What the server observes under SecAgg+ (Flower 1.41, ``SecAggPlusWorkflow.unmask_stage``):
after unmasking, the workflow sets the parameters of *every* client's ``FitRes`` to one
aggregate ``A``, the ``r``-weighted mean of the clients' quantized model parameters with
``r_i ~ num_examples_i`` (see :mod:`fl_attack.simulate.secagg` for the arithmetic); example
counts and metrics stay per client, in the clear. The inner strategy then aggregates these
results (FedAvg's weighted mean of ``k`` copies of ``A`` is ``A`` up to float rounding).

The audit turns ``A`` into the layer update the attacker needs, the members' summed changes
``k (A - W0)``: each of the ``k`` members is handed to the :class:`fl_attack.audit.Auditor` as a
:class:`ClientUpdate` carrying ``A``, exactly what the strategy received for it, and the
auditor attacks the ``k`` of them as one secure-aggregation unit, summing ``k`` times
``A - W0``. With equal example counts this is the sum of the members' changes plus the
protocol's quantization noise; with unequal counts each member's change is scaled by its
relative weight, which keeps every sample's rank-one term. The record is named like any
secure-aggregation unit (``secagg-<member>_<member>...``), lists its members and, when they
reported their batches, scores every member.

Without SecAgg+ (``DefaultWorkflow()`` alone) the results carry each client's own parameters
and go to the auditor as they are, as :class:`strategies.HonestButCuriousStrategy` does for
Message-API strategies: each client is attacked on its own, or in the auditor's simulated
secure-aggregation groups (``secagg-group-size``, ``secagg-quantization``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flwr.app import Context, UserConfigValue
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.serverapp.strategy import Strategy as MessageStrategy

from fl_attack import LayerAttack
from fl_attack.audit import Auditor, ClientIdentity, ClientUpdate, GroundTruth, SecAggSettings
from fl_attack.audit.protocol import (
    LEGACY_METRIC_PREFIX,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
    TRAIN_MODE_KEY,
)
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.results.store import AttackRecord

from .audit_end import finish_audit
from .run_config import one_line

logger = logging.getLogger(__name__)

_PARTITION_METRIC = LEGACY_METRIC_PREFIX + PARTITION_ID_KEY
_INDICES_METRIC = LEGACY_METRIC_PREFIX + SAMPLE_INDICES_KEY
_TRAIN_MODE_METRIC = LEGACY_METRIC_PREFIX + TRAIN_MODE_KEY


def positional_names(arrays: Sequence[np.ndarray]) -> list[str]:
    """Names for legacy ``Parameters``, which carry none.

    A 2-D array followed by a 1-D array of as many entries (a linear layer's weight and
    bias) at position ``i`` becomes ``layer-<i>.weight`` and ``layer-<i>.bias``; any other
    array is ``array-<i>``. The audit's default layer is then the first such pair.
    """
    names = [f"array-{index}" for index in range(len(arrays))]
    index = 0
    while index < len(arrays) - 1:
        weight, bias = np.shape(arrays[index]), np.shape(arrays[index + 1])
        if len(weight) == 2 and bias == (weight[0],):
            names[index], names[index + 1] = f"layer-{index}.weight", f"layer-{index}.bias"
            index += 2
        else:
            index += 1
    return names


def _check_legacy(strategy: object) -> None:
    if isinstance(strategy, MessageStrategy):
        raise TypeError(
            f"AuditedLegacyStrategy wraps a legacy flwr.server.strategy.Strategy (LegacyContext, "
            f"SecAggPlusWorkflow), got the Message-API strategy {type(strategy).__name__}; "
            "wrap it with strategies.HonestButCuriousStrategy instead"
        )
    if not isinstance(strategy, LegacyStrategy):
        raise TypeError(
            f"AuditedLegacyStrategy wraps a legacy flwr.server.strategy.Strategy, got {type(strategy).__name__}"
        )


def _partition_id(metrics: dict[str, Scalar]) -> int | None:
    value = metrics.get(_PARTITION_METRIC)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ground_truth(metrics: dict[str, Scalar], node_id: int) -> GroundTruth | None:
    """The batch a client reported in its metrics; malformed reports are logged and ignored."""
    text = metrics.get(_INDICES_METRIC)
    if text is None:
        return None
    try:
        if not isinstance(text, str):
            raise ValueError(f"expected text like '3,17,42', got {type(text).__name__}")
        indices = [int(item) for item in text.split(",") if item.strip()]
        if not indices or min(indices) < 0:
            raise ValueError(f"expected non-negative indices, got {text!r}")
    except ValueError as error:
        logger.warning("node %s reported unreadable sample indices (%s); not scored", node_id, error)
        return None
    return GroundTruth(indices=indices)


def _without_audit_metrics(fit_res: FitRes) -> FitRes:
    metrics = {
        key: value for key, value in fit_res.metrics.items() if not key.startswith(LEGACY_METRIC_PREFIX)
    }
    return FitRes(
        status=fit_res.status,
        parameters=fit_res.parameters,
        num_examples=fit_res.num_examples,
        metrics=metrics,
    )


def securely_aggregated(results: Sequence[tuple[ClientProxy, FitRes]]) -> bool:
    """Whether the results carry one shared aggregate (SecAgg+) rather than each client's parameters.

    ``SecAggPlusWorkflow`` gives every ``FitRes`` the same ``Parameters`` object; a single
    result is the client's own (quantized) parameters either way.
    """
    if len(results) < 2:
        return False
    first = results[0][1].parameters
    return all(
        fit_res.parameters is first or fit_res.parameters.tensors == first.tensors
        for _, fit_res in results[1:]
    )


class AuditedLegacyStrategy(LegacyStrategy):
    """Legacy strategy wrapper that attacks what the server receives, SecAgg+ aggregates included.

    Aggregation is exactly the inner strategy's: it receives the same results, less the
    audit metrics opted-in clients add (:func:`clients.secagg.audit_metrics`). An attack
    that fails is recorded and training goes on.

    Parameters
    ----------
    strategy : flwr.server.strategy.Strategy
        The legacy strategy that trains (e.g. ``flwr.server.strategy.FedAvg``).
    auditor : Auditor
        Attacks, judges, scores and stores (see :class:`fl_attack.audit.Auditor`).
    array_names : Sequence[str] or None (default: None)
        Names of the arrays in the order of the strategy's ``Parameters`` (e.g.
        ``list(model.state_dict())``); None names them with :func:`positional_names`.

    Raises
    ------
    TypeError
        If ``strategy`` is not a legacy strategy (a Message-API one belongs in
        :class:`strategies.HonestButCuriousStrategy`).
    ValueError
        If the auditor attacks chosen partitions: SecAgg+ hides which client sent what.
    """

    def __init__(
        self, strategy: LegacyStrategy, auditor: Auditor, *, array_names: Sequence[str] | None = None
    ) -> None:
        _check_legacy(strategy)
        if auditor.sampling.attack_partitions is not None:
            raise ValueError(
                "attack-partitions cannot pick clients inside a SecAgg+ aggregate; use attack-fraction"
            )
        self.strategy = strategy
        self.auditor = auditor
        self.array_names = None if array_names is None else list(array_names)
        self._report: Path | None = None
        self._closed = False
        self._records_reported = 0

    @classmethod
    def from_context(
        cls,
        strategy: LegacyStrategy,
        context: Context,
        *,
        array_names: Sequence[str] | None = None,
        scorer: ReconstructionScorer | None = None,
        attacker: LayerAttack | None = None,
        **overrides: UserConfigValue,
    ) -> AuditedLegacyStrategy:
        """Wrap ``strategy`` with an auditor configured from the run config (one line in a ServerApp).

        The audit keys and ``overrides`` are those of
        :meth:`strategies.HonestButCuriousStrategy.from_context`: every audit key (``attack-*``,
        ``output-dir``, ...) is read from ``context.run_config``, and ``overrides`` use the same
        names with underscores and win. ``scorer`` scores reconstructions against the batches
        clients report; ``attacker`` replaces the configured attack.

        Raises
        ------
        TypeError
            If ``strategy`` is not a legacy strategy.
        strategies.run_config.RunConfigError
            On an unknown audit key or a bad value.
        """
        from .factory import build_auditor

        _check_legacy(strategy)
        settings = {key.replace("_", "-"): value for key, value in overrides.items()}
        try:
            auditor = build_auditor(context.run_config, settings, scorer=scorer, attacker=attacker)
        except ValueError as error:  # a wrong key or value: one line in Flower's log
            raise one_line(error) from None
        return cls(strategy, auditor, array_names=array_names)

    @property
    def records(self) -> list[AttackRecord]:
        """Every attack so far (without arrays when a store keeps them)."""
        return self.auditor.records

    def __repr__(self) -> str:
        """Compute a string representation of the strategy."""
        return f"AuditedLegacyStrategy({self.strategy!r})"

    def close(self) -> Path | None:
        """End the audit: wait for the queued attacks, stop the workers, write the report and print
        the summary to the run's log (:func:`strategies.audit_end.finish_audit`); again only when
        attacks were recorded since the last call.

        Returns
        -------
        Path or None
            The ``report.html`` written (None: memory-only audit, or a report that could not be written).
        """
        self.auditor.close()  # waits for the queued attacks; the auditor stays usable
        if self._closed and len(self.auditor.records) == self._records_reported:
            return self._report
        self._closed = True
        self._report = finish_audit(self.auditor, history=None)
        self._records_reported = len(self.auditor.records)
        return self._report

    def named_arrays(self, parameters: Parameters) -> dict[str, np.ndarray]:
        """The ``Parameters`` as named numpy arrays (names: ``array_names`` or positional).

        Raises
        ------
        ValueError
            If ``array_names`` does not name every array.
        """
        arrays = parameters_to_ndarrays(parameters)
        names = self.array_names if self.array_names is not None else positional_names(arrays)
        if len(names) != len(arrays):
            raise ValueError(f"{len(names)} array names for {len(arrays)} parameter arrays")
        return dict(zip(names, arrays, strict=True))

    # ------------------------------------------------------------------ training

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """Initialize the (global) model parameters."""
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the global layer sent in this round, then let the inner strategy configure.

        Raises
        ------
        fl_attack.audit.LayerNotFoundError
            In the first round, if the configured layer is not among the arrays.
        """
        self.auditor.start_round(server_round, self.named_arrays(parameters))
        return self.strategy.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Attack what the results carry, then aggregate them with the inner strategy."""
        try:
            self._audit(server_round, results)
        except Exception as error:  # the audit never stops training
            logger.warning("Audit of round %s failed: %s: %s", server_round, type(error).__name__, error)
        cleaned = [(proxy, _without_audit_metrics(fit_res)) for proxy, fit_res in results]
        return self.strategy.aggregate_fit(server_round, cleaned, failures)

    def _audit(self, server_round: int, results: Sequence[tuple[ClientProxy, FitRes]]) -> None:
        secure = securely_aggregated(results)
        shared = self.named_arrays(results[0][1].parameters) if secure else None
        updates = []
        for proxy, fit_res in results:
            metrics = fit_res.metrics
            mode = metrics.get(_TRAIN_MODE_METRIC)
            updates.append(
                ClientUpdate(
                    identity=ClientIdentity(node_id=proxy.node_id, partition_id=_partition_id(metrics)),
                    arrays=shared if shared is not None else self.named_arrays(fit_res.parameters),
                    ground_truth=_ground_truth(metrics, proxy.node_id),
                    train_mode=mode if isinstance(mode, str) else None,
                    num_examples=fit_res.num_examples,
                )
            )
        if not secure:
            self.auditor.audit_round(server_round, updates)
            return
        logger.info(
            "Round %s: one SecAgg+ aggregate of %d clients, attacked as one batch", server_round, len(updates)
        )
        auditor = self.auditor
        simulated = auditor.secagg
        # The real aggregate is one unit, already quantized: no simulated grouping or quantization.
        auditor.secagg = SecAggSettings(group_size=len(updates))
        try:
            auditor.audit_round(server_round, updates)
        finally:
            auditor.secagg = simulated

    # ---------------------------------------------------------------- evaluation

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Configure the next round of federated evaluation."""
        return self.strategy.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Aggregate the evaluation results with the inner strategy."""
        return self.strategy.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Evaluate the global model with the inner strategy (centralized evaluation)."""
        return self.strategy.evaluate(server_round, parameters)


def audit_secagg(
    strategy: LegacyStrategy,
    context: Context,
    *,
    array_names: Sequence[str] | None = None,
    scorer: ReconstructionScorer | None = None,
    attacker: LayerAttack | None = None,
    **overrides: UserConfigValue,
) -> AuditedLegacyStrategy:
    """One line for a SecAgg+ ServerApp: ``strategy = audit_secagg(FedAvg(...), context)``.

    Same as :meth:`AuditedLegacyStrategy.from_context`; pass the returned strategy to
    ``LegacyContext`` and call its ``close()`` after the workflow.
    """
    return AuditedLegacyStrategy.from_context(
        strategy, context, array_names=array_names, scorer=scorer, attacker=attacker, **overrides
    )
