"""Zero detection, exact kernel polishing and sparsity thresholds for candidate directions.

A candidate direction ``q`` (unit vector in R^b) proposes the gradient column ``left @ q``
of one sample, whose entries vanish exactly where that sample's ReLU is inactive. Because
``left`` has orthonormal columns, ``left @ q`` is a unit vector too, so one absolute zero
tolerance serves every candidate of a clean gradient; under noise the tolerance is per direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    eigh_seconds,
    elementwise_seconds,
    map_rows,
    matmul_seconds,
    qr_seconds,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: On noisy gradients an entry within this many predicted noise deviations of 0 is a zero:
#: it balances the true zeros missed against the small non-zeros admitted (measured on
#: CIFAR-10 at (20, 200) and (150, 4000) under DP noise).
NOISE_SIGMAS = 2.5


@dataclass(frozen=True)
class ZeroTolerance:
    """When an entry of a unit gradient column counts as an exact zero.

    ``absolute`` applies to the entries of ``left @ q`` with ``||q|| = 1``; it is derived from
    the relative noise ``s_{b+1}/s_b`` of the spectrum (or a user-given noise level).

    On a noisy gradient (``entry_noise > 0``) each direction gets its own threshold instead:
    i.i.d. noise of std ``sigma`` on the gradient perturbs the entries of the unit column
    ``left @ q`` by about ``sigma * ||S_b^{-1} q||`` (first-order perturbation of the
    subspace; ``S_b`` are the top singular values), so directions of weak, nearly collinear
    samples get wider zeros than those of strong ones. See :meth:`thresholds`.
    """

    absolute: float
    relative_noise: float
    entry_noise: float = 0.0
    inverse_singular_values: torch.Tensor | None = None
    noise_sigmas: float = NOISE_SIGMAS

    @classmethod
    def from_noise(cls, relative_noise: float, *, width: int, factor: float = 30.0) -> ZeroTolerance:
        scale = min(max(factor * relative_noise, 1e-10), 0.5)
        return cls(absolute=scale / math.sqrt(width), relative_noise=relative_noise)

    def with_entry_noise(self, entry_noise: float, singular_values: torch.Tensor) -> ZeroTolerance:
        """This tolerance with per-direction thresholds for gradient noise of std ``entry_noise``.

        ``singular_values`` are the ``b`` retained singular values of the gradient.
        """
        if not math.isfinite(entry_noise) or entry_noise < 0:
            raise ValueError(f"entry_noise must be finite and >= 0, got {entry_noise}")
        if bool((singular_values <= 0).any()):
            raise ValueError("the retained singular values must be positive")
        return replace(self, entry_noise=float(entry_noise), inverse_singular_values=1.0 / singular_values)

    @property
    def per_direction(self) -> bool:
        return self.entry_noise > 0 and self.inverse_singular_values is not None

    def thresholds(self, unit_directions: torch.Tensor) -> torch.Tensor:
        """Zero threshold of each unit direction, shape ``unit_directions.shape[:-1]``."""
        if not self.per_direction:
            return unit_directions.new_full(unit_directions.shape[:-1], self.absolute)
        assert self.inverse_singular_values is not None  # set with per_direction
        inverse = self.inverse_singular_values.to(device=unit_directions.device, dtype=unit_directions.dtype)
        spread = (unit_directions * inverse).norm(dim=-1)
        return (self.noise_sigmas * self.entry_noise * spread).clamp_min(1e-300)


def min_sparsity(width: int, *, false_rejection: float) -> float:
    """Smallest zero fraction ``tau`` a correct direction is required to have (SPEAR Sec. 4.1).

    Chosen so that a column with Bernoulli(1/2) zeros falls below ``tau * m`` zeros with
    probability at most ``false_rejection``: ``2^-m sum_{i <= tau m} C(m, i) <= p``.
    """
    log_half_m = -width * math.log(2.0)
    cumulative = 0.0
    for i in range(width + 1):
        cumulative += math.exp(
            math.lgamma(width + 1) - math.lgamma(i + 1) - math.lgamma(width - i + 1) + log_half_m
        )
        if cumulative > false_rejection:
            return i / width
    return 1.0


def normalize_columns(directions: torch.Tensor) -> torch.Tensor:
    """Scale each row of ``(k, b)`` directions to unit norm with a canonical sign.

    The sign is chosen so that the entry of largest magnitude is positive, which makes
    ``q`` and ``-q`` compare equal after normalisation.
    """
    directions = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    pivot = directions.gather(1, directions.abs().argmax(dim=1, keepdim=True))
    return directions * torch.where(pivot < 0, -1.0, 1.0).to(directions.dtype)


def deduplicate(directions: torch.Tensor, *, cos_tolerance: float = 1e-6) -> torch.Tensor:
    """Keep one representative of each group of directions equal up to sign and scale.

    Returns the indices (into ``directions``) of the kept rows, in their original order.
    """
    if directions.shape[0] <= 1:
        return torch.arange(directions.shape[0], device=directions.device)
    unit = normalize_columns(directions)
    similar = (unit @ unit.T).abs() > 1.0 - cos_tolerance
    # a row is kept when no earlier row is similar to it
    earlier = torch.triu(similar, diagonal=1)
    duplicate = earlier.any(dim=0)
    return torch.nonzero(~duplicate).flatten()


def zero_masks(factors: LowRankFactors, directions: torch.Tensor, tolerance: ZeroTolerance) -> torch.Tensor:
    """``(k, m)`` boolean mask of the exact zeros of each candidate's gradient column."""
    unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (unit @ factors.left.T).abs() <= tolerance.thresholds(unit)[:, None]


def excess_zeros(
    factors: LowRankFactors, directions: torch.Tensor, tolerance: ZeroTolerance, counts: torch.Tensor
) -> torch.Tensor:
    """How many standard deviations ``counts`` zeros exceed what a dense column would show.

    Under noise a direction's threshold can be wide enough that even a dense unit column
    (entries ~ N(0, 1/m)) has many entries below it, so raw counts favour the noisiest
    directions. The z-score against that dense null ranks and filters them fairly; on a clean
    gradient the null count is ~0 and the score orders like the counts.
    """
    m = factors.left.shape[0]
    unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    null = torch.erf(tolerance.thresholds(unit) * math.sqrt(m / 2.0)).clamp(1e-12, 1 - 1e-12)
    return (counts.to(null.dtype) - m * null) / torch.sqrt(m * null * (1 - null))


def least_squares_kernel(factors: LowRankFactors, directions: torch.Tensor, *, rows: int) -> torch.Tensor:
    """For each direction, the unit vector minimising the norm of its ``rows`` smallest entries.

    A loose minimum of the sphere search is only approximately sparse; the least-squares
    kernel of a generous set of its smallest rows (most of them true zeros) lands much closer
    to the exact direction than the minimum itself, so the exact rounding that follows picks
    true zeros only.
    """
    left = factors.left
    values = (directions @ left.T).abs()
    chosen = torch.topk(values, k=rows, dim=1, largest=False).indices
    submatrices = left[chosen]
    _, eigenvectors = torch.linalg.eigh(submatrices.transpose(1, 2) @ submatrices)
    return eigenvectors[:, :, 0]


def kernel_of_smallest(factors: LowRankFactors, directions: torch.Tensor, *, rows: int) -> torch.Tensor:
    """Round approximate directions to exact ones: the kernel of their ``rows`` smallest rows.

    For each candidate the ``rows`` entries of ``left @ q`` closest to zero select a submatrix
    ``L_A`` of ``left``; the returned unit vector spans ``ker(L_A)`` (SPEAR Thm. 3.3). With
    ``rows = b - 1`` this is exact whenever all chosen rows are true zeros of one sample.
    """
    left = factors.left
    b = left.shape[1]
    values = (directions @ left.T).abs()
    chosen = torch.topk(values, k=rows, dim=1, largest=False).indices
    submatrices = left[chosen]  # (k, rows, b)
    if rows >= b:
        _, _, vh = torch.linalg.svd(submatrices, full_matrices=True)
        return vh[:, -1, :]
    q, _ = torch.linalg.qr(submatrices.transpose(1, 2), mode="complete")  # (k, b, b)
    return q[:, :, -1]


def round_minima(
    factors: LowRankFactors,
    minima: torch.Tensor,
    *,
    rows: int,
    exact: bool,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Round the sphere search's minima: least-squares kernel of their ``rows`` smallest rows,
    then (``exact``) the exact kernel of the ``b - 1`` smallest.

    Runs in chunks and stops at ``deadline``: returns the rounded directions of the minima
    processed by then, in order (a prefix of ``minima``).
    """
    m, b = factors.left.shape
    seconds = (
        matmul_seconds(4.0 * m * b + 2.0 * rows * b * b) + elementwise_seconds(2.0 * m) + eigh_seconds(b)
    )
    if exact:
        seconds += qr_seconds(b)

    def rounded(chunk: torch.Tensor) -> torch.Tensor:
        estimate = least_squares_kernel(factors, chunk, rows=rows)
        return kernel_of_smallest(factors, estimate, rows=b - 1) if exact else estimate

    return map_rows(rounded, minima, seconds_per_row=seconds, deadline=deadline)


def refine_on_zeros(
    factors: LowRankFactors, directions: torch.Tensor, tolerance: ZeroTolerance, *, iterations: int = 2
) -> torch.Tensor:
    """Least-squares kernel over all detected zero rows of each candidate.

    Using every detected zero (about ``m/2`` rows) instead of ``b - 1`` averages out the noise
    of a float32 or DP-noised gradient; on a clean gradient it only sharpens the digits.
    """
    left = factors.left
    b = left.shape[1]
    for _ in range(iterations):
        mask = zero_masks(factors, directions, tolerance).to(left.dtype)  # (k, m)
        enough = mask.sum(dim=1) >= b - 1
        if not bool(enough.any()):
            break
        gram = torch.einsum("km,mi,mj->kij", mask[enough], left, left)
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
        # zeros shared by several samples leave a kernel of dimension > 1: stay where the
        # direction already is inside it instead of jumping to an arbitrary kernel vector
        # only an exact (float64-level) second kernel vector: a merely small eigenvalue is
        # noise of the gradient, which the smallest eigenvector averages out
        floor = 1e-12 * eigenvalues[:, -1:]
        in_kernel = (eigenvalues <= floor).to(left.dtype)
        in_kernel[:, 0] = 1.0
        coefficients = (eigenvectors.transpose(1, 2) @ directions[enough].unsqueeze(-1)).squeeze(-1)
        multi = in_kernel.sum(dim=1) > 1
        projected = (eigenvectors @ (coefficients * in_kernel).unsqueeze(-1)).squeeze(-1)
        refined = torch.where(multi[:, None], projected, eigenvectors[:, :, 0])
        refined = refined / refined.norm(dim=1, keepdim=True).clamp_min(1e-300)
        # keep the orientation of the input so repeated refinement is stable
        sign = torch.sign((refined * directions[enough]).sum(dim=1, keepdim=True))
        directions = directions.clone()
        directions[enough] = refined * torch.where(sign == 0, 1.0, sign)
    return directions
