"""Audit your own Flower app: a user's ClientApp code, unchanged, answering an audited server.

The example apps' functions are called directly with hand-built Flower messages (no Ray), so
these tests follow one round exactly: the server's one line, the client's optional ground-truth
line, what the attacker recovers, how it is scored, and what aggregation receives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fl_attack import get_attack
from fl_attack.audit import (
    AttackSettings,
    Auditor,
    ClientIdentity,
    ClientUpdate,
    ExecutionSettings,
    GroundTruth,
)
from fl_attack.audit.protocol import GROUND_TRUTH_KEY
from fl_attack.evaluation.scoring import FeatureScorer
from strategies import HonestButCuriousStrategy
from tests.example_apps import CNN_ONE_STEP, example_on_path, load_example


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages built outside a Flower run need a task identity (as a ServerApp has)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # pylint: disable=protected-access
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # pylint: disable=protected-access


class FakeGrid:
    """Just enough of a Grid for FedAvg's node sampling."""

    def __init__(self, node_ids: list[int]) -> None:
        self._node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)


def _context(config: dict[str, Any], node_id: int = 0, node_config: dict[str, Any] | None = None) -> Context:
    return Context(
        run_id=1, node_id=node_id, node_config=node_config or {}, state=RecordDict(), run_config=config
    )


def _cnn_round(overrides: dict[str, Any]) -> tuple[HonestButCuriousStrategy, list[Message]]:
    """Round 1 of the quickstart CNN: the audited server configures, the example's own client code answers."""
    example = load_example("quickstart_cnn")
    config = {**example.config, **CNN_ONE_STEP, **overrides}
    with example_on_path(example):
        from cnn_example.client_app import train
        from cnn_example.task import Net

        strategy = HonestButCuriousStrategy.from_context(FedAvg(), _context(config), scorer=FeatureScorer())
        torch.manual_seed(int(config["seed"]))
        arrays = ArrayRecord(Net().state_dict())
        messages = sorted(
            strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([1, 2])),  # type: ignore[arg-type]
            key=lambda message: message.metadata.dst_node_id,
        )
        replies = [
            train(message, _context(config, node_id, {"partition-id": node_id - 1, "num-partitions": 2}))
            for node_id, message in zip((1, 2), messages, strict=True)
        ]
        strategy.aggregate_train(1, replies)
        strategy.close()
    return strategy, replies


def test_users_cnn_client_is_audited_on_fc1_features(tmp_path: Path) -> None:
    overrides = {"attack-isolation": "thread", "attack-time-budget": 5.0, "output-dir": str(tmp_path / "run")}
    strategy, replies = _cnn_round(overrides)
    first, second = [record for record in strategy.records if record.attack.get("attack") != "cocktail-party"]
    assert (first.client, second.client) == ("node-1", "node-2")
    assert first.input_space == second.input_space == "features"
    # seed 0: partition 0's batch of 8 is recovered exactly; fc1's 400 inputs per sample
    assert first.verdict == "exact", first.verdict_reason
    assert first.quality["kind"] == "features" and first.quality["num_reference"] == 8
    assert first.quality["exact_fraction"] == 1.0 and first.quality["max_relative_error"] < 1e-4
    assert strategy.auditor.store is not None
    stored = np.load(strategy.auditor.store.directory / "round-001" / "node-1" / "reconstruction.npy")
    assert stored.shape == (8, 400) and (stored >= -1e-4 * np.abs(stored).max()).all()  # pooled ReLU features
    assert first.quality["plausibility"]["non_negative_fraction"] == 1.0
    # the ground truth was for the audit only: aggregation never saw it
    assert all(GROUND_TRUTH_KEY not in reply.content for reply in replies)


def test_ground_truth_must_come_from_the_received_weights_for_a_cnn() -> None:
    """After the local step the convolutions moved: their features are no longer what fc1 saw."""
    example = load_example("quickstart_cnn")
    with example_on_path(example):
        from cnn_example.task import Net, load_data, train

        from clients.ground_truth import layer_inputs

        torch.manual_seed(0)
        net = Net()
        loader, _ = load_data(0, 2, batch_size=8, dataset="photo-patches", data_root="", seed=1000)
        batch = next(iter(loader))
        before = layer_inputs(net, batch[0]).double()
        train(net, [batch], epochs=1, lr=0.1)
        after = layer_inputs(net, batch[0]).double()
    relative = (after - before).norm(dim=1) / before.norm(dim=1)
    assert float(relative.min()) > 1e-3  # far above EXACT_RELATIVE_ERROR: scoring would call it inexact


def test_from_context_scores_features_by_default(tmp_path: Path) -> None:
    strategy = HonestButCuriousStrategy.from_context(
        FedAvg(), _context({"output-dir": str(tmp_path / "run"), "attack-isolation": "thread"})
    )
    strategy.close()
    assert isinstance(strategy.auditor.scorer, FeatureScorer)


def test_float32_rounding_is_named_when_it_withholds_exact() -> None:
    """Every row recovered, one neuron's ReLU agreement lost to float32 rounding: the reason says so."""
    example = load_example("tabular")
    with example_on_path(example):
        from tabular_example.task import IncomeClassifier, load_data, load_table, table_schema, train

        from fl_attack.evaluation.scoring import TabularScorer

        torch.manual_seed(5)
        model = IncomeClassifier()
        received = {key: value.detach().clone().numpy() for key, value in model.state_dict().items()}
        loader, _ = load_data(0, 2, batch_size=8, source="bundled", data_root="", seed=5)
        rows, targets = next(iter(loader))
        train(model, [(rows, targets)], optimizer="sgd", lr=0.1)
        scorer = TabularScorer(table_schema(load_table("bundled", "")[0]))
    attacker = get_attack("spear++", device="cpu", seed=0, time_budget=20.0, progress=False)
    auditor = Auditor(
        attacker,
        scorer=scorer,  # type: ignore[arg-type]
        attack=AttackSettings(time_budget=20.0),
        execution=ExecutionSettings(isolation="thread"),
    )
    auditor.start_round(1, received)
    sent = {key: value.detach().numpy() for key, value in model.state_dict().items()}
    (record,) = auditor.audit_round(
        1, [ClientUpdate(ClientIdentity(1), sent, ground_truth=GroundTruth(inputs=rows.double().numpy()))]
    )
    auditor.close()
    assert record.quality["exact_fraction"] == 1.0  # every row, by the scorer's 1e-4 criterion
    assert record.attack["relative_noise"] > 1e-6  # float32 rounding is visible in the update
    assert record.verdict == "exact" or "rounding" in record.verdict_reason, record.verdict_reason
