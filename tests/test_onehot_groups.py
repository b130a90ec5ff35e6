"""Detecting one-hot column groups from a first-layer update: found on Adult, never on images."""

from __future__ import annotations

import pytest
import torch

from fl_attack.pipeline.side_information.onehot_groups import NO_GROUPS, detect_onehot_groups
from fl_attack.simulate.victims import build_victim, client_gradient
from tests.onehot_adult_rows import GROUP_RANGES, INPUT_DIM, adult_batch

FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


def _update(
    x: torch.Tensor, labels: torch.Tensor, *, seed: int, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    model = build_victim("spear++", input_dim=x.shape[1], width=200, num_classes=classes, depth=4, seed=seed)
    weight_grad, bias_grad = client_gradient(model, x, labels)
    return weight_grad.double(), bias_grad.double()


def _detect(
    weight_grad: torch.Tensor, bias_grad: torch.Tensor, x: torch.Tensor
) -> tuple[tuple[int, ...], ...]:
    live = x.abs().sum(dim=0) > 0
    return detect_onehot_groups(weight_grad, bias_grad, live=live, unit_roundoff=FLOAT32_EPS).groups


@pytest.mark.parametrize("seed", [3, 9])
def test_adult_groups_are_the_schema_groups_live_in_the_batch(seed: int) -> None:
    x, labels = adult_batch(seed)
    weight_grad, bias_grad = _update(x, labels, seed=seed, classes=2)
    live = x.abs().sum(dim=0) > 0
    expected = tuple(tuple(c for c in range(start, stop) if bool(live[c])) for start, stop in GROUP_RANGES)
    found = detect_onehot_groups(weight_grad, bias_grad, live=live, unit_roundoff=FLOAT32_EPS)
    assert found.groups == expected
    assert len(found) == 8 and found.columns == tuple(c for group in expected for c in group)
    # every detected range holds its group and no live column of another feature
    for (start, stop), group in zip(found.ranges, found.groups, strict=True):
        assert start <= group[0] and group[-1] < stop
        assert all(c in group for c in range(start, stop) if bool(live[c]))


def test_a_group_off_by_one_thousandth_in_one_row_is_not_detected() -> None:
    x, labels = adult_batch(9)
    row_hot = int(torch.nonzero(x[0, 10:26]).flatten()[0]) + 10  # the education column of row 0
    x[0, row_hot] = 1.001
    weight_grad, bias_grad = _update(x, labels, seed=9, classes=2)
    groups = _detect(weight_grad, bias_grad, x)
    assert len(groups) == 7 and all(row_hot not in group for group in groups)


def test_noise_on_the_update_hides_every_group() -> None:
    x, labels = adult_batch(3)
    weight_grad, bias_grad = _update(x, labels, seed=3, classes=2)
    generator = torch.Generator().manual_seed(0)
    scale = 1e-3 * float(weight_grad.abs().max())  # far below DP-SGD noise levels
    noisy = weight_grad + scale * torch.randn(weight_grad.shape, generator=generator, dtype=torch.float64)
    noisy_bias = bias_grad + scale * torch.randn(bias_grad.shape, generator=generator, dtype=torch.float64)
    assert _detect(noisy, noisy_bias, x) == ()


@pytest.mark.parametrize("seed", [0, 1])
def test_images_show_no_group(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (20,), generator=generator)
    # normalised colour patches: dense, both signs
    normalised = torch.randn(20, 3 * 16 * 16, generator=generator)
    assert _detect(*_update(normalised, labels, seed=seed, classes=10), normalised) == ()
    # raw digits: pixels in [0, 1], a dead border, strokes
    pixels = (torch.rand(20, 28, 28, generator=generator) - 0.6).clamp_min(0) * 2.5
    pixels[:, :4], pixels[:, -4:], pixels[:, :, :4], pixels[:, :, -4:] = 0.0, 0.0, 0.0, 0.0
    raw = pixels.clamp_max(1.0).reshape(20, -1)
    assert _detect(*_update(raw, labels, seed=seed, classes=10), raw) == ()


def test_a_zero_bias_gradient_or_bad_roundoff_detects_nothing() -> None:
    x, labels = adult_batch(9)
    weight_grad, bias_grad = _update(x, labels, seed=9, classes=2)
    live = torch.ones(INPUT_DIM, dtype=torch.bool)
    zero = torch.zeros_like(bias_grad)
    assert detect_onehot_groups(weight_grad, zero, live=live, unit_roundoff=FLOAT32_EPS) is NO_GROUPS
    assert detect_onehot_groups(weight_grad, bias_grad, live=live, unit_roundoff=0.0) is NO_GROUPS


def test_shapes_that_do_not_agree_are_refused() -> None:
    weight_grad, bias_grad = torch.zeros(4, 6, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"must agree, got \(4, 6\), \(3,\) and \(6,\)"):
        detect_onehot_groups(
            weight_grad, bias_grad[:3], live=torch.ones(6, dtype=torch.bool), unit_roundoff=1e-7
        )
    with pytest.raises(ValueError, match="must agree"):
        detect_onehot_groups(
            weight_grad[0], bias_grad, live=torch.ones(6, dtype=torch.bool), unit_roundoff=1e-7
        )
