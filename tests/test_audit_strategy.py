"""Tests of the honest-but-curious strategy wrapper with hand-built Flower messages."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fl_attack import LayerUpdate, Reconstruction
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import AttackSettings, Auditor, LayerNotFoundError, SamplingSettings, SecAggSettings
from fl_attack.audit import select_layer as _select_layer
from fl_attack.audit.protocol import AUDIT_KEY, PARTITION_ID_KEY, SAMPLE_INDICES_KEY
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.results.store import ReconstructionStore, load_table
from fl_attack.types import OPTIONAL_PARTS
from strategies import HonestButCuriousStrategy

INPUT_DIM, WIDTH, CLASSES = 12, 6, 3


def select_layer(record: ArrayRecord, **keys: Any) -> Any:
    """The layer chosen among a Flower record's arrays."""
    return _select_layer({key: value.numpy() for key, value in record.items()}, **keys)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages built outside a Flower run need a task identity (as a ServerApp has)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # pylint: disable=protected-access
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # pylint: disable=protected-access


class FakeGrid:
    """Just enough of a Grid for FedAvg's node sampling."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)


class RecordingAttacker(LayerAttackBase):
    """Returns fixed inputs and remembers every update it receives, with the call's options."""

    def __init__(self, inputs: np.ndarray | None = None) -> None:
        self.calls: list[tuple[LayerUpdate[Any], dict[str, Any]]] = []
        self.inputs = np.zeros((2, INPUT_DIM)) if inputs is None else inputs

    def attack(
        self, update: LayerUpdate[Any], /, *, batch_size: int | None = None, budget: Budget | None = None
    ) -> Reconstruction:
        self.calls.append((update, {"batch_size": batch_size, "budget": budget}))
        b = len(self.inputs)
        return Reconstruction(
            inputs=torch.as_tensor(self.inputs, dtype=torch.float64),
            batch_size=b,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(b, dtype=torch.float64),
            seconds=0.0,
        )


class FailingAttacker(LayerAttackBase):
    """Raises the given exception on every call."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        raise self.error


class SlowAttacker(LayerAttackBase):
    """Blocks until released (or for at most ``seconds``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = threading.Event()

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        self.release.wait(self.seconds)
        raise RuntimeError("released")


def _record(arrays: dict[str, np.ndarray], prefix: str = "") -> ArrayRecord:
    return ArrayRecord({prefix + key: Array(value) for key, value in arrays.items()})


def _global_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "0.weight": rng.standard_normal((WIDTH, INPUT_DIM)).astype(np.float32),
        "0.bias": rng.standard_normal(WIDTH).astype(np.float32),
        "2.weight": rng.standard_normal((CLASSES, WIDTH)).astype(np.float32),
        "2.bias": rng.standard_normal(CLASSES).astype(np.float32),
    }


def _client_arrays(global_arrays: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {
        key: (value - 0.01 * rng.standard_normal(value.shape)).astype(np.float32)
        for key, value in global_arrays.items()
    }


def _reply(
    node_id: int,
    arrays: dict[str, np.ndarray],
    *,
    num_examples: int = 4,
    partition_id: int | None = None,
    indices: list[int] | None = None,
    prefix: str = "",
) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)
    content = RecordDict(
        {
            "arrays": _record(arrays, prefix),
            "metrics": MetricRecord({"num-examples": num_examples, "train-loss": float(node_id)}),
        }
    )
    audit: dict[str, Any] = {}
    if partition_id is not None:
        audit[PARTITION_ID_KEY] = partition_id
    if indices is not None:
        audit[SAMPLE_INDICES_KEY] = indices
    if audit:
        content[AUDIT_KEY] = ConfigRecord(audit)
    return Message(content, reply_to=instruction)


def _configure(strategy: HonestButCuriousStrategy, arrays: dict[str, np.ndarray], rnd: int = 1) -> None:
    messages = list(
        strategy.configure_train(rnd, _record(arrays), ConfigRecord(), FakeGrid([11, 22, 33]))  # type: ignore[arg-type]
    )
    assert len(messages) == 3


def _audited(inner: Any, attacker: Any, **options: Any) -> HonestButCuriousStrategy:
    return HonestButCuriousStrategy(inner, Auditor(attacker, **options))


def _fedavg() -> FedAvg:
    return FedAvg(min_train_nodes=2, min_available_nodes=2, min_evaluate_nodes=2)


def test_attacker_receives_exact_first_layer_delta() -> None:
    global_arrays = _global_arrays()
    clients = {11: _client_arrays(global_arrays, 1), 22: _client_arrays(global_arrays, 2)}
    attacker = RecordingAttacker()
    strategy = _audited(_fedavg(), attacker, attack=AttackSettings(time_budget=5.0, batch_size=4))
    _configure(strategy, global_arrays)
    replies = [_reply(node, arrays, partition_id=node // 11 - 1) for node, arrays in clients.items()]

    strategy.aggregate_train(1, replies)

    assert len(attacker.calls) == 2
    for (update, options), node in zip(attacker.calls, clients, strict=True):
        weight_grad, bias_grad = update.weight_update, update.bias_update
        expected_w = clients[node]["0.weight"].astype(np.float64) - global_arrays["0.weight"].astype(
            np.float64
        )
        expected_b = clients[node]["0.bias"].astype(np.float64) - global_arrays["0.bias"].astype(np.float64)
        np.testing.assert_array_equal(weight_grad, expected_w)
        np.testing.assert_array_equal(bias_grad, expected_b)
        np.testing.assert_array_equal(update.weight, global_arrays["0.weight"].astype(np.float64))
        np.testing.assert_array_equal(update.bias, global_arrays["0.bias"].astype(np.float64))
        # The attacker gets the update and the global layer, nothing about the client's data.
        assert set(options) == {"batch_size", "budget"}
        assert options["batch_size"] == 4 and options["budget"].seconds == 5.0
        assert all(getattr(update, part) is None for part in OPTIONAL_PARTS)  # it uses none of them
    assert [record.client for record in strategy.records] == ["partition-0", "partition-1"]
    assert all(record.status == "ok" for record in strategy.records)


def test_aggregation_is_exactly_the_inner_strategys() -> None:
    global_arrays = _global_arrays()
    replies = [
        _reply(11, _client_arrays(global_arrays, 1), num_examples=3, partition_id=0, indices=[1, 2, 3]),
        _reply(22, _client_arrays(global_arrays, 2), num_examples=5, partition_id=1, indices=[4, 5, 6, 7, 8]),
        _reply(33, _client_arrays(global_arrays, 3), num_examples=8, partition_id=2, indices=[9]),
    ]
    plain_replies = copy.deepcopy(replies)
    for reply in plain_replies:
        del reply.content[AUDIT_KEY]

    alone_arrays, alone_metrics = _fedavg().aggregate_train(1, plain_replies)
    strategy = _audited(_fedavg(), RecordingAttacker())
    _configure(strategy, global_arrays)
    audited_arrays, audited_metrics = strategy.aggregate_train(1, replies)

    assert alone_arrays is not None and audited_arrays is not None
    assert list(audited_arrays.keys()) == list(alone_arrays.keys())
    for key in alone_arrays:
        np.testing.assert_array_equal(audited_arrays[key].numpy(), alone_arrays[key].numpy())
    assert dict(audited_metrics or {}) == dict(alone_metrics or {})
    assert len(strategy.records) == 3
    # The simulation-only ground truth never reaches the inner strategy.
    assert all(AUDIT_KEY not in reply.content for reply in replies)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("no sparse directions"), "error"),
        (MemoryError(), "out-of-memory"),
        (torch.cuda.OutOfMemoryError("CUDA out of memory"), "out-of-memory"),
    ],
)
def test_attack_failures_are_recorded_and_training_continues(
    error: BaseException, status: str, tmp_path: Path
) -> None:
    global_arrays = _global_arrays()
    store = ReconstructionStore(tmp_path / "run")
    strategy = _audited(_fedavg(), FailingAttacker(error), store=store)
    _configure(strategy, global_arrays)
    replies = [
        _reply(node, _client_arrays(global_arrays, node), partition_id=i) for i, node in enumerate((11, 22))
    ]
    expected, _ = _fedavg().aggregate_train(1, copy.deepcopy(replies))

    arrays, metrics = strategy.aggregate_train(1, replies)

    assert arrays is not None and metrics is not None and expected is not None
    np.testing.assert_array_equal(arrays["0.weight"].numpy(), expected["0.weight"].numpy())
    assert [record.status for record in strategy.records] == [status, status]
    rows = load_table(store.table_path)
    assert [row["status"] for row in rows] == [status, status]
    stored = json.loads((store.directory / "round-001" / "partition-0" / "metrics.json").read_text())
    assert stored["status"] == status and stored["error"]


def test_attack_timeout_is_recorded_and_training_continues() -> None:
    global_arrays = _global_arrays()
    attacker = SlowAttacker(seconds=30.0)
    strategy = _audited(_fedavg(), attacker, attack=AttackSettings(timeout=0.2))
    _configure(strategy, global_arrays)
    replies = [_reply(11, _client_arrays(global_arrays, 1)), _reply(22, _client_arrays(global_arrays, 2))]
    start = time.perf_counter()
    try:
        arrays, _ = strategy.aggregate_train(1, replies)
    finally:
        attacker.release.set()
    assert time.perf_counter() - start < 10.0
    assert arrays is not None
    assert [record.status for record in strategy.records] == ["timeout", "timeout"]
    assert all("timeout" in (record.error or "") for record in strategy.records)


def test_unreadable_reply_is_recorded() -> None:
    global_arrays = _global_arrays()
    strategy = _audited(_fedavg(), RecordingAttacker())
    _configure(strategy, global_arrays)
    shrunk = _client_arrays(global_arrays, 1)
    shrunk["0.bias"] = shrunk["0.bias"][:-1]
    strategy.aggregate_train(1, [_reply(11, shrunk, partition_id=0)])
    assert strategy.records[0].status == "error"
    assert "differ" in (strategy.records[0].error or "")


def test_wrong_layer_name_lists_available_keys() -> None:
    strategy = _audited(_fedavg(), RecordingAttacker(), attack=AttackSettings(weight_key="fc1.weight"))
    with pytest.raises(LayerNotFoundError) as raised:
        _configure(strategy, _global_arrays())
    message = str(raised.value)
    assert "fc1.weight" in message
    for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert key in message


def test_named_layer_and_default_layer() -> None:
    arrays = _record(_global_arrays())
    assert select_layer(arrays).weight == "0.weight"
    chosen = select_layer(arrays, weight_key="2.weight")
    assert (chosen.weight, chosen.bias) == ("2.weight", "2.bias")
    with pytest.raises(LayerNotFoundError, match="available keys"):
        select_layer(arrays, weight_key="0.bias")
    with pytest.raises(LayerNotFoundError, match="no linear layer"):
        select_layer(_record({"0.bias": np.zeros(3, dtype=np.float32)}))


def test_opacus_module_prefix_is_stripped() -> None:
    global_arrays = _global_arrays()
    prefixed_global = _record(global_arrays, "_module.")
    assert select_layer(prefixed_global).weight == "0.weight"
    assert select_layer(prefixed_global, weight_key="_module.0.weight").bias == "0.bias"

    attacker = RecordingAttacker()
    strategy = _audited(_fedavg(), attacker, attack=AttackSettings(weight_key="_module.0.weight"))
    _configure(strategy, global_arrays)
    client = _client_arrays(global_arrays, 1)
    strategy.aggregate_train(1, [_reply(11, client, prefix="_module.")])
    update, _ = attacker.calls[0]
    weight_grad, bias_grad = update.weight_update, update.bias_update
    np.testing.assert_array_equal(
        weight_grad, client["0.weight"].astype(np.float64) - global_arrays["0.weight"].astype(np.float64)
    )
    np.testing.assert_array_equal(
        bias_grad, client["0.bias"].astype(np.float64) - global_arrays["0.bias"].astype(np.float64)
    )


def test_attack_selection_by_partition_and_fraction() -> None:
    global_arrays = _global_arrays()
    nodes = (11, 22, 33, 44)

    def replies() -> list[Message]:
        return [
            _reply(node, _client_arrays(global_arrays, node), partition_id=i) for i, node in enumerate(nodes)
        ]

    chosen = _audited(_fedavg(), RecordingAttacker(), sampling=SamplingSettings(attack_partitions=[1, 3]))
    _configure(chosen, global_arrays)
    chosen.aggregate_train(1, replies())
    assert [record.client for record in chosen.records] == ["partition-1", "partition-3"]

    half = _audited(_fedavg(), RecordingAttacker(), sampling=SamplingSettings(attack_fraction=0.5), seed=3)
    _configure(half, global_arrays)
    half.aggregate_train(1, replies())
    assert len(half.records) == 2

    none = _audited(_fedavg(), RecordingAttacker(), sampling=SamplingSettings(attack_fraction=0.0))
    _configure(none, global_arrays)
    arrays, _ = none.aggregate_train(1, replies())
    assert none.records == [] and arrays is not None


def test_error_replies_are_skipped_and_passed_on() -> None:
    from flwr.app import Error

    global_arrays = _global_arrays()
    instruction = Message(RecordDict(), dst_node_id=33, message_type=MessageType.TRAIN)
    failed = Message(Error(code=0, reason="client crashed"), reply_to=instruction)
    attacker = RecordingAttacker()
    strategy = _audited(_fedavg(), attacker)
    _configure(strategy, global_arrays)
    arrays, _ = strategy.aggregate_train(
        1,
        [_reply(11, _client_arrays(global_arrays, 1)), _reply(22, _client_arrays(global_arrays, 2)), failed],
    )
    assert arrays is not None
    assert len(attacker.calls) == 2 and len(strategy.records) == 3  # the error reply is recorded too


def test_ground_truth_scoring_and_storage(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    dataset = rng.standard_normal((20, INPUT_DIM))
    indices = [3, 7, 11]
    truth = dataset[indices]
    attacker = RecordingAttacker(inputs=truth[[2, 0, 1]])  # arbitrary order
    scorer = ReconstructionScorer(
        dataset,
        denormalize=lambda x: (torch.as_tensor(x) * 0.1 + 0.5).reshape(-1, 1, 3, 4),
        image_shape=(1, 3, 4),
    )
    store = ReconstructionStore(tmp_path / "run", run_config={"dataset": "synthetic"})
    strategy = _audited(_fedavg(), attacker, store=store, scorer=scorer)
    global_arrays = _global_arrays()
    _configure(strategy, global_arrays)
    strategy.aggregate_train(
        1,
        [
            _reply(11, _client_arrays(global_arrays, 1), partition_id=0, indices=indices),
            _reply(22, _client_arrays(global_arrays, 2), partition_id=1),
        ],
    )
    scored, unscored = strategy.records
    assert scored.psnr is not None and min(scored.psnr) > 90.0
    assert scored.quality["exact_fraction"] == 1.0
    # with a store, records keep no arrays (bounded memory): the images are in the store
    assert scored.reconstructed_images is None and scored.inputs is None
    stored = np.load(store.directory / "round-001" / "partition-0" / "reconstruction.npy")
    np.testing.assert_allclose(np.sort(stored, axis=0), np.sort(truth, axis=0), atol=1e-12)
    assert unscored.psnr is None and unscored.reference_images is None
    assert (store.directory / "round-001" / "partition-1" / "reconstruction.png").stat().st_size > 0

    directory = store.directory / "round-001" / "partition-0"
    assert {path.name for path in directory.iterdir()} == {
        "reconstruction.npy",
        "reconstruction.png",
        "metrics.json",
    }
    rows = {row["client"]: row for row in load_table(store.table_path)}
    assert float(rows["partition-0"]["mean_psnr"]) > 90.0
    assert rows["partition-1"]["mean_psnr"] == ""


def test_secure_aggregation_attacks_group_sums_and_scores_each_member() -> None:
    rng = np.random.default_rng(6)
    dataset = rng.standard_normal((20, INPUT_DIM))
    member_indices = {0: [1, 2], 1: [5, 6, 7], 2: [9]}
    # The attacker recovers partition 0's samples exactly and nothing of partition 1's.
    recovered = np.concatenate([dataset[[2, 1]], rng.standard_normal((3, INPUT_DIM))])
    attacker = RecordingAttacker(inputs=recovered)
    scorer = ReconstructionScorer(
        dataset,
        denormalize=lambda x: (torch.as_tensor(x) * 0.1 + 0.5).reshape(-1, 1, 3, 4),
        image_shape=(1, 3, 4),
    )
    strategy = _audited(
        _fedavg(),
        attacker,
        scorer=scorer,
        attack=AttackSettings(batch_size=4),
        secagg=SecAggSettings(group_size=2),
    )
    global_arrays = _global_arrays()
    _configure(strategy, global_arrays)
    clients = {partition: _client_arrays(global_arrays, partition) for partition in member_indices}
    replies = [
        _reply(11 * (partition + 1), clients[partition], partition_id=partition, indices=indices)
        for partition, indices in reversed(member_indices.items())
    ]

    strategy.aggregate_train(1, replies)

    # Groups follow partition order: {0, 1} summed, then {2} alone.
    assert [record.client for record in strategy.records] == [
        "secagg-partition-0_partition-1",
        "partition-2",
    ]
    (update, options), _ = attacker.calls
    summed = sum(clients[p]["0.weight"].astype(np.float64) - global_arrays["0.weight"] for p in (0, 1))
    np.testing.assert_allclose(update.weight_update, summed, rtol=0, atol=1e-12)
    assert options["batch_size"] == 8
    group = strategy.records[0]
    assert group.details["partition_id"] == [0, 1]
    members = group.details["members"]
    assert members["partition-0"]["samples"] == 2 and members["partition-0"]["exact_fraction"] == 1.0
    assert members["partition-1"]["samples"] == 3 and members["partition-1"]["exact_fraction"] == 0.0
    assert group.quality["exact_fraction"] == pytest.approx(0.4)


def test_secure_aggregation_group_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="secagg_group_size must be a positive integer"):
        _audited(_fedavg(), RecordingAttacker(), secagg=SecAggSettings(group_size=0))


def test_evaluation_is_delegated() -> None:
    inner = _fedavg()
    strategy = _audited(inner, RecordingAttacker())
    instruction = Message(RecordDict(), dst_node_id=11, message_type=MessageType.EVALUATE)
    replies = [
        Message(
            RecordDict({"metrics": MetricRecord({"num-examples": 2, "eval-acc": 0.5})}), reply_to=instruction
        )
    ]
    assert dict(strategy.aggregate_evaluate(1, replies) or {}) == dict(
        inner.aggregate_evaluate(1, replies) or {}
    )
