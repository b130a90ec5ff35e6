"""Fault suite: bad arguments at the public API fail at once, in one line."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_attack import Spear, SpearPlusPlus

from .helpers import (
    BIAS,
    WEIGHT,
    fedsgd_arrays,
    victim_arrays,
)


def _observed_update() -> dict[str, np.ndarray]:
    global_arrays = victim_arrays()
    client, _ = fedsgd_arrays(global_arrays, seed=1)
    weight = global_arrays[WEIGHT].astype(np.float64)
    bias = global_arrays[BIAS].astype(np.float64)
    return {
        "weight_grad": client[WEIGHT].astype(np.float64) - weight,
        "bias_grad": client[BIAS].astype(np.float64) - bias,
        "weight": weight,
        "bias": bias,
    }


INVALID_CALLS = {
    "time-budget-nan": (
        {"time_budget": math.nan},
        {},
        "time_budget must be a positive, finite number of seconds, got nan",
    ),
    "time-budget-zero": (
        {"time_budget": 0},
        {},
        "time_budget must be a positive, finite number of seconds, got 0",
    ),
    "time-budget-negative": (
        {"time_budget": -1},
        {},
        "time_budget must be a positive, finite number of seconds, got -1",
    ),
    "batch-size-float": (
        {},
        {"batch_size": 10.0},
        "batch_size must be a positive integer or None, got 10.0 (float)",
    ),
    "batch-size-bool": (
        {},
        {"batch_size": True},
        "batch_size must be a positive integer or None, got True (bool)",
    ),
    "device-mps": (
        {"device": "mps"},
        {},
        "device 'mps' was requested but this torch build has no MPS support on this machine",
    ),
}


@pytest.mark.parametrize("attack", [SpearPlusPlus, Spear], ids=["spear++", "spear"])
@pytest.mark.parametrize("case", list(INVALID_CALLS))
def test_invalid_arguments_fail_at_the_public_api_in_one_line(case: str, attack: type[SpearPlusPlus]) -> None:
    options, arguments, message = INVALID_CALLS[case]
    if case == "device-mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        attack(progress=False, **options).invert(**_observed_update(), **arguments)  # type: ignore[arg-type]
    assert str(raised.value) == message and "\n" not in message
    assert (
        Path(str(raised.traceback[-1].path)).name == "validation.py"
    )  # checked up front, not deep in the search
    assert time.perf_counter() - start < 5.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_fails_in_one_line() -> None:
    with pytest.raises(ValueError) as raised:
        SpearPlusPlus(device=torch.device("cuda"), progress=False).invert(**_observed_update())  # type: ignore[arg-type]
    assert str(raised.value) == "device 'cuda' was requested but CUDA is not available on this machine"
    assert Path(str(raised.traceback[-1].path)).name == "validation.py"
