"""The batch size is read against float rounding, at any learning rate and under clipping.

A server that differences float32 weights after one small step (``W - lr * g`` rounded to
float32, then ``- W``) sees the update plus the rounding of ``W``: at lr 1e-3 that rounding is
only a few hundred times below the batch's weakest singular value, so no fixed gap (the old
1e3) separates the batch from it, and the estimate fell back to the number of non-zero rows.
The estimate now measures the spectrum against the rounding floor of the observed update.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from synthetic_layer import relu_layer_update
from torch.func import functional_call, grad, vmap

from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.pipeline.spectrum.decompose import (
    ROUNDING_EDGE,
    decompose,
    estimate_batch_size,
    rounding_floor,
)
from fl_attack.simulate.victims import build_victim, dp_sgd_gradient, first_linear, noisy_gradient
from fl_attack.types import ObservedUpdate

BATCH = 8
EPS32 = torch.finfo(torch.float32).eps


@functools.cache
def _client() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, float]:
    """The faces victim (m = 200), a batch of 8 and the smallest per-sample gradient norm."""
    data = load_dataset("faces", split="all")
    images, labels, _ = sample_batch(data, BATCH, seed=BATCH)
    model = build_victim("spear++", input_dim=data.input_dim, width=200, num_classes=data.num_classes, seed=0)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def sample_loss(p: dict[str, torch.Tensor], image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (image[None],))
        return torch.nn.functional.cross_entropy(logits, label[None])

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, images, labels)
    norms = torch.stack([g.flatten(1).double().norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
    return model, images, labels, float(norms.min())


def _clipped_step(
    lr: float, clip_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W_new - W_old`` in float32 after one DP-SGD step without noise, every sample clipped."""
    model, images, labels, smallest_norm = _client()
    weight_grad, bias_grad = dp_sgd_gradient(
        model, images, labels, noise_multiplier=0.0, max_grad_norm=clip_fraction * smallest_norm
    )
    layer = first_linear(model)[1]
    weight, bias = layer.weight.detach(), layer.bias.detach()
    return (weight - lr * weight_grad) - weight, (bias - lr * bias_grad) - bias, weight, bias


@pytest.mark.parametrize("clip_fraction", [0.5, 0.05], ids=["clip-0.5", "clip-0.05"])
@pytest.mark.parametrize("lr", [1e-1, 1e-2, 1e-3, 1e-4])
def test_clipped_float32_step_gives_the_batch_size_at_any_learning_rate(
    lr: float, clip_fraction: float
) -> None:
    update, _, weight, _ = _clipped_step(lr, clip_fraction)
    assert update.dtype == torch.float32 and int((update.abs().amax(dim=1) > 0).sum()) > 100
    floor = rounding_floor(update, unit_roundoff=EPS32, weight=weight)
    singular_values = torch.linalg.svdvals(update.double())
    weakest = float(singular_values[BATCH - 1]) / floor
    if weakest < 1.0:  # lr 1e-4 with heavy clipping: the weakest samples are lost below rounding
        with pytest.raises(ValueError, match="lost in float rounding"):
            estimate_batch_size(singular_values, shape=tuple(update.shape), rounding_floor=floor)
        return
    estimate = estimate_batch_size(singular_values, shape=tuple(update.shape), rounding_floor=floor)
    assert estimate.batch_size == BATCH, (lr, clip_fraction, weakest, estimate)
    # clean exactly when the weakest sample stands clear of what rounding can give
    assert estimate.noisy is (weakest < ROUNDING_EDGE)
    assert estimate.rounding_floor == floor


def test_the_reported_case_lr_1e3_is_no_longer_the_count_of_nonzero_rows() -> None:
    """lr 1e-3, clipping binding: a gap of ~700x, below the old fixed 1e3."""
    update, _, weight, _ = _clipped_step(1e-3, 0.5)
    singular_values = torch.linalg.svdvals(update.double())
    gap = float(singular_values[BATCH - 1] / singular_values[BATCH])
    assert 100 < gap < 1e3
    floor = rounding_floor(update, unit_roundoff=EPS32, weight=weight)
    assert (
        estimate_batch_size(singular_values, shape=tuple(update.shape), rounding_floor=floor).batch_size
        == BATCH
    )
    # without the weights the floor is unknown; the noise bulk below the gap still gives it away
    blind = estimate_batch_size(singular_values, shape=tuple(update.shape))
    assert blind.batch_size == BATCH and blind.noisy


def test_attack_reports_the_figures_of_its_estimate() -> None:
    update, bias_update, weight, bias = _clipped_step(1e-3, 0.5)
    rec = SpearPlusPlus(seed=0, time_budget=20.0, progress=False).invert(
        update, bias_update, weight=weight, bias=bias
    )
    stats = rec.stats
    assert stats["estimated_batch_size"] == rec.batch_size == BATCH
    floor = rounding_floor(update, unit_roundoff=EPS32, weight=weight)
    assert stats["rounding_floor"] == pytest.approx(floor, rel=1e-12)
    singular_values = torch.linalg.svdvals(update.double())
    assert stats["spectral_gap"] == pytest.approx(
        float(singular_values[BATCH - 1] / singular_values[BATCH]), rel=1e-6
    )
    assert stats["relative_noise"] == pytest.approx(1.0 / stats["spectral_gap"], rel=1e-9)
    assert stats["signal_to_rounding"] == pytest.approx(float(singular_values[BATCH - 1]) / floor, rel=1e-6)
    assert "rank_noise_ratio" in stats  # relative noise ~1.4e-3: the attack runs its noisy path


def test_noisy_update_reports_the_rank_noise_ratio() -> None:
    update, bias_update, weight, bias = _clipped_step(1e-1, 0.5)
    noisy_weight, noisy_bias = noisy_gradient(
        update, bias_update, sigma=0.1 * float(update.abs().median()), seed=0
    )
    rec = SpearPlusPlus(seed=0, time_budget=5.0, progress=False).invert(
        noisy_weight, noisy_bias, weight=weight, bias=bias, batch_size=BATCH
    )
    stats = rec.stats
    m, n = update.shape
    singular_values = torch.linalg.svdvals(noisy_weight.double())
    edge = stats["noise_std"] * ((m - BATCH) ** 0.5 + (n - BATCH) ** 0.5)
    assert stats["rank_noise_ratio"] == pytest.approx(float(singular_values[BATCH - 1]) / edge, rel=1e-6)
    assert stats["rank_noise_ratio"] > 1.0  # the batch stands above the noise bulk


def test_float64_near_duplicates_are_two_samples_not_one() -> None:
    """A 1e-3 difference is ~1e-3 of the spectrum: far above float64 rounding, so signal."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    inputs[1] = inputs[0] + 1e-3 * torch.randn(6, generator=generator, dtype=torch.float64)
    update = relu_layer_update(inputs, width=12, seed=0)
    observed = ObservedUpdate.from_update(update.layer_update(), device=torch.device("cpu"))
    assert observed.unit_roundoff == torch.finfo(torch.float64).eps
    floor = rounding_floor(
        observed.weight_update, unit_roundoff=observed.unit_roundoff, weight=observed.weight
    )
    factors = decompose(observed.weight_update, rounding_floor=floor)
    assert factors.batch_size == 2 and not factors.spectrum.noisy


def test_unit_roundoff_follows_the_precision_the_values_came_from() -> None:
    update = relu_layer_update(
        torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), width=10, seed=1
    )
    arrays = update.arrays()
    as_float32 = {name: value.float() for name, value in arrays.items()}
    widened = {name: value.double() for name, value in as_float32.items()}  # a server working in float64
    cpu = torch.device("cpu")

    def roundoff(given: dict[str, Any]) -> float:
        grads = given["weight_grad"], given["bias_grad"]
        return ObservedUpdate.from_arrays(
            *grads, weight=given["weight"], bias=given["bias"], device=cpu
        ).unit_roundoff

    assert roundoff(arrays) == torch.finfo(torch.float64).eps
    assert roundoff(as_float32) == EPS32
    assert roundoff(widened) == EPS32
    numpy_arrays = {name: value.numpy() for name, value in as_float32.items()}
    assert roundoff(numpy_arrays) == EPS32


def test_rounding_floor_validation_and_dead_rows() -> None:
    update = torch.zeros(4, 5)
    assert rounding_floor(update, unit_roundoff=EPS32) == 0.0
    with pytest.raises(ValueError, match="unit_roundoff"):
        rounding_floor(update, unit_roundoff=0.0)
    update[1, 2] = 2.0  # one live row of five entries: rms 2 / sqrt(5)
    weight = torch.full((4, 5), 3.0)
    expected = EPS32 * (2.0 / 5**0.5 + 3.0) * (1.0 + 5**0.5)
    assert rounding_floor(update, unit_roundoff=EPS32, weight=weight) == pytest.approx(expected, rel=1e-12)
