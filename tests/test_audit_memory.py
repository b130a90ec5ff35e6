"""What the auditor holds while attacks wait: counted objects, never timings.

A queued unit holds its client's attacked layer once, as sent (float32), and the round's global
layer is shared by the round's units; a finished attack holds nothing; a bounded queue bounds
what is held.
"""

from __future__ import annotations

import gc
import hashlib
import io
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import LayerUpdate
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings, spill
from fl_attack.audit.layer import SentLayer, layer_arrays, layer_delta
from fl_attack.audit.prepare import NON_FINITE_UPDATE
from fl_attack.audit.spill import SPILL_FOLDER, QueueSpill
from fl_attack.audit.units import Prepared
from fl_attack.reconstruction import Reconstruction
from fl_attack.results.store import ReconstructionStore
from tests.test_audit_strategy import INPUT_DIM, _client_arrays, _global_arrays

#: Seconds a test waits for attacks to finish before it fails (not a measurement).
PATIENCE = 60.0


class CountingAttacker(LayerAttackBase):
    """Returns a fixed reconstruction and keeps no argument; optionally waits for a gate."""

    def __init__(self, *, gated: bool = False) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not gated:
            self.gate.set()
        self.calls = 0

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        self.entered.set()
        self.gate.wait(PATIENCE)
        self.calls += 1
        return Reconstruction(
            inputs=torch.zeros((2, INPUT_DIM), dtype=torch.float64),
            batch_size=2,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(2, dtype=torch.float64),
            seconds=0.0,
        )


def _live(kind: type) -> int:
    gc.collect()
    return sum(1 for thing in gc.get_objects() if type(thing) is kind)


def _float64_updates() -> int:
    """Distinct float64 updates alive: an attacker's view of an update (without the optional parts it
    does not use) shares the update's arrays and is not counted again."""
    gc.collect()
    return len({id(thing.weight_update) for thing in gc.get_objects() if type(thing) is LayerUpdate})


def _held() -> tuple[int, int, int]:
    """Units, sent layers and float64 updates alive (other tests' leftovers included: compare to a baseline)."""
    return _live(Prepared), _live(SentLayer), _float64_updates()


def _updates(count: int, global_arrays: dict[str, np.ndarray]) -> list[ClientUpdate]:
    return [
        ClientUpdate(
            identity=ClientIdentity(node_id=10 + k, partition_id=k), arrays=_client_arrays(global_arrays, k)
        )
        for k in range(count)
    ]


def _pooled(attacker: Any, *, store: ReconstructionStore | None = None) -> Auditor:
    """An auditor with one pool thread whose attacks stop after :data:`PATIENCE` seconds."""
    return Auditor(
        attacker,
        store=store,
        attack=AttackSettings(timeout=PATIENCE),
        execution=ExecutionSettings(isolation="thread", workers=1),
    )


def _wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.01)


def test_a_finished_attack_holds_no_update_before_the_drain() -> None:
    """Finished jobs leave the pool at once: their updates are freed without waiting for drain()."""
    auditor = _pooled(CountingAttacker())
    global_arrays = _global_arrays()
    baseline = _held()
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, _updates(5, global_arrays))
    pool = auditor.pool
    assert pool is not None
    _wait_until(lambda: pool.done == 5, "5 attacks done")
    try:
        assert pool.pending == 0
        assert _held() == baseline
        assert [record.status for record in auditor.records] == ["ok"] * 5
    finally:
        auditor.close()


@pytest.mark.parametrize("queue_size", [1, 3])
def test_a_bounded_queue_bounds_the_updates_held(queue_size: int) -> None:
    """With a blocked worker and ``queue_size`` k, the auditor holds at most k + 2 units' updates:
    k waiting, one running, and the one the round is blocked on; only the running one as float64."""
    attacker = CountingAttacker(gated=True)
    auditor = Auditor(
        attacker,
        attack=AttackSettings(timeout=PATIENCE),
        execution=ExecutionSettings(
            isolation="thread", workers=1, queue_size=queue_size, queue_policy="block"
        ),
    )
    global_arrays = _global_arrays()
    baseline = _held()
    before = {id(thing) for thing in gc.get_objects() if type(thing) is SentLayer}
    auditor.start_round(1, global_arrays)
    pool = auditor.pool
    assert pool is not None
    submitting = threading.Thread(target=auditor.audit_round, args=(1, _updates(8, global_arrays)))
    submitting.start()
    try:
        _wait_until(lambda: pool.pending == queue_size + 1, "the queue to fill")
        held = [thing for thing in gc.get_objects() if type(thing) is SentLayer and id(thing) not in before]
        assert len(held) == queue_size + 2
        assert all(unit.weight.dtype == np.float32 for unit in held)
        assert len({id(unit.global_weight) for unit in held}) == 1  # the round's global layer, once
        assert _float64_updates() == baseline[2] + 1  # only the running attack's float64 update
        del held
    finally:
        attacker.gate.set()
        submitting.join(PATIENCE)
        auditor.close()
    assert attacker.calls == 8
    assert _held() == baseline


def test_a_queued_unit_keeps_the_sent_layer_and_shares_the_global_layer() -> None:
    auditor = _pooled(CountingAttacker())
    global_arrays = _global_arrays()
    updates = _updates(2, global_arrays)
    auditor.start_round(1, global_arrays)
    layer = auditor.layer
    assert layer is not None
    global_layer = auditor._global_layer[1]
    first, second = (auditor._prepare(1, [update], global_layer) for update in updates)
    auditor.close()
    assert isinstance(first, Prepared) and isinstance(second, Prepared)
    assert isinstance(first.update, SentLayer) and isinstance(second.update, SentLayer)
    assert first.update.weight is updates[0].arrays[layer.weight]  # type: ignore[index]
    assert first.update.global_weight is second.update.global_weight is global_layer[0]
    expected = layer_delta(updates[0].arrays, layer=layer, weight=global_layer[0], bias=global_layer[1])  # type: ignore[arg-type]
    materialized = first.materialized().update
    assert isinstance(materialized, LayerUpdate)
    assert materialized.weight_update.dtype == np.float64
    assert np.array_equal(materialized.weight_update, expected.weight_update)
    assert np.array_equal(materialized.bias_update, expected.bias_update)


def test_double_precision_and_non_finite_updates_are_decided_at_once() -> None:
    """A float64 update is subtracted when it arrives (its difference may overflow); a NaN is refused."""
    auditor = Auditor(
        CountingAttacker(),
        attack=AttackSettings(timeout=PATIENCE),
        execution=ExecutionSettings(isolation="thread"),
    )
    global_arrays = _global_arrays()
    auditor.start_round(1, global_arrays)
    layer = auditor.layer
    assert layer is not None
    global_layer = auditor._global_layer[1]
    double = {key: value.astype(np.float64) for key, value in _client_arrays(global_arrays, 0).items()}
    nan = _client_arrays(global_arrays, 1)
    nan[layer.weight][3, 4] = np.nan
    prepared = auditor._prepare(
        1, [ClientUpdate(identity=ClientIdentity(node_id=1), arrays=double)], global_layer
    )
    refused = auditor._prepare(
        1, [ClientUpdate(identity=ClientIdentity(node_id=2), arrays=nan)], global_layer
    )
    assert isinstance(prepared, Prepared) and isinstance(prepared.update, LayerUpdate)
    assert np.array_equal(prepared.update.weight_update, double[layer.weight] - global_layer[0])
    assert not isinstance(refused, Prepared)
    assert refused.error == NON_FINITE_UPDATE and refused.status == "error"


class OnlyTheLayer(Mapping[str, np.ndarray]):
    """A reply whose arrays fail when anything but the attacked layer is read."""

    def __init__(self, arrays: dict[str, np.ndarray], readable: tuple[str, ...]) -> None:
        self.arrays, self.readable = arrays, readable

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.readable:
            raise AssertionError(f"{key} was read")
        return self.arrays[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)


def test_the_layer_is_read_without_reading_the_rest_of_the_model() -> None:
    global_arrays = _global_arrays()
    auditor = Auditor(CountingAttacker(), execution=ExecutionSettings(isolation="thread"))
    layer = auditor.select_layer(global_arrays)
    reply = OnlyTheLayer(_client_arrays(global_arrays, 0), (layer.weight, layer.bias))
    weight, bias = layer_arrays(reply, layer)
    assert weight is reply.arrays[layer.weight] and bias is reply.arrays[layer.bias]
    view = {layer.weight: np.zeros((2, *global_arrays[layer.weight].shape), np.float32)[0], layer.bias: bias}
    kept, _ = layer_arrays(view, layer)
    assert kept.flags.owndata and kept.base is None  # a view is copied: the larger buffer is not kept
    buffer = io.BytesIO()
    np.save(buffer, reply.arrays[layer.weight])
    buffer.seek(0)
    loaded = np.load(buffer)  # how Flower decodes an Array: a view of exactly its own bytes
    same, _ = layer_arrays({layer.weight: loaded, layer.bias: bias}, layer)
    assert same is loaded


def test_every_finished_attack_gives_freed_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """After each finished attack the pool thread asks glibc to return its heaps' free pages."""
    from fl_attack.audit import auditor as auditor_module

    calls: list[int] = []
    monkeypatch.setattr(auditor_module, "release_freed_memory", lambda: calls.append(1) or True)
    auditor = _pooled(CountingAttacker())
    global_arrays = _global_arrays()
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, _updates(3, global_arrays))
    auditor.close()
    assert len(calls) == 3


class DigestAttacker(CountingAttacker):
    """Remembers a digest of every update it was given (not the update)."""

    def __init__(self, *, gated: bool = False) -> None:
        super().__init__(gated=gated)
        self.digests: list[str] = []

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        self.digests.append(hashlib.sha256(np.ascontiguousarray(update.weight_update).tobytes()).hexdigest())
        return super().attack(update, **options)


def test_waiting_updates_wait_in_private_files_and_are_attacked_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a store, waiting units beyond the memory allowance hold their weight in a 0600 file
    (memory-mapped), removed when their attack starts; the attacker receives exactly the
    difference it gets without the file."""
    monkeypatch.setattr(spill, "SPILL_AFTER_BYTES", 0)
    attacker = DigestAttacker(gated=True)
    store = ReconstructionStore.create(tmp_path / "run")
    auditor = _pooled(attacker, store=store)
    global_arrays = _global_arrays()
    updates = _updates(5, global_arrays)
    auditor.start_round(1, global_arrays)
    layer, global_layer = auditor.layer, auditor._global_layer[1]
    assert layer is not None
    deltas = [
        layer_delta(arrays, layer=layer, weight=global_layer[0], bias=global_layer[1])
        for arrays in (update.arrays for update in updates)
        if arrays is not None
    ]
    expected = [hashlib.sha256(delta.weight_update.tobytes()).hexdigest() for delta in deltas]
    del deltas
    folder = store.directory / SPILL_FOLDER
    before = {id(thing) for thing in gc.get_objects() if type(thing) is SentLayer}
    auditor.audit_round(1, updates)
    del updates
    try:
        _wait_until(lambda: folder.is_dir() and len(list(folder.iterdir())) == 4, "4 waiting updates spilled")
        assert sorted(stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()) == [0o600] * 4
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        waiting = [
            unit
            for unit in gc.get_objects()
            if type(unit) is SentLayer and id(unit) not in before and not unit._taken
        ]
        assert len(waiting) == 4 and all(isinstance(unit.weight, np.memmap) for unit in waiting)
        del waiting
    finally:
        attacker.gate.set()
        auditor.close()
    assert attacker.digests == expected
    assert not folder.exists()


def test_a_dropped_update_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "SPILL_AFTER_BYTES", 0)
    attacker = CountingAttacker(gated=True)
    store = ReconstructionStore.create(tmp_path / "run")
    auditor = Auditor(
        attacker,
        store=store,
        execution=ExecutionSettings(isolation="thread", workers=1, queue_size=1, queue_policy="drop-oldest"),
    )
    global_arrays = _global_arrays()
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, _updates(1, global_arrays))
    assert attacker.entered.wait(PATIENCE)  # the first attack runs (and waits at the gate)
    auditor.start_round(2, global_arrays)
    auditor.audit_round(2, _updates(3, global_arrays))
    folder = store.directory / SPILL_FOLDER
    try:
        dropped = [
            (record.server_round, record.client) for record in auditor.records if record.status == "dropped"
        ]
        assert dropped == [(2, "partition-0"), (2, "partition-1")]  # the oldest waiting ones
        _wait_until(
            lambda: folder.is_dir() and len(list(folder.iterdir())) == 1, "the waiting update spilled"
        )
    finally:
        attacker.gate.set()
        auditor.close()
    assert not folder.exists()


def test_a_short_queue_is_never_written(tmp_path: Path) -> None:
    """Below the allowance nothing is spilled; above it, the new updates are."""
    global_arrays = _global_arrays()
    auditor = Auditor(CountingAttacker(), execution=ExecutionSettings(isolation="thread"))
    layer = auditor.select_layer(global_arrays)
    weight, bias = layer_arrays(_client_arrays(global_arrays, 0), layer)
    global_weight, global_bias = weight.astype(np.float64), bias.astype(np.float64)
    units = [
        SentLayer(weight=weight.copy(), bias=bias, global_weight=global_weight, global_bias=global_bias)
        for _ in range(3)
    ]
    queue = QueueSpill(tmp_path / SPILL_FOLDER, after_bytes=2 * weight.nbytes)
    for queued, unit in enumerate(units, start=1):
        queue.add(unit, queued=queued)
    _wait_until(lambda: isinstance(units[2].weight, np.memmap), "the third update spilled")
    spilled = [isinstance(unit.weight, np.memmap) for unit in units]
    files = sorted(path.name for path in (tmp_path / SPILL_FOLDER).iterdir())
    queue.close()
    assert spilled == [False, False, True] and files == ["0.layer"]
    assert not (tmp_path / SPILL_FOLDER).exists()


def test_by_default_a_few_seconds_of_attacks_wait_in_memory(tmp_path: Path) -> None:
    """At m = 200 on CIFAR-10 (a 2.4 MiB float32 layer as sent) the default allowance keeps the
    first 6 waiting updates in memory, about 4 s of attacks; every later one goes to a file."""
    weight = np.zeros((200, 3072), np.float32)
    global_weight = np.zeros((200, 3072), np.float64)
    units = [
        SentLayer(
            weight=weight.copy(),
            bias=np.zeros(200, np.float32),
            global_weight=global_weight,
            global_bias=np.zeros(200, np.float64),
        )
        for _ in range(9)
    ]
    queue = QueueSpill(tmp_path / SPILL_FOLDER)
    for queued, unit in enumerate(units, start=1):
        queue.add(unit, queued=queued)
    _wait_until(lambda: isinstance(units[-1].weight, np.memmap), "the last update spilled")
    spilled = [isinstance(unit.weight, np.memmap) for unit in units]
    queue.close()
    assert spilled == [False] * 6 + [True] * 3
