"""Faults on the audit path: garbage replies, vanished clients, duplicate ids, attacker faults, a full disk.

Every test first stores one clean round (:func:`tests.faults.helpers.start_run`), then injects
its fault in round 2 and checks that training goes on, that aggregation is bit-identical to a
plain FedAvg's on the same replies without the audit records, that round 1's stored files are
unchanged and still load, and that the failure is recorded with its cause.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fl_attack.audit import AttackSettings
from fl_attack.audit.protocol import GROUND_TRUTH_INPUTS, GROUND_TRUTH_KEY
from fl_attack.results.store import INPUTS_FILE

from .helpers import (
    BATCH,
    BIAS,
    INPUT_DIM,
    WEIGHT,
    WIDTH,
    AuditedRun,
    ScriptedAttacker,
    assert_bit_identical,
    assert_intact,
    echo,
    error_reply,
    fedsgd_arrays,
    honest_replies,
    layer_change,
    reply,
    settled_records,
    start_run,
    stored_metrics,
    training_content,
)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages built outside a Flower run need a task identity (as a ServerApp has)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # pylint: disable=protected-access
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # pylint: disable=protected-access


# ------------------------------------------------------------------ 1. garbage arrays


@dataclass(frozen=True)
class Garbage:
    """A malformed reply: how it is made, what FedAvg does with it, and the cause the audit records."""

    name: str
    make: Callable[[dict[str, np.ndarray]], RecordDict]
    #: The exception a plain FedAvg raises on the round (it refuses to aggregate), or None.
    inner_refusal: str | None
    cause: str


def _with(arrays: dict[str, np.ndarray], key: str, value: np.ndarray) -> RecordDict:
    return training_content({**arrays, key: value}, partition_id=1)


def _nan_weight(arrays: dict[str, np.ndarray]) -> RecordDict:
    weight = arrays[WEIGHT].copy()
    weight[3, 5] = np.nan
    return _with(arrays, WEIGHT, weight)


def _inf_bias(arrays: dict[str, np.ndarray]) -> RecordDict:
    bias = arrays[BIAS].copy()
    bias[0] = -np.inf
    return _with(arrays, BIAS, bias)


def _without_bias(arrays: dict[str, np.ndarray]) -> RecordDict:
    return training_content({key: value for key, value in arrays.items() if key != BIAS}, partition_id=1)


def _two_array_records(arrays: dict[str, np.ndarray]) -> RecordDict:
    content = training_content(arrays, partition_id=1)
    content["optimizer-state"] = ArrayRecord({"momentum": Array(np.zeros(4, dtype=np.float32))})
    return content


def _no_array_record(arrays: dict[str, np.ndarray]) -> RecordDict:
    return training_content(None, partition_id=1)


SHAPES = f"differ from the global ({WIDTH}, {INPUT_DIM})/({WIDTH},)"
GARBAGE = [
    Garbage(
        "weight-missing-a-column",
        lambda a: _with(a, WEIGHT, a[WEIGHT][:, :-1]),
        "ValueError",
        f"client layer shapes ({WIDTH}, {INPUT_DIM - 1})/({WIDTH},) {SHAPES}",
    ),
    # FedAvg broadcasts a (1, n) weight into the sum without complaint; the audit does not.
    Garbage(
        "weight-one-row",
        lambda a: _with(a, WEIGHT, a[WEIGHT][:1]),
        None,
        f"client layer shapes (1, {INPUT_DIM})/({WIDTH},) {SHAPES}",
    ),
    Garbage(
        "bias-one-too-long",
        lambda a: _with(a, BIAS, np.append(a[BIAS], np.float32(0.5))),
        "ValueError",
        f"client layer shapes ({WIDTH}, {INPUT_DIM})/({WIDTH + 1},) {SHAPES}",
    ),
    Garbage("nan-in-weight", _nan_weight, None, "it contains NaN or Inf entries"),
    Garbage("inf-in-bias", _inf_bias, None, "it contains NaN or Inf entries"),
    Garbage(
        "missing-bias-key",
        _without_bias,
        "InconsistentMessageReplies",
        f"attacked layer entries ['{BIAS}'] not found; available keys: {WEIGHT} ({WIDTH}, {INPUT_DIM}), "
        f"2.weight (3, {WIDTH}), 2.bias (3,)",
    ),
    Garbage(
        "two-array-records",
        _two_array_records,
        "InconsistentMessageReplies",
        "ValueError: expected exactly one model ArrayRecord in the reply, found 2",
    ),
    Garbage(
        "no-array-record",
        _no_array_record,
        "InconsistentMessageReplies",
        "ValueError: expected exactly one model ArrayRecord in the reply, found 0",
    ),
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=[garbage.name for garbage in GARBAGE])
def test_garbage_arrays_are_recorded_and_aggregation_is_the_inner_strategys(
    garbage: Garbage, tmp_path: Path
) -> None:
    run = start_run(tmp_path / "run")
    honest = fedsgd_arrays(run.global_arrays, seed=11)[0]
    honest_change = layer_change(honest, run.global_arrays)
    replies = [
        reply(11, training_content(honest, partition_id=0)),
        reply(22, garbage.make(fedsgd_arrays(run.global_arrays, seed=22)[0])),
    ]

    audited, plain = run.train(2, replies)

    # The wrapper does exactly what FedAvg does: aggregate, or refuse the round with the same error.
    assert_bit_identical(audited, plain)
    if garbage.inner_refusal is None:
        assert audited.returned and audited.arrays is not None
    else:
        assert audited.raised is not None and audited.raised[0] == garbage.inner_refusal
    records = run.records(2)
    assert [(record.status, record.verdict) for record in records["partition-0"]] == [("ok", "exact")]
    (failed,) = records["partition-1"]
    assert (failed.status, failed.verdict) == ("error", "failed")
    assert failed.error == f"unreadable update: {garbage.cause}"
    assert failed.verdict_reason == failed.error
    # The attacker only ever saw the honest update.
    assert len(run.attacker.received) == 3
    np.testing.assert_array_equal(run.attacker.received[-1], honest_change)
    rows = {row["client"]: row for row in run.rows(2)}
    assert rows["partition-1"]["status"] == "error" and garbage.cause in rows["partition-1"]["error"]
    assert stored_metrics(run.store, rows["partition-1"]["directory"])["error"] == failed.error
    assert_intact(run.store, run.round_one)


def test_every_client_omitting_the_attacked_layer_is_aggregated_and_recorded(tmp_path: Path) -> None:
    """A partial model (the first layer frozen and not sent) is aggregated; the audit says why it is blind."""
    run = start_run(tmp_path / "run")
    replies = [
        reply(
            node,
            training_content(_without_layer(fedsgd_arrays(run.global_arrays, seed=node)[0]), partition_id=p),
        )
        for p, node in enumerate((11, 22))
    ]

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.arrays is not None and list(audited.arrays) == ["2.weight", "2.bias"]
    records = run.records(2)
    for client in ("partition-0", "partition-1"):
        (record,) = records[client]
        assert (record.status, record.verdict) == ("error", "failed")
        assert (record.error or "").startswith(
            f"unreadable update: attacked layer entries ['{WEIGHT}', '{BIAS}'] not found"
        )
    assert len(run.attacker.received) == 2
    assert_intact(run.store, run.round_one)


def _without_layer(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key: value for key, value in arrays.items() if key not in (WEIGHT, BIAS)}


def test_huge_values_garbage_is_not_applicable_and_a_huge_real_update_is_exact(tmp_path: Path) -> None:
    """1e30 entries overflow nothing: random ones are 'not one gradient', a real step x1e30 is still exact."""
    run = start_run(tmp_path / "run")
    run.attacker.mode = "spear++"
    scaled, batch = fedsgd_arrays(run.global_arrays, seed=11, scale=1e30)
    rng = np.random.default_rng(7)
    garbage = dict(fedsgd_arrays(run.global_arrays, seed=22)[0])
    garbage[WEIGHT] = (1e30 * rng.standard_normal((WIDTH, INPUT_DIM))).astype(np.float32)
    replies = [
        reply(11, training_content(scaled, partition_id=0)),
        reply(22, training_content(garbage, partition_id=1)),
    ]

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.arrays is not None and all(np.isfinite(value).all() for value in audited.arrays.values())
    records = run.records(2)
    (exact,) = records["partition-0"]
    assert (exact.status, exact.verdict) == ("ok", "exact")
    rows = {row["client"]: row for row in run.rows(2)}
    recovered = np.load(
        run.store.directory / rows["partition-0"]["directory"] / INPUTS_FILE, allow_pickle=False
    )
    errors = np.abs(recovered[:, None, :] - batch[None, :, :].astype(np.float64)).max(axis=2)
    assert recovered.shape == (BATCH, INPUT_DIM) and errors.min(axis=0).max() < 1e-4
    (garbled,) = records["partition-1"]
    assert (garbled.status, garbled.verdict) == ("error", "not-applicable")
    assert "ValueError: no low-rank structure in the gradient spectrum" in (garbled.error or "")
    assert garbled.verdict_reason == (
        f"the update has full rank on {INPUT_DIM} input features: it is not one gradient of a small batch "
        f"(a batch of {INPUT_DIM} or more samples, several local steps, or DP noise), which an exact attack "
        "on this layer cannot separate"
    )
    assert_intact(run.store, run.round_one)


# ------------------------------------------------------- 1b. garbage metadata of one reply


def _ground_truth_scalar(content: RecordDict) -> None:
    content[GROUND_TRUTH_KEY] = ArrayRecord({GROUND_TRUTH_INPUTS: Array(np.array(3.0))})


METADATA = {
    "num-examples-inf": (math.inf, None),
    "num-examples-nan": (math.nan, None),
    "num-examples-negative": (-3.0, None),
    "ground-truth-scalar": (float(BATCH), _ground_truth_scalar),
}


@pytest.mark.parametrize("case", list(METADATA))
def test_one_clients_garbage_metadata_costs_no_other_audit(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = start_run(tmp_path / "run")
    num_examples, corrupt = METADATA[case]
    content = training_content(
        fedsgd_arrays(run.global_arrays, seed=22)[0], num_examples=num_examples, partition_id=1
    )
    if corrupt is not None:
        corrupt(content)
    replies = [honest_replies(run, {11: 0})[0], reply(22, content)]

    with caplog.at_level("WARNING"):
        audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)  # FedAvg's weights may be NaN or sum to zero: its business
    records = run.records(2)
    assert [record.status for client in ("partition-0", "partition-1") for record in records[client]] == [
        "ok",
        "ok",
    ]
    assert not any("Audit of round 2 failed" in message for message in caplog.messages)
    if corrupt is not None:
        assert (
            "Ignoring the ground truth sent by partition-1: ValueError: 'inputs' must hold one row per sample, "
            "got a scalar of dtype float64" in caplog.messages
        )
    assert_intact(run.store, run.round_one)


# ---------------------------------------------------------- 2. clients that disappear


def test_a_client_that_disappears_mid_round(tmp_path: Path) -> None:
    run = start_run(tmp_path / "run")
    replies = [*honest_replies(run, {11: 0, 22: 1}), error_reply(33, reason="node 33 lost its connection")]

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.arrays is not None
    records = run.records(2)
    for client in ("partition-0", "partition-1"):
        assert [(record.status, record.verdict) for record in records[client]] == [("ok", "exact")]
    assert len(run.attacker.received) == 4  # the vanished client sent nothing to attack
    assert_intact(run.store, run.round_one)


def test_a_round_where_every_client_failed(tmp_path: Path) -> None:
    run = start_run(tmp_path / "run")
    replies = [error_reply(node, reason=f"node {node} crashed", code=1) for node in (11, 22, 33)]

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.returned and audited.arrays is None and audited.metrics is None
    assert len(run.attacker.received) == 2  # round 1's attacks only
    assert [row for row in run.rows(2) if row["status"] == "ok"] == []
    assert_intact(run.store, run.round_one)


VANISHED = {
    "one-of-three": ({11: 0, 22: 1}, {33: "node 33 lost its connection"}),
    "all-three": ({}, {11: "node 11 crashed", 22: "node 22 crashed", 33: "node 33 crashed"}),
}


@pytest.mark.parametrize("case", list(VANISHED))
def test_a_vanished_client_is_recorded_with_its_error(case: str, tmp_path: Path) -> None:
    run = start_run(tmp_path / "run")
    honest, vanished = VANISHED[case]
    replies = [
        *honest_replies(run, honest),
        *(error_reply(node, reason=why) for node, why in vanished.items()),
    ]

    run.train(2, replies)

    records = run.records(2)
    rows = {row["client"]: row for row in run.rows(2)}
    for node, why in vanished.items():
        (record,) = records[f"node-{node}"]
        assert (record.status, record.verdict) == ("error", "failed")
        assert why in (record.error or "") and why in record.verdict_reason
        assert rows[f"node-{node}"]["status"] == "error" and why in rows[f"node-{node}"]["error"]
    assert len(rows) == len(honest) + len(vanished)


# ---------------------------------------------------------- 3. duplicate partition ids


def test_two_clients_claiming_one_partition_are_both_stored(tmp_path: Path) -> None:
    run = start_run(tmp_path / "run")
    replies = honest_replies(run, {11: 0, 22: 0, 33: 1})
    changes = {
        node: layer_change(fedsgd_arrays(run.global_arrays, seed=node)[0], run.global_arrays)
        for node in (11, 22)
    }

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.arrays is not None
    claimed = run.records(2)["partition-0"]
    assert sorted(record.details["node_id"] for record in claimed) == [11, 22]
    rows = [row for row in run.rows(2) if row["client"] == "partition-0"]
    assert [row["directory"] for row in rows] == ["round-002/partition-0", "round-002/partition-0-dup2"]
    for row in rows:
        metrics = stored_metrics(run.store, row["directory"])
        node = metrics["details"]["node_id"]
        stored = np.load(run.store.directory / row["directory"] / INPUTS_FILE, allow_pickle=False)
        np.testing.assert_array_equal(stored, echo(changes[node]))  # each its own client's update
    assert stored_metrics(run.store, "round-002/partition-0-dup2")["duplicate_of"] == "round-002/partition-0"
    assert stored_metrics(run.store, "round-002/partition-0")["duplicate_of"] is None
    assert_intact(run.store, run.round_one)


# ---------------------------------------------------------- 4. attacker faults


def test_an_attack_past_its_timeout_is_abandoned_and_recorded(tmp_path: Path) -> None:
    run = start_run(tmp_path / "run", attack=AttackSettings(timeout=0.3))
    run.attacker.mode = "block"
    replies = honest_replies(run, {11: 0, 22: 1})
    start = time.perf_counter()
    try:
        audited, plain = run.train(2, replies)
        records = run.records(2)
    finally:
        run.attacker.release.set()

    assert time.perf_counter() - start < 10.0
    assert_bit_identical(audited, plain)
    assert audited.arrays is not None
    for client in ("partition-0", "partition-1"):
        (record,) = records[client]
        assert (record.status, record.verdict) == ("timeout", "timeout")
        # the CPU time the attack's thread got (blocked: next to none), and that nothing was kept
        assert re.fullmatch(
            r"attack did not finish within the 0\.3 s timeout \(abandoned; "
            r"its thread got \d\.\d s of CPU in \d\.\d s of wall time\)",
            record.error or "",
        ), record.error
        assert record.verdict_reason == (
            f"{record.error}; it had handed back no partial result, so nothing it found is kept"
        )
    assert [row["status"] for row in run.rows(2)] == ["timeout", "timeout"]
    assert_intact(run.store, run.round_one)


@pytest.mark.parametrize(
    ("error", "description"),
    [
        (ValueError("no sparse direction found"), "ValueError: no sparse direction found"),
        (SystemExit(3), "SystemExit: 3"),
    ],
    ids=["value-error", "system-exit"],
)
def test_an_attacker_that_raises_is_recorded(error: BaseException, description: str, tmp_path: Path) -> None:
    run = start_run(tmp_path / "run")
    run.attacker.mode, run.attacker.error = "raise", error
    replies = honest_replies(run, {11: 0, 22: 1})

    audited, plain = run.train(2, replies)

    assert_bit_identical(audited, plain)
    assert audited.arrays is not None
    for client in ("partition-0", "partition-1"):
        (record,) = run.records(2)[client]
        assert (record.status, record.verdict) == ("error", "failed")
        assert record.error == description
        assert record.verdict_reason == f"the attack failed: {description}"
        assert type(error).__name__ in record.details["traceback"]
    stored = {row["client"]: stored_metrics(run.store, row["directory"]) for row in run.rows(2)}
    assert {client: document["error"] for client, document in stored.items()} == {
        "partition-0": description,
        "partition-1": description,
    }
    assert_intact(run.store, run.round_one)


# ---------------------------------------------------------- 5. a disk that fills up


def _fill_the_disk(tiny_disk: Path) -> tuple[AuditedRun, list[tuple[int, str]]]:
    """Audit rounds onto the 64 KiB disk until attacks are lost; return the run and the lost attacks."""
    # each reconstruction is 3 x 320 float64 values (~7.6 KiB): a round's two attacks take ~6 pages
    run = start_run(tiny_disk / "run", attacker=ScriptedAttacker(repeat=20))
    expected: dict[tuple[int, str], np.ndarray] = {}
    for server_round in range(2, 7):
        replies = honest_replies(run, {11: 0, 22: 1}, seed=server_round)
        for node, client in ((11, "partition-0"), (22, "partition-1")):
            change = layer_change(
                fedsgd_arrays(run.global_arrays, seed=server_round + node)[0], run.global_arrays
            )
            expected[(server_round, client)] = echo(change, repeat=20)
        audited, plain = run.train(server_round, replies)
        assert_bit_identical(audited, plain)
        assert audited.arrays is not None
    stored = {(int(row["round"]), row["client"]): row["directory"] for row in run.store.rows()}
    for key, directory in stored.items():
        if key in expected:
            on_disk = np.load(run.store.directory / directory / INPUTS_FILE, allow_pickle=False)
            np.testing.assert_array_equal(on_disk, expected[key])
    lost = [(record.server_round, record.client) for record in settled_records(run.strategy)]
    lost = [key for key in lost if key not in stored]
    for server_round, client in lost:
        assert not (run.store.directory / f"round-{server_round:03d}" / client).exists()
    return run, lost


def test_a_full_disk_loses_no_stored_attack_and_training_finishes(tiny_disk: Path) -> None:
    run, lost = _fill_the_disk(tiny_disk)

    assert lost, "the 64 KiB disk never filled up"
    assert len(run.store.rows()) >= 4  # rounds 1 and 2 at least were stored before the disk filled
    assert len(settled_records(run.strategy)) == 12  # every attack of the 6 rounds ran
    assert_intact(run.store, run.round_one)
    assert [path for path in run.store.directory.rglob("*") if path.name.endswith(".tmp")] == []


def test_a_full_disk_lists_every_lost_attack_in_store_failures(tiny_disk: Path) -> None:
    run, lost = _fill_the_disk(tiny_disk)

    failures = run.strategy.auditor.store_failures
    assert len(failures) == len(lost) > 0
    for failure, (server_round, client) in zip(failures, lost, strict=True):
        assert f"round {server_round}" in failure and client in failure and "disk full" in failure


# ---------------------------------------------------------- 6. validation at the public API
