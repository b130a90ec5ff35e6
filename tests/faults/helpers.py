"""Building blocks of the audit fault tests: a real victim, hand-built Flower replies, scripted attackers.

The victim is a two-layer ReLU network whose clients take one real FedSGD step, so every
honest update is a low-rank gradient (the verdicts then name the fault, not the update).
An :class:`AuditedRun` stores one clean round first, so that every fault test can check
that nothing stored before the fault is lost.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fl_attack import LayerUpdate, Reconstruction, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import Auditor, ExecutionSettings
from fl_attack.audit.protocol import AUDIT_KEY, GROUND_TRUTH_KEY, NUM_EXAMPLES_KEY, PARTITION_ID_KEY
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.results.store import INPUTS_FILE, METRICS_FILE, AttackRecord, ReconstructionStore
from strategies import HonestButCuriousStrategy

INPUT_DIM, WIDTH, CLASSES, BATCH = 16, 40, 3, 3
WEIGHT, BIAS = "0.weight", "0.bias"
LEARNING_RATE = 0.1
#: Columns the echo attacker repeats the update's rows into (sets the size of a stored attack).
ECHO_REPEAT = 1


def victim_arrays(*, seed: int = 0) -> dict[str, np.ndarray]:
    """Global float32 arrays of ``Linear(16, 40) -> ReLU -> Linear(40, 3)``, in model order."""
    rng = np.random.default_rng(seed)

    def uniform(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        bound = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    return {
        WEIGHT: uniform((WIDTH, INPUT_DIM), INPUT_DIM),
        BIAS: uniform((WIDTH,), INPUT_DIM),
        "2.weight": uniform((CLASSES, WIDTH), WIDTH),
        "2.bias": uniform((CLASSES,), WIDTH),
    }


def fedsgd_arrays(
    global_arrays: Mapping[str, np.ndarray], *, seed: int, scale: float = 1.0
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A client's arrays after one SGD step on its own batch of ``BATCH`` samples, and that batch.

    ``scale`` multiplies the step (``1e30``: a real update of absurd magnitude).
    """
    rng = np.random.default_rng(1000 + seed)
    inputs = rng.standard_normal((BATCH, INPUT_DIM)).astype(np.float32)
    labels = torch.as_tensor(rng.integers(0, CLASSES, BATCH))
    params = {key: torch.tensor(value, requires_grad=True) for key, value in global_arrays.items()}
    hidden = torch.relu(torch.as_tensor(inputs) @ params[WEIGHT].T + params[BIAS])
    logits = hidden @ params["2.weight"].T + params["2.bias"]
    loss = torch.nn.functional.cross_entropy(logits, labels)
    gradients = torch.autograd.grad(loss, list(params.values()))
    stepped = {}
    for (key, param), gradient in zip(params.items(), gradients, strict=True):
        step = scale * LEARNING_RATE * gradient.double()
        stepped[key] = (param.detach().double() - step).float().numpy()
    return stepped, inputs


def layer_change(client: Mapping[str, np.ndarray], global_arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The attacked weight's change as the server computes it (float64 difference of float32 arrays)."""
    return np.asarray(client[WEIGHT], dtype=np.float64) - np.asarray(global_arrays[WEIGHT], dtype=np.float64)


# ------------------------------------------------------------------------------------ replies


def training_content(
    arrays: Mapping[str, np.ndarray] | None,
    *,
    num_examples: float = BATCH,
    partition_id: int | None = None,
) -> RecordDict:
    """A training reply's content: ``arrays`` (none when None), the metrics and the audit record."""
    content = RecordDict({"metrics": MetricRecord({NUM_EXAMPLES_KEY: num_examples, "train-loss": 0.5})})
    if arrays is not None:
        content["arrays"] = ArrayRecord({key: Array(np.asarray(value)) for key, value in arrays.items()})
    if partition_id is not None:
        content[AUDIT_KEY] = ConfigRecord({PARTITION_ID_KEY: partition_id})
    return content


def reply(node_id: int, content: RecordDict) -> Message:
    """``content`` as the reply of node ``node_id`` to a training instruction."""
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)
    return Message(content, reply_to=instruction)


def error_reply(node_id: int, *, reason: str, code: int = 0) -> Message:
    """The reply of a node whose training failed (it disappeared mid-round)."""
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)
    return Message(Error(code=code, reason=reason), reply_to=instruction)


class FakeGrid:
    """Just enough of a Flower Grid for FedAvg's node sampling."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        """The connected nodes."""
        return list(self._node_ids)


# ---------------------------------------------------------------------------------- attackers


class ScriptedAttacker(LayerAttackBase):
    """A fake attacker whose behaviour a test switches between rounds (thread isolation only).

    Modes: ``"echo"`` returns the update's first ``BATCH`` rows (tiled ``repeat`` times),
    claimed complete, so a stored reconstruction tells which update it came from;
    ``"raise"`` raises :attr:`error`; ``"block"`` waits until :attr:`release` is set (or
    ``block_seconds``) and then raises; ``"spear++"`` runs the real SPEAR++ on the CPU.
    """

    def __init__(self, *, repeat: int = ECHO_REPEAT, block_seconds: float = 30.0) -> None:
        self.mode = "echo"
        self.repeat = repeat
        self.block_seconds = block_seconds
        self.error: BaseException = ValueError("no sparse direction found")
        self.release = threading.Event()
        self.received: list[np.ndarray] = []
        self._spear = SpearPlusPlus(device="cpu", time_budget=20.0, progress=False)

    def attack(
        self,
        update: LayerUpdate[np.ndarray],
        /,
        *,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Behave as :attr:`mode` says."""
        self.received.append(np.array(update.weight_update, copy=True))
        if self.mode == "raise":
            raise self.error
        if self.mode == "block":
            self.release.wait(self.block_seconds)
            raise RuntimeError("the blocked attack was released")
        if self.mode == "spear++":
            return self._spear.attack(update, batch_size=batch_size, budget=budget)
        return Reconstruction(
            inputs=torch.as_tensor(echo(update.weight_update, repeat=self.repeat)),
            batch_size=BATCH,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(BATCH, dtype=torch.float64),
            seconds=0.0,
        )


def echo(weight_grad: np.ndarray, *, repeat: int = ECHO_REPEAT) -> np.ndarray:
    """What the echo attacker returns for ``weight_grad`` (float64)."""
    return np.tile(np.asarray(weight_grad, dtype=np.float64)[:BATCH], (1, repeat))


# ------------------------------------------------------------------------------------ outcomes


@dataclass(frozen=True)
class Outcome:
    """What ``aggregate_train`` did: the aggregate it returned, or the exception it raised."""

    arrays: dict[str, np.ndarray] | None = None
    metrics: dict[str, Any] | None = None
    raised: tuple[str, str] | None = None

    @property
    def returned(self) -> bool:
        """Whether ``aggregate_train`` returned (training goes on)."""
        return self.raised is None


def outcome_of(call: Callable[[], tuple[ArrayRecord | None, MetricRecord | None]]) -> Outcome:
    """Run one ``aggregate_train`` call and keep what it returned or raised."""
    try:
        arrays, metrics = call()
    except Exception as error:  # the inner strategy's own refusal is part of its behaviour
        return Outcome(raised=(type(error).__name__, str(error)))
    return Outcome(
        arrays=None if arrays is None else {key: value.numpy() for key, value in arrays.items()},
        metrics=None if metrics is None else dict(metrics),
    )


def plain_fedavg() -> FedAvg:
    """The inner strategy of every fault test."""
    return FedAvg(min_train_nodes=2, min_available_nodes=2, min_evaluate_nodes=2)


def plain_outcome(server_round: int, replies: Sequence[Message]) -> Outcome:
    """What a plain FedAvg does with copies of ``replies`` without the audit-only records."""
    plain = copy.deepcopy(list(replies))
    for message in plain:
        if message.has_error():
            continue
        for key in (AUDIT_KEY, GROUND_TRUTH_KEY):
            if key in message.content:
                del message.content[key]
    return outcome_of(lambda: plain_fedavg().aggregate_train(server_round, plain))


def assert_bit_identical(audited: Outcome, plain: Outcome) -> None:
    """Same exception, or the same arrays (keys, order, dtype, shape and bytes) and metrics."""
    assert audited.raised == plain.raised
    assert (audited.arrays is None) == (plain.arrays is None)
    if audited.arrays is not None and plain.arrays is not None:
        assert list(audited.arrays) == list(plain.arrays)
        for key, expected in plain.arrays.items():
            actual = audited.arrays[key]
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, key
            assert np.array_equal(actual, expected, equal_nan=True), key
            assert actual.tobytes() == expected.tobytes(), key
    # repr compares NaN metrics (FedAvg averages a NaN weight into them) as equal
    assert repr(audited.metrics) == repr(plain.metrics)


# ---------------------------------------------------------------------------------- the store


def snapshot(store: ReconstructionStore) -> dict[str, dict[str, bytes]]:
    """Every stored attack's files, by the directory the table names."""
    return {
        row["directory"]: {
            path.name: path.read_bytes() for path in (store.directory / row["directory"]).iterdir()
        }
        for row in store.rows()
    }


def assert_intact(store: ReconstructionStore, stored: Mapping[str, Mapping[str, bytes]]) -> None:
    """Files stored earlier are unchanged and still load; the table still lists them."""
    listed = {row["directory"] for row in store.rows()}
    for directory, files in stored.items():
        assert directory in listed, directory
        path = store.directory / directory
        assert {item.name: item.read_bytes() for item in path.iterdir()} == dict(files), directory
        metrics = json.loads((path / METRICS_FILE).read_text(encoding="utf-8"))
        assert metrics["directory"] == directory
        if INPUTS_FILE in files:
            assert np.isfinite(np.load(path / INPUTS_FILE, allow_pickle=False)).all()


def stored_metrics(store: ReconstructionStore, directory: str) -> dict[str, Any]:
    """The ``metrics.json`` of one stored attack."""
    document = json.loads((store.directory / directory / METRICS_FILE).read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


# ------------------------------------------------------------------------------------ the run


@dataclass
class AuditedRun:
    """A FedAvg run audited into a store, whose first round was clean and is stored.

    Attributes
    ----------
    strategy : HonestButCuriousStrategy
        The wrapper around a plain FedAvg (thread isolation).
    store : ReconstructionStore
        Where the audit writes.
    attacker : ScriptedAttacker
        Switch its mode to inject attacker faults.
    global_arrays : dict[str, numpy.ndarray]
        The arrays the next round sends (round 1's aggregate after :func:`start_run`).
    round_one : dict[str, dict[str, bytes]]
        Round 1's stored files (:func:`snapshot`).
    """

    strategy: HonestButCuriousStrategy
    store: ReconstructionStore
    attacker: ScriptedAttacker
    global_arrays: dict[str, np.ndarray]
    round_one: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def train(self, server_round: int, replies: Sequence[Message]) -> tuple[Outcome, Outcome]:
        """Send the round's arrays, then aggregate ``replies``: (audited outcome, plain FedAvg's)."""
        instructions = self.strategy.configure_train(
            server_round,
            ArrayRecord({key: Array(value) for key, value in self.global_arrays.items()}),
            ConfigRecord(),
            FakeGrid([11, 22, 33]),  # type: ignore[arg-type]
        )
        assert len(list(instructions)) == 3
        plain = plain_outcome(server_round, replies)
        audited = outcome_of(lambda: self.strategy.aggregate_train(server_round, list(replies)))
        if audited.arrays is not None:
            self.global_arrays = dict(audited.arrays)
        return audited, plain

    def records(self, server_round: int) -> dict[str, list[AttackRecord]]:
        """The round's records by client, once every attack dispatched so far has ended."""
        settled = settled_records(self.strategy)
        by_client: dict[str, list[AttackRecord]] = {}
        for record in settled:
            if record.server_round == server_round:
                by_client.setdefault(record.client, []).append(record)
        return by_client

    def rows(self, server_round: int) -> list[dict[str, str]]:
        """The table rows of ``server_round``."""
        return [row for row in self.store.rows() if row["round"] == str(server_round)]


def settled_records(strategy: HonestButCuriousStrategy) -> list[AttackRecord]:
    """Every record, after ``close()`` has ended every attack dispatched so far (the runner stays usable)."""
    strategy.close()
    return list(strategy.records)


def start_run(directory: Path, *, attacker: ScriptedAttacker | None = None, **options: Any) -> AuditedRun:
    """Audit a FedAvg run into ``directory`` and train round 1 with two honest clients (stored)."""
    scripted = attacker or ScriptedAttacker()
    store = ReconstructionStore(directory, run_config={"suite": "audit-faults"})
    auditor = Auditor(scripted, store=store, execution=ExecutionSettings(isolation="thread"), **options)
    run = AuditedRun(HonestButCuriousStrategy(plain_fedavg(), auditor), store, scripted, victim_arrays())
    replies = [
        reply(node, training_content(fedsgd_arrays(run.global_arrays, seed=node)[0], partition_id=partition))
        for partition, node in enumerate((11, 22))
    ]
    audited, plain = run.train(1, replies)
    assert_bit_identical(audited, plain)
    assert audited.returned
    assert [(row["client"], row["status"]) for row in run.rows(1)] == [
        ("partition-0", "ok"),
        ("partition-1", "ok"),
    ]
    run.round_one = snapshot(store)
    return run


def honest_replies(run: AuditedRun, nodes: Mapping[int, int | None], *, seed: int = 0) -> list[Message]:
    """Honest replies of ``{node_id: partition_id}`` to the run's current arrays."""
    return [
        reply(
            node,
            training_content(fedsgd_arrays(run.global_arrays, seed=seed + node)[0], partition_id=partition),
        )
        for node, partition in nodes.items()
    ]
