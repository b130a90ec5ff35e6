"""Low-rank decomposition of a weight gradient and batch-size estimation from its spectrum."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    chunked_gram,
    chunked_product,
    matmul_seconds,
    require_time,
    svd_seconds,
    svdvals_seconds,
    symmetric_eigen_seconds,
)
from fl_attack.pipeline.spectrum.gram_spectrum import noisy_spectrum

#: Without a known rounding floor, a singular-value gap at least this large is taken as the
#: noise-free rank cut (float32 rounding of a gradient puts the tail about six orders of
#: magnitude below the signal).
CLEAN_GAP = 1e3

#: Rounding alone leaves singular values below this many times the rounding floor of
#: :func:`rounding_floor` (measured: 0.2x for float32 weights differenced after one step,
#: 0.9-1.6x for float32 autograd gradients); values above it are signal.
ROUNDING_EDGE = 4.0

#: The smallest gap ``s_b / s_{b+1}`` accepted as a clean rank cut when the values below it
#: are at the rounding floor, or form a flat noise bulk.
MIN_CLEAN_GAP = 10.0

#: The smallest gap accepted (as a noisy cut) between samples barely above the rounding floor
#: and the rounding below them.
MIN_ROUNDING_GAP = 3.0

#: The smallest gap accepted (as a noisy cut) above a flat noise bulk; within a Gaussian
#: bulk consecutive singular values differ by far less (largest ratio ~1.2-1.5).
MIN_BULK_GAP = 5.0


def rounding_floor(
    weight_grad: torch.Tensor, *, unit_roundoff: float, weight: torch.Tensor | None = None
) -> float:
    """The largest singular value that floating-point rounding alone gives an observed update.

    The rounding error of each entry is below ``unit_roundoff`` times its magnitude: the
    update's own (a gradient computed in that precision), plus the weight's when the update is
    a difference of weights rounded to that precision (``W - lr * g`` in float32 loses the
    digits of a small step below those of ``W``). Errors of rms ``e`` on the ``m'`` non-zero
    rows of an ``(m, n)`` update have singular values below about ``e (sqrt(m') + sqrt(n))``.

    Parameters
    ----------
    weight_grad
        ``(m, n)`` observed update (any float dtype).
    unit_roundoff
        ``torch.finfo(dtype).eps`` of the precision the update was computed in.
    weight
        ``(m, n)`` layer weight the update was taken at, when the update may be a difference
        of weights; None counts the update's own rounding only.
    """
    if not unit_roundoff > 0 or not math.isfinite(unit_roundoff):
        raise ValueError(f"unit_roundoff must be positive and finite, got {unit_roundoff}")
    update = weight_grad.double()
    rows = update.abs().amax(dim=1) > 0  # rows of neurons dead for the batch stay exact zeros
    count = int(rows.sum())
    if count == 0:
        return 0.0
    rms = float(update[rows].square().mean().sqrt())
    if weight is not None:
        rms += float(weight.double()[rows].square().mean().sqrt())
    return unit_roundoff * rms * (math.sqrt(count) + math.sqrt(update.shape[1]))


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
        True when no clean gap was found: the batch stands above noise (a noise bulk, the
        Gavish-Donoho threshold, or rounding only a few times below the weakest sample).
    rounding_floor
        The largest singular value rounding alone could give (:func:`rounding_floor`); 0 when
        unknown.
    """

    batch_size: int
    gap: float
    relative_noise: float
    noisy: bool
    rounding_floor: float = 0.0


def estimate_batch_size(
    singular_values: torch.Tensor, *, shape: tuple[int, int], rounding_floor: float | None = None
) -> SpectrumEstimate:
    """Estimate the batch size from the singular values of the weight gradient.

    In order:

    1. With a known ``rounding_floor``: the singular values above what rounding alone gives
       (``ROUNDING_EDGE`` times the floor) are the batch, when the next one is at least
       ``MIN_CLEAN_GAP`` times smaller. This holds at any learning rate: a small FedSGD step
       differenced in float32 leaves the rounding of the weights, far above that of the
       step, so no fixed gap separates signal from rounding. When the weakest samples are
       only a few times above the floor, the largest gap (at least ``MIN_ROUNDING_GAP``) into
       the rounding is the batch, marked ``noisy``.
    2. The largest log-gap between non-zero singular values, when at least ``CLEAN_GAP``.
    3. The largest log-gap, when at least ``MIN_BULK_GAP`` and followed by a flat noise bulk
       (three or more values spread no wider than a Marchenko-Pastur bulk allows), marked
       ``noisy``: DP noise, or rounding of weights when the floor is not known. Unlike the
       Gavish-Donoho threshold this is not misled by exact zeros below the bulk.
    4. The number of non-zero singular values, when the rest are exact zeros (neurons dead
       for the whole batch, or an exactly low-rank float64 update) and, with a known floor,
       the smallest non-zero one is above rounding.
    5. Otherwise (DP noise) the number of singular values above the Gavish-Donoho threshold
       computed from the median singular value (``noisy``).

    Parameters
    ----------
    singular_values
        Singular values in decreasing order.
    shape
        ``(m, n)`` of the gradient, for the aspect ratio of the noise threshold.
    rounding_floor
        :func:`rounding_floor` of the observed update, if known.

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
    floor = float(rounding_floor) if rounding_floor is not None else 0.0
    tiny = s[0] * torch.finfo(torch.float64).eps * max(shape)
    # exact zeros come from neurons dead for the whole batch (or exact low-rank input): they
    # are not part of the noise tail, so gaps are searched among the non-zero values only
    nonzero = int((s > tiny).sum())

    def clean(b: int) -> SpectrumEstimate:
        following = float(s[b]) if b < full else 0.0
        gap = float(s[b - 1]) / following if following > 0 else math.inf
        return SpectrumEstimate(b, gap, following / float(s[b - 1]), False, floor)

    if floor > 0:
        signal = int((s > ROUNDING_EDGE * floor).sum())
        if 1 <= signal < full and (signal >= nonzero or float(s[signal - 1] / s[signal]) >= MIN_CLEAN_GAP):
            return clean(signal)
        cut = _rounding_cut(s[:nonzero], floor)
        if cut is not None:
            return SpectrumEstimate(cut, float(s[cut - 1] / s[cut]), float(s[cut] / s[cut - 1]), True, floor)
    log_s = torch.log(s[:nonzero])
    gaps = log_s[:-1] - log_s[1:]
    if gaps.numel():
        best = int(torch.argmax(gaps))
        best_gap = math.exp(float(gaps[best]))
        if best_gap >= CLEAN_GAP:
            return clean(best + 1)
        if best_gap >= MIN_BULK_GAP and _flat_bulk(s[best + 1 : nonzero], shape):
            # a noise bulk of unknown origin (DP noise, or rounding the floor did not account for)
            b = best + 1
            return SpectrumEstimate(b, best_gap, float(s[b] / s[b - 1]), True, floor)
    if nonzero < full and float(s[nonzero - 1]) > ROUNDING_EDGE * floor:
        return clean(nonzero)
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
        rounding = ""
        if floor > 0:
            above = int((s > ROUNDING_EDGE * floor).sum())
            rounding = (
                f", or the update's weakest samples are lost in float rounding ({above} singular values"
                f" stand above its rounding floor {floor:.3g}: a learning rate this small keeps too few digits)"
            )
        raise ValueError(
            f"no low-rank structure in the gradient spectrum (largest gap x{largest:.3g}):"
            f" the batch size is probably >= min(m, n) = {min(shape)}, which no exact attack can invert"
            + rounding
        )
    return SpectrumEstimate(b, float(s[b - 1] / s[b]), float(s[b] / s[b - 1]), True, floor)


def _rounding_cut(s: torch.Tensor, floor: float) -> int | None:
    """The batch size of an update whose weakest samples are only a few times above rounding.

    The largest gap ``s_k / s_{k+1}`` (at least ``MIN_ROUNDING_GAP``) among the cuts whose
    next value is within rounding (below ``ROUNDING_EDGE`` times the floor) and whose last
    value is above the floor itself; None when there is none.
    """
    if s.numel() < 2:
        return None
    gaps = s[:-1] / s[1:]
    allowed = (s[1:] <= ROUNDING_EDGE * floor) & (s[:-1] > floor)
    if not bool(allowed.any()):
        return None
    gaps = torch.where(allowed, gaps, torch.zeros_like(gaps))
    best = int(torch.argmax(gaps))
    return best + 1 if float(gaps[best]) >= MIN_ROUNDING_GAP else None


def _flat_bulk(tail: torch.Tensor, shape: tuple[int, int]) -> bool:
    """Whether singular values look like the bulk of a noise matrix: three or more, spread
    no wider than four times the Marchenko-Pastur ratio of the non-zero part of the update."""
    if tail.numel() < 3:
        return False
    small, large = math.sqrt(tail.numel()), math.sqrt(max(shape))
    if large <= small:
        return True
    return float(tail[0] / tail[-1]) <= 4.0 * (large + small) / (large - small)


#: Layers whose smaller side is at least this long get their singular vectors by subspace
#: iteration (:func:`_top_singular_triplets`), or under noise from the Gram matrix
#: (:func:`_gram_triplets`), instead of a full SVD (measured at m = 4000, n = 3072: 8-18 s
#: against 46-55 s on a loaded core; at m = 1100 the full SVD is faster).
LARGE_SIDE = 2048

#: Extra vectors carried by the subspace iteration beyond the batch size.
SUBSPACE_OVERSAMPLE = 8

#: Subspace iterations; each multiplies the error by ``(s_{k+1} / s_b)^2``.
SUBSPACE_ITERATIONS = 3

#: Subspace iteration is used only when ``s_{k+1} / s_b`` is below this ratio.
SUBSPACE_MAX_RATIO = 1e-3


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


def decompose(
    weight_grad: torch.Tensor,
    *,
    batch_size: int | None = None,
    rounding_floor: float | None = None,
    deadline: Deadline = Deadline.never(),
) -> LowRankFactors:
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
    rounding_floor
        :func:`rounding_floor` of the update, if known (see :func:`estimate_batch_size`).
    deadline
        Deadline by which to give up (``Deadline.never()``: never). Matrix products
        check it between chunks; a LAPACK call (singular values, a full SVD, an eigendecomposition)
        is not started when its estimated cost (:mod:`fl_attack.pipeline.budget.deadline`) does not fit
        before it. The factors do not depend on it.

    Raises
    ------
    ValueError
        If ``batch_size`` is not in ``[1, min(m, n) - 1]`` or no rank can be estimated.
    fl_attack.pipeline.budget.deadline.DeadlineReached
        If the deadline passed, or would pass during a LAPACK call, before the factors are known.
    """
    m, n = weight_grad.shape
    noisy, u, vh = None, None, None
    if min(m, n) >= LARGE_SIDE:
        # the noisy route costs less than the singular values, but is not started when they would not fit
        require_time(
            svdvals_seconds(m, n),
            deadline=deadline,
            what=f"the singular values of a {m} x {n} update",
            device=weight_grad.device,
        )
        if batch_size is not None and 1 <= batch_size < min(m, n):
            noisy = noisy_spectrum(
                weight_grad,
                rank=batch_size,
                oversample=SUBSPACE_OVERSAMPLE,
                max_ratio=SUBSPACE_MAX_RATIO,
                deadline=deadline,
            )
    if noisy is not None:
        s, top_vectors = noisy
    elif min(m, n) >= LARGE_SIDE:
        s = torch.linalg.svdvals(weight_grad)
    else:
        require_time(
            svd_seconds(m, n),
            deadline=deadline,
            what=f"the SVD of a {m} x {n} update",
            device=weight_grad.device,
        )
        u, s, vh = _full_svd(weight_grad)
    spectrum = estimate_batch_size(s, shape=(m, n), rounding_floor=rounding_floor)
    if batch_size is not None:
        if not 1 <= batch_size < min(m, n):
            raise ValueError(
                f"batch_size={batch_size} is not attackable for an (m, n) = ({m}, {n}) layer: "
                f"need 1 <= b < min(m, n) = {min(m, n)} (b > m or b > n leaves no low-rank structure)"
            )
        b = batch_size
        tail = float(s[b] / s[b - 1]) if b < s.numel() and s[b - 1] > 0 else 0.0
        spectrum = SpectrumEstimate(
            b, 1.0 / tail if tail > 0 else math.inf, tail, spectrum.noisy, spectrum.rounding_floor
        )
    else:
        b = spectrum.batch_size
        if b >= min(m, n):
            raise ValueError(
                f"estimated batch size {b} >= min(m, n) = {min(m, n)}: the gradient is not low-rank"
            )
    if s[b - 1] <= 0:
        raise ValueError(f"the gradient has rank below the requested batch size {b}")
    top = s
    if noisy is not None:
        u, top, vh = _gram_triplets(weight_grad, rank=b, deadline=deadline, top_vectors=top_vectors)
    elif u is None or vh is None:
        u, top, vh = _top_singular_triplets(weight_grad, s, rank=b, deadline=deadline)
    left = u[:, :b].contiguous()
    right = (top[:b, None] * vh[:b]).contiguous()
    return LowRankFactors(left=left, right=right, singular_values=s, spectrum=spectrum)


def _full_svd(weight_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``u, s, vh`` of an ``(m, n)`` matrix."""
    m, n = weight_grad.shape
    if m < n:
        # LAPACK is several times faster on the tall orientation
        v_t, s, u_t = torch.linalg.svd(weight_grad.T, full_matrices=False)
        return u_t.T, s, v_t.T
    return torch.linalg.svd(weight_grad, full_matrices=False)


def _top_singular_triplets(
    weight_grad: torch.Tensor, singular_values: torch.Tensor, *, rank: int, deadline: Deadline
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``rank`` singular triplets ``(u, s, vh)`` without a full SVD.

    Computing every singular vector of a large layer (``m = 4000, n = 3072``) costs several
    times more than its singular values, and the attack needs only the top ``b``. Subspace
    iteration on ``rank + SUBSPACE_OVERSAMPLE`` vectors converges like
    ``(s_{k+1} / s_b)^(2q + 1)`` after ``q`` iterations; with a clean rank cut that ratio is
    below ``1e-3`` and ``SUBSPACE_ITERATIONS`` iterations reach float64 precision. A cut
    with a smaller gap (noise) takes the vectors of the Gram matrix (:func:`_gram_triplets`),
    which need no convergence. The products check ``deadline`` between chunks.
    """
    s = singular_values
    k = min(rank + SUBSPACE_OVERSAMPLE, int(s.numel()))
    following = float(s[k]) if k < s.numel() else 0.0
    if following >= SUBSPACE_MAX_RATIO * float(s[rank - 1]):
        return _gram_triplets(weight_grad, rank=rank, deadline=deadline)
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(weight_grad.shape[1], k, generator=generator, dtype=weight_grad.dtype)
    basis = torch.linalg.qr(chunked_product(weight_grad, probe.to(weight_grad.device), deadline=deadline)).Q
    for _ in range(SUBSPACE_ITERATIONS):
        right_basis = torch.linalg.qr(chunked_product(weight_grad.T, basis, deadline=deadline)).Q
        basis = torch.linalg.qr(chunked_product(weight_grad, right_basis, deadline=deadline)).Q
    m, n = weight_grad.shape
    require_time(
        matmul_seconds(2.0 * m * n * k),
        deadline=deadline,
        what="the projection on the top subspace",
        device=weight_grad.device,
    )
    small_u, top, vh = torch.linalg.svd(basis.T @ weight_grad, full_matrices=False)
    return basis @ small_u, top, vh


def _gram_triplets(
    weight_grad: torch.Tensor,
    *,
    rank: int,
    deadline: Deadline,
    top_vectors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``rank`` singular triplets ``(u, s, vh)`` from the Gram matrix of the shorter side.

    The eigenvectors of ``W^T W`` (or ``W W^T``) span the top singular subspace up to
    ``eps s_1^2 / (s_b^2 - s_{b+1}^2)``, ``s_1 / (s_b + s_{b+1})`` times the full SVD's own
    ``eps s_1 / (s_b - s_{b+1})`` (measured on the CIFAR-10 (150, 4000) update under DP noise of
    0.25x its median entry: rank-b products 9e-15 apart), and the eigendecomposition with vectors
    costs less than a full SVD (there, one thread: 17 s against 38 s at load 4-5, 75 s against
    155 s at load 8). The triplets are those of the projection of ``W`` on that subspace: the left
    factor is orthonormal to LAPACK precision whatever the conditioning of the Gram matrix.
    """
    m, n = weight_grad.shape
    tall = m >= n
    oriented = weight_grad if tall else weight_grad.T
    if top_vectors is None:
        gram = chunked_gram(oriented, deadline=deadline)
        size = gram.shape[0]
        require_time(
            symmetric_eigen_seconds(size),
            deadline=deadline,
            what=f"the eigenvectors of a {size} x {size} Gram matrix",
            device=gram.device,
        )
        top_vectors = torch.linalg.eigh(gram)[1]
    basis = top_vectors[:, -rank:].flip(1)  # top right singular vectors of `oriented`
    small_u, top, small_vh = torch.linalg.svd(
        chunked_product(oriented, basis, deadline=deadline), full_matrices=False
    )
    if tall:
        return small_u, top, small_vh @ basis.T
    # weight_grad = oriented^T ~= basis small_vh^T diag(top) small_u^T
    return basis @ small_vh.T, top, small_u.T.contiguous()


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


def weakest_sample_margins(
    factors: LowRankFactors, *, entry_noise: float, shape: tuple[int, int]
) -> dict[str, float]:
    """How far the weakest sample's singular value ``s_b`` stands above what hides it.

    ``signal_to_rounding``: against the update's float rounding floor (below ~4 the weakest sample
    is lost to rounding); ``rank_noise_ratio``: against the top of the noise bulk of i.i.d. entry
    noise of std ``entry_noise`` (the Marchenko-Pastur edge; below ~1 it is lost). Each only where
    that floor or noise is positive.
    """
    m, n = shape
    b = factors.batch_size
    weakest = float(factors.singular_values[b - 1])
    margins = {}
    floor = factors.spectrum.rounding_floor
    if floor > 0:
        margins["signal_to_rounding"] = weakest / floor
    if entry_noise > 0:
        edge = entry_noise * (math.sqrt(max(m - b, 1)) + math.sqrt(max(n - b, 1)))
        margins["rank_noise_ratio"] = weakest / edge
    return margins
