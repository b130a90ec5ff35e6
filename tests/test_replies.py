"""Reading training replies: the model arrays are decoded only when the audit reads them."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_attack.audit.protocol import GROUND_TRUTH_KEY
from strategies.replies import DecodedOnRead, model_arrays


def _undecodable(like: np.ndarray) -> Array:
    template = Array(like)
    return Array(dtype=template.dtype, shape=template.shape, stype=template.stype, data=b"garbage")


def test_only_the_arrays_read_are_decoded() -> None:
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    record = ArrayRecord({"0.weight": Array(weight), "0.bias": Array(np.ones(2, np.float32))})
    record["1.weight"] = _undecodable(np.ones((4, 2), np.float32))
    content = RecordDict({"arrays": record, "audit": ConfigRecord({"partition-id": 0})})

    arrays = model_arrays(content)

    assert isinstance(arrays, DecodedOnRead)
    assert list(arrays) == ["0.weight", "0.bias", "1.weight"] and len(arrays) == 3
    np.testing.assert_array_equal(arrays["0.weight"], weight)
    with pytest.raises(ValueError, match=r"array '1.weight' of the reply cannot be decoded"):
        arrays["1.weight"]
    with pytest.raises(KeyError):
        arrays["2.weight"]


def test_the_ground_truth_record_is_not_the_model() -> None:
    model = ArrayRecord({"0.weight": Array(np.ones((2, 3), np.float32))})
    truth = ArrayRecord({"inputs": Array(np.zeros((1, 3), np.float32))})
    arrays = model_arrays(RecordDict({"arrays": model, GROUND_TRUTH_KEY: truth}))
    assert list(arrays) == ["0.weight"]
    with pytest.raises(ValueError, match="expected exactly one model ArrayRecord in the reply, found 0"):
        model_arrays(RecordDict({GROUND_TRUTH_KEY: truth}))
