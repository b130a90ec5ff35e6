"""One-hot rows of the update's row space: every one enumerated, samples pinned, real Adult batches recovered."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fl_attack import SpearPlusPlus
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.side_information.onehot_groups import detect_onehot_groups
from fl_attack.pipeline.side_information.onehot_rows import (
    OneHotSide,
    cutting_directions,
    lineality,
    one_hot_proposals,
    one_hot_rows,
    single_sample_mask,
)
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear
from tests.onehot_adult_rows import adult_batch

BATCH, WIDTH = 20, 200
TWINS_3 = (0, 6, 8)  # seed 3: three rows with the same categories


def _case(
    seed: int,
) -> tuple[OneHotSide, ZeroTolerance, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The one-hot side of a batch's update (plain SVD factors), its tolerance, the true directions, rows and update."""
    x, labels = adult_batch(seed)
    model = build_victim("spear++", input_dim=x.shape[1], width=WIDTH, num_classes=2, depth=4, seed=seed)
    weight_grad, bias_grad = (t.double() for t in client_gradient(model, x, labels))
    _, layer = first_linear(model)
    weight, bias = layer.weight.detach().double(), layer.bias.detach().double()
    left, values, right_h = torch.linalg.svd(weight_grad, full_matrices=False)
    left, right = left[:, :BATCH], values[:BATCH, None] * right_h[:BATCH]
    tolerance = ZeroTolerance.from_noise(float(values[BATCH] / values[BATCH - 1]), width=WIDTH)
    active = left.norm(dim=1) > tolerance.absolute
    groups = detect_onehot_groups(
        weight_grad,
        bias_grad,
        live=x.abs().sum(dim=0) > 0,
        unit_roundoff=float(torch.finfo(torch.float32).eps),
    )
    side = OneHotSide(
        right=right,
        groups=groups.groups,
        left=left[active],
        pre_activation_basis=(weight @ right.T)[active],
        bias=bias[active],
    )
    rows_a = x.double() @ torch.linalg.pinv(right)  # x_i = a_i^T R
    truth = torch.linalg.inv(rows_a).T  # row i: the direction q_i of sample i
    truth = truth / truth.norm(dim=1, keepdim=True)
    return side, tolerance, truth, x, (weight_grad, bias_grad, weight, bias)


def _matched(directions: torch.Tensor, truth: torch.Tensor) -> set[int]:
    """The samples whose true direction is among ``directions`` (up to sign, to 1e-8)."""
    cosines = (directions / directions.norm(dim=1, keepdim=True)) @ truth.T
    return {int(i) for i in torch.nonzero(cosines.abs().amax(dim=0) > 1 - 1e-8).flatten()}


def test_enumeration_finds_exactly_the_one_hot_vectors_of_a_row_space() -> None:
    generator = torch.Generator().manual_seed(0)
    groups = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    every = []
    for choice in itertools.product(*groups):
        row = torch.zeros(9, dtype=torch.float64)
        row[list(choice)] = 1.0
        every.append(row)
    patterns = torch.stack(every)
    chosen = patterns[torch.randperm(patterns.shape[0], generator=generator)[:4]]
    # a row space spanned by 4 one-hot rows (mixed by a random invertible matrix)
    span = torch.randn(4, 4, generator=generator, dtype=torch.float64) @ chosen
    _, _, vectors_h = torch.linalg.svd(span, full_matrices=True)
    found = one_hot_rows(vectors_h[4:], groups=groups, width=9)
    assert found is not None
    basis = vectors_h[:4]  # orthonormal rows spanning the row space
    members = [p for p in every if float((p - basis.T @ (basis @ p)).norm()) < 1e-9]
    assert {tuple(r.tolist()) for r in found} == {tuple(p.tolist()) for p in members}
    assert len(members) >= 4 and found.shape[0] == len(members)


def test_seed_9_every_sample_pinned_by_its_one_hot_row() -> None:
    side, tolerance, truth, _, _ = _case(9)
    result = one_hot_proposals(side, truth.new_zeros(0, BATCH), tolerance=tolerance, min_zeros=BATCH + 2)
    assert result.lineality == 0
    assert result.one_hot_rows == 418  # 20 samples and 398 virtual one-hot rows
    assert result.directions.shape[0] == BATCH and _matched(result.directions, truth) == set(range(BATCH))


def test_seed_3_twins_leave_a_lineality_of_two_that_one_twin_direction_cuts() -> None:
    side, tolerance, truth, _, _ = _case(3)
    alone = one_hot_proposals(side, truth.new_zeros(0, BATCH), tolerance=tolerance, min_zeros=BATCH + 2)
    assert (alone.lineality, alone.one_hot_rows, alone.directions.shape[0]) == (2, 0, 0)
    # a sample with unique categories cuts nothing: its direction is orthogonal to the twins' differences
    other = one_hot_proposals(side, truth[1:2], tolerance=tolerance, min_zeros=BATCH + 2)
    assert (other.lineality, other.directions.shape[0]) == (2, 0)
    # one twin's direction: the other 19 samples, the two remaining twins on one line
    twin = one_hot_proposals(
        side, truth[TWINS_3[1] : TWINS_3[1] + 1], tolerance=tolerance, min_zeros=BATCH + 2
    )
    assert twin.lineality == 1
    assert _matched(twin.directions, truth) == set(range(BATCH)) - {TWINS_3[1]}
    assert twin.directions.shape[0] == BATCH - 1


def test_cuts_take_near_twin_directions_and_skip_mixtures() -> None:
    side, tolerance, truth, _, _ = _case(3)
    first, second, third = TWINS_3
    mixture = truth[first] + truth[second]  # vanishes where both twins are inactive
    candidates = torch.stack([truth[1], mixture, truth[2], truth[second], truth[third]])
    assert single_sample_mask(side, candidates, tolerance=tolerance).tolist() == [
        True,
        False,
        True,
        True,
        True,
    ]
    assert lineality(side, truth.new_zeros(0, BATCH)) == 2
    # unique-category samples (1, 2) do not lower the lineality: the twins' directions do
    kept = cutting_directions(side, candidates[[0, 2, 3, 4]], target=0)
    assert kept is not None and _matched(kept, truth) == {second, third} and kept.shape[0] == 2
    assert cutting_directions(side, candidates[[0, 2]]) is None


def test_wrong_known_shape_is_refused() -> None:
    side, tolerance, truth, _, _ = _case(9)
    with pytest.raises(ValueError, match=r"known must have shape \(k, 20\) with 0 <= k < 20, got \(20, 20\)"):
        one_hot_proposals(side, truth, tolerance=tolerance, min_zeros=BATCH)
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        one_hot_proposals(side, truth[0, :3], tolerance=tolerance, min_zeros=BATCH)


@pytest.mark.parametrize("seed", [9, 3])
def test_real_adult_batches_that_failed_before_are_recovered_exactly(seed: int) -> None:
    """Both failed with ``complete=False`` after 30 s before the one-hot proposals."""
    torch.set_num_threads(1)
    side, _, _, x, (weight_grad, bias_grad, weight, bias) = _case(seed)
    del side
    rec = SpearPlusPlus(time_budget=30.0, seed=seed, progress=False).invert(
        weight_grad, bias_grad, weight=weight, bias=bias, batch_size=BATCH
    )
    assert rec.complete and rec.self_check is not None and rec.self_check.passed
    assert rec.stats["onehot_groups"] == 8
    # every row exact: one-to-one with the true rows, float32 rounding apart
    distances = torch.cdist(rec.inputs.double(), x.double())
    nearest = distances.argmin(dim=1)
    assert sorted(nearest.tolist()) == list(range(BATCH))
    assert float(distances.min(dim=1).values.max()) < 1e-4
    if seed == 9:
        assert rec.stats["onehot_sweep"] == BATCH and rec.stats["rounds"] == 1
    else:
        later = rec.stats.get("onehot_missing_proposals", 0) + rec.stats.get("onehot_round_proposals", 0)
        assert rec.stats["onehot_lineality"] == 2 and later > 0
    assert rec.seconds < 30.0 and math.isfinite(rec.sparsity_matching)
