"""The image prior of the DP-noise table: scale prior, TV denoising and the pixel range.

The attack library stays agnostic of the data kind; the table, which knows its inputs are
images, scores each reconstruction twice: as the attack returned it, and *denoised* by
:mod:`fl_attack.pipeline.denoise` (each row pulled toward the data's typical size by its scale
uncertainty, then TV-denoised by the noise std it carries and clipped to ``[0, 1]``). A denoised
batch is an estimate under a prior, never exact.
"""

from __future__ import annotations

import math

import torch

from fl_attack.data.images import ImageData
from fl_attack.pipeline.denoise import denoise_images, prior_scales, row_noise_std, scale_uncertainty


def size_prior(data: ImageData) -> tuple[float, float]:
    """Mean and std of ``log rms`` of the dataset's normalised images (the prior on a sample's size)."""
    flat = data.images.reshape(data.images.shape[0], -1).to(torch.float64)
    log_rms = 0.5 * flat.square().mean(dim=1).clamp_min(1e-12).log()
    if log_rms.numel() < 2:
        raise ValueError(f"the size prior needs at least 2 images, {data.name} has {log_rms.numel()}")
    return float(log_rms.mean()), float(log_rms.std())


def denoised_attack(
    inputs: torch.Tensor,
    *,
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    noise_std: float,
    data: ImageData,
) -> torch.Tensor:
    """An attack's noisy reconstruction under the image prior: scale prior, TV, pixel range.

    Everything comes from the observed update, the attack's noise estimate and the data's
    size prior; nothing from the ground truth.
    """
    if not math.isfinite(noise_std) or noise_std <= 0:
        raise ValueError(f"noise_std must be positive and finite, got {noise_std}")
    noise = row_noise_std(weight_grad=weight_grad, inputs=inputs, noise_std=noise_std)
    spread = scale_uncertainty(
        weight_grad=weight_grad, bias_grad=bias_grad, inputs=inputs, noise_std=noise_std
    )
    mean, std = size_prior(data)
    factors = prior_scales(inputs, row_noise=noise, scale_std=spread, log_rms_mean=mean, log_rms_std=std)
    scaled = inputs.to(torch.float64) * factors[:, None]
    return _tv_and_range(scaled, noise * factors, data)


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
    return _tv_and_range(inputs.to(torch.float64), noise, data)


def _tv_and_range(inputs: torch.Tensor, noise: torch.Tensor, data: ImageData) -> torch.Tensor:
    c, h, w = data.image_shape
    return denoise_images(inputs, row_noise=noise, image_shape=(c, h, w), mean=data.mean, std=data.std)
