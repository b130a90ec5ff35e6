"""The legacy adapter: Flower's SecAgg+ aggregate attacked as Flower delivers it, aggregation untouched."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.serverapp.strategy import FedAvg as MessageFedAvg

from clients.secagg import audit_metrics
from fl_attack.audit import Auditor, SamplingSettings, SecAggSettings
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.results.store import load_table
from fl_attack.simulate.secagg import (
    FLOWER_DEFAULTS,
    secagg_observed_sum,
    secagg_plus_aggregate,
    weight_factor,
)
from strategies import HonestButCuriousStrategy
from strategies.secagg import AuditedLegacyStrategy, audit_secagg, positional_names, securely_aggregated
from tests.secagg_inprocess import (
    NAMES,
    RecordingAttacker,
    RecordingFedAvg,
    client_replies,
    run_flower_round,
    scorer,
    task_identity,
)

__all__ = ["task_identity"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "secagg"


def test_wrong_kinds_of_strategy_are_refused_in_one_line() -> None:
    auditor = Auditor(RecordingAttacker())
    with pytest.raises(
        TypeError,
        match=r"^AuditedLegacyStrategy wraps a legacy flwr.server.strategy.Strategy "
        r"\(LegacyContext, SecAggPlusWorkflow\), got the Message-API strategy FedAvg; wrap it "
        r"with strategies.HonestButCuriousStrategy instead$",
    ):
        AuditedLegacyStrategy(MessageFedAvg(), auditor)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got the Message-API strategy FedAvg"):
        audit_secagg(
            MessageFedAvg(), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
        )  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wraps a legacy flwr.server.strategy.Strategy, got dict$"):
        AuditedLegacyStrategy({}, auditor)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^HonestButCuriousStrategy wraps a Message-API strategy .* got FedAvg; "
        r"for a legacy flwr.server.strategy one \(e.g. with SecAgg\+\), use strategies.secagg$",
    ):
        HonestButCuriousStrategy(LegacyFedAvg(), auditor)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="attack-partitions cannot pick clients inside a SecAgg\\+ aggregate"
    ):
        AuditedLegacyStrategy(
            LegacyFedAvg(), Auditor(RecordingAttacker(), sampling=SamplingSettings(attack_partitions=[0]))
        )


def test_positional_names_find_the_linear_layers() -> None:
    arrays = [
        np.zeros((3, 1, 2, 2)),
        np.zeros(3),
        np.zeros((5, 12)),
        np.zeros(5),
        np.zeros(()),
        np.zeros((2, 5)),
        np.zeros(2),
    ]
    assert positional_names(arrays) == [
        "array-0",
        "array-1",
        "layer-2.weight",
        "layer-2.bias",
        "array-4",
        "layer-5.weight",
        "layer-5.bias",
    ]


def test_audit_metrics_only_when_the_client_opted_in() -> None:
    def context(node_config: dict[str, Any]) -> Context:
        return Context(run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={})

    assert audit_metrics(context({}), sample_indices=[1, 2]) == {}
    assert audit_metrics(
        context({"audit-ground-truth": "true"}),
        sample_indices=np.array([4, 1]),
        partition_id=2,
        train_mode="fedsgd",
    ) == {"fl-attack.sample-indices": "4,1", "fl-attack.partition-id": 2, "fl-attack.train-mode": "fedsgd"}
    with pytest.raises(ValueError, match=r"sample indices must be non-negative integers, got \[1, -3\]"):
        audit_metrics(context({}), sample_indices=[1, -3], simulation=True)


def _adapter_round(
    *, secure: bool, attacker: RecordingAttacker
) -> tuple[AuditedLegacyStrategy, RecordingFedAvg, list[np.ndarray], dict[int, Any], list[int]]:
    start, replies = client_replies(4, seed=7, examples=(8, 8, 8, 8))
    for position, node in enumerate(sorted(replies)):  # the clients report partition and batch
        arrays, count, metrics = replies[node]
        metrics.update(
            {
                "fl-attack.partition-id": position,
                "fl-attack.sample-indices": f"{2 * position},{2 * position + 1}",
                "fl-attack.train-mode": "fedsgd",
            }
        )
    inner = RecordingFedAvg(min_fit_clients=4, min_available_clients=4)
    strategy = AuditedLegacyStrategy(
        inner,
        Auditor(attacker, scorer=scorer(), secagg=SecAggSettings(group_size=2, quantization=FLOWER_DEFAULTS)),
        array_names=NAMES,
    )
    order = run_flower_round(replies, start=start, strategy=strategy, seed=11, secure=secure)
    return strategy, inner, start, replies, order


def test_adapter_attacks_the_secaggplus_aggregate_as_one_unit_and_aggregates_like_the_inner_strategy() -> (
    None
):
    attacker = RecordingAttacker()
    strategy, inner, start, replies, order = _adapter_round(secure=True, attacker=attacker)

    assert securely_aggregated(inner.received)
    aggregate = secagg_plus_aggregate(
        [replies[n][0] for n in order], num_examples=[8] * 4, rng=np.random.RandomState(11)
    )
    # the attacker saw k (A - W0) of the first layer, summed as the auditor sums members
    (call,) = attacker.calls
    change = aggregate[0] - start[0].astype(np.float64)
    assert np.array_equal(call["update"].weight_update, change + change + change + change)
    assert np.array_equal(call["update"].weight, start[0].astype(np.float64))
    (record,) = strategy.records
    assert record.client == "secagg-partition-0_partition-1_partition-2_partition-3"
    assert record.details["partition_id"] == [0, 1, 2, 3] and record.details["secagg_group_size"] == 4
    assert sorted(record.details["members"]) == ["partition-0", "partition-1", "partition-2", "partition-3"]
    assert all(quality["samples"] == 2 for quality in record.details["members"].values())
    # the auditor's own settings are back: simulated groups of 2 with quantization
    assert strategy.auditor.secagg == SecAggSettings(group_size=2, quantization=FLOWER_DEFAULTS)

    # aggregation: exactly the plain legacy FedAvg on what the workflow delivered, minus the audit metrics
    plain = LegacyFedAvg().aggregate_fit(1, inner.received, [])
    returned = parameters_to_ndarrays(inner.returned[0])
    assert all(np.array_equal(a, b) for a, b in zip(returned, parameters_to_ndarrays(plain[0]), strict=True))
    assert sorted(metrics["loss"] for metrics in inner.seen_metrics) == [0.0, 1.0, 2.0, 3.0]
    assert all(not key.startswith("fl-attack.") for metrics in inner.seen_metrics for key in metrics)


def test_adapter_without_secagg_attacks_every_client() -> None:
    attacker = RecordingAttacker()
    strategy, inner, start, replies, _ = _adapter_round(secure=False, attacker=attacker)
    assert not securely_aggregated(inner.received)
    # no real SecAgg+: the auditor's simulated groups of 2 (quantized) apply to the clients' own updates
    assert [record.client for record in strategy.records] == [
        "secagg-partition-0_partition-1",
        "secagg-partition-2_partition-3",
    ]
    nodes = sorted(replies)
    expected, _ = secagg_observed_sum(
        [
            [replies[n][0][0].astype(np.float64) - start[0], replies[n][0][1].astype(np.float64) - start[1]]
            for n in nodes[:2]
        ],
        start=start[:2],
        num_examples=[8, 8],
        seed=(0, 1, *nodes[:2]),
    )
    assert np.array_equal(attacker.calls[0]["update"].weight_update, expected)


# ----------------------------------------------------------------------------- run_simulation


class RecordingAudit(AuditedLegacyStrategy):
    """The adapter, keeping what ``aggregate_fit`` received and returned (the ServerApp runs in a thread)."""

    rounds: list[dict[str, Any]] = []

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
        RecordingAudit.rounds.append({"start": parameters_to_ndarrays(parameters)})
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        returned = super().aggregate_fit(server_round, results, failures)
        RecordingAudit.rounds[-1].update(results=list(results), returned=returned)
        return returned


def test_adapter_under_run_simulation_with_flowers_secaggplus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 clients of the example app (on digits, the smallest model), one round of real SecAgg+ under Ray."""
    from flwr.server import Grid, ServerApp
    from flwr.server.workflow import DefaultWorkflow
    from flwr.simulation import run_simulation

    monkeypatch.syspath_prepend(str(EXAMPLE))
    # The simulated clients run in Ray workers: they import this checkout and the example.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT), str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    )
    from measure import NUM_CLIENTS, replayed_updates
    from secagg_example.client_app import create_client_app
    from secagg_example.task import get_weights, load_data, make_model

    RecordingAudit.rounds = []
    attacker = RecordingAttacker(rows=3, width=64)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        data = load_data("digits")
        model = make_model(input_dim=data.input_dim, num_classes=data.num_classes, width=200, seed=0)
        inner = LegacyFedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=NUM_CLIENTS,
            min_available_clients=NUM_CLIENTS,
            initial_parameters=ndarrays_to_parameters(get_weights(model)),
            on_fit_config_fn=lambda r: {"server-round": r},
        )
        strategy = RecordingAudit.from_context(
            inner,
            context,
            array_names=list(model.state_dict()),
            attacker=attacker,
            scorer=ReconstructionScorer.from_image_data(data),
            output_dir=str(tmp_path / "run"),
            attack_isolation="thread",
            attack_time_budget=5.0,
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        try:
            DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2))(
                grid, legacy
            )
        finally:
            strategy.close()

    run_simulation(
        server_app=server_app,
        client_app=create_client_app({"seed": 0, "dataset": "digits"}),
        num_supernodes=NUM_CLIENTS,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "num_gpus": 0},
        },
    )

    (recorded,) = RecordingAudit.rounds
    results = recorded["results"]
    assert len(results) == NUM_CLIENTS and securely_aggregated(results)
    aggregate = parameters_to_ndarrays(results[0][1].parameters)
    # aggregation is the plain legacy FedAvg's on the delivered results
    plain = LegacyFedAvg().aggregate_fit(1, results, [])
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            parameters_to_ndarrays(recorded["returned"][0]), parameters_to_ndarrays(plain[0]), strict=True
        )
    )
    # what Flower delivered: the mean of the clients' parameters (equal counts) up to SecAgg+'s quantization
    start, updates = replayed_updates({"seed": 0, "dataset": "digits"})
    total = NUM_CLIENTS * weight_factor(8, max_weight=1000.0, quantization_range=2**22)
    bound = NUM_CLIENTS * 1.25 * 16.0 / total
    for position, key in enumerate(start):
        mean = np.mean([update.arrays[key].astype(np.float64) for update in updates], axis=0)
        assert np.abs(aggregate[position] - mean).max() <= bound, key
    # the attack saw the sum of the four changes as the server derives it, and was recorded with members
    (call,) = attacker.calls
    change = aggregate[0] - recorded["start"][0].astype(np.float64)
    assert np.array_equal(call["update"].weight_update, change + change + change + change)
    rows = load_table(tmp_path / "run" / "attacks.csv")
    assert [(row["round"], row["client"], row["status"]) for row in rows] == [
        ("1", "secagg-partition-0_partition-1_partition-2_partition-3", "ok")
    ]
    metrics = json.loads((tmp_path / "run" / rows[0]["directory"] / "metrics.json").read_text())
    assert sorted(metrics["details"]["members"]) == [f"partition-{p}" for p in range(NUM_CLIENTS)]
    assert all(quality["samples"] == 8 for quality in metrics["details"]["members"].values())
    assert metrics["details"]["train_mode"] == "fedsgd"
