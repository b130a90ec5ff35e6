"""A scale prior for noisy images from how far their pixels reach toward the pixel range.

Under DP noise the update fixes each recovered input only up to a scale (``x_i / c_i``), which
only the noisy bias gradient pins down (:func:`fl_attack.image_priors.denoise.scale_uncertainty`).
Natural photos nearly always use most of the pixel range ``[0, 1]``: the largest ``x_k /
limit_k`` of a normalised image, with ``limit_k`` the distance from the channel mean to the
edge of the range on ``x_k``'s side, is close to 1 (its *box fill*; log std 0.075 over the
CIFAR-10 training images, against 0.27 for the log of the images' rms). The box fill of a
recovered row scales as ``1 / c_i``, so it estimates ``c_i``.

On a noisy row the maximum is read off a total-variation denoising of the row (ROF, weights
proportional to the row's noise std, luma and chroma apart for colour images: both scale with
the row, so the statistic stays scale-covariant); that
statistic is biased and spread by the noise according to the row's signal-to-noise ratio, which
:func:`calibrate_box_fill` measures by simulation on clean images of the same kind (white
Gaussian noise of a known ratio) and :func:`box_fill_scales` interpolates. The resulting
log-scale estimate is combined with the bias gradient's by the product of the two Gaussians.

This is a *prior* for callers that know their inputs are images; the attacks do not apply it,
and a result scaled by it is an estimate, never exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_attack.image_priors.denoise import opponent_tv, tv_denoise

#: TV dual steps of the denoising the box fill is read from (calibration and use alike).
_TV_ITERATIONS = 100

#: TV weights of that denoising per unit of the row's noise std: 3-channel images are denoised in
#: an opponent basis, luma and chroma apart (chosen on CIFAR-10 at 1x median noise, seeds 10-14:
#: log-scale error 0.114 against 0.125 with the channels coupled at weight 1); others coupled at 1.
_LUMA_WEIGHT = 1.0
_CHROMA_WEIGHT = 2.0

#: Box fills below this share of the range count as this share (no log of 0 for an all-zero row).
_TINY_FILL = 1e-6


@dataclass(frozen=True)
class BoxFillCalibration:
    """The box-fill statistic of noisy clean images, by signal-to-noise ratio.

    Attributes
    ----------
    log_snr
        ``(k,)`` increasing log signal-to-noise ratios (rms of the image over the noise std).
    mean, std
        ``(k,)`` mean and std of :func:`log_box_fill` of the TV-denoised noisy images there.
    """

    log_snr: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    def __post_init__(self) -> None:
        k = self.log_snr.shape[0] if self.log_snr.dim() == 1 else -1
        if k < 2 or self.mean.shape != (k,) or self.std.shape != (k,):
            raise ValueError(
                "log_snr, mean and std must be 1-D of one common length >= 2, got shapes "
                f"{tuple(self.log_snr.shape)}, {tuple(self.mean.shape)}, {tuple(self.std.shape)}"
            )
        values = torch.cat([self.log_snr, self.mean, self.std])
        if not bool(torch.isfinite(values).all()):
            raise ValueError("the calibration contains NaN or Inf")
        if not bool((self.log_snr.diff() > 0).all()):
            raise ValueError("log_snr must be strictly increasing")
        if not bool((self.std > 0).all()):
            raise ValueError("the calibration's std must be positive")

    def at(self, log_snr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std at each ``log_snr``, interpolated linearly and held at the grid's ends."""
        grid = self.log_snr.to(torch.float64)
        v = log_snr.to(torch.float64).clamp(float(grid[0]), float(grid[-1]))
        upper = torch.searchsorted(grid, v).clamp(1, grid.shape[0] - 1)
        share = (v - grid[upper - 1]) / (grid[upper] - grid[upper - 1])

        def _interpolate(table: torch.Tensor) -> torch.Tensor:
            t = table.to(torch.float64)
            return t[upper - 1] * (1 - share) + t[upper] * share

        return _interpolate(self.mean), _interpolate(self.std)


def _range_limits(
    mean: Sequence[float], std: Sequence[float], channels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(mean) != channels or len(std) != channels:
        raise ValueError(
            f"mean and std need one value per channel ({channels}), got {len(mean)} and {len(std)}"
        )
    if any(not math.isfinite(s) or s <= 0 for s in std):
        raise ValueError(f"std must be positive and finite, got {list(std)}")
    if any(not math.isfinite(v) or not 0 < v < 1 for v in mean):
        raise ValueError(f"the channel means must lie strictly inside (0, 1), got {list(mean)}")
    mu = torch.tensor(list(mean), dtype=torch.float64).view(1, channels, 1, 1)
    sd = torch.tensor(list(std), dtype=torch.float64).view(1, channels, 1, 1)
    return (1 - mu) / sd, -mu / sd


def log_box_fill(images: torch.Tensor, *, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Log of the largest ``x_k / limit_k`` of each normalised image (0 when a pixel touches the range).

    Parameters
    ----------
    images
        ``(B, C, H, W)`` normalised images ``(pixel - mean) / std``.
    mean, std
        The per-channel normalisation (``0 < mean < 1``, ``std > 0``).

    Returns
    -------
    torch.Tensor
        ``(B,)`` float64; positive where a pixel lies outside ``[0, 1]``.

    Raises
    ------
    ValueError
        On a bad shape, NaN/Inf or bad normalisation.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
        raise ValueError(
            f"images must be a non-empty (B, C, H, W) tensor, got {getattr(images, 'shape', images)!r}"
        )
    if not bool(torch.isfinite(images).all()):
        raise ValueError("images contain NaN or Inf")
    high, low = _range_limits(mean, std, images.shape[1])
    x = images.to(torch.float64)
    reach = torch.where(x > 0, x / high, x / low).reshape(x.shape[0], -1)
    return reach.max(dim=1).values.clamp_min(_TINY_FILL).log()


def _denoised_fill(
    images: torch.Tensor, noise: torch.Tensor, *, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    if images.shape[1] == 3:
        denoised = opponent_tv(
            images,
            luma_weight=_LUMA_WEIGHT * noise,
            chroma_weight=_CHROMA_WEIGHT * noise,
            iterations=_TV_ITERATIONS,
        )
    else:
        denoised = tv_denoise(images, weight=noise, iterations=_TV_ITERATIONS)
    return log_box_fill(denoised, mean=mean, std=std)


def calibrate_box_fill(
    images: torch.Tensor,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    snrs: Sequence[float],
    seed: int = 0,
) -> BoxFillCalibration:
    """Measure the box fill of TV-denoised noisy images at each signal-to-noise ratio.

    Each clean image gets white Gaussian noise of std ``rms(image) / snr`` (normalised units),
    is TV-denoised with that std as the weight, and its :func:`log_box_fill` is recorded.

    Parameters
    ----------
    images
        ``(N, C, H, W)`` clean normalised images of the kind to be recovered, ``N >= 2``.
    mean, std
        Their normalisation.
    snrs
        At least two distinct positive signal-to-noise ratios.
    seed
        Seeds the noise.

    Raises
    ------
    ValueError
        On fewer than 2 images, a bad shape, NaN/Inf, bad normalisation or bad ratios.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] < 2:
        raise ValueError(f"need at least 2 images (N, C, H, W), got {getattr(images, 'shape', images)!r}")
    if not bool(torch.isfinite(images).all()):
        raise ValueError("images contain NaN or Inf")
    ratios = sorted({float(s) for s in snrs})
    if len(ratios) < 2 or any(not math.isfinite(s) or s <= 0 for s in ratios):
        raise ValueError(f"snrs must hold at least two distinct positive ratios, got {list(snrs)}")
    clean = images.to(torch.float64)
    rms = clean.reshape(clean.shape[0], -1).square().mean(dim=1).sqrt()
    if not bool((rms > 0).all()):
        raise ValueError("an all-zero image has no signal-to-noise ratio")
    generator = torch.Generator().manual_seed(seed)
    means, stds = [], []
    for ratio in ratios:
        noise = rms / ratio
        noisy = clean + torch.randn(clean.shape, generator=generator, dtype=torch.float64) * noise.view(
            -1, 1, 1, 1
        )
        fill = _denoised_fill(noisy, noise, mean=mean, std=std)
        means.append(float(fill.mean()))
        stds.append(float(fill.std()))
    return BoxFillCalibration(
        log_snr=torch.tensor(ratios, dtype=torch.float64).log(),
        mean=torch.tensor(means, dtype=torch.float64),
        std=torch.tensor(stds, dtype=torch.float64),
    )


def box_fill_scales(
    inputs: torch.Tensor,
    *,
    row_noise: torch.Tensor,
    scale_std: torch.Tensor,
    calibration: BoxFillCalibration,
    image_shape: tuple[int, int, int],
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """Per-row factors from the box fill, combined with the bias gradient's scale.

    Row ``i`` (``x_i / c_i`` plus noise of std ``row_noise_i``) has signal-to-noise ratio
    ``r_i = sqrt(max(ms_i - row_noise_i^2, tiny)) / row_noise_i``; its box fill ``f_i`` (of the
    row TV-denoised by its noise) estimates ``log c_i`` as ``mean(r_i) - log f_i`` with std
    ``std(r_i)`` from the calibration. The bias gradient's estimate is ``log c_i = 0`` with std
    ``scale_std_i``; the product of the two Gaussians has its maximum at
    ``(mean(r_i) - log f_i) scale_std_i^2 / (scale_std_i^2 + std(r_i)^2)``. Multiply row ``i``
    (and its noise std) by the returned factor.

    Parameters
    ----------
    inputs
        ``(b, C*H*W)`` recovered inputs, normalised.
    row_noise
        ``(b,)`` their noise stds (:func:`fl_attack.image_priors.denoise.row_noise_std`), positive.
    scale_std
        ``(b,)`` relative std of each row's bias-gradient scale
        (:func:`fl_attack.image_priors.denoise.scale_uncertainty`), non-negative.
    calibration
        :func:`calibrate_box_fill` on clean images of the same kind.
    image_shape
        ``(C, H, W)``.
    mean, std
        The normalisation.

    Raises
    ------
    ValueError
        On shapes that do not fit, NaN/Inf, non-positive noise or negative scale stds.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.shape[0] == 0:
        raise ValueError(
            f"inputs must be a non-empty (b, n) tensor, got {getattr(inputs, 'shape', inputs)!r}"
        )
    c, h, w = (int(s) for s in image_shape)
    if c * h * w != inputs.shape[1]:
        raise ValueError(
            f"image_shape {image_shape} has {c * h * w} entries but inputs have {inputs.shape[1]}"
        )
    if not bool(torch.isfinite(inputs).all()):
        raise ValueError("inputs contain NaN or Inf")
    b = inputs.shape[0]
    noise = torch.as_tensor(row_noise, dtype=torch.float64).flatten()
    spread = torch.as_tensor(scale_std, dtype=torch.float64).flatten()
    if noise.shape != (b,) or spread.shape != (b,):
        raise ValueError(
            f"row_noise and scale_std need one value per input ({b}), got {noise.numel()} and {spread.numel()}"
        )
    if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
        raise ValueError("row_noise must be positive and finite")
    if not bool(torch.isfinite(spread).all()) or bool((spread < 0).any()):
        raise ValueError("scale_std must be non-negative and finite")
    x = inputs.to(torch.float64)
    power = x.square().mean(dim=1)
    signal = (power - noise.square()).clamp_min(_TINY_FILL * power).sqrt()
    expected, spread_fill = calibration.at((signal / noise).log())
    fill = _denoised_fill(x.reshape(b, c, h, w), noise, mean=mean, std=std)
    weight = spread.square() / (spread.square() + spread_fill.square())
    return ((expected - fill) * weight).exp()
