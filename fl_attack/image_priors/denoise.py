"""The noise each recovered input carries under DP noise, and an optional image prior against it.

With i.i.d. Gaussian noise of std ``sigma`` on a weight gradient ``G = D^T X + E`` and the
gradient columns ``D`` (``(b, m)``, one row per sample) the least-squares inputs
``(D D^T)^{-1} D G`` carry Gaussian noise of std ``sigma sqrt([(D D^T)^{-1}]_ii)`` on every entry
of row ``i``. An attack recovers ``X`` but not ``D``; :func:`row_noise_std` reads ``D`` back from
the update and the recovered inputs (``D^T = G X^+``), so the figure needs no ground truth.

What the update cannot give, it cannot give to any estimator without a prior: the scale of each
sample (``G`` is unchanged by ``d_i -> c d_i, x_i -> x_i / c``) is fixed only by the noisy bias
gradient ``D^T 1``, and :func:`scale_uncertainty` reports how well (the relative std of the
least-squares scales). On CIFAR-10 at (b, m) = (20, 200) with noise 1x the median gradient entry
this scale error, not the directions, is most of the gap between the attack and an oracle that
knows ``D`` (docs/results/spearpp-t3.md).

Two *priors*, for callers that know what their inputs are: :func:`prior_scales` combines that
uncertainty with a prior on the inputs' size (the rms of their entries over data of the same
kind) into a factor per row, and :func:`denoise_images`, for images, is a total-variation (ROF)
denoising of each recovered image with a weight proportional to the noise std its row carries,
then clipping to the pixel range (optionally luma and chroma apart). Neither is applied by the
attacks (they stay agnostic of the data kind), and a denoised result is an estimate, never exact.
For photos, :mod:`fl_attack.image_priors.pixel_range_scale` gives a tighter scale prior than the size prior.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: A row whose rms is all noise keeps this share of its power in :func:`prior_scales` (no log of 0).
_TINY_POWER = 1e-6

#: Chambolle's dual step; the projection algorithm converges for steps up to 1/8.
_TV_STEP = 0.125

#: Orthonormal opponent colour basis (rows): luma, red - blue, (red + blue) / 2 - green.
_OPPONENT = torch.tensor(
    [
        [1 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)],
        [1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)],
        [1 / math.sqrt(6), -2 / math.sqrt(6), 1 / math.sqrt(6)],
    ],
    dtype=torch.float64,
)


def _finite_matrix(value: torch.Tensor, *, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(value).__name__}")
    if value.dim() != 2 or value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor, got shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return value.detach().to(device="cpu", dtype=torch.float64)


def _positive(value: float, *, name: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return float(value)


def gradient_columns(weight_grad: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The per-sample gradient columns ``D`` ``(b, m)`` that best explain ``G ~= D^T X``.

    Parameters
    ----------
    weight_grad
        ``(m, n)`` observed weight gradient ``G``.
    inputs
        ``(b, n)`` recovered inputs ``X`` (rank b).

    Raises
    ------
    ValueError
        On shapes that do not fit, NaN/Inf, or inputs of rank below b.
    """
    g = _finite_matrix(weight_grad, name="weight_grad")
    x = _finite_matrix(inputs, name="inputs")
    if x.shape[1] != g.shape[1]:
        raise ValueError(f"inputs have n={x.shape[1]} entries but weight_grad has n={g.shape[1]} columns")
    if x.shape[0] >= x.shape[1]:
        raise ValueError(f"need fewer inputs than features, got b={x.shape[0]} >= n={x.shape[1]}")
    if int(torch.linalg.matrix_rank(x)) < x.shape[0]:
        raise ValueError(f"the {x.shape[0]} inputs are linearly dependent: no gradient columns fit them")
    return torch.linalg.lstsq(x.T, g.T).solution  # (b, m): X^T D = G^T


def row_noise_std(
    *, weight_grad: torch.Tensor, inputs: torch.Tensor, noise_std: float, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """Std of the Gaussian noise on each entry of each recovered input row.

    Parameters
    ----------
    weight_grad
        ``(m, n)`` observed (noisy) weight gradient.
    inputs
        ``(b, n)`` inputs recovered from it.
    noise_std
        Std ``sigma`` of the i.i.d. noise on the gradient entries (e.g. the attack's
        ``stats["noise_std"]``, read off the spectrum).
    columns
        ``(b, m)`` gradient columns, when known (the oracle's true ``dL/dZ``); read back from
        the update by :func:`gradient_columns` otherwise.

    Returns
    -------
    torch.Tensor
        ``(b,)`` float64: ``sigma sqrt([(D D^T)^{-1}]_ii)``.

    Raises
    ------
    ValueError
        On bad shapes, NaN/Inf, a non-positive noise std or singular columns.
    """
    sigma = _positive(noise_std, name="noise_std")
    if columns is None:
        d = gradient_columns(weight_grad, inputs)
    else:
        d = _finite_matrix(columns, name="columns")
        b = _finite_matrix(inputs, name="inputs").shape[0]
        m = _finite_matrix(weight_grad, name="weight_grad").shape[0]
        if d.shape != (b, m):
            raise ValueError(f"columns must have shape ({b}, {m}), got {tuple(d.shape)}")
    gram = d @ d.T
    if int(torch.linalg.matrix_rank(gram)) < gram.shape[0]:
        raise ValueError("the gradient columns are linearly dependent: the inputs are not identifiable")
    return sigma * torch.linalg.inv(gram).diagonal().clamp_min(0).sqrt()


def scale_uncertainty(
    *, weight_grad: torch.Tensor, bias_grad: torch.Tensor, inputs: torch.Tensor, noise_std: float
) -> torch.Tensor:
    """Relative std of each sample's scale, the one thing only the bias gradient fixes.

    The scales ``s`` of the unit columns ``u_i`` solve ``sum_i s_i u_i = dL/db`` by least
    squares; noise of std ``sigma`` on the bias gradient leaves ``s_i`` a std of
    ``sigma sqrt([(U^T U)^{-1}]_ii)``, returned relative to ``|s_i|``.

    Raises
    ------
    ValueError
        On bad shapes, NaN/Inf or a non-positive noise std.
    """
    sigma = _positive(noise_std, name="noise_std")
    d = gradient_columns(weight_grad, inputs)
    if not isinstance(bias_grad, torch.Tensor) or bias_grad.dim() != 1 or bias_grad.shape[0] != d.shape[1]:
        shape = tuple(bias_grad.shape) if isinstance(bias_grad, torch.Tensor) else type(bias_grad).__name__
        raise ValueError(f"bias_grad must be a tensor of shape ({d.shape[1]},), got {shape}")
    if not bool(torch.isfinite(bias_grad).all()):
        raise ValueError("bias_grad contains NaN or Inf")
    unit = d / d.norm(dim=1, keepdim=True)
    scales = torch.linalg.lstsq(unit.T, bias_grad.double().cpu()[:, None]).solution.squeeze(1)
    spread = sigma * torch.linalg.inv(unit @ unit.T).diagonal().clamp_min(0).sqrt()
    return spread / scales.abs()


def prior_scales(
    inputs: torch.Tensor,
    *,
    row_noise: torch.Tensor,
    scale_std: torch.Tensor,
    log_rms_mean: float,
    log_rms_std: float,
) -> torch.Tensor:
    """Per-row factors that pull each input's size toward a prior on the data's size.

    A recovered row is ``x_i / c_i`` plus noise, with ``log c_i`` of std about ``scale_std_i``
    (:func:`scale_uncertainty`). A prior ``log rms(x) ~ N(log_rms_mean, log_rms_std^2)`` over the
    data (the rms of an input's entries, measured on data of the same kind) gives a second
    estimate of ``log c_i``; the product of the two Gaussians has its maximum at
    ``(log_rms_mean - log rms_i) scale_std_i^2 / (scale_std_i^2 + log_rms_std^2)``, with
    ``rms_i`` the row's rms net of its noise. Multiply row ``i`` (and its noise std) by the
    returned factor.

    Raises
    ------
    ValueError
        On shapes that do not fit, NaN/Inf, negative stds or a non-positive ``log_rms_std``.
    """
    x = _finite_matrix(inputs, name="inputs")
    b = x.shape[0]
    noise = _per_row(row_noise, b, name="row_noise")
    spread = _per_row(scale_std, b, name="scale_std")
    prior_std = _positive(log_rms_std, name="log_rms_std")
    if not math.isfinite(log_rms_mean):
        raise ValueError(f"log_rms_mean must be finite, got {log_rms_mean}")
    power = (x.square().mean(dim=1) - noise.square()).clamp_min(_TINY_POWER * x.square().mean(dim=1))
    log_rms = 0.5 * power.log()
    weight = spread.square() / (spread.square() + prior_std**2)
    return ((log_rms_mean - log_rms) * weight).exp()


def _per_row(value: torch.Tensor, rows: int, *, name: str) -> torch.Tensor:
    out = torch.as_tensor(value, dtype=torch.float64).flatten().cpu()
    if out.shape != (rows,):
        raise ValueError(f"{name} must have one value per input ({rows}), got {out.numel()}")
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ValueError(f"{name} must be non-negative and finite")
    return out


def _image_gradient(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gx = torch.zeros_like(u)
    gy = torch.zeros_like(u)
    gx[..., :, :-1] = u[..., :, 1:] - u[..., :, :-1]
    gy[..., :-1, :] = u[..., 1:, :] - u[..., :-1, :]
    return gx, gy


def _divergence(px: torch.Tensor, py: torch.Tensor) -> torch.Tensor:
    """The negative adjoint of :func:`_image_gradient`."""
    dx = torch.zeros_like(px)
    dy = torch.zeros_like(py)
    dx[..., :, 0] = px[..., :, 0]
    dx[..., :, 1:-1] = px[..., :, 1:-1] - px[..., :, :-2]
    dx[..., :, -1] = -px[..., :, -2]
    dy[..., 0, :] = py[..., 0, :]
    dy[..., 1:-1, :] = py[..., 1:-1, :] - py[..., :-2, :]
    dy[..., -1, :] = -py[..., -2, :]
    return dx + dy


def tv_denoise(images: torch.Tensor, *, weight: torch.Tensor | float, iterations: int = 100) -> torch.Tensor:
    """Total-variation (ROF) denoising, ``argmin_u ||u - f||^2 / 2 + weight TV(u)`` per image.

    Chambolle's (2004) dual projection algorithm; the TV couples the channels (the norm of
    the spatial gradient is taken over both directions and all channels).

    Parameters
    ----------
    images
        ``(B, C, H, W)`` images, ``H, W >= 2``.
    weight
        The TV weight, one per image ``(B,)`` or one for all; 0 leaves an image unchanged.
    iterations
        Dual steps (at least 1).

    Raises
    ------
    ValueError
        On a bad shape, NaN/Inf, a negative or non-finite weight or ``iterations < 1``.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise ValueError(f"images must be a (B, C, H, W) tensor, got {getattr(images, 'shape', images)!r}")
    if images.shape[0] == 0 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(
            f"images must hold at least one image of at least 2x2 pixels, got {tuple(images.shape)}"
        )
    if not bool(torch.isfinite(images).all()):
        raise ValueError("images contain NaN or Inf")
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    f = images.to(torch.float64)
    lam = torch.as_tensor(weight, dtype=torch.float64).flatten()
    if lam.numel() == 1:
        lam = lam.expand(f.shape[0])
    if lam.shape != (f.shape[0],):
        raise ValueError(
            f"weight must be a scalar or have one value per image ({f.shape[0]}), got {lam.numel()}"
        )
    if not bool(torch.isfinite(lam).all()) or bool((lam < 0).any()):
        raise ValueError("weight must be non-negative and finite")
    active = lam > 0
    out = f.clone()
    if not bool(active.any()):
        return out
    fa, la = f[active], lam[active].view(-1, 1, 1, 1)
    px, py = torch.zeros_like(fa), torch.zeros_like(fa)
    for _ in range(iterations):
        gx, gy = _image_gradient(_divergence(px, py) - fa / la)
        norm = (gx.square() + gy.square()).sum(dim=1, keepdim=True).sqrt()
        px = (px + _TV_STEP * gx) / (1 + _TV_STEP * norm)
        py = (py + _TV_STEP * gy) / (1 + _TV_STEP * norm)
    out[active] = fa - la * _divergence(px, py)
    return out


def opponent_tv(
    images: torch.Tensor, *, luma_weight: torch.Tensor, chroma_weight: torch.Tensor, iterations: int = 100
) -> torch.Tensor:
    """TV (ROF) denoising of 3-channel images in an orthonormal opponent basis, luma and chroma apart.

    The basis (luma ``(r + g + b) / sqrt 3`` and two chroma channels) keeps white noise white;
    the luma is denoised by :func:`tv_denoise` with ``luma_weight`` and the two chroma channels
    together with ``chroma_weight`` (colour varies more smoothly in photos than brightness).

    Parameters
    ----------
    images
        ``(B, 3, H, W)`` images.
    luma_weight, chroma_weight
        ``(B,)`` TV weights (or one for all), non-negative.
    iterations
        TV dual steps.

    Returns
    -------
    torch.Tensor
        ``(B, 3, H, W)`` float64, not clipped.

    Raises
    ------
    ValueError
        When the images do not have 3 channels, or as :func:`tv_denoise`.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"opponent_tv needs (B, 3, H, W) images, got {getattr(images, 'shape', images)!r}")
    basis = _OPPONENT.to(torch.float64)
    opponent = torch.einsum("kc,bchw->bkhw", basis, images.to(torch.float64))
    luma = tv_denoise(opponent[:, :1], weight=luma_weight, iterations=iterations)
    colour = tv_denoise(opponent[:, 1:], weight=chroma_weight, iterations=iterations)
    return torch.einsum("kc,bkhw->bchw", basis, torch.cat([luma, colour], dim=1))


def denoise_images(
    inputs: torch.Tensor,
    *,
    row_noise: torch.Tensor,
    image_shape: tuple[int, int, int],
    mean: Sequence[float],
    std: Sequence[float],
    strength: float = 1.0,
    chroma_strength: float | None = None,
    iterations: int = 100,
) -> torch.Tensor:
    """An image prior on recovered inputs: TV denoising by each row's noise, then the pixel range.

    Each ``(C, H, W)`` input (normalised as ``(pixel - mean) / std``) is taken to pixel scale,
    denoised by :func:`tv_denoise` with weight ``strength x`` its row's noise std in pixel
    units, clipped to ``[0, 1]`` and normalised back. With ``chroma_strength`` (3 channels
    only) the pixels are first turned into an orthonormal opponent basis (luma
    ``(r + g + b) / sqrt 3`` and two chroma channels, so white noise stays white) and luma and
    chroma are denoised apart, with weights ``strength x`` and ``chroma_strength x`` the noise
    std: colour varies more smoothly in photos than brightness.

    Parameters
    ----------
    inputs
        ``(b, C*H*W)`` recovered inputs, normalised.
    row_noise
        ``(b,)`` noise std of each row in normalised units (:func:`row_noise_std`).
    image_shape
        ``(C, H, W)``.
    mean, std
        The per-channel normalisation (``std > 0``).
    strength
        TV weight per unit of pixel noise std (of the luma with ``chroma_strength``).
    chroma_strength
        TV weight of the two chroma channels per unit of pixel noise std; None denoises all
        channels together (their gradients coupled) with ``strength``.
    iterations
        TV dual steps.

    Returns
    -------
    torch.Tensor
        ``(b, C*H*W)`` float64 denoised inputs, normalised.

    Raises
    ------
    ValueError
        On shapes that do not fit, NaN/Inf, negative noise, a non-positive std or strength.
    """
    x = _finite_matrix(inputs, name="inputs")
    c, h, w = (int(s) for s in image_shape)
    if c * h * w != x.shape[1]:
        raise ValueError(f"image_shape {image_shape} has {c * h * w} entries but inputs have {x.shape[1]}")
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean and std need one value per channel ({c}), got {len(mean)} and {len(std)}")
    if any(not math.isfinite(s) or s <= 0 for s in std) or any(not math.isfinite(v) for v in mean):
        raise ValueError(f"std must be positive and mean finite, got mean={list(mean)} std={list(std)}")
    noise = _per_row(row_noise, x.shape[0], name="row_noise")
    factor = _positive(strength, name="strength")
    mu = torch.tensor(list(mean), dtype=torch.float64).view(1, c, 1, 1)
    sd = torch.tensor(list(std), dtype=torch.float64).view(1, c, 1, 1)
    pixels = x.reshape(-1, c, h, w) * sd + mu
    pixel_noise = noise * float(sd.mean())
    if chroma_strength is None:
        cleaned = tv_denoise(pixels, weight=factor * pixel_noise, iterations=iterations)
    else:
        chroma = _positive(chroma_strength, name="chroma_strength")
        if c != 3:
            raise ValueError(f"chroma_strength needs 3 colour channels, got {c}")
        cleaned = opponent_tv(
            pixels,
            luma_weight=factor * pixel_noise,
            chroma_weight=chroma * pixel_noise,
            iterations=iterations,
        )
    return ((cleaned.clamp(0.0, 1.0) - mu) / sd).reshape(x.shape[0], -1)
