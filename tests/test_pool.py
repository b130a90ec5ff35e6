"""Attacks off the round's critical path: the pool, its queue policies, drains and timings."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fl_attack import LayerUpdate
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings
from fl_attack.audit.pool import AttackPool
from fl_attack.results.store import ReconstructionStore, load_table
from tests.test_audit_strategy import RecordingAttacker, _client_arrays, _global_arrays


class GatedAttacker(RecordingAttacker):
    """Blocks every attack until released (thread isolation: the test controls the timing)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Any:
        self.gate.wait(30.0)
        return super().attack(update, **options)


def _updates(count: int) -> tuple[dict[str, np.ndarray], list[ClientUpdate]]:
    global_arrays = _global_arrays()
    return global_arrays, [
        ClientUpdate(
            identity=ClientIdentity(node_id=10 + k, partition_id=k), arrays=_client_arrays(global_arrays, k)
        )
        for k in range(count)
    ]


def test_audit_round_returns_before_the_attacks_finish_and_drain_waits(tmp_path: Path) -> None:
    attacker = GatedAttacker()
    store = ReconstructionStore.create(tmp_path / "run")
    auditor = Auditor(
        attacker,
        store=store,
        attack=AttackSettings(timeout=60.0),
        execution=ExecutionSettings(isolation="thread", workers=2),
    )
    global_arrays, updates = _updates(3)
    auditor.start_round(1, global_arrays)
    start = time.perf_counter()
    assert auditor.audit_round(1, updates) == []  # nothing has finished yet
    assert time.perf_counter() - start < 5.0 and auditor.pool is not None and auditor.pool.pending == 3
    attacker.gate.set()
    assert auditor.drain(timeout=60.0)
    auditor.close()
    rows = load_table(store.table_path)
    assert sorted(row["client"] for row in rows) == ["partition-0", "partition-1", "partition-2"]
    for row in rows:
        assert row["status"] == "ok"
        assert float(row["queued_at"]) <= float(row["started_at"]) <= float(row["finished_at"])
    assert all(record.inputs is None for record in auditor.records)  # arrays live in the store only


@pytest.mark.parametrize("policy", ["drop-oldest", "sample"])
def test_a_full_queue_records_what_it_drops(policy: str, tmp_path: Path) -> None:
    attacker = GatedAttacker()
    auditor = Auditor(
        attacker,
        attack=AttackSettings(timeout=60.0),
        execution=ExecutionSettings(isolation="thread", workers=1, queue_size=1, queue_policy=policy),
    )
    global_arrays, updates = _updates(4)
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, updates)
    attacker.gate.set()
    auditor.close()
    statuses = sorted(record.status for record in auditor.records)
    assert len(statuses) == 4 and statuses.count("dropped") >= 1 and "ok" in statuses
    for record in auditor.records:
        if record.status == "dropped":
            assert record.verdict == "dropped" and "queue was full" in (record.error or "")


def test_block_policy_drops_nothing() -> None:
    attacker = RecordingAttacker()
    auditor = Auditor(
        attacker,
        execution=ExecutionSettings(isolation="thread", workers=1, queue_size=1, queue_policy="block"),
    )
    global_arrays, updates = _updates(4)
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, updates)
    auditor.close()
    assert sorted(record.status for record in auditor.records) == ["ok"] * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_pool_threads_record_at_low_priority_and_leave_the_caller_alone() -> None:
    # the test process may itself run under nice (a loaded machine's test run): the caller keeps
    # whatever priority it had, and the pool's thread runs at the lowest one
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = AttackPool(workers=1)
    seen: list[int] = []
    pool.submit(
        "job",
        lambda _: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        lambda _: None,
    )
    pool.close()
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        AttackPool(workers=0)
    with pytest.raises(ValueError, match="queue policy must be one of block, drop-oldest, sample"):
        AttackPool(workers=1, policy="lifo")
    with pytest.raises(ValueError, match="backend must be 'local' or 'ray'"):
        ExecutionSettings(backend="dask")


def test_ray_backend_runs_an_attack_as_a_task() -> None:
    ray = pytest.importorskip("ray")
    from fl_attack import SpearPlusPlus
    from fl_attack.audit.ray_runner import RayAttackRunner

    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((40, 12)), rng.standard_normal(40)
    inputs = rng.standard_normal((2, 12))
    output_grad = ((inputs @ weight.T + bias) > 0) * rng.standard_normal((2, 40))
    delta = LayerUpdate(output_grad.T @ inputs, output_grad.sum(0), weight, bias)
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    except Exception as error:  # pragma: no cover - depends on the machine
        pytest.skip(f"Ray cannot start here: {error}")
    try:
        runner = RayAttackRunner(SpearPlusPlus(time_budget=20.0, device="cpu", progress=False), num_cpus=1)
        result = runner.run(delta, time_budget=20.0, timeout=120.0)
        assert result.status == "ok", result.error
        recovered = result.reconstruction.inputs.numpy()
        for sample in inputs:
            assert np.abs(recovered - sample).max(axis=1).min() < 1e-6
    finally:
        ray.shutdown()


def test_a_queued_attack_keeps_only_its_layer_update() -> None:
    """Waiting units hold the attacked layer's update, not every member's whole model."""
    from fl_attack.audit.units import Prepared

    auditor = Auditor(
        RecordingAttacker(),
        attack=AttackSettings(timeout=60.0),
        execution=ExecutionSettings(isolation="thread", workers=1),
    )
    global_arrays, updates = _updates(1)
    auditor.start_round(1, global_arrays)
    assert auditor.layer is not None
    prepared = auditor._prepare(1, updates, auditor._global_layer[1])
    auditor.close()
    assert isinstance(prepared, Prepared)
    assert all(member.arrays is None for member in prepared.members)
    weight = updates[0].arrays[auditor.layer.weight]  # type: ignore[index]
    expected = weight.astype(np.float64) - global_arrays[auditor.layer.weight].astype(np.float64)
    assert np.array_equal(prepared.delta.weight_update, expected)
