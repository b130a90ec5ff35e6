"""Scoring reconstructions against the ground truth.

Only the experimenter holds the client's real data, so everything here is for evaluation and
never part of the attack itself. The conventions follow SPEAR / SPEAR++: reconstructions are
matched one-to-one to the reference samples (the attack returns them in an arbitrary order),
PSNR is computed per sample on de-normalized images in ``[0, 1]``, and a batch counts as
recovered when its mean PSNR exceeds 90 dB (25 dB in the noisy DP-SGD / FedAvg settings).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fl_attack.vocabulary import APPROX_PSNR_DB, EXACT_PSNR_DB

__all__ = [
    "PSNR_CAP_DB",
    "APPROX_PSNR_DB",
    "EXACT_PSNR_DB",
    "BatchQuality",
    "batch_accuracy",
    "evaluate_reconstruction",
    "lpips_available",
    "lpips_distance",
    "match_samples",
    "psnr",
    "ssim",
]

PSNR_CAP_DB: float = 300.0
"""Upper bound reported by :func:`psnr`; a perfect (zero-MSE) reconstruction gets exactly this."""

_SSIM_WINDOW = 11
_SSIM_SIGMA = 1.5
_SSIM_K1 = 0.01
_SSIM_K2 = 0.03
_ALEXNET_CHECKPOINT = "alexnet-owt-7be5be79.pth"
_LPIPS_MIN_SIDE = 32

ArrayLike = torch.Tensor | np.ndarray


def _as_float64(x: ArrayLike, *, name: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int32, torch.int64)):
        raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
    return x.detach().to(device="cpu", dtype=torch.float64)


def _check_same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"reconstructed and reference must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.dim() < 2 or a.shape[0] == 0:
        raise ValueError(f"expected a non-empty batch of shape (B, ...), got {tuple(a.shape)}")


def psnr(reconstructed: ArrayLike, reference: ArrayLike, *, data_range: float = 1.0) -> torch.Tensor:
    """Per-sample peak signal-to-noise ratio.

    Parameters
    ----------
    reconstructed, reference
        Tensors or arrays of the same shape ``(B, ...)``; the mean squared error is taken over
        every dimension but the first. Computed in float64 whatever the input dtype.
    data_range
        Peak-to-peak range of the signal (1.0 for images in ``[0, 1]``).

    Returns
    -------
    torch.Tensor
        ``(B,)`` float64 PSNR in dB, capped at :data:`PSNR_CAP_DB` (300 dB). The cap keeps a
        perfect reconstruction (MSE 0) finite so that batch means stay meaningful; float64
        round-off alone puts an exact float32 reconstruction far below it. Samples with a
        non-finite error (NaN / inf in the reconstruction) score 0 dB.
    """
    if not data_range > 0 or not math.isfinite(data_range):
        raise ValueError(f"data_range must be a positive finite number, got {data_range}")
    rec = _as_float64(reconstructed, name="reconstructed")
    ref = _as_float64(reference, name="reference")
    _check_same_shape(rec, ref)
    mse = (rec - ref).pow(2).flatten(1).mean(dim=1)
    value = 10.0 * torch.log10(data_range**2 / mse)
    return value.nan_to_num(nan=0.0, posinf=PSNR_CAP_DB, neginf=0.0).clamp(max=PSNR_CAP_DB)


def _pairwise_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a_flat, b_flat = a.flatten(1), b.flatten(1)
    return torch.cdist(a_flat, b_flat, compute_mode="donot_use_mm_for_euclid_dist").pow(2) / a_flat.shape[1]


def match_samples(reconstructed: ArrayLike, reference: ArrayLike) -> torch.Tensor:
    """One-to-one matching of reconstructions to reference samples by minimum total MSE.

    Parameters
    ----------
    reconstructed
        ``(B_rec, ...)`` recovered samples in arbitrary order.
    reference
        ``(B_ref, ...)`` ground-truth samples with the same trailing size.

    Returns
    -------
    torch.Tensor
        ``order`` of shape ``(B_ref,)``, int64: ``reconstructed[order[i]]`` is matched to
        ``reference[i]``. When there are fewer reconstructions than references, the
        unmatched references get ``-1``; surplus reconstructions are left unused.
    """
    rec = _as_float64(reconstructed, name="reconstructed")
    ref = _as_float64(reference, name="reference")
    if rec.dim() < 2 or ref.dim() < 2:
        raise ValueError(f"expected batches of shape (B, ...), got {tuple(rec.shape)} and {tuple(ref.shape)}")
    rec_n, ref_n = math.prod(rec.shape[1:]), math.prod(ref.shape[1:])
    if rec_n != ref_n:
        raise ValueError(f"reconstructed samples have {rec_n} entries but reference samples have {ref_n}")
    order = torch.full((ref.shape[0],), -1, dtype=torch.int64)
    if rec.shape[0] == 0 or ref.shape[0] == 0:
        return order
    cost = _pairwise_mse(rec.reshape(rec.shape[0], rec_n), ref.reshape(ref.shape[0], ref_n)).numpy()
    finite = np.isfinite(cost)
    if not finite.all():
        # Failed (NaN / inf) reconstructions are matched last instead of crashing the solver.
        worst = float(cost[finite].max()) if finite.any() else 1.0
        cost = np.where(finite, cost, max(worst, 1.0) * 1e6)
    rec_idx, ref_idx = linear_sum_assignment(cost)
    order[torch.as_tensor(ref_idx, dtype=torch.int64)] = torch.as_tensor(rec_idx, dtype=torch.int64)
    return order


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2.0
    g = torch.exp(-(coords**2) / (2.0 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(reconstructed: ArrayLike, reference: ArrayLike, *, data_range: float = 1.0) -> torch.Tensor:
    """Per-sample structural similarity (Wang et al., 2004) of ``(B, C, H, W)`` images.

    Uses the standard Gaussian window (11 x 11, sigma 1.5), ``K1 = 0.01``, ``K2 = 0.03`` and
    valid (unpadded) filtering, which agrees with
    ``skimage.metrics.structural_similarity(gaussian_weights=True, use_sample_covariance=False)``.
    Images smaller than 11 pixels use the largest odd window that fits, with sigma scaled
    in proportion. The SSIM map is averaged over pixels and channels.

    Parameters
    ----------
    reconstructed, reference
        Images of the same shape ``(B, C, H, W)``; computed in float64.
    data_range
        Peak-to-peak range of the images (1.0 for ``[0, 1]``).

    Returns
    -------
    torch.Tensor
        ``(B,)`` float64 SSIM, 1.0 for identical images.
    """
    if not data_range > 0 or not math.isfinite(data_range):
        raise ValueError(f"data_range must be a positive finite number, got {data_range}")
    rec = _as_float64(reconstructed, name="reconstructed")
    ref = _as_float64(reference, name="reference")
    _check_same_shape(rec, ref)
    if rec.dim() != 4:
        raise ValueError(f"ssim expects (B, C, H, W) images, got shape {tuple(rec.shape)}")
    channels, height, width = rec.shape[1:]
    size = min(_SSIM_WINDOW, height, width)
    if size % 2 == 0:
        size -= 1
    sigma = _SSIM_SIGMA * size / _SSIM_WINDOW
    window = _gaussian_window(size, sigma).expand(channels, 1, size, size).contiguous()

    def blur(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, window, groups=channels)

    c1 = (_SSIM_K1 * data_range) ** 2
    c2 = (_SSIM_K2 * data_range) ** 2
    mu_x, mu_y = blur(rec), blur(ref)
    var_x = blur(rec * rec) - mu_x**2
    var_y = blur(ref * ref) - mu_y**2
    cov = blur(rec * ref) - mu_x * mu_y
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    return (numerator / denominator).flatten(1).mean(dim=1)


def lpips_available() -> bool:
    """Whether LPIPS can be computed offline.

    True only when the ``lpips`` package is installed *and* both its linear-layer weights and
    the torchvision AlexNet backbone checkpoint are already on disk, so that computing LPIPS
    can never trigger a download.
    """
    spec = importlib.util.find_spec("lpips")
    if spec is None or spec.origin is None:
        return False
    package_dir = Path(spec.origin).parent
    linear_weights = package_dir / "weights" / "v0.1" / "alex.pth"
    backbone = Path(torch.hub.get_dir()) / "checkpoints" / _ALEXNET_CHECKPOINT
    return linear_weights.is_file() and backbone.is_file()


_LPIPS_MODEL: list[Any] = []


def lpips_distance(reconstructed: ArrayLike, reference: ArrayLike) -> torch.Tensor | None:
    """Per-sample LPIPS (AlexNet) distance of ``(B, C, H, W)`` images in ``[0, 1]``.

    Returns
    -------
    torch.Tensor or None
        ``(B,)`` float64 distances (lower is more similar), or None when LPIPS is not
        available offline (see :func:`lpips_available`), when the images are not 1- or
        3-channel, or when they are smaller than 32 pixels a side (AlexNet's feature maps
        vanish below that).
    """
    rec = _as_float64(reconstructed, name="reconstructed")
    ref = _as_float64(reference, name="reference")
    _check_same_shape(rec, ref)
    if rec.dim() != 4 or rec.shape[1] not in (1, 3) or min(rec.shape[2:]) < _LPIPS_MIN_SIDE:
        return None
    if not lpips_available():
        return None
    if not _LPIPS_MODEL:
        import lpips  # optional dependency, checked by lpips_available()

        _LPIPS_MODEL.append(lpips.LPIPS(net="alex", verbose=False).eval())
    model = _LPIPS_MODEL[0]
    if rec.shape[1] == 1:
        rec, ref = rec.expand(-1, 3, -1, -1), ref.expand(-1, 3, -1, -1)
    with torch.no_grad():
        dist: torch.Tensor = model(rec.float() * 2 - 1, ref.float() * 2 - 1)
    return dist.flatten().to(torch.float64)


@dataclass(frozen=True)
class BatchQuality:
    """How well one batch was reconstructed, scored against the ground truth.

    Attributes
    ----------
    psnr
        ``(B_ref,)`` float64 PSNR in dB of each reference sample against its matched
        reconstruction; unmatched references score 0 dB.
    ssim
        ``(B_ref,)`` float64 SSIM (unmatched: 0), or None when the image shape is unknown.
    lpips
        ``(B_ref,)`` float64 LPIPS (unmatched: NaN), or None when LPIPS is not available.
    order
        ``(B_ref,)`` int64 matching from :func:`match_samples`.
    mean_psnr
        Mean of ``psnr``.
    exact_fraction
        Fraction of reference samples recovered exactly (PSNR above the exact threshold).
    approx_fraction
        Fraction of reference samples recovered approximately (PSNR above the approximate
        threshold).
    batch_exact
        SPEAR++ batch criterion: mean PSNR above the exact threshold.
    """

    psnr: torch.Tensor
    ssim: torch.Tensor | None
    lpips: torch.Tensor | None
    order: torch.Tensor
    mean_psnr: float
    exact_fraction: float
    approx_fraction: float
    batch_exact: bool

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary: plain floats, ints, bools, lists and None."""
        return {
            "num_reference": int(self.psnr.numel()),
            "num_matched": int((self.order >= 0).sum()),
            "mean_psnr": float(self.mean_psnr),
            "min_psnr": float(self.psnr.min()) if self.psnr.numel() else 0.0,
            "exact_fraction": float(self.exact_fraction),
            "approx_fraction": float(self.approx_fraction),
            "batch_exact": bool(self.batch_exact),
            "mean_ssim": float(self.ssim.mean()) if self.ssim is not None else None,
            "mean_lpips": float(self.lpips.nanmean()) if self.lpips is not None else None,
            "lpips": "available" if self.lpips is not None else "not available",
            "psnr": [float(v) for v in self.psnr],
        }


def _flatten_batch(x: ArrayLike, *, name: str) -> torch.Tensor:
    t = _as_float64(x, name=name)
    if t.dim() < 2:
        raise ValueError(f"{name} must be a batch of shape (B, n), got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _to_images(
    flat: torch.Tensor,
    *,
    denormalize: Callable[[torch.Tensor], torch.Tensor] | None,
    image_shape: tuple[int, ...] | None,
) -> torch.Tensor:
    x = flat
    if denormalize is not None:
        x = torch.as_tensor(denormalize(flat)).detach().to(device="cpu", dtype=torch.float64)
        if x.shape[0] != flat.shape[0] or math.prod(x.shape[1:]) != flat.shape[1]:
            raise ValueError(f"denormalize changed the batch from {tuple(flat.shape)} to {tuple(x.shape)}")
    if image_shape is not None:
        x = x.reshape(x.shape[0], *image_shape)
    return x


def evaluate_reconstruction(
    reconstructed_flat: ArrayLike,
    reference_flat: ArrayLike,
    *,
    denormalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    image_shape: tuple[int, ...] | None = None,
    exact_db: float = EXACT_PSNR_DB,
    approx_db: float = APPROX_PSNR_DB,
) -> BatchQuality:
    """Match a reconstructed batch to the ground truth and score it.

    Parameters
    ----------
    reconstructed_flat
        ``(B_rec, n)`` recovered inputs in arbitrary order, in the model's (normalized) input
        space. Tensor or array, any real dtype.
    reference_flat
        ``(B_ref, n)`` the client's true inputs, same space.
    denormalize
        Maps a ``(B, n)`` normalized batch back to ``(B, C, H, W)`` images in ``[0, 1]``
        (e.g. :meth:`fl_attack.data.images.ImageData.denormalize`); matching and all scores are
        computed on its output with ``data_range = 1``. When None, the data are compared as
        they are, with ``data_range`` the max-min of the reference.
    image_shape
        ``(C, H, W)`` used to reshape the samples into images for SSIM / LPIPS. Not needed
        when ``denormalize`` already returns images; without either, SSIM is None.
    exact_db, approx_db
        PSNR thresholds for an exact and an approximate sample reconstruction.

    Returns
    -------
    BatchQuality
    """
    rec = _flatten_batch(reconstructed_flat, name="reconstructed_flat")
    ref = _flatten_batch(reference_flat, name="reference_flat")
    if ref.shape[0] == 0:
        raise ValueError("reference_flat must contain at least one sample")
    if rec.shape[0] > 0 and rec.shape[1] != ref.shape[1]:
        raise ValueError(
            f"reconstructed samples have n={rec.shape[1]} entries but reference samples have n={ref.shape[1]}"
        )
    if image_shape is not None:
        image_shape = tuple(int(s) for s in image_shape)
        if math.prod(image_shape) != ref.shape[1]:
            raise ValueError(
                f"image_shape {image_shape} has {math.prod(image_shape)} entries but samples "
                f"have n={ref.shape[1]}"
            )
    ref_img = _to_images(ref, denormalize=denormalize, image_shape=image_shape)
    if rec.shape[0] > 0:
        rec_img = _to_images(rec, denormalize=denormalize, image_shape=image_shape)
    else:
        rec_img = ref_img[:0]
    if denormalize is not None:
        data_range = 1.0
    else:
        spread = float(ref.max() - ref.min())
        data_range = spread if spread > 0 else 1.0

    order = match_samples(rec_img, ref_img)
    matched = order >= 0
    psnr_values = torch.zeros(ref.shape[0], dtype=torch.float64)
    is_image = ref_img.dim() == 4
    ssim_values = torch.zeros(ref.shape[0], dtype=torch.float64) if is_image else None
    lpips_values: torch.Tensor | None = None
    if matched.any():
        picked = rec_img[order[matched]]
        psnr_values[matched] = psnr(picked, ref_img[matched], data_range=data_range)
        if ssim_values is not None:
            ssim_values[matched] = ssim(picked, ref_img[matched], data_range=data_range)
            if denormalize is not None:
                distances = lpips_distance(picked, ref_img[matched])
                if distances is not None:
                    lpips_values = torch.full((ref.shape[0],), math.nan, dtype=torch.float64)
                    lpips_values[matched] = distances

    mean_psnr = float(psnr_values.mean())
    return BatchQuality(
        psnr=psnr_values,
        ssim=ssim_values,
        lpips=lpips_values,
        order=order,
        mean_psnr=mean_psnr,
        exact_fraction=float((psnr_values > exact_db).double().mean()),
        approx_fraction=float((psnr_values > approx_db).double().mean()),
        batch_exact=mean_psnr > exact_db,
    )


def batch_accuracy(qualities: Sequence[BatchQuality], *, threshold_db: float = 90.0) -> float:
    """Fraction of batches whose mean PSNR exceeds ``threshold_db`` (SPEAR++ "Acc").

    Use 90 dB for exact recovery, 25 dB for the DP-SGD and FedAvg settings.
    """
    if len(qualities) == 0:
        raise ValueError("batch_accuracy needs at least one BatchQuality")
    return sum(q.mean_psnr > threshold_db for q in qualities) / len(qualities)
