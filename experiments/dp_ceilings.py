"""What the DP-noise table reads our PSNR against: ceilings that know part of the truth.

- *oracle* (:func:`experiments.observe.oracle_quality`): least squares with the true ``dL/dZ``.
- *bias-scale ceiling*: the true gradient columns' directions, but each sample's scale read off
  the noisy bias gradient by least squares, as an attack must: the update's scale ambiguity
  ``d_i -> c d_i, x_i -> x_i / c`` is fixed by nothing else, so this is the ceiling of an attack
  without a prior that finds every direction exactly.
- both *denoised* under the image prior of :mod:`experiments.dp_prior` (the oracle with TV and the
  pixel range only, as it knows the scales; the bias-scale ceiling with the whole prior, as ours).
"""

from __future__ import annotations

import torch
from torch import Tensor

from experiments.dp_prior import denoised_attack, denoised_oracle
from fl_attack.data.images import ImageData
from fl_attack.evaluation.metrics import evaluate_reconstruction


def _psnr(inputs: Tensor, reference: Tensor, data: ImageData) -> float:
    quality = evaluate_reconstruction(
        inputs, reference, denormalize=data.denormalize, image_shape=data.image_shape
    )
    return quality.mean_psnr


def ceiling_facts(
    *,
    columns: Tensor,
    weight_grad: Tensor,
    bias_grad: Tensor,
    reference: Tensor,
    sigma: float,
    data: ImageData,
) -> dict[str, float]:
    """Mean PSNR of the denoised oracle, the bias-scale ceiling and the denoised bias-scale ceiling.

    Parameters
    ----------
    columns
        ``(b, m)`` the true ``dL/dZ`` of the batch.
    weight_grad, bias_grad
        The noisy ``(m, n)`` and ``(m,)`` update.
    reference
        ``(b, n)`` the true inputs.
    sigma
        The noise std (> 0).
    data
        The image data (normalisation, size prior).
    """
    grad, bias = weight_grad.double(), bias_grad.double()
    d = columns.double()
    oracle = torch.linalg.solve(d @ d.T, d @ grad)
    oracle_denoised = denoised_oracle(oracle, weight_grad=grad, columns=d, noise_std=sigma, data=data)
    unit = d / d.norm(dim=1, keepdim=True)
    scales = torch.linalg.lstsq(unit.T, bias[:, None]).solution.squeeze(1)
    scaled = unit * scales[:, None]
    ceiling = torch.linalg.solve(scaled @ scaled.T, scaled @ grad)
    ceiling_denoised = denoised_attack(ceiling, weight_grad=grad, bias_grad=bias, noise_std=sigma, data=data)
    return {
        "oracle_denoised_mean_psnr": _psnr(oracle_denoised, reference, data),
        "bias_scale_mean_psnr": _psnr(ceiling, reference, data),
        "bias_scale_denoised_mean_psnr": _psnr(ceiling_denoised, reference, data),
    }
