"""The pool of exact candidate directions collected during a search."""

from __future__ import annotations

from dataclasses import replace

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    chunk_rows,
    eigh_seconds,
    elementwise_seconds,
    map_rows,
    matmul_seconds,
)
from fl_attack.pipeline.search.sparsity import (
    ZeroTolerance,
    deduplicate,
    excess_zeros,
    normalize_columns,
    refine_on_zeros,
    zero_masks,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: Two kernels of the same sample differ by up to ~this many times the relative noise
#: ``s_{b+1}/s_b`` in angle: after local FedAvg steps some of their b - 1 "zeros" are only
#: small, not exact. Distinct samples differ by far more.
DUPLICATE_ANGLE_PER_NOISE = 50.0


def duplicate_cos_tolerance(relative_noise: float) -> float:
    """``1 - |cos|`` below which two proposals are the same direction.

    A near-duplicate kept as a second candidate can be selected beside its twin and make
    ``Q`` ill-conditioned (every sample then reconstructs as noise), so the tolerance
    follows the angle ``DUPLICATE_ANGLE_PER_NOISE * relative_noise``, within ``[1e-9, 1e-2]``.
    """
    if not relative_noise >= 0:
        raise ValueError(f"relative_noise must be >= 0, got {relative_noise}")
    angle = DUPLICATE_ANGLE_PER_NOISE * relative_noise
    return min(1e-2, max(1e-9, 0.5 * angle**2))


class CandidatePool:
    """Deduplicated unit directions whose gradient columns are sparse enough.

    Parameters
    ----------
    factors
        Low-rank factors restricted to the informative rows (see :func:`informative_rows`).
    tolerance
        Zero tolerance for the entries of unit gradient columns.
    min_zeros
        A proposal is a confident candidate with at least this many exact zeros (SPEAR's
        sparsity filter).
    weak_min_zeros
        Proposals with fewer zeros than ``min_zeros`` but at least this many are kept as weak
        candidates: true directions of samples whose inputs resemble others have fewer
        zeros than the binomial model expects, but so do sparse mixtures of two samples.
    cos_tolerance
        Proposals whose |cosine| with a kept direction exceeds ``1 - cos_tolerance`` are duplicates.
    min_excess
        Under noise (per-direction tolerance) a confident candidate must also have this many
        standard deviations more zeros than a dense column (see :func:`excess_zeros`).

    Attributes
    ----------
    excess
        ``(c,)`` the z-score of each stored direction's zero count against a dense column;
        the sparsity ranking of noisy gradients.
    """

    def __init__(
        self,
        factors: LowRankFactors,
        tolerance: ZeroTolerance,
        *,
        min_zeros: int,
        weak_min_zeros: int,
        cos_tolerance: float,
        min_excess: float = 6.0,
    ) -> None:
        self.factors = factors
        self.tolerance = tolerance
        self.min_zeros = min_zeros
        self.weak_min_zeros = min(weak_min_zeros, min_zeros)
        self.cos_tolerance = cos_tolerance
        self.min_excess = min_excess
        b = factors.batch_size
        self.directions = factors.left.new_zeros(0, b)
        self.zero_counts = torch.zeros(0, dtype=torch.long, device=factors.left.device)
        self.excess = factors.left.new_zeros(0)
        self.mixtures = factors.left.new_zeros(0, b)
        self.mixture_counts = torch.zeros(0, dtype=torch.long, device=factors.left.device)
        self.mixture_limit = max(64, 4 * b)
        self.proposals_seen = 0
        self.rejected_sparsity = 0
        self.twin_planes: list[
            torch.Tensor
        ] = []  # planes already split (fl_attack.pipeline.selection.near_duplicates)

    def __len__(self) -> int:
        return int(self.directions.shape[0])

    def add(self, proposals: torch.Tensor, *, deadline: Deadline = Deadline.never()) -> int:
        """Refine, filter and deduplicate ``(k, b)`` proposals; returns how many new confident
        or weak candidates were stored.

        The work runs in chunks: at ``deadline`` the proposals not yet processed are dropped.
        """
        if proposals.shape[0] == 0:
            return 0
        proposals = proposals[torch.isfinite(proposals).all(dim=1)]
        # cheap first pass: most proposals are duplicates of each other or too dense
        proposals = self._unique_sparse(normalize_columns(proposals), deadline)
        if proposals.shape[0] == 0:
            return 0
        m, b = self.factors.left.shape
        refine_seconds = 2 * (matmul_seconds(2.0 * m * b * b + 2.0 * m * b) + eigh_seconds(b))
        proposals = map_rows(
            lambda chunk: normalize_columns(refine_on_zeros(self.factors, chunk, self.tolerance)),
            proposals,
            seconds_per_row=refine_seconds,
            deadline=deadline,
        )
        proposals = proposals[torch.isfinite(proposals).all(dim=1) & (proposals.norm(dim=1) > 0.5)]
        counts = zero_masks(self.factors, proposals, self.tolerance).sum(dim=1)
        excess = excess_zeros(self.factors, proposals, self.tolerance, counts)
        keep = counts >= self.min_zeros
        if self.tolerance.per_direction:
            keep &= excess >= self.min_excess
        self.rejected_sparsity += int((~keep).sum())
        # more zeros than the b - 1 any kernel has: a sparse mixture of a few samples
        sparse_mixture = ~keep & (counts >= self.factors.batch_size + 2)
        new_weak = self._remember_mixtures(proposals[sparse_mixture], counts[sparse_mixture])
        proposals, counts, excess = proposals[keep], counts[keep], excess[keep]
        if proposals.shape[0] == 0:
            return new_weak
        if len(self):
            # a proposal duplicating a pool member with fewer zeros is its more exact version
            similarity = (proposals @ self.directions.T).abs()
            nearest = similarity.argmax(dim=1)
            duplicate = similarity.gather(1, nearest[:, None]).squeeze(1) > 1.0 - self.cos_tolerance
            better = duplicate & (excess > self.excess[nearest])
            for index in torch.nonzero(better).flatten().tolist():
                target = int(nearest[index])
                if excess[index] > self.excess[target]:
                    self.directions[target] = proposals[index]
                    self.zero_counts[target] = counts[index]
                    self.excess[target] = excess[index]
            proposals, counts, excess = proposals[~duplicate], counts[~duplicate], excess[~duplicate]
        kept = deduplicate(proposals, cos_tolerance=self.cos_tolerance)
        self.directions = torch.cat([self.directions, proposals[kept]], dim=0)
        self.zero_counts = torch.cat([self.zero_counts, counts[kept]], dim=0)
        self.excess = torch.cat([self.excess, excess[kept]], dim=0)
        return int(kept.numel()) + new_weak

    def _unique_sparse(self, unit: torch.Tensor, deadline: Deadline) -> torch.Tensor:
        """The unit proposals that repeat no earlier one and have at least ``b - 1`` zeros.

        Processed in chunks of rows until ``deadline``; counts them in ``proposals_seen``.
        """
        m, b = self.factors.left.shape
        total = unit.shape[0]
        seconds = matmul_seconds(2.0 * b * (total + m)) + elementwise_seconds(2.0 * (total + m))
        size = chunk_rows(seconds, device=unit.device)
        kept = []
        for start in range(0, total, size):
            if deadline.expired():
                break
            stop = min(total, start + size)
            # a row repeats an earlier one (kept or not) when their |cosine| is close to 1
            similar = (unit[start:stop] @ unit[:stop].T).abs() > 1.0 - self.cos_tolerance
            earlier = (
                torch.arange(stop, device=unit.device)[None, :]
                < torch.arange(start, stop, device=unit.device)[:, None]
            )
            chunk = unit[start:stop][~(similar & earlier).any(dim=1)]
            self.proposals_seen += stop - start
            counts = zero_masks(self.factors, chunk, self.tolerance).sum(dim=1)
            kept.append(chunk[counts >= b - 1])
        return torch.cat(kept, dim=0) if kept else unit[:0]

    def _remember_mixtures(self, mixtures: torch.Tensor, counts: torch.Tensor) -> int:
        """Store sparse mixtures; returns how many new weak candidates were stored."""
        if mixtures.shape[0] == 0:
            return 0
        before = len(self.mixtures)
        merged = torch.cat([self.mixtures, mixtures], dim=0)
        merged_counts = torch.cat([self.mixture_counts, counts], dim=0)
        kept = deduplicate(merged, cos_tolerance=self.cos_tolerance)
        # keep the sparsest: they are the likeliest true directions of look-alike samples
        kept = kept[torch.argsort(merged_counts[kept], descending=True, stable=True)[: self.mixture_limit]]
        self.mixtures, self.mixture_counts = merged[kept], merged_counts[kept]
        return int(((kept >= before) & (merged_counts[kept] >= self.weak_min_zeros)).sum())

    def weak(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weak candidates (see ``weak_min_zeros``) and their zero counts."""
        keep = self.mixture_counts >= self.weak_min_zeros
        return self.mixtures[keep], self.mixture_counts[keep]


def informative_rows(
    factors: LowRankFactors, tolerance: ZeroTolerance
) -> tuple[LowRankFactors, torch.Tensor]:
    """Drop neurons whose gradient row is zero for the whole batch: they constrain nothing.

    Returns the factors restricted to the other rows and the ``(m,)`` boolean mask of those rows.
    """
    active = factors.left.norm(dim=1) > tolerance.absolute
    return replace(factors, left=factors.left[active].contiguous()), active


def is_member(rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """Which of the ``(k, b)`` ``rows`` are (up to sign and float64 digits) rows of ``pool``."""
    if pool.shape[0] == 0:
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    similarity = (rows / rows.norm(dim=1, keepdim=True)) @ (pool / pool.norm(dim=1, keepdim=True)).T
    return (similarity.abs() > 1 - 1e-9).any(dim=1)


def rows_not_in(rows: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The ``rows`` that are not (up to sign and float64 digits) rows of ``chosen``."""
    if rows.shape[0] == 0 or chosen.shape[0] == 0:
        return rows
    return rows[~is_member(rows, chosen)]
