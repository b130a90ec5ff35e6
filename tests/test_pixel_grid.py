"""The 8-bit pixel grid: rows of normalized 8-bit images are certified and rounded to their pixels;
blends, extrapolations of near copies, features and few-valued data are not."""

from __future__ import annotations

import pytest
import torch
from test_claims_property import _assert_every_row_is_a_true_sample, _attack, _local_training_update

import fl_attack.attacks.spear as spear_module
from fl_attack.audit.verdict import decide_verdict
from fl_attack.pipeline.selection.pixel_grid import MAX_DEVIATION, pixel_grid
from fl_attack.vocabulary import STATUS_OK, VERDICT_EXACT

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)


def _pixels(b: int, pixels: int, seed: int, channels: int = 3) -> torch.Tensor:
    """``(b, channels, pixels)`` integer levels in ``[0, 255]`` that use the whole range."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 256, (b, channels, pixels), generator=generator).double()
    levels[0, :, 0], levels[0, :, 1] = 0.0, 255.0
    return levels


def _normalize(levels: torch.Tensor, *, channels_last: bool = False) -> torch.Tensor:
    channels = levels.shape[1]
    mean = torch.tensor(MEAN[:channels], dtype=torch.float64).view(1, -1, 1)
    std = torch.tensor(STD[:channels], dtype=torch.float64).view(1, -1, 1)
    x = (levels / 255 - mean) / std
    if channels_last:
        x = x.transpose(1, 2)
    return x.reshape(levels.shape[0], -1)


def _step(channel: int = 0) -> float:
    return 1 / (255 * STD[channel])


@pytest.mark.parametrize(
    ("channels", "channels_last", "layout"),
    [
        (3, False, "channels-first"),
        (3, True, "channels-last"),
        (1, False, "grey"),
    ],
)
def test_noisy_rows_of_normalized_images_are_rounded_to_their_exact_pixels(
    channels: int, channels_last: bool, layout: str
) -> None:
    truth = _normalize(_pixels(6, 100, seed=1, channels=channels), channels_last=channels_last)
    noise = (
        0.02
        * _step()
        * torch.randn(truth.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    )
    grid = pixel_grid(truth + noise)
    assert grid is not None and grid.layout == layout and len(grid.channels) == channels
    assert grid.span == 256 and grid.deviation < MAX_DEVIATION
    snapped = grid.snap(truth + noise)
    # every value on its own level: the rest is the fitted lattice's error, far below a level
    assert float((snapped - truth).abs().max()) < 0.01 * min(_step(c) for c in range(channels))
    # the fitted lattice is the normalization's: step 1 / (255 std) per channel
    for index, lattice in enumerate(grid.channels):
        assert lattice.step == pytest.approx(_step(index), rel=1e-4)


@pytest.mark.parametrize("share", [0.5, 0.1, 0.01])
def test_a_blend_of_two_images_fits_no_grid(share: float) -> None:
    truth = _normalize(_pixels(6, 100, seed=3))
    rows = truth.clone()
    rows[2] = (1 - share) * truth[2] + share * truth[3]
    assert pixel_grid(rows) is None


def test_rows_off_by_a_third_of_a_level_somewhere_fit_no_grid() -> None:
    rows = _normalize(_pixels(6, 100, seed=4))
    rows[4, 17] += 0.3 * _step()
    assert pixel_grid(rows) is None


def test_features_and_few_valued_data_fit_no_grid() -> None:
    generator = torch.Generator().manual_seed(5)
    assert pixel_grid(torch.randn(8, 300, generator=generator, dtype=torch.float64)) is None
    binary = (torch.rand(8, 300, generator=generator) < 0.5).double()
    assert pixel_grid(binary) is None  # two levels: a half-blend would fit a finer lattice
    dark = _normalize(torch.randint(0, 100, (8, 3, 100), generator=generator).double())
    assert pixel_grid(dark) is None  # fewer than 128 levels spanned: a half-blend would fit 256
    assert pixel_grid(_normalize(_pixels(2, 20, seed=5))) is None  # too few values per channel
    nan = _normalize(_pixels(6, 100, seed=5))
    nan[0, 0] = float("nan")
    assert pixel_grid(nan) is None
    with pytest.raises(ValueError, match="non-empty"):
        pixel_grid(torch.zeros(300))


def test_the_extrapolation_of_near_copies_is_counted_and_distinct_images_give_none() -> None:
    levels = _pixels(6, 100, seed=6)
    rows = _normalize(levels)
    grid = pixel_grid(rows)
    assert grid is not None and grid.extrapolated_pairs(rows) == 0
    near = levels.clone()
    shift = torch.randint(-2, 3, levels[0].shape, generator=torch.Generator().manual_seed(6)).double()
    interior = (levels[0] >= 4) & (levels[0] <= 251)
    near[1] = levels[0] + shift * interior  # a near copy, equal at the extreme levels
    near_rows = _normalize(near)
    grid = pixel_grid(near_rows)
    assert grid is not None
    # 2 x_0 - x_1 and 2 x_1 - x_0 stay within the 256 levels: the grid cannot tell them from the copies
    assert grid.extrapolated_pairs(near_rows) == 2


def _images_update(*, seed: int, epochs: int, lr: float):  # type: ignore[no-untyped-def]
    truth = _normalize(_pixels(8, 64, seed=seed))
    update = _local_training_update(
        truth, width=100, seed=seed, batch=4, epochs=epochs, lr=lr, momentum=0.0, decay=0.0
    )
    return truth, update


def test_several_local_epochs_of_images_are_claimed_exact_through_their_pixel_grid() -> None:
    truth, update = _images_update(seed=0, epochs=3, lr=0.1)
    rec = _attack(update)
    assert rec is not None and rec.complete and rec.self_check is not None and rec.self_check.passed
    assert rec.stats["stopped_by"] == "pixel_grid" and rec.stats["pixel_grid"] == "channels-first"
    assert rec.self_check.certificate.startswith("every value of every row lies on an 8-bit pixel grid")
    _assert_every_row_is_a_true_sample(rec, truth)
    assert float(torch.cdist(rec.inputs, truth).min(dim=1).values.max()) < 1e-9  # the exact pixels
    assert float(rec.confidence.min()) == 1.0
    verdict = decide_verdict(
        status=STATUS_OK,
        error=None,
        attack=rec.summary(),
        signature=lambda: None,
        magnitude_concentration=None,
        input_space="inputs",
    )
    assert verdict.verdict == VERDICT_EXACT
    assert "8-bit pixel grid" in verdict.reason and "do not confirm them" in verdict.reason


def test_without_the_grid_the_same_update_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim above rests on the grid: W_0's patterns alone refuse these three epochs."""
    truth, update = _images_update(seed=0, epochs=3, lr=0.1)
    monkeypatch.setattr(spear_module, "pixel_grid", lambda inputs: None)
    rec = _attack(update)
    assert rec is not None and not rec.complete
    assert "pixel_grid" not in rec.stats


def test_a_blended_selection_on_images_is_not_certified(monkeypatch: pytest.MonkeyPatch) -> None:
    """A selection holding a blend of two images reads no grid, so nothing is claimed."""
    truth, update = _images_update(seed=1, epochs=3, lr=0.1)
    seen: list[bool] = []
    real = spear_module.pixel_grid

    def blended(inputs: torch.Tensor):  # type: ignore[no-untyped-def]
        mixed = inputs.clone()
        mixed[0] = 0.7 * inputs[0] + 0.3 * inputs[1]
        grid = real(mixed)
        seen.append(grid is None)
        return grid

    monkeypatch.setattr(spear_module, "pixel_grid", blended)
    rec = _attack(update)
    assert rec is not None and seen and all(seen)
    assert not rec.complete
