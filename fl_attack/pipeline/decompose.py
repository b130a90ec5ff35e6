"""Low-rank decomposition of a weight gradient and batch-size estimation from its spectrum."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: A singular-value gap at least this large is taken as the noise-free rank cut
#: (float32 rounding puts the tail about six orders of magnitude below the signal).
CLEAN_GAP = 1e3


def _gavish_donoho_omega(beta: float) -> float:
    """Optimal hard-threshold factor for unknown noise (Gavish & Donoho, 2014, Eq. 5)."""
    return 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43


@dataclass(frozen=True)
class SpectrumEstimate:
    """Rank and noise read off the singular values of an observed gradient.

    Attributes
    ----------
    batch_size
        Estimated rank ``b`` of the noise-free gradient.
    gap
        Ratio ``s_b / s_{b+1}`` (``inf`` when ``b`` is the full rank).
    relative_noise
        ``s_{b+1} / s_b``: how strongly the tail perturbs the recovered subspace. About
        ``1e-7`` for a clean float32 gradient, approaching 1 under heavy DP noise.
    noisy
        True when no clean gap was found and the Gavish-Donoho threshold was used.
    """

    batch_size: int
    gap: float
    relative_noise: float
    noisy: bool


def estimate_batch_size(singular_values: torch.Tensor, *, shape: tuple[int, int]) -> SpectrumEstimate:
    """Estimate the batch size from the singular values of the weight gradient.

    A clean gradient has a gap of several orders of magnitude after the ``b``-th singular
    value even in float32; it is found as the largest log-gap. Without such a gap (DP noise)
    the rank is the number of singular values above the Gavish-Donoho threshold computed
    from the median singular value.

    Parameters
    ----------
    singular_values
        Singular values in decreasing order.
    shape
        ``(m, n)`` of the gradient, for the aspect ratio of the noise threshold.

    Raises
    ------
    ValueError
        If the spectrum is zero or the gradient has no detectable low-rank structure, which
        happens when the batch is at least as large as ``min(m, n)``.
    """
    s = singular_values.detach().double().cpu()
    if s.numel() == 0 or s[0] <= 0:
        raise ValueError("the gradient has no non-zero singular value")
    full = s.numel()
    tiny = s[0] * torch.finfo(torch.float64).eps * max(shape)
    # exact zeros come from neurons dead for the whole batch (or exact low-rank input): they
    # are not part of the noise tail, so the gap is searched among the non-zero values only
    nonzero = int((s > tiny).sum())
    log_s = torch.log(s[:nonzero])
    gaps = log_s[:-1] - log_s[1:]
    if gaps.numel():
        best = int(torch.argmax(gaps))
        best_gap = math.exp(float(gaps[best]))
        if best_gap >= CLEAN_GAP:
            b = best + 1
            return SpectrumEstimate(b, best_gap, float(s[b] / s[b - 1]), False)
    if nonzero < full:
        return SpectrumEstimate(nonzero, math.inf, float(s[nonzero] / s[nonzero - 1]), False)
    beta = min(shape) / max(shape)
    threshold = _gavish_donoho_omega(beta) * float(torch.median(s))
    b = int((s > threshold).sum())
    tail = s[b:]
    small, large = math.sqrt(min(shape)), math.sqrt(max(shape))
    if b > 0 and tail.numel() >= 3 and large > small:
        # Gaussian noise has a flat tail (Marchenko-Pastur bulk between sqrt(N) -/+ sqrt(M));
        # a tail decaying far faster is signal: a batch too large to leave a low rank
        bulk_spread = (large + small) / (large - small)
        if float(tail[0] / tail[-1].clamp_min(tiny)) > 4.0 * bulk_spread:
            b = full
    if b == 0 or b >= full:
        largest = math.exp(float(gaps.max())) if gaps.numel() else 1.0
        raise ValueError(
            f"no low-rank structure in the gradient spectrum (largest gap x{largest:.3g}):"
            f" the batch size is probably >= min(m, n) = {min(shape)}, which no exact attack can invert"
        )
    return SpectrumEstimate(b, float(s[b - 1] / s[b]), float(s[b] / s[b - 1]), True)


@dataclass(frozen=True)
class LowRankFactors:
    """``dL/dW ~= L @ R`` with the SPEAR++ preconditioning applied.

    ``left`` (m, b) has orthonormal columns (the preconditioned left factor ``U_b``);
    ``right`` (b, n) is ``S_b V_b^T``. A column ``q`` of the disaggregation matrix maps to
    the (unscaled) gradient column ``left @ q`` of one sample and the inputs are
    ``X^T = Q^{-1} right``.
    """

    left: torch.Tensor
    right: torch.Tensor
    singular_values: torch.Tensor
    spectrum: SpectrumEstimate

    @property
    def batch_size(self) -> int:
        return int(self.left.shape[1])


def decompose(weight_grad: torch.Tensor, *, batch_size: int | None = None) -> LowRankFactors:
    """SVD-based low-rank decomposition of a weight gradient (SPEAR++ Sec. 4.1).

    Preconditioning ``L <- (L L^T)^{-1/2}``-style whitening of the SVD factor
    ``U_b S_b^{1/2}`` leaves exactly ``U_b``, so the left factor is orthonormal and the
    search for sparse directions is well conditioned.

    Parameters
    ----------
    weight_grad
        ``(m, n)`` float64 gradient (or update proportional to it).
    batch_size
        Use this rank instead of the spectrum estimate.

    Raises
    ------
    ValueError
        If ``batch_size`` is not in ``[1, min(m, n) - 1]`` or no rank can be estimated.
    """
    m, n = weight_grad.shape
    if m < n:
        # LAPACK is several times faster on the tall orientation
        v_t, s, u_t = torch.linalg.svd(weight_grad.T, full_matrices=False)
        u, vh = u_t.T, v_t.T
    else:
        u, s, vh = torch.linalg.svd(weight_grad, full_matrices=False)
    spectrum = estimate_batch_size(s, shape=(m, n))
    if batch_size is not None:
        if not 1 <= batch_size < min(m, n):
            raise ValueError(
                f"batch_size={batch_size} is not attackable for an (m, n) = ({m}, {n}) layer: "
                f"need 1 <= b < min(m, n) = {min(m, n)} (b > m or b > n leaves no low-rank structure)"
            )
        b = batch_size
        tail = float(s[b] / s[b - 1]) if b < s.numel() and s[b - 1] > 0 else 0.0
        spectrum = SpectrumEstimate(b, 1.0 / tail if tail > 0 else math.inf, tail, spectrum.noisy)
    else:
        b = spectrum.batch_size
        if b >= min(m, n):
            raise ValueError(
                f"estimated batch size {b} >= min(m, n) = {min(m, n)}: the gradient is not low-rank"
            )
    if s[b - 1] <= 0:
        raise ValueError(f"the gradient has rank below the requested batch size {b}")
    left = u[:, :b].contiguous()
    right = (s[:b, None] * vh[:b]).contiguous()
    return LowRankFactors(left=left, right=right, singular_values=s, spectrum=spectrum)


def noise_std(singular_values: torch.Tensor, *, batch_size: int, shape: tuple[int, int]) -> float:
    """Std of i.i.d. noise on the gradient entries, from the energy beyond rank ``b``.

    Noise of std ``sigma`` on an ``(m, n)`` gradient leaves about ``sigma^2 (m - b)(n - b)``
    of energy outside the rank-``b`` signal subspace.
    """
    m, n = shape
    dof = (m - batch_size) * (n - batch_size)
    tail = singular_values[batch_size:].double()
    if dof <= 0 or tail.numel() == 0:
        return 0.0
    return math.sqrt(float((tail**2).sum()) / dof)
