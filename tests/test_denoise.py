"""The noise model of recovered rows under DP noise, the scale prior and the TV image prior."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from experiments.dp_ceilings import ceiling_facts
from experiments.dp_gap import parse_seeds
from experiments.dp_prior import box_fill_calibration, denoised_attack, size_prior
from fl_attack.data.images import ImageData
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.image_priors.denoise import (
    denoise_images,
    gradient_columns,
    prior_scales,
    row_noise_std,
    scale_uncertainty,
    tv_denoise,
)

MEAN, STD = (0.5,), (0.25,)
SHAPE = (1, 16, 16)


def _blocky_images(b: int, generator: torch.Generator) -> torch.Tensor:
    """``(b, 1, 16, 16)`` piecewise-constant images in [0, 1] (4x4 blocks)."""
    blocks = torch.rand(b, 1, 4, 4, generator=generator, dtype=torch.float64)
    return blocks.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)


def _sparse_columns(b: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """``(b, m)`` gradient columns with ReLU-like zeros (about half the entries)."""
    values = torch.randn(b, m, generator=generator, dtype=torch.float64)
    return values * (torch.rand(b, m, generator=generator, dtype=torch.float64) > 0.5)


def _problem(seed: int = 0, b: int = 3, m: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = _blocky_images(b, generator)
    inputs = ((pixels - MEAN[0]) / STD[0]).reshape(b, -1)
    return inputs, _sparse_columns(b, m, generator), pixels


def test_gradient_columns_are_exact_without_noise() -> None:
    inputs, columns, _ = _problem()
    recovered = gradient_columns(columns.T @ inputs, inputs)
    assert torch.allclose(recovered, columns, atol=1e-10)


def test_row_noise_std_matches_the_spread_of_least_squares_rows() -> None:
    inputs, columns, _ = _problem()
    sigma = 0.3
    predicted = row_noise_std(weight_grad=columns.T @ inputs, inputs=inputs, noise_std=sigma, columns=columns)
    generator = torch.Generator().manual_seed(1)
    clean = columns.T @ inputs
    errors = []
    for _ in range(200):
        noisy = clean + sigma * torch.randn(clean.shape, generator=generator, dtype=torch.float64)
        errors.append(torch.linalg.solve(columns @ columns.T, columns @ noisy) - inputs)
    measured = torch.stack(errors).std(dim=(0, 2))
    assert torch.allclose(predicted, measured, rtol=0.05)


def test_row_noise_std_reads_the_columns_back_from_the_update() -> None:
    inputs, columns, _ = _problem()
    update = columns.T @ inputs
    known = row_noise_std(weight_grad=update, inputs=inputs, noise_std=0.1, columns=columns)
    read_back = row_noise_std(weight_grad=update, inputs=inputs, noise_std=0.1)
    assert torch.allclose(known, read_back, rtol=1e-9)


def test_scale_uncertainty_matches_the_spread_of_bias_scales() -> None:
    inputs, columns, _ = _problem()
    sigma = 1e-3
    update = columns.T @ inputs
    bias = columns.sum(dim=0)
    predicted = scale_uncertainty(weight_grad=update, bias_grad=bias, inputs=inputs, noise_std=sigma)
    unit = columns / columns.norm(dim=1, keepdim=True)
    generator = torch.Generator().manual_seed(2)
    scales = []
    for _ in range(400):
        noisy = bias + sigma * torch.randn(bias.shape, generator=generator, dtype=torch.float64)
        scales.append(torch.linalg.lstsq(unit.T, noisy[:, None]).solution.squeeze(1))
    measured = torch.stack(scales).std(dim=0) / columns.norm(dim=1)
    assert torch.allclose(predicted, measured, rtol=0.1)


def test_prior_scales_is_the_product_of_two_gaussians() -> None:
    rows = torch.stack([torch.full((64,), 2.0), torch.full((64,), 1.0)]).double()
    factors = prior_scales(
        rows,
        row_noise=torch.zeros(2, dtype=torch.float64),
        scale_std=torch.tensor([0.3, 0.3], dtype=torch.float64),
        log_rms_mean=0.0,
        log_rms_std=0.3,
    )
    # equal stds: halfway (in log) between the measured rms and the prior's
    assert factors[0].item() == pytest.approx(2.0**-0.5, rel=1e-12)
    assert factors[1].item() == pytest.approx(1.0, rel=1e-12)


def test_prior_scales_subtracts_the_noise_power() -> None:
    rows = torch.full((1, 64), math.sqrt(2.0), dtype=torch.float64)  # rms sqrt(2): signal 1, noise 1
    factors = prior_scales(
        rows, row_noise=torch.ones(1), scale_std=torch.ones(1), log_rms_mean=0.0, log_rms_std=1.0
    )
    assert factors.item() == pytest.approx(1.0, rel=1e-12)


def test_denoised_estimate_beats_least_squares_on_a_noisy_update() -> None:
    inputs, columns, pixels = _problem(seed=3)
    sigma = 1.5
    generator = torch.Generator().manual_seed(4)
    clean = columns.T @ inputs
    noisy = clean + sigma * torch.randn(clean.shape, generator=generator, dtype=torch.float64)
    least_squares = torch.linalg.solve(columns @ columns.T, columns @ noisy)
    noise = row_noise_std(weight_grad=noisy, inputs=least_squares, noise_std=sigma, columns=columns)
    denoised = denoise_images(least_squares, row_noise=noise, image_shape=SHAPE, mean=MEAN, std=STD)
    ls_error = float((least_squares - inputs).square().mean())
    denoised_error = float((denoised - inputs).square().mean())
    # measured at this seed: mean squared error 0.1189 -> 0.0472 (4.0 dB)
    assert 10 * math.log10(ls_error / denoised_error) > 3.5
    denoised_pixels = denoised * STD[0] + MEAN[0]
    assert float(denoised_pixels.min()) >= 0.0 and float(denoised_pixels.max()) <= 1.0


def test_tv_denoise_leaves_constant_images_and_zero_weight_unchanged() -> None:
    constant = torch.full((2, 3, 8, 8), 0.7, dtype=torch.float64)
    assert torch.allclose(tv_denoise(constant, weight=0.5), constant, atol=1e-12)
    noisy = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(tv_denoise(noisy, weight=torch.tensor([0.0, 0.0])), noisy)
    smoothed = tv_denoise(noisy, weight=torch.tensor([0.0, 0.2]))
    assert torch.equal(smoothed[0], noisy[0])
    assert float(smoothed[1].diff(dim=-1).abs().sum()) < 0.5 * float(noisy[1].diff(dim=-1).abs().sum())


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    inputs, columns, _ = _problem()
    update = columns.T @ inputs
    broken = update.clone()
    broken[0, 0] = math.nan
    with pytest.raises(ValueError, match="weight_grad contains NaN or Inf"):
        row_noise_std(weight_grad=broken, inputs=inputs, noise_std=0.1)
    with pytest.raises(ValueError, match="inputs have n=255 entries but weight_grad has n=256"):
        gradient_columns(update, inputs[:, :255])
    with pytest.raises(ValueError, match="noise_std must be positive and finite"):
        row_noise_std(weight_grad=update, inputs=inputs, noise_std=0.0)
    with pytest.raises(ValueError, match="linearly dependent"):
        gradient_columns(update, torch.cat([inputs[:2], inputs[:1]]))
    with pytest.raises(ValueError, match=r"columns must have shape \(3, 40\)"):
        row_noise_std(weight_grad=update, inputs=inputs, noise_std=0.1, columns=columns[:2])
    with pytest.raises(ValueError, match=r"bias_grad must be a tensor of shape \(40,\)"):
        scale_uncertainty(weight_grad=update, bias_grad=torch.zeros(39), inputs=inputs, noise_std=0.1)
    with pytest.raises(ValueError, match="image_shape"):
        denoise_images(inputs, row_noise=torch.ones(3), image_shape=(3, 16, 16), mean=MEAN, std=STD)
    with pytest.raises(ValueError, match="row_noise must be non-negative and finite"):
        denoise_images(inputs, row_noise=-torch.ones(3), image_shape=SHAPE, mean=MEAN, std=STD)
    with pytest.raises(ValueError, match=r"images must be a \(B, C, H, W\) tensor"):
        tv_denoise(torch.zeros(3, 8, 8), weight=0.1)
    with pytest.raises(ValueError, match="log_rms_std must be positive"):
        prior_scales(
            inputs, row_noise=torch.ones(3), scale_std=torch.ones(3), log_rms_mean=0.0, log_rms_std=0.0
        )


def _image_data(images: torch.Tensor) -> ImageData:
    labels = torch.zeros(images.shape[0], dtype=torch.int64)
    return ImageData(name="blocks", images=images.float(), labels=labels, mean=MEAN, std=STD, num_classes=2)


def test_size_prior_is_the_log_rms_of_the_dataset() -> None:
    images = torch.stack([torch.full(SHAPE, 1.0), torch.full(SHAPE, math.e)])
    mean, std = size_prior(_image_data(images))
    assert mean == pytest.approx(0.5, rel=1e-6)
    assert std == pytest.approx(math.sqrt(0.5), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 images"):
        size_prior(_image_data(images[:1]))


def test_denoised_attack_uses_only_the_update_and_improves_a_noisy_estimate() -> None:
    inputs, columns, pixels = _problem(seed=3)
    generator = torch.Generator().manual_seed(6)
    data = _image_data(_blocky_images(200, generator).sub(MEAN[0]).div(STD[0]))
    sigma = 1.5
    weight_grad = columns.T @ inputs + sigma * torch.randn(40, 256, generator=generator, dtype=torch.float64)
    bias_grad = columns.sum(dim=0) + sigma * torch.randn(40, generator=generator, dtype=torch.float64)
    least_squares = torch.linalg.solve(columns @ columns.T, columns @ weight_grad)
    denoised = denoised_attack(
        least_squares, weight_grad=weight_grad, bias_grad=bias_grad, noise_std=sigma, data=data
    )
    # measured at this seed: mean squared error 0.112 -> 0.068 (one of the three block images
    # reaches only 0.81 of the range, so its box-fill scale is 19% low)
    assert float((denoised - inputs).square().mean()) < 0.7 * float((least_squares - inputs).square().mean())
    assert box_fill_calibration(data) is box_fill_calibration(data)  # calibrated once per dataset
    with pytest.raises(ValueError, match="noise_std must be positive and finite"):
        denoised_attack(least_squares, weight_grad=weight_grad, bias_grad=bias_grad, noise_std=0.0, data=data)


def test_bias_scale_ceiling_is_the_oracle_when_the_bias_gradient_is_clean() -> None:
    inputs, columns, _ = _problem(seed=3)
    generator = torch.Generator().manual_seed(7)
    data = _image_data(_blocky_images(50, generator).sub(MEAN[0]).div(STD[0]))
    weight_grad = columns.T @ inputs + 0.5 * torch.randn(40, 256, generator=generator, dtype=torch.float64)
    oracle = torch.linalg.solve(columns @ columns.T, columns @ weight_grad)
    oracle_psnr = evaluate_reconstruction(oracle, inputs, denormalize=data.denormalize).mean_psnr

    def facts(bias_grad: torch.Tensor) -> dict[str, float]:
        return ceiling_facts(
            columns=columns,
            weight_grad=weight_grad,
            bias_grad=bias_grad,
            reference=inputs,
            sigma=0.5,
            data=data,
        )

    clean = facts(columns.sum(dim=0))
    assert clean["bias_scale_mean_psnr"] == pytest.approx(oracle_psnr, abs=1e-9)
    noisy_bias = columns.sum(dim=0) + 0.5 * torch.randn(40, generator=generator, dtype=torch.float64)
    noisy = facts(noisy_bias)
    assert noisy["bias_scale_mean_psnr"] < oracle_psnr
    assert noisy["oracle_denoised_mean_psnr"] == clean["oracle_denoised_mean_psnr"]
    assert noisy["oracle_denoised_mean_psnr"] > oracle_psnr


def test_gap_seeds_parse_ranges_and_lists() -> None:
    assert parse_seeds("0-2,5") == [0, 1, 2, 5]
    assert parse_seeds("7") == [7]
    with pytest.raises(argparse.ArgumentTypeError, match="bad seed range '3-1'"):
        parse_seeds("3-1")
    with pytest.raises(argparse.ArgumentTypeError, match="bad seed range 'a'"):
        parse_seeds("a")
