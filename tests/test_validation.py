"""The public API refuses bad arguments with one clear line, before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_attack import CocktailPartyAttack, Spear, SpearPlusPlus
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.validation import resolve_device


def _update() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((50, 20)), rng.standard_normal(50)
    inputs = rng.standard_normal((3, 20))
    output_grad = ((inputs @ weight.T + bias) > 0) * rng.standard_normal((3, 50))
    return output_grad.T @ inputs, output_grad.sum(0), weight, bias


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0.0, -1.0, True, "30"])
@pytest.mark.parametrize("attack", [SpearPlusPlus, CocktailPartyAttack])
def test_bad_time_budgets_are_refused(attack: type, budget: object) -> None:
    with pytest.raises(ValueError, match="time_budget must be") as raised:
        attack(progress=False, time_budget=budget)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("budget", [float("nan"), 0.0, -1.0, True, "30"])
def test_a_call_budget_refuses_bad_seconds(budget: object) -> None:
    with pytest.raises(ValueError, match="time_budget must be") as raised:
        Budget.start(budget)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("budget", [float("nan"), 0, -1])
def test_bad_time_budget_at_construction(budget: float) -> None:
    with pytest.raises(ValueError, match="time_budget must be"):
        SpearPlusPlus(time_budget=budget)


@pytest.mark.parametrize("size", [3.0, True, 0, -2, "3"])
def test_bad_batch_sizes_are_refused(size: object) -> None:
    dw, db, w, b = _update()
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        SpearPlusPlus(progress=False).invert(dw, db, weight=w, bias=b, batch_size=size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", torch.device("cuda"), "cuda:0"])
def test_cuda_without_cuda_is_one_clear_line(device: object) -> None:
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        resolve_device(device)  # type: ignore[arg-type]
    dw, db, w, b = _update()
    with pytest.raises(ValueError, match="CUDA is not available"):
        SpearPlusPlus(device=device, progress=False).invert(dw, db, weight=w, bias=b)  # type: ignore[arg-type]


def test_unsupported_devices_are_named() -> None:
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        with pytest.raises(ValueError, match="'mps' was requested"):
            resolve_device("mps")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("factory", "pattern"),
    [
        (lambda: SpearPlusPlus(surrogate="l2"), "surrogate"),
        (lambda: SpearPlusPlus(optimizer="adam"), "optimizer"),
        (lambda: SpearPlusPlus(time_budget=-1.0), "time_budget"),
        (lambda: SpearPlusPlus(time_budget=0.0), "time_budget"),
        (lambda: Spear(time_budget=-5), "time_budget"),
        (lambda: SpearPlusPlus(false_rejection=0.0), "false_rejection"),
        (lambda: SpearPlusPlus(accept_matching=1.5), "accept_matching"),
        (lambda: SpearPlusPlus(initializations=0), "initializations"),
        (lambda: Spear(samples_per_batch=0), "samples_per_batch"),
    ],
    ids=[
        "surrogate",
        "optimizer",
        "negative-budget",
        "zero-budget",
        "spear-budget",
        "false-rejection",
        "accept-matching",
        "initializations",
        "samples-per-batch",
    ],
)
def test_invalid_constructor_arguments_raise(factory, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        factory()
