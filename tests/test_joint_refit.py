"""Joint re-fit of a noisy selection on its predicted zeros (fl_attack.pipeline.noise.joint_refit) and the
last steps of a noisy attack (fl_attack.pipeline.noise.one_at_a_time.finish_noisy)."""

from __future__ import annotations

import math

import pytest
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.noise.blend_refit import blend_refit
from fl_attack.pipeline.noise.joint_refit import MIN_COS, joint_refit, predicted_zeros, refit_on
from fl_attack.pipeline.noise.one_at_a_time import REFIT_MIN_FOUND, finish_noisy
from fl_attack.pipeline.selection.select import (
    Selection,
    SparsityMatchingScorer,
    orthonormal_completion,
    prune_doubtful,
)
from tests.test_trusted import _layer


def _tilted(directions: torch.Tensor, cos: float, seed: int = 5) -> torch.Tensor:
    """Each unit row turned away from itself to the cosine ``cos``."""
    noise = torch.randn(directions.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    noise = noise - (noise * directions).sum(dim=1, keepdim=True) * directions
    noise = noise / noise.norm(dim=1, keepdim=True) * math.tan(math.acos(cos))
    tilted = directions + noise
    return tilted / tilted.norm(dim=1, keepdim=True)


def _selection(scorer: SparsityMatchingScorer, found: torch.Tensor) -> Selection:
    b = found.shape[1]
    directions = torch.cat([found, orthonormal_completion(found, b)], dim=0) if found.shape[0] < b else found
    mask = torch.arange(b) < found.shape[0]
    per_sample, q_inv = scorer.score(directions)
    per_sample = torch.where(mask, per_sample, torch.zeros_like(per_sample))
    return Selection(directions, mask, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean()))


def _cosines(directions: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    unit = directions / directions.norm(dim=1, keepdim=True)
    return (unit @ truth.T).abs().amax(dim=1)


def test_refit_on_the_exact_zeros_of_a_clean_column_returns_its_direction() -> None:
    layer = _layer()
    scorer, truth = layer.scorer, layer.directions
    left = scorer.factors.left
    columns = truth @ left.T  # (b, m) unit gradient columns of the noisy factor
    zeros = columns.abs() <= 0.05 * columns.abs().amax(dim=1, keepdim=True)
    # a clean factor: remove each column's own small entries so that those rows are exact zeros of it
    rows = torch.nonzero(zeros[0]).flatten()
    assert rows.numel() >= truth.shape[1] - 1
    exact = left.clone()
    exact[rows] -= torch.outer(exact[rows] @ truth[0], truth[0])
    clean = type(scorer)(scorer.update, type(scorer.factors)(exact, *_rest(scorer)), scorer.tolerance)
    start = _tilted(truth[:1], 0.9)
    refitted = refit_on(clean, start, zeros[:1])
    assert float((refitted[0] @ truth[0]).abs()) == pytest.approx(1.0, abs=1e-12)
    assert float(refitted[0] @ start[0]) > 0  # signed like the direction it re-fits


def _rest(scorer: SparsityMatchingScorer) -> tuple[torch.Tensor, torch.Tensor, object]:
    factors = scorer.factors
    return factors.right, factors.singular_values, factors.spectrum


def test_refit_on_keeps_a_direction_with_too_few_zeros() -> None:
    layer = _layer()
    start = layer.directions[:2]
    zeros = torch.zeros(2, layer.scorer.factors.left.shape[0], dtype=torch.bool)
    zeros[0, : start.shape[1] - 2] = True  # b - 2 rows: no kernel to fit
    assert torch.equal(refit_on(layer.scorer, start, zeros), start)


def test_predicted_zeros_are_small_entries_on_predicted_inactive_neurons() -> None:
    layer = _layer()
    selection = _selection(layer.scorer, layer.directions)
    zeros = predicted_zeros(layer.scorer, selection.directions, selection.found)
    _, q_inv = layer.scorer.score(selection.directions)
    inactive = layer.scorer.inactive(q_inv).T
    columns = (selection.directions @ layer.scorer.factors.left.T).abs()
    small = columns <= layer.scorer.tolerance.thresholds(selection.directions)[:, None]
    assert torch.equal(zeros, inactive & small)
    assert 0 < int(zeros.sum()) < int(small.sum())


def test_joint_refit_moves_tilted_directions_towards_the_truth_and_raises_the_matching() -> None:
    layer = _layer(width=1200)
    tilted = _tilted(layer.directions, 0.995)
    before = _selection(layer.scorer, tilted)
    after = joint_refit(layer.scorer, before)
    assert after.sparsity_matching > before.sparsity_matching + 0.3
    assert float(_cosines(after.directions, layer.directions).min()) > 0.9999
    assert torch.equal(after.found, before.found)


def test_joint_refit_keeps_a_row_that_a_wrong_pattern_would_move_far() -> None:
    # narrower: the tilted inputs predict the pattern badly and one row's re-fit lands at 0.81
    # of the truth; that row stays where it was
    layer = _layer()
    tilted = _tilted(layer.directions, 0.995)
    after = joint_refit(layer.scorer, _selection(layer.scorer, tilted))
    assert float(_cosines(after.directions, layer.directions).min()) >= 0.995 - 1e-12
    assert bool(((after.directions * tilted).sum(dim=1).abs() >= MIN_COS).all())


def test_joint_refit_keeps_the_completion_orthogonal_to_the_refitted_rows() -> None:
    layer = _layer()
    before = _selection(layer.scorer, _tilted(layer.directions[:5], 0.97))
    after = joint_refit(layer.scorer, before)
    assert int(after.found.sum()) == 5 and not bool(after.found[5])
    assert float((after.directions[5] @ after.directions[:5].T).abs().max()) < 1e-12


def test_joint_refit_returns_the_selection_when_nothing_is_found_or_no_time_is_left() -> None:
    layer = _layer()
    empty = _selection(layer.scorer, layer.directions[:0])
    assert joint_refit(layer.scorer, empty) is empty
    tilted = _selection(layer.scorer, _tilted(layer.directions, 0.97))
    assert joint_refit(layer.scorer, tilted, deadline=Deadline(0.0)) is tilted
    assert joint_refit(layer.scorer, tilted, iterations=0) is tilted


def test_joint_refit_rejects_negative_iterations() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match="iterations must be >= 0, got -1"):
        joint_refit(layer.scorer, _selection(layer.scorer, layer.directions), iterations=-1)


def test_finish_noisy_refits_only_wide_layers_with_most_of_the_batch_found() -> None:
    narrow = _layer()
    tilted = _selection(narrow.scorer, _tilted(narrow.directions, 0.97))
    pruned = prune_doubtful(narrow.scorer, tilted)
    kept = finish_noisy(narrow.scorer, tilted, width=999, deadline=Deadline.never())
    assert torch.equal(kept.directions, pruned.directions)
    wide = _layer(width=1200)
    complete = _selection(wide.scorer, _tilted(wide.directions, 0.995))
    refitted = finish_noisy(wide.scorer, complete, width=1200, deadline=Deadline.never())
    expected = blend_refit(wide.scorer, joint_refit(wide.scorer, prune_doubtful(wide.scorer, complete)))
    assert torch.equal(refitted.directions, expected.directions)
    assert refitted.sparsity_matching > complete.sparsity_matching
    b = wide.directions.shape[0]
    few = math.ceil(REFIT_MIN_FOUND * b) - 1
    partial = _selection(wide.scorer, _tilted(wide.directions[:few], 0.995))
    assert torch.equal(
        finish_noisy(wide.scorer, partial, width=1200, deadline=Deadline.never()).directions,
        prune_doubtful(wide.scorer, partial).directions,
    )
