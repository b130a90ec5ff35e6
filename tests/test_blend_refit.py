"""Re-fitting the blended rows of a noisy selection (fl_attack.pipeline.noise.blend_refit)."""

from __future__ import annotations

import pytest
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.noise.blend_refit import (
    EXCESS_RATIO,
    blend_refit,
    inactive_excess,
    inactive_masks,
    refit_on_inactive,
)
from tests.test_joint_refit import _cosines, _selection
from tests.test_trusted import _layer


def _blended(truth: torch.Tensor, row: int, other: int, weight: float) -> torch.Tensor:
    """The true directions with ``row`` replaced by a unit mix of it and ``other``."""
    blend = truth[row] + weight * truth[other]
    directions = truth.clone()
    directions[row] = blend / blend.norm()
    return directions


def test_true_directions_carry_noise_only_on_their_inactive_neurons() -> None:
    layer = _layer(width=1200)
    excess = inactive_excess(layer.scorer, layer.directions)
    assert float(excess.max()) < EXCESS_RATIO
    assert float(excess.min()) > 0.5  # pure noise sits at 1


@pytest.mark.parametrize("other", [1, 2, 3])
def test_a_blend_carries_the_other_samples_gradient_on_its_inactive_neurons(other: int) -> None:
    layer = _layer(width=1200)
    excess = inactive_excess(layer.scorer, _blended(layer.directions, 0, other, 0.5))
    assert float(excess[0]) > 2 * EXCESS_RATIO
    assert float(excess[1:].max()) < EXCESS_RATIO


def test_inactive_masks_leave_out_the_neurons_nearest_the_threshold() -> None:
    layer = _layer(width=1200)
    _, q_inv = layer.scorer.score(layer.directions)
    masks = inactive_masks(layer.scorer, q_inv)
    inputs = q_inv @ layer.scorer.factors.right
    pre = inputs @ layer.scorer.update.weight.T + layer.scorer.update.bias  # (b, m)
    assert bool((pre[masks] <= 0).all())
    inactive = (pre <= 0).sum(dim=1)
    # about a fifth of all neurons (the nearest the threshold, either side) is left out
    assert bool((masks.sum(dim=1) < inactive).all())
    assert bool((masks.sum(dim=1) > 0.5 * inactive).all())


@pytest.mark.parametrize(("other", "weight"), [(1, 0.3), (2, 0.5), (3, 0.5)])
def test_blend_refit_restores_the_blended_direction_and_leaves_the_others(other: int, weight: float) -> None:
    layer = _layer(width=1200)
    blended = _blended(layer.directions, 0, other, weight)
    before = _selection(layer.scorer, blended)
    assert float(_cosines(before.directions[:1], layer.directions)[0]) < 0.96
    after = blend_refit(layer.scorer, before)
    cosines = _cosines(after.directions, layer.directions)
    assert float(cosines.min()) > 0.9999
    assert torch.equal(after.found, before.found)
    torch.testing.assert_close(after.directions[1:], before.directions[1:], rtol=0, atol=1e-15)
    assert after.sparsity_matching > before.sparsity_matching


def test_refit_on_inactive_keeps_the_rows_it_is_not_asked_to_refit() -> None:
    layer = _layer(width=1200)
    blended = _blended(layer.directions, 0, 1, 0.5)
    refitted = refit_on_inactive(layer.scorer, blended, [0])
    torch.testing.assert_close(refitted[1:], blended[1:], rtol=0, atol=1e-15)
    assert float(refitted[0] @ blended[0]) > 0  # signed like the row it re-fits
    torch.testing.assert_close(refit_on_inactive(layer.scorer, blended, []), blended, rtol=0, atol=1e-15)


def test_blend_refit_returns_the_selection_when_nothing_is_flagged_found_or_timed() -> None:
    layer = _layer(width=1200)
    exact = _selection(layer.scorer, layer.directions)
    assert blend_refit(layer.scorer, exact) is exact
    empty = _selection(layer.scorer, layer.directions[:0])
    assert blend_refit(layer.scorer, empty) is empty
    blended = _selection(layer.scorer, _blended(layer.directions, 0, 1, 0.5))
    assert blend_refit(layer.scorer, blended, deadline=Deadline(0.0)) is blended
    assert blend_refit(layer.scorer, blended, iterations=0) is blended


def test_blend_refit_rejects_negative_iterations() -> None:
    layer = _layer(width=1200)
    with pytest.raises(ValueError, match="iterations must be >= 0, got -2"):
        blend_refit(layer.scorer, _selection(layer.scorer, layer.directions), iterations=-2)
