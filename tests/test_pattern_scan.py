"""The one breakpoint scan (``fl_attack.pipeline.search.pattern_scan``): a missing sample's direction from its line."""

from __future__ import annotations

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.pattern_scan import line_pattern_kernels
from fl_attack.pipeline.spectrum.decompose import decompose
from tests.synthetic_layer import relu_layer_update

BATCH, WIDTH, FEATURES = 8, 80, 40


def _missing_sample_line() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``left``, the line's ``slope`` towards the last sample's input, the ``bias``, and that sample's true direction."""
    inputs = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    update = relu_layer_update(inputs, width=WIDTH, seed=5)
    factors = decompose(update.weight_grad.double(), batch_size=BATCH)
    right = factors.right.double()
    columns = torch.linalg.inv(update.inputs @ torch.linalg.pinv(right)).T
    columns = columns / columns.norm(dim=1, keepdim=True)
    # the last sample's input is R^T beta with beta orthogonal to the other columns: one line through 0
    complete, _ = torch.linalg.qr(columns[:-1].T, mode="complete")
    dual = complete[:, -1]
    if float((right.T @ dual) @ update.inputs[-1]) < 0:
        dual = -dual  # the sample lies at alpha > 0
    slope = update.weight.double() @ (right.T @ dual)
    return factors.left, slope, update.bias.double(), columns[-1]


def _finds(hits: list[tuple[float, torch.Tensor]], direction: torch.Tensor) -> bool:
    return any(abs(float(vector @ direction)) > 1 - 1e-9 for _, vector in hits)


def test_the_scan_finds_the_missing_sample_on_its_side_of_the_line_only() -> None:
    left, slope, bias, truth = _missing_sample_line()
    options = {"minimum": BATCH - 1, "limit": 1e-6, "chunk": 16}
    assert _finds(line_pattern_kernels(left, slope, bias, **options), truth)
    assert _finds(line_pattern_kernels(left, slope, bias, positive_only=True, **options), truth)
    # the sample lies at alpha > 0 of slope, so at alpha < 0 of -slope: not scanned there
    assert _finds(line_pattern_kernels(left, -slope, bias, **options), truth)
    assert not _finds(line_pattern_kernels(left, -slope, bias, positive_only=True, **options), truth)


def test_fresh_grams_find_the_same_patterns_as_the_running_sum() -> None:
    left, slope, bias, truth = _missing_sample_line()
    options = {"minimum": BATCH - 1, "limit": 1e-6, "chunk": 16, "positive_only": True}
    running = line_pattern_kernels(left, slope, bias, **options)
    fresh = line_pattern_kernels(left, slope, bias, fresh_grams=True, **options)
    assert len(running) == len(fresh) and _finds(fresh, truth)
    for (_, first), (_, second) in zip(running, fresh, strict=True):
        assert abs(float(first @ second)) > 1 - 1e-9


def test_an_expired_deadline_scans_nothing() -> None:
    left, slope, bias, _ = _missing_sample_line()
    assert (
        line_pattern_kernels(
            left, slope, bias, minimum=BATCH - 1, limit=1e-6, chunk=16, deadline=Deadline(0.0)
        )
        == []
    )
