"""The box-fill scale prior (fl_attack.image_priors.pixel_range_scale) and the luma/chroma TV of denoise_images."""

from __future__ import annotations

import math

import pytest
import torch

from fl_attack.image_priors.denoise import denoise_images, opponent_tv
from fl_attack.image_priors.pixel_range_scale import (
    BoxFillCalibration,
    box_fill_scales,
    calibrate_box_fill,
    log_box_fill,
)

MEAN, STD = (0.5,), (0.25,)


def _normalised(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels - MEAN[0]) / STD[0]


def _flat_calibration(std: float = 0.1) -> BoxFillCalibration:
    grid = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    return BoxFillCalibration(
        log_snr=grid, mean=torch.zeros(3, dtype=torch.float64), std=torch.full((3,), std)
    )


def test_log_box_fill_is_the_reach_toward_the_pixel_range() -> None:
    touching = torch.full((1, 1, 4, 4), 0.5, dtype=torch.float64)
    touching[0, 0, 0, 0] = 1.0  # one pixel on the top of the range
    inside = torch.full((1, 1, 4, 4), 0.5, dtype=torch.float64)
    inside[0, 0, 1, 1] = 0.25  # halfway from the mean (0.5) to 0
    inside[0, 0, 2, 2] = 0.6  # a fifth of the way up
    fills = log_box_fill(_normalised(torch.cat([touching, inside])), mean=MEAN, std=STD)
    torch.testing.assert_close(fills, torch.tensor([0.0, math.log(0.5)], dtype=torch.float64))
    # the fill scales with the image: half the image reaches half as far
    halved = log_box_fill(_normalised(touching) / 2, mean=MEAN, std=STD)
    assert float(halved[0]) == pytest.approx(math.log(0.5), abs=1e-12)


def test_log_box_fill_uses_each_channels_own_limits() -> None:
    mean, std = (0.25, 0.5), (0.5, 0.25)
    pixels = torch.tensor([0.25, 0.5], dtype=torch.float64).view(1, 2, 1, 1).repeat(1, 1, 2, 2)
    pixels[0, 0, 0, 0] = 0.0  # channel 0 at the bottom of its range
    pixels[0, 1, 0, 0] = 0.75  # channel 1 halfway up
    normalised = (pixels - torch.tensor(mean).view(1, 2, 1, 1)) / torch.tensor(std).view(1, 2, 1, 1)
    assert float(log_box_fill(normalised, mean=mean, std=std)[0]) == pytest.approx(0.0, abs=1e-12)


def test_calibration_interpolates_and_holds_its_ends() -> None:
    calibration = BoxFillCalibration(
        log_snr=torch.tensor([0.0, 2.0], dtype=torch.float64),
        mean=torch.tensor([1.0, 3.0], dtype=torch.float64),
        std=torch.tensor([0.5, 0.1], dtype=torch.float64),
    )
    mean, std = calibration.at(torch.tensor([-1.0, 0.0, 0.5, 2.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(mean, torch.tensor([1.0, 1.0, 1.5, 3.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(std, torch.tensor([0.5, 0.5, 0.4, 0.1, 0.1], dtype=torch.float64))


def test_calibrate_box_fill_measures_touching_images_near_zero_at_high_snr() -> None:
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(40, 1, 4, 4, generator=generator, dtype=torch.float64).repeat_interleave(4, 2)
    pixels = pixels.repeat_interleave(4, 3)
    pixels[:, :, :4, :4] = 1.0  # every image has a block at the top of the range
    calibration = calibrate_box_fill(_normalised(pixels), mean=MEAN, std=STD, snrs=[1.0, 1000.0], seed=0)
    torch.testing.assert_close(
        calibration.log_snr, torch.tensor([0.0, math.log(1000.0)], dtype=torch.float64)
    )
    # almost no noise: TV hardly moves the top block, the fill stays at the range (log 0)
    assert abs(float(calibration.mean[1])) < 0.01
    assert float(calibration.std[1]) < 0.01
    # at SNR 1 the statistic spreads out
    assert float(calibration.std[0]) > 10 * float(calibration.std[1])
    again = calibrate_box_fill(_normalised(pixels), mean=MEAN, std=STD, snrs=[1000.0, 1.0], seed=0)
    torch.testing.assert_close(again.mean, calibration.mean, rtol=0, atol=0)


def _scales(
    row: torch.Tensor, *, noise: float, scale_std: float, shape: tuple[int, int, int]
) -> torch.Tensor:
    return box_fill_scales(
        row,
        row_noise=torch.full((row.shape[0],), noise, dtype=torch.float64),
        scale_std=torch.full((row.shape[0],), scale_std, dtype=torch.float64),
        calibration=_flat_calibration(std=0.1),
        image_shape=shape,
        mean=MEAN,
        std=STD,
    )


def test_box_fill_scales_undo_a_scale_the_bias_gradient_cannot_pin_down() -> None:
    pixels = torch.full((1, 1, 8, 8), 0.5, dtype=torch.float64)
    pixels[..., :4, :4] = 1.0
    pixels[..., 4:, 4:] = 0.1
    row = _normalised(pixels).reshape(1, -1) / 2  # the recovered row is the image at half its size
    # a useless bias gradient (huge scale std): the box fill sets the scale, almost exactly 2
    loose = _scales(row, noise=1e-4, scale_std=1e3, shape=(1, 8, 8))
    assert float(loose[0]) == pytest.approx(2.0, rel=1e-3)
    # a bias gradient as sure as the box fill (both std 0.1): the product of the Gaussians halves the log step
    even = _scales(row, noise=1e-4, scale_std=0.1, shape=(1, 8, 8))
    assert float(even[0]) == pytest.approx(math.sqrt(2.0), rel=1e-3)
    # an exact bias gradient: no change
    assert float(_scales(row, noise=1e-4, scale_std=0.0, shape=(1, 8, 8))[0]) == 1.0


def test_box_fill_bad_input_is_rejected_with_a_clear_error() -> None:
    row = torch.zeros(2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"image_shape \(1, 4, 5\) has 20 entries but inputs have 16"):
        _scales(row, noise=1.0, scale_std=1.0, shape=(1, 4, 5))
    with pytest.raises(ValueError, match="row_noise must be positive and finite"):
        _scales(row, noise=0.0, scale_std=1.0, shape=(1, 4, 4))
    with pytest.raises(ValueError, match="scale_std must be non-negative and finite"):
        _scales(row, noise=1.0, scale_std=-1.0, shape=(1, 4, 4))
    with pytest.raises(ValueError, match=r"need one value per input \(2\), got 3 and 2"):
        box_fill_scales(
            row,
            row_noise=torch.ones(3),
            scale_std=torch.ones(2),
            calibration=_flat_calibration(),
            image_shape=(1, 4, 4),
            mean=MEAN,
            std=STD,
        )
    with pytest.raises(ValueError, match=r"channel means must lie strictly inside \(0, 1\)"):
        log_box_fill(torch.zeros(1, 1, 4, 4), mean=(0.0,), std=STD)
    with pytest.raises(ValueError, match="std must be positive and finite"):
        log_box_fill(torch.zeros(1, 1, 4, 4), mean=MEAN, std=(0.0,))
    with pytest.raises(ValueError, match="images contain NaN or Inf"):
        log_box_fill(torch.full((1, 1, 4, 4), math.nan), mean=MEAN, std=STD)
    with pytest.raises(ValueError, match="at least two distinct positive ratios"):
        calibrate_box_fill(torch.ones(3, 1, 4, 4), mean=MEAN, std=STD, snrs=[2.0, 2.0])
    with pytest.raises(ValueError, match="need at least 2 images"):
        calibrate_box_fill(torch.ones(1, 1, 4, 4), mean=MEAN, std=STD, snrs=[1.0, 2.0])
    with pytest.raises(ValueError, match="an all-zero image has no signal-to-noise ratio"):
        calibrate_box_fill(torch.zeros(2, 1, 4, 4), mean=MEAN, std=STD, snrs=[1.0, 2.0])
    with pytest.raises(ValueError, match="log_snr must be strictly increasing"):
        BoxFillCalibration(log_snr=torch.tensor([1.0, 0.0]), mean=torch.zeros(2), std=torch.ones(2))
    with pytest.raises(ValueError, match="the calibration's std must be positive"):
        BoxFillCalibration(log_snr=torch.tensor([0.0, 1.0]), mean=torch.zeros(2), std=torch.zeros(2))
    with pytest.raises(ValueError, match="one common length >= 2"):
        BoxFillCalibration(log_snr=torch.tensor([0.0]), mean=torch.zeros(1), std=torch.ones(1))


RGB_MEAN, RGB_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _rgb_rows(pixels: torch.Tensor) -> torch.Tensor:
    return ((pixels - 0.5) / 0.25).reshape(pixels.shape[0], -1)


def test_luma_chroma_tv_denoises_colour_noise_by_the_chroma_weight_alone() -> None:
    generator = torch.Generator().manual_seed(2)
    gray = torch.full((1, 3, 16, 16), 0.6, dtype=torch.float64)  # constant luma: luma TV leaves it
    # noise along red - blue only: pure chroma in the opponent basis
    wiggle = 0.05 * torch.randn(1, 1, 16, 16, generator=generator, dtype=torch.float64)
    noisy = gray + torch.cat([wiggle, torch.zeros_like(wiggle), -wiggle], dim=1)
    clean = _rgb_rows(gray)

    def error(strength: float, chroma: float) -> float:
        out = denoise_images(
            _rgb_rows(noisy),
            row_noise=torch.tensor([0.2]),
            image_shape=(3, 16, 16),
            mean=RGB_MEAN,
            std=RGB_STD,
            strength=strength,
            chroma_strength=chroma,
        )
        return float((out - clean).square().mean())

    before = float((_rgb_rows(noisy) - clean).square().mean())
    # the luma weight does not touch chroma noise; the chroma weight removes most of it
    assert error(1e-9, 1e-9) == pytest.approx(before, rel=1e-6)
    assert error(5.0, 1e-9) == pytest.approx(before, rel=1e-6)
    assert error(1e-9, 5.0) < 0.1 * before


def test_luma_chroma_tv_needs_three_channels_and_a_positive_weight() -> None:
    rows = torch.zeros(1, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="chroma_strength needs 3 colour channels, got 1"):
        denoise_images(
            rows, row_noise=torch.ones(1), image_shape=(1, 4, 4), mean=MEAN, std=STD, chroma_strength=1.0
        )
    rgb = torch.zeros(1, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="chroma_strength must be positive and finite"):
        denoise_images(
            rgb,
            row_noise=torch.ones(1),
            image_shape=(3, 4, 4),
            mean=RGB_MEAN,
            std=RGB_STD,
            chroma_strength=0.0,
        )


def test_opponent_tv_keeps_constant_images_and_needs_three_channels() -> None:
    constant = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64).view(1, 3, 1, 1).repeat(2, 1, 6, 6)
    out = opponent_tv(constant, luma_weight=torch.tensor([0.3, 1.0]), chroma_weight=torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(out, constant, rtol=0, atol=1e-12)
    with pytest.raises(
        ValueError, match=r"opponent_tv needs \(B, 3, H, W\) images, got torch.Size\(\[1, 1, 4, 4\]\)"
    ):
        opponent_tv(torch.zeros(1, 1, 4, 4), luma_weight=torch.ones(1), chroma_weight=torch.ones(1))
