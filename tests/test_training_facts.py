"""What the audit reads of a client's training: its reply's ``num-examples`` and the train config
the server sent it, through hand-built Flower messages to the attack and into the verdict."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fl_attack import LayerUpdate, Reconstruction, SpearPlusPlus
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings
from fl_attack.audit.training_facts import ObservedTraining, ServerTrainConfig, read_train_config
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.local_training.known import KnownTraining
from fl_attack.results.store import AttackRecord
from fl_attack.simulate.victims import fedavg_update
from strategies import HonestButCuriousStrategy
from tests.synthetic_layer import relu_layer_update

BATCH, FEATURES, WIDTH = 4, 48, 120

#: A train config with every key the audit reads, as a Flower server sends it.
FULL_CONFIG = {"lr": 0.1, "local-epochs": 1, "batch-size": 2, "momentum": 0.9, "weight-decay": 5e-4}


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


class SpyAttack(SpearPlusPlus):
    """SPEAR++ that remembers the update and batch size it was handed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(seed=0, progress=False, **options)
        self.calls: list[tuple[LayerUpdate[Any], int | None]] = []

    def attack(
        self, observed: LayerUpdate[Any], /, *, batch_size: int | None = None, budget: Budget | None = None
    ) -> Reconstruction:
        self.calls.append((observed, batch_size))
        return super().attack(observed, batch_size=batch_size, budget=budget)


def _one_step(seed: int = 0) -> tuple[torch.Tensor, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A batch of ``BATCH`` samples, the global layer and the layer a client sends after one SGD step."""
    inputs = torch.rand(BATCH, FEATURES, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    layer = relu_layer_update(inputs, width=WIDTH, seed=seed)
    global_arrays = {"fc.weight": layer.weight.numpy(), "fc.bias": layer.bias.numpy()}
    sent = {
        "fc.weight": (layer.weight - 0.01 * layer.weight_grad).numpy(),
        "fc.bias": (layer.bias - 0.01 * layer.bias_grad).numpy(),
    }
    return inputs, global_arrays, sent


def _reply(node_id: int, arrays: dict[str, np.ndarray], *, num_examples: int) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)
    content = RecordDict(
        {
            "arrays": ArrayRecord({key: Array(value) for key, value in arrays.items()}),
            "metrics": MetricRecord({"num-examples": num_examples, "train-loss": 0.5}),
        }
    )
    return Message(content, reply_to=instruction)


def _strategy_round(
    attacker: SpearPlusPlus,
    global_arrays: dict[str, np.ndarray],
    sent: dict[str, np.ndarray],
    *,
    num_examples: int,
    train_config: dict[str, Any],
) -> AttackRecord:
    """One round of FedAvg wrapped by the audit, the server sending ``train_config``; its one record."""
    auditor = Auditor(
        attacker,
        attack=AttackSettings(time_budget=20.0, fallback=""),
        execution=ExecutionSettings(isolation="thread"),
    )
    strategy = HonestButCuriousStrategy(FedAvg(min_train_nodes=1, min_available_nodes=1), auditor)
    arrays = ArrayRecord({key: Array(value) for key, value in global_arrays.items()})
    instructions = list(
        strategy.configure_train(1, arrays, ConfigRecord(train_config), FakeGrid([7]))  # type: ignore[arg-type]
    )
    assert [message.metadata.dst_node_id for message in instructions] == [7]
    strategy.aggregate_train(1, [_reply(7, sent, num_examples=num_examples)])
    auditor.close()
    (record,) = auditor.records
    return record


def _rows_are_true_samples(record: AttackRecord, inputs: torch.Tensor) -> bool:
    """Every recovered row is one of the true samples (relative error below 1e-6), each once."""
    assert record.inputs is not None
    rows = torch.as_tensor(np.asarray(record.inputs), dtype=torch.float64)
    errors = torch.cdist(rows, inputs) / inputs.norm(dim=1)[None, :]
    best = errors.argmin(dim=1)
    return bool((errors.min(dim=1).values < 1e-6).all()) and len(set(best.tolist())) == len(rows)


# ------------------------------------------------------------------ reading the train config


def test_the_valid_keys_of_a_train_config_are_read() -> None:
    config = read_train_config({**FULL_CONFIG, "server-round": 3, "local-epochs": 2.0}, sender="node-1")
    assert config == ServerTrainConfig(lr=0.1, local_epochs=2, batch_size=2, momentum=0.9, weight_decay=5e-4)
    assert config.describe() == "local-epochs 2, batch-size 2, momentum 0.9, weight-decay 0.0005, lr 0.1"
    assert read_train_config({"server-round": 3}, sender="node-1").empty


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("batch-size", "five"),
        ("batch-size", 2.5),
        ("batch-size", 0),
        ("local-epochs", True),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("weight-decay", -1e-4),
        ("weight-decay", [5e-4]),
    ],
)
def test_a_malformed_value_is_left_out_with_a_warning(
    key: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fl_attack.audit.training_facts"):
        config = read_train_config({**FULL_CONFIG, key: value}, sender="node-7")
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"The train config sent to node-7 has {key}={value!r}, not ")
    assert warning.endswith("the audit does not use it")
    others = read_train_config({k: v for k, v in FULL_CONFIG.items() if k != key}, sender="node-7")
    assert config == others  # only the malformed key is left out


def test_mini_batch_size_wins_over_batch_size() -> None:
    """This project's own app sends both: ``batch-size`` is its FedSGD batch, ``mini-batch-size`` FedAvg's."""
    config = read_train_config({"batch-size": 8, "mini-batch-size": 3}, sender="node-1")
    assert config.batch_size == 3 and config.describe() == "mini-batch-size 3"
    assert read_train_config({"batch-size": 8}, sender="node-1").describe() == "batch-size 8"


def test_a_client_reporting_one_fedsgd_step_gets_no_local_epochs() -> None:
    training = ObservedTraining(8, ServerTrainConfig(batch_size=8, local_epochs=1))
    assert training.known_training(train_mode="fedsgd") is None
    assert training.known_training(train_mode="fedavg") == KnownTraining(mini_batch_size=8, epochs=1)


def test_lr_alone_does_not_reach_the_attack() -> None:
    """The attack ignores the update's scale: lr narrows nothing without weight decay."""
    assert ObservedTraining(4, ServerTrainConfig(lr=0.1)).known_training() is None
    assert ObservedTraining(4, ServerTrainConfig(lr=0.1, weight_decay=0.0)).known_training() == KnownTraining(
        weight_decay=0.0, lr=0.1
    )


def test_a_sum_of_clients_has_no_one_train_config() -> None:
    config = ServerTrainConfig(batch_size=2)
    unit = ObservedTraining.of_members([3, 5], [config, config])
    assert unit == ObservedTraining(num_examples=8, config=ServerTrainConfig())
    assert ObservedTraining.of_members([3, None], [config, None]).num_examples is None


# ------------------------------------------------------------------ through the Flower wrapper


def test_the_train_config_the_server_sent_reaches_the_attack() -> None:
    inputs, global_arrays, sent = _one_step()
    attacker = SpyAttack()
    record = _strategy_round(attacker, global_arrays, sent, num_examples=BATCH, train_config=FULL_CONFIG)
    ((update, batch_size),) = attacker.calls
    assert update.local_training == KnownTraining(
        mini_batch_size=2, momentum=0.9, weight_decay=5e-4, lr=0.1, epochs=1
    )
    assert batch_size == BATCH  # num-examples, matching the update's rank
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
    assert _rows_are_true_samples(record, inputs)
    assert record.verdict_reason.endswith(
        "; it rests on a batch of 4 (the client's num-examples, matching the update's rank) and the "
        "server's train config (local-epochs 1, batch-size 2, momentum 0.9, weight-decay 0.0005, lr 0.1)"
    ), record.verdict_reason
    assert record.attack["reported_examples"] == BATCH


def test_without_a_train_config_the_attack_is_the_same() -> None:
    """No config (and a count the spectrum confirms): the same reconstruction as the bare attack."""
    inputs, global_arrays, sent = _one_step()
    attacker = SpyAttack()
    record = _strategy_round(attacker, global_arrays, sent, num_examples=BATCH, train_config={})
    ((update, _),) = attacker.calls
    assert update.local_training is None
    bare = SpearPlusPlus(seed=0, progress=False).attack(
        LayerUpdate(update.weight_update, update.bias_update, weight=update.weight, bias=update.bias)
    )
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
    assert record.inputs is not None
    np.testing.assert_array_equal(np.asarray(record.inputs), bare.inputs.numpy())
    assert "train config" not in record.verdict_reason


def test_a_malformed_train_config_warns_and_the_audit_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    inputs, global_arrays, sent = _one_step()
    attacker = SpyAttack()
    malformed = {"batch-size": "two", "momentum": 1.5, "weight-decay": 0.0, "lr": 0.1}
    with caplog.at_level(logging.WARNING):
        record = _strategy_round(attacker, global_arrays, sent, num_examples=BATCH, train_config=malformed)
    warnings = [entry.getMessage() for entry in caplog.records if entry.name.endswith("training_facts")]
    assert warnings == [
        "The train config sent to node-7 has batch-size='two', not a positive whole number: the audit does not use it",
        "The train config sent to node-7 has momentum=1.5, not a number in [0, 1): the audit does not use it",
    ]
    ((update, _),) = attacker.calls
    assert update.local_training == KnownTraining(weight_decay=0.0, lr=0.1)
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
    assert _rows_are_true_samples(record, inputs)
    assert "the server's train config (weight-decay 0, lr 0.1)" in record.verdict_reason


@pytest.mark.parametrize("reported", [2, 10, 1])
def test_a_wrong_num_examples_never_reaches_the_attack_nor_a_wrong_claim(reported: int) -> None:
    """An app reporting mini-batches (or anything but the batch): the attack estimates the batch
    itself, recovers the true samples, and the reason says the count was not used."""
    inputs, global_arrays, sent = _one_step(seed=1)
    attacker = SpyAttack()
    record = _strategy_round(attacker, global_arrays, sent, num_examples=reported, train_config={})
    ((_, batch_size),) = attacker.calls
    assert batch_size is None
    if record.verdict == "exact":
        assert _rows_are_true_samples(record, inputs)
    assert record.verdict == "exact", record.verdict_reason  # the count takes nothing away
    assert record.verdict_reason.endswith(
        f"; it rests on the batch size from the update's rank {BATCH} (the client's num-examples, "
        f"{reported}, differs, so it was not used)"
    ), record.verdict_reason


# ------------------------------------------------------------------ verdict wording


class MustNotRun(SpearPlusPlus):
    """SPEAR++ that fails the test if it is ever asked to invert."""

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Any:
        raise AssertionError("the attack ran on an update its spectrum rules out")


def _audit(
    attacker: SpearPlusPlus, global_arrays: dict[str, np.ndarray], update: ClientUpdate
) -> AttackRecord:
    auditor = Auditor(
        attacker,
        attack=AttackSettings(time_budget=30.0, fallback=""),
        execution=ExecutionSettings(isolation="thread"),
    )
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, [update])
    auditor.close()
    (record,) = auditor.records
    return record


@pytest.mark.parametrize(
    ("dead", "phrase"), [(0, "no low-rank structure"), (8, "full rank 112 on its 112 live")]
)
def test_more_samples_than_neurons_is_not_applicable(dead: int, phrase: str) -> None:
    """5000 samples on a 120-neuron layer whose update agrees (no low-rank structure)."""
    generator = np.random.default_rng(0)
    global_arrays = {"fc.weight": generator.normal(size=(120, 400)), "fc.bias": generator.normal(size=120)}
    step = 1e-2 * np.random.default_rng(1).normal(size=(120, 400))
    step[:dead] = 0.0
    sent = {
        "fc.weight": global_arrays["fc.weight"] + step,
        "fc.bias": global_arrays["fc.bias"] + step.sum(axis=1),
    }
    update = ClientUpdate(ClientIdentity(node_id=3), sent, num_examples=5000)
    record = _audit(MustNotRun(seed=0, progress=False), global_arrays, update)
    assert (record.status, record.verdict) == ("not-run", "not-applicable")
    assert record.verdict_reason.startswith(
        "5000 samples against 120 neurons: no exact attack can separate them (the count is the client's "
        "num-examples); the update agrees"
    ), record.verdict_reason
    assert phrase in record.verdict_reason


def test_more_samples_than_neurons_on_a_low_rank_update_is_still_attacked() -> None:
    """The update shows a batch of 4: a count of 5000 is not what it holds, and the attack decides."""
    inputs, global_arrays, sent = _one_step()
    update = ClientUpdate(ClientIdentity(node_id=3), sent, num_examples=5000)
    record = _audit(SpearPlusPlus(seed=0, progress=False), global_arrays, update)
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
    assert _rows_are_true_samples(record, inputs)


def _one_epoch(momentum: float) -> tuple[torch.Tensor, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Six samples, one epoch of two mini-batches of 3 at lr 0.5 (a later sample leaves W_0's pattern)."""
    inputs = torch.randn(6, 24, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).double()
    labels = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(6))
    weight_delta, bias_delta = fedavg_update(
        model, inputs, labels, lr=0.5, epochs=1, mini_batch_size=3, seed=6, momentum=momentum
    )
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    global_arrays = {"fc.weight": weight.numpy(), "fc.bias": bias.numpy()}
    sent = {"fc.weight": (weight + weight_delta).numpy(), "fc.bias": (bias + bias_delta).numpy()}
    return inputs, global_arrays, sent


def test_a_local_epoch_verdict_names_its_steps_and_the_config_it_rests_on() -> None:
    inputs, global_arrays, sent = _one_epoch(momentum=0.9)
    config = ServerTrainConfig(lr=0.5, local_epochs=1, batch_size=3, momentum=0.9)
    update = ClientUpdate(ClientIdentity(node_id=3), sent, num_examples=6, train_config=config)
    record = _audit(SpearPlusPlus(seed=0, progress=False), global_arrays, update)
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
    assert _rows_are_true_samples(record, inputs)
    assert record.verdict_reason.startswith(
        "one local epoch, 2 mini-batches of 3, momentum 0.9: all 6 samples recovered; the self-check passed"
    ), record.verdict_reason
    assert record.verdict_reason.endswith(
        "; it rests on a batch of 6 (the client's num-examples, matching the update's rank) and the "
        "server's train config (local-epochs 1, batch-size 3, momentum 0.9)"
    ), record.verdict_reason


@pytest.mark.parametrize(
    "config",
    [
        ServerTrainConfig(batch_size=2, momentum=0.9),  # not the mini-batch size the client used
        ServerTrainConfig(batch_size=3, momentum=0.0),  # not its momentum
        ServerTrainConfig(local_epochs=2),  # not its epochs
    ],
    ids=["batch-size", "momentum", "epochs"],
)
def test_a_config_the_client_did_not_follow_is_claimed_less_never_wrongly(config: ServerTrainConfig) -> None:
    inputs, global_arrays, sent = _one_epoch(momentum=0.9)
    update = ClientUpdate(ClientIdentity(node_id=3), sent, num_examples=6, train_config=config)
    record = _audit(SpearPlusPlus(seed=0, progress=False, time_budget=3.0), global_arrays, update)
    assert record.verdict != "exact" or _rows_are_true_samples(record, inputs)
