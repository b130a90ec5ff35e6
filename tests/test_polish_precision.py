"""Polishing a complete selection, and the ground-truth-free precision of each recovered row.

Uses the float32-gradient cases of :mod:`tests.test_selection` (true directions from the
client's true ``dL/dZ``).
"""

from __future__ import annotations

import math

import pytest
import torch

from fl_attack.pipeline.selection.polish import polish
from fl_attack.pipeline.selection.precision import estimated_row_errors, precision_stats
from fl_attack.pipeline.selection.select import Selection
from tests.test_selection import _truth


def test_polish_refits_each_direction_on_its_samples_inactive_neurons() -> None:
    truth = _truth("photo-patches", 10, 200, 0)
    b = truth.batch
    scorer = truth.scorer()
    gen = torch.Generator().manual_seed(2)
    # each true direction moved by ~1e-5 (as rounding noise of an update leaves them)
    blurred = truth.directions + 1e-5 * torch.randn(b, b, generator=gen, dtype=torch.float64)
    per_sample, q_inv = scorer.score(blurred)
    rough = Selection(blurred, torch.ones(b, dtype=torch.bool), q_inv @ truth.factors.right, per_sample, 1.0)

    polished = polish(scorer, rough)

    def worst_error(selection: Selection) -> float:
        order = torch.cdist(truth.inputs, selection.inputs).argmin(dim=1)
        return float(((selection.inputs[order] - truth.inputs).norm(dim=1) / truth.inputs.norm(dim=1)).max())

    assert worst_error(rough) > 1e-5
    assert worst_error(polished) < 1e-3 * worst_error(rough)
    assert bool((polished.per_sample >= rough.per_sample).all())
    # an incomplete selection is returned as it is
    partial = Selection(blurred, torch.arange(b) < b - 1, rough.inputs, per_sample, 1.0)
    assert polish(scorer, partial) is partial


def test_estimated_row_errors_track_the_true_errors_of_a_float32_gradient() -> None:
    truth = _truth("photo-patches", 10, 200, 0)
    b = truth.batch
    scorer = truth.scorer()
    per_sample, q_inv = scorer.score(truth.directions)
    exact = Selection(
        truth.directions, torch.ones(b, dtype=torch.bool), q_inv @ truth.factors.right, per_sample, 1.0
    )

    estimated = estimated_row_errors(scorer, exact)
    order = torch.cdist(truth.inputs, exact.inputs).argmin(dim=1)
    measured = (exact.inputs[order] - truth.inputs).norm(dim=1) / truth.inputs.norm(dim=1)

    # the float32 rounding leaves errors of ~1e-7; the estimate is within a small factor of each
    assert float(measured.max()) < 1e-5
    ratio = estimated[order] / measured
    assert bool((ratio > 0.3).all()) and bool((ratio < 10.0).all()), ratio
    stats = precision_stats(scorer, exact)
    assert stats["estimated_max_relative_error"] == pytest.approx(float(estimated.max()))
    assert len(stats["estimated_relative_errors"]) == b
    # a row that recovered nothing has no precision
    empty = Selection(
        exact.directions, exact.found, exact.inputs * torch.arange(b).ne(0)[:, None], per_sample, 1.0
    )
    assert math.isinf(float(estimated_row_errors(scorer, empty)[0]))
