"""The image prior of the DP-noise table: a scale prior, colour TV denoising and the pixel range.

The attack library stays agnostic of the data kind; the table, which knows its inputs are
images, scores each reconstruction twice: as the attack returned it, and *denoised* by
:mod:`fl_attack.image_priors.denoise` and :mod:`fl_attack.image_priors.pixel_range_scale`: each row's scale
(which the update fixes only through the noisy bias gradient) is pulled toward the one that makes
its pixels reach the edge of the pixel range as photos do (the *box fill*, calibrated by
simulation on clean images of the dataset), then luma and chroma are TV-denoised apart by the
noise std the row carries and the pixels clipped to ``[0, 1]``. A denoised batch is an estimate
under a prior, never exact.
"""

from __future__ import annotations

import math

import torch

from fl_attack.data.images import ImageData
from fl_attack.image_priors.denoise import denoise_images, row_noise_std, scale_uncertainty
from fl_attack.image_priors.pixel_range_scale import BoxFillCalibration, box_fill_scales, calibrate_box_fill

#: TV weights per unit of pixel noise std, luma and chroma (3-channel images), chosen on CIFAR-10
#: at 1x median noise on seeds 10-14 (0.4-0.6 and 1.0-1.2 within 0.1 dB); other channel counts
#: are denoised with their gradients coupled at weight 1.0.
LUMA_STRENGTH = 0.5
CHROMA_STRENGTH = 1.0
_COUPLED_STRENGTH = 1.0

#: Images of the dataset the box fill is calibrated on, and the signal-to-noise ratios.
CALIBRATION_IMAGES = 128
CALIBRATION_SNRS = tuple(math.exp(math.log(0.5) + k * (math.log(30.0) - math.log(0.5)) / 8) for k in range(9))

_calibrations: dict[tuple[object, ...], BoxFillCalibration] = {}


def size_prior(data: ImageData) -> tuple[float, float]:
    """Mean and std of ``log rms`` of the dataset's normalised images (the prior on a sample's size)."""
    flat = data.images.reshape(data.images.shape[0], -1).to(torch.float64)
    log_rms = 0.5 * flat.square().mean(dim=1).clamp_min(1e-12).log()
    if log_rms.numel() < 2:
        raise ValueError(f"the size prior needs at least 2 images, {data.name} has {log_rms.numel()}")
    return float(log_rms.mean()), float(log_rms.std())


def box_fill_calibration(data: ImageData) -> BoxFillCalibration:
    """The box-fill calibration of ``data`` (on up to :data:`CALIBRATION_IMAGES` of its images, drawn
    with a fixed seed), computed once per dataset and process."""
    key = (data.name, tuple(data.images.shape), data.mean, data.std)
    if key not in _calibrations:
        count = data.images.shape[0]
        order = torch.randperm(count, generator=torch.Generator().manual_seed(0))[:CALIBRATION_IMAGES]
        _calibrations[key] = calibrate_box_fill(
            data.images[order], mean=data.mean, std=data.std, snrs=CALIBRATION_SNRS
        )
    return _calibrations[key]


def denoised_attack(
    inputs: torch.Tensor,
    *,
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    noise_std: float,
    data: ImageData,
) -> torch.Tensor:
    """An attack's noisy reconstruction under the image prior: box-fill scales, TV, pixel range.

    Everything comes from the observed update, the attack's noise estimate and the dataset's
    clean images (the calibration); nothing from the batch's ground truth.
    """
    if not math.isfinite(noise_std) or noise_std <= 0:
        raise ValueError(f"noise_std must be positive and finite, got {noise_std}")
    noise = row_noise_std(weight_grad=weight_grad, inputs=inputs, noise_std=noise_std)
    spread = scale_uncertainty(
        weight_grad=weight_grad, bias_grad=bias_grad, inputs=inputs, noise_std=noise_std
    )
    factors = box_fill_scales(
        inputs,
        row_noise=noise,
        scale_std=spread,
        calibration=box_fill_calibration(data),
        image_shape=data.image_shape,
        mean=data.mean,
        std=data.std,
    )
    scaled = inputs.to(torch.float64) * factors[:, None]
    return tv_and_range(scaled, noise * factors, data)


def denoised_oracle(
    inputs: torch.Tensor,
    *,
    weight_grad: torch.Tensor,
    columns: torch.Tensor,
    noise_std: float,
    data: ImageData,
) -> torch.Tensor:
    """The oracle's least-squares inputs under the same TV and pixel-range prior (it knows the scales)."""
    noise = row_noise_std(weight_grad=weight_grad, inputs=inputs, noise_std=noise_std, columns=columns)
    return tv_and_range(inputs.to(torch.float64), noise, data)


def tv_and_range(inputs: torch.Tensor, noise: torch.Tensor, data: ImageData) -> torch.Tensor:
    """TV-denoise each row by its noise std (luma and chroma apart for 3 channels) and clip to the pixel range."""
    c, h, w = data.image_shape
    colour = c == 3
    return denoise_images(
        inputs,
        row_noise=noise,
        image_shape=(c, h, w),
        mean=data.mean,
        std=data.std,
        strength=LUMA_STRENGTH if colour else _COUPLED_STRENGTH,
        chroma_strength=CHROMA_STRENGTH if colour else None,
    )
