"""A reply's array read in place: equal to ``numpy.load``'s, over the reply's own bytes, never a copy."""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fl_attack.audit import Auditor, ClientIdentity, ClientUpdate, ExecutionSettings
from fl_attack.audit.layer import LayerKeys, SentLayer, layer_arrays, layer_delta
from fl_attack.audit.units import Prepared
from strategies.npy_view import npy_view
from strategies.replies import DecodedOnRead
from tests.test_audit_memory import PATIENCE, CountingAttacker
from tests.test_audit_strategy import _client_arrays, _global_arrays


def _npy(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    if version is None:
        np.save(buffer, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return buffer.getvalue()


def _root(array: np.ndarray) -> object:
    root: object = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    return root


ARRAYS = {
    "float32 matrix": np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32),
    "float16 vector": np.linspace(-3, 3, 11).astype(np.float16),
    "big-endian float64": np.arange(12, dtype=">f8").reshape(3, 4) / 7,
    "fortran order": np.asfortranarray(np.arange(20, dtype=np.float32).reshape(4, 5)),
    "scalar": np.array(2.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "int64 with nan-free payload": np.arange(-5, 5, dtype=np.int64),
}


@pytest.mark.parametrize("name", list(ARRAYS))
@pytest.mark.parametrize("version", [None, (1, 0), (2, 0)])
def test_the_view_is_what_numpy_load_returns_over_the_same_bytes(
    name: str, version: tuple[int, int] | None
) -> None:
    data = _npy(ARRAYS[name], version)
    loaded = np.load(io.BytesIO(data), allow_pickle=False)

    view = npy_view(data)

    assert view is not None
    assert view.dtype == loaded.dtype and view.shape == loaded.shape
    assert view.tobytes(order="A") == loaded.tobytes(order="A")
    np.testing.assert_array_equal(view, loaded)
    assert view.flags.f_contiguous == loaded.flags.f_contiguous
    assert _root(view) is data  # no copy: the bytes themselves
    assert not view.flags.writeable  # the reply's bytes are never changed through it


def test_what_is_not_read_in_place_is_left_to_numpy_load() -> None:
    data = _npy(ARRAYS["float32 matrix"])
    assert npy_view(bytearray(data)) is None  # mutable: its owner could change it under the audit
    assert npy_view(memoryview(data)) is None
    assert npy_view(data[:-4]) is None  # shorter than its header says
    assert npy_view(data + b"\0" * 4) is None  # longer than its header says
    assert npy_view(b"garbage") is None
    assert npy_view(_npy(np.arange(3), version=(3, 0))) is None  # not a version it reads


def test_the_audit_keeps_the_reply_layer_without_a_copy() -> None:
    """The attacked layer read from a reply is the reply's bytes, equal to Flower's own decoding."""
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((6, 12)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    record = ArrayRecord({"fc.weight": Array(weight), "fc.bias": Array(bias)})
    layer = LayerKeys(weight="fc.weight", bias="fc.bias")

    kept_weight, kept_bias = layer_arrays(DecodedOnRead(record), layer)

    assert _root(kept_weight) is record["fc.weight"].data and _root(kept_bias) is record["fc.bias"].data
    np.testing.assert_array_equal(kept_weight, record["fc.weight"].numpy())
    np.testing.assert_array_equal(kept_bias, record["fc.bias"].numpy())
    assert kept_weight.dtype == np.float32 and kept_weight.shape == (6, 12)


def test_a_waiting_update_holds_the_reply_bytes_not_a_copy() -> None:
    """While its attack waits, a queued update keeps the reply's own bytes of the layer; the attack
    then gets the same difference as from Flower's decoding."""
    global_arrays = _global_arrays()
    sent = _client_arrays(global_arrays, 0)
    record = ArrayRecord({key: Array(np.asarray(value)) for key, value in sent.items()})
    attacker = CountingAttacker(gated=True)
    auditor = Auditor(attacker, execution=ExecutionSettings(isolation="thread", workers=1))
    try:
        auditor.start_round(1, global_arrays)
        updates = [
            ClientUpdate(
                identity=ClientIdentity(node_id=10 + k, partition_id=k), arrays=DecodedOnRead(record)
            )
            for k in range(2)
        ]
        auditor.audit_round(1, updates)
        assert attacker.entered.wait(PATIENCE)  # the first attack runs; the second update waits
        layer = auditor.layer
        assert layer is not None
        waiting = [
            unit.update
            for unit in gc.get_objects()
            if type(unit) is Prepared and isinstance(unit.update, SentLayer) and not unit.update._taken
        ]
        assert len(waiting) == 1
        assert _root(waiting[0].weight) is record[layer.weight].data
        assert _root(waiting[0].bias) is record[layer.bias].data
        expected = layer_delta(
            sent, layer=layer, weight=waiting[0].global_weight, bias=waiting[0].global_bias
        )
        delta = waiting[0].delta()
        assert delta.weight_update.tobytes() == expected.weight_update.tobytes()
        assert delta.bias_update.tobytes() == expected.bias_update.tobytes()
        del waiting, delta
    finally:
        attacker.gate.set()
        auditor.close()
    assert [record.status for record in auditor.records] == ["ok", "ok"]
