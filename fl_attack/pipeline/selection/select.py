"""Choosing b directions from a candidate pool and turning them into inputs.

Shared by SPEAR and SPEAR++: the sparsest independent set first (Spielman et al.), then
greedy swaps that raise the sparsity-matching coefficient (SPEAR Sec. 4.2; also from the
best earlier selection), scale from the
bias gradient (SPEAR Thm. 3.5), and an orthonormal completion when fewer than b
independent directions exist (SPEAR++ Sec. 4.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    chunk_rows,
    eigh_seconds,
    elementwise_seconds,
    lstsq_seconds,
    matmul_seconds,
    qr_seconds,
)
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ObservedUpdate

#: Residual norm below which a unit direction counts as dependent on those already chosen.
RANK_TOLERANCE = 1e-6

#: ``1 - |cos|`` below which two candidates are twins, never selected together. Distinct
#: samples' directions are far apart (on CIFAR-10 at b = 150 every true direction keeps a
#: residual > 0.5 against the span of the others).
TWIN_COS_TOLERANCE = 1e-4

#: Flops one position of a swap round may spend on scoring trial sets.
SWAP_FLOPS = 2e9
#: Entries of a unit direction below this are set to zero (denormals stall batched LAPACK).
_NEGLIGIBLE = 1e-150


@dataclass(frozen=True)
class Selection:
    """b chosen directions, their scale, the inputs they imply and how well they match.

    Attributes
    ----------
    directions
        ``(b, b)``: row ``i`` is the unit direction ``q_i`` (placeholders included).
    found
        ``(b,)`` bool: False for placeholder rows from the orthonormal completion.
    inputs
        ``(b, n)`` recovered layer inputs, ``X^T = Q^{-1} R``.
    per_sample
        ``(b,)`` sparsity-matching coefficient of each column.
    sparsity_matching
        Mean of ``per_sample`` (lambda of SPEAR Def. 4.1).
    """

    directions: torch.Tensor
    found: torch.Tensor
    inputs: torch.Tensor
    per_sample: torch.Tensor
    sparsity_matching: float

    @property
    def complete(self) -> bool:
        return bool(self.found.all())


class SparsityMatchingScorer:
    """Evaluates sets of directions by the sparsity-matching coefficient, batched.

    ``Z = W X + b 1^T`` is computed as ``(W R^T) Q^{-T} + b 1^T`` so a set of b directions
    costs ``O(m b^2 + b^3)`` instead of ``O(m n b)``.
    """

    def __init__(self, update: ObservedUpdate, factors: LowRankFactors, tolerance: ZeroTolerance) -> None:
        self.update = update
        self.factors = factors
        self.tolerance = tolerance
        self.pre_activation_basis = update.weight @ factors.right.T  # (m, b)

    def scales(self, directions: torch.Tensor) -> torch.Tensor:
        """Per-direction scales ``s`` with ``left Q diag(s) 1 = dL/db`` for ``(..., b, b)`` row sets."""
        columns = self.factors.left @ directions.transpose(-1, -2)  # (..., m, b)
        target = self.update.bias_update.expand(*columns.shape[:-2], -1).unsqueeze(-1)
        return torch.linalg.lstsq(columns, target).solution.squeeze(-1)

    def score(self, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample matching ``(..., b)`` and the inverse scaled ``Q`` for ``(..., b, b)`` row sets.

        Singular sets score ``-1`` everywhere.
        """
        unit = directions / directions.norm(dim=-1, keepdim=True)
        # a zero or non-finite direction makes its set invalid; LAPACK must never see NaN/Inf
        eye = torch.eye(unit.shape[-1], dtype=unit.dtype, device=unit.device)
        valid = torch.isfinite(unit).all(dim=-1).all(dim=-1)
        unit = torch.where(valid[..., None, None], unit, eye)
        unit = torch.where(unit.abs() < _NEGLIGIBLE, torch.zeros_like(unit), unit)
        scales = self.scales(unit)
        # Q = U diag(s) with unit columns U: invert the well-scaled U, then divide by s
        unit_inv, singular = _safe_inverse(unit.transpose(-1, -2))
        finite = valid & torch.isfinite(scales).all(dim=-1) & (scales != 0).all(dim=-1)
        safe_scales = torch.where(finite[..., None], scales, torch.ones_like(scales))
        q_inv = unit_inv / safe_scales.unsqueeze(-1)  # rows of U^{-1} divided by s_i
        columns = self.factors.left @ unit.transpose(-1, -2)  # unit gradient columns (..., m, b)
        is_zero = columns.abs() <= self.tolerance.thresholds(unit).unsqueeze(-2)
        agree = self.inactive(q_inv) == is_zero
        per_sample = agree.to(directions.dtype).mean(dim=-2)
        bad = singular | ~finite
        per_sample = torch.where(bad.unsqueeze(-1), torch.full_like(per_sample, -1.0), per_sample)
        return per_sample, q_inv

    def inactive(self, q_inv: torch.Tensor) -> torch.Tensor:
        """``(..., m, b)``: the neurons each sample's gradient column must vanish on, given the
        inverse scaled ``Q`` of ``(..., b, b)`` sets: those its input leaves inactive."""
        return (self.pre_activation_basis @ q_inv.transpose(-1, -2) + self.update.bias[:, None]) <= 0

    def accepts(self, selection: Selection, *, accept_matching: float) -> bool:
        """Whether ``selection`` is accepted as exact: complete, each sample matching ``accept_matching``."""
        return selection.complete and float(selection.per_sample.min()) >= accept_matching

    def inputs(self, directions: torch.Tensor) -> torch.Tensor:
        """``X^T = Q^{-1} R`` for one set of b directions."""
        _, q_inv = self.score(directions)
        return q_inv @ self.factors.right


def score_seconds(width: int, size: int) -> float:
    """Estimated seconds that :meth:`SparsityMatchingScorer.score` spends on one set of ``size``
    directions of a layer of ``width`` neurons (see :mod:`fl_attack.pipeline.budget.deadline`)."""
    return (
        lstsq_seconds(width, size)
        + matmul_seconds(6.0 * width * size * size)
        + 2 * qr_seconds(size)
        + elementwise_seconds(4.0 * width * size)
    )


def finishing_seconds(update: ObservedUpdate, *, batch_size: int) -> float:
    """Estimated seconds of the final selection and self-check of ``batch_size`` directions."""
    m, n, b = update.width, update.input_dim, batch_size
    return 4 * score_seconds(m, b) + matmul_seconds(6.0 * b * b * (m + n)) + eigh_seconds(b)


def better_selection(candidate: Selection, incumbent: Selection) -> bool:
    """Whether ``candidate`` finds more samples than ``incumbent``, or as many with a higher matching."""
    key_c = (int(candidate.found.sum()), candidate.sparsity_matching)
    key_i = (int(incumbent.found.sum()), incumbent.sparsity_matching)
    return key_c > key_i


def _safe_inverse(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverses of ``(..., b, b)`` matrices by QR, with a flag for the singular ones.

    Not LU: on a batch holding an exactly singular matrix (a swap trial repeating a chosen
    direction) multi-threaded MKL LU stalls for minutes (``DLASWP`` errors). Singular
    matrices get the identity's inverse and ``True`` in the flag.
    """
    q, r = torch.linalg.qr(matrices)
    diagonal = r.diagonal(dim1=-2, dim2=-1).abs()
    singular = (diagonal <= RANK_TOLERANCE**2 * diagonal.amax(dim=-1, keepdim=True)).any(dim=-1)
    singular |= ~torch.isfinite(diagonal).all(dim=-1)
    eye = torch.eye(matrices.shape[-1], dtype=matrices.dtype, device=matrices.device)
    r = torch.where(singular[..., None, None], eye, r)
    q = torch.where(singular[..., None, None], eye, q)
    return torch.linalg.solve_triangular(r, q.transpose(-1, -2), upper=True), singular


def orthonormal_completion(directions: torch.Tensor, size: int) -> torch.Tensor:
    """Rows spanning the orthogonal complement of ``directions`` in R^size."""
    if directions.shape[0] == 0:
        return torch.eye(size, dtype=torch.float64, device=directions.device)
    q, _ = torch.linalg.qr(directions.T, mode="complete")
    return q[:, directions.shape[0] :].T


def sparsest_independent(candidates: torch.Tensor, zero_counts: torch.Tensor, size: int) -> list[int]:
    """Greedily take the sparsest candidates that keep the chosen set linearly independent.

    A candidate within ``TWIN_COS_TOLERANCE`` of a chosen one is skipped as its twin (the
    same sample's direction rounded on slightly different zeros): independent in exact
    arithmetic, but it would push out another sample and make ``Q`` ill-conditioned. Runs on
    the host: each candidate's two tests would otherwise be two device round trips.
    """
    candidates = candidates.cpu()
    order = torch.argsort(zero_counts.cpu(), descending=True, stable=True).tolist()
    chosen: list[int] = []
    basis = torch.empty(0, candidates.shape[1], dtype=candidates.dtype, device=candidates.device)
    units = torch.empty_like(basis)
    for index in order:
        vector = candidates[index] / candidates[index].norm()
        if units.shape[0] and float((units @ vector).abs().max()) > 1.0 - TWIN_COS_TOLERANCE:
            continue
        residual = vector
        if basis.shape[0]:
            # twice: one pass of classical Gram-Schmidt loses orthogonality among near-dependent
            # candidates (mixtures of a few look-alike samples), and a dependent set passes
            for _ in range(2):
                residual = residual - basis.T @ (basis @ residual)
        norm = residual.norm()
        if norm > RANK_TOLERANCE:
            chosen.append(index)
            basis = torch.cat([basis, (residual / norm)[None]], dim=0)
            units = torch.cat([units, vector[None]], dim=0)
            if len(chosen) == size:
                break
    return chosen


def select(
    scorer: SparsityMatchingScorer,
    candidates: torch.Tensor,
    zero_counts: torch.Tensor,
    *,
    max_swap_rounds: int = 50,
    deadline: Deadline = Deadline.never(),
    good_enough: float = 1.0,
    incumbent: torch.Tensor | None = None,
) -> Selection:
    """Two-stage greedy selection of b directions from ``candidates`` (rows).

    Parameters
    ----------
    scorer
        Scores sets of directions by sparsity matching.
    candidates
        ``(c, b)`` deduplicated candidate directions.
    zero_counts
        ``(c,)`` number of exact zeros of each candidate's gradient column (or any sparsity
        score, larger meaning sparser).
    max_swap_rounds
        Upper bound on improving swaps (each round tries every swap of the worst columns).
    deadline
        Deadline after which no further swap is tried.
    good_enough
        Per-sample matching at which a chosen direction is not swapped any more; swaps stop
        when every direction reaches it. On large layers a swap round costs seconds, so
        directions that already match (e.g. >= 0.99) must not be traded for marginal gains.
    incumbent
        ``(b, b)`` directions of an earlier selection: when all of them are among
        ``candidates``, the swaps also start from them and the better end point is returned.
        A larger pool can make the sparsest set start far from an earlier, better selection
        (sparse mixtures outnumber the samples), and greedy swaps may not find the way back.
    """
    b = scorer.factors.batch_size
    chosen = sparsest_independent(candidates, zero_counts, b) if candidates.shape[0] else []
    found = len(chosen)
    if found < b:
        picked = candidates[chosen] if chosen else candidates.new_zeros(0, b)
        unit = picked / picked.norm(dim=1, keepdim=True) if found else picked
        directions = torch.cat([unit, orthonormal_completion(unit, b).to(candidates.dtype)], dim=0)
        found_mask = torch.arange(b, device=candidates.device) < found
        per_sample, q_inv = scorer.score(directions)
        per_sample = torch.where(found_mask, per_sample, torch.zeros_like(per_sample))
        return Selection(
            directions, found_mask, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean())
        )

    starts = [chosen]
    warm = _rows_of(incumbent, candidates) if incumbent is not None and incumbent.shape[0] == b else None
    if warm is not None and sorted(warm) != sorted(chosen):
        starts.append(warm)
    found_mask = torch.ones(b, dtype=torch.bool, device=candidates.device)
    for start in starts:
        # a start the scorer accepts as it is (e.g. one local epoch, whose later samples match
        # W_0 below good_enough by nature) is not traded for swaps that raise W_0's matching
        per_sample, q_inv = scorer.score(candidates[start])
        unswapped = Selection(
            candidates[start], found_mask, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean())
        )
        if scorer.accepts(unswapped, accept_matching=good_enough):
            return unswapped
    ends = [
        _swapped(scorer, candidates, zero_counts, start, max_swap_rounds, deadline, good_enough)
        for start in starts
    ]
    directions, per_sample = max(ends, key=lambda end: float(end[1].sum()))
    _, q_inv = scorer.score(directions)
    return Selection(
        directions, found_mask, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean())
    )


def _rows_of(directions: torch.Tensor, candidates: torch.Tensor) -> list[int] | None:
    """The candidate row of each direction (parallel to it), or None when one has none."""
    unit = directions / directions.norm(dim=1, keepdim=True)
    pool = candidates / candidates.norm(dim=1, keepdim=True)
    cos = (unit @ pool.T).abs()
    best = cos.max(dim=1)
    if bool((best.values < 1 - TWIN_COS_TOLERANCE).any()):
        return None
    rows = best.indices.tolist()
    return rows if len(set(rows)) == len(rows) else None


def _swapped(
    scorer: SparsityMatchingScorer,
    candidates: torch.Tensor,
    zero_counts: torch.Tensor,
    chosen: list[int],
    max_swap_rounds: int,
    deadline: Deadline,
    good_enough: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy swaps from the ``chosen`` rows: the directions reached and their per-sample matching."""
    chosen = list(chosen)
    directions = candidates[chosen].clone()
    per_sample, _ = scorer.score(directions)
    chosen_set = set(chosen)
    unused = sorted(
        (i for i in range(candidates.shape[0]) if i not in chosen_set), key=lambda i: -float(zero_counts[i])
    )
    for _ in range(max_swap_rounds):
        if not unused or bool((per_sample >= good_enough).all()) or deadline.expired():
            break
        improved = _best_swap(scorer, directions, per_sample, candidates, unused, deadline, good_enough)
        if improved is None:
            break
        position, pool_index, per_sample = improved
        replaced = chosen[position]
        chosen[position] = unused[pool_index]
        unused[pool_index] = replaced
        directions[position] = candidates[chosen[position]]
    return directions, per_sample


def _best_swap(
    scorer: SparsityMatchingScorer,
    directions: torch.Tensor,
    per_sample: torch.Tensor,
    candidates: torch.Tensor,
    unused: list[int],
    deadline: Deadline,
    good_enough: float = 1.0,
) -> tuple[int, int, torch.Tensor] | None:
    """The swap (chosen position, unused candidate) that raises total matching the most."""
    current = float(per_sample.sum())
    # one trial set costs ~ m b^2: on large layers only the sparsest unused candidates and
    # the worst positions are tried, so that a swap round stays within seconds
    m, b = scorer.factors.left.shape[0], directions.shape[0]
    per_set = m * b * b
    pool = candidates[unused[: max(16, int(SWAP_FLOPS // per_set))]]
    positions = torch.argsort(per_sample).tolist()
    positions = positions[: max(8, int(SWAP_FLOPS * 8 // (per_set * pool.shape[0])))]
    best: tuple[float, int, int, torch.Tensor] | None = None
    size = chunk_rows(score_seconds(m, b), device=directions.device)
    # try the worst-matching positions first; each is a batched evaluation over the pool, in
    # chunks so that the deadline is checked within it (the best swap so far stays valid)
    for position in positions:
        if per_sample[position] >= good_enough or deadline.expired():
            break
        for start in range(0, pool.shape[0], size):
            if deadline.expired():
                break
            chunk = pool[start : start + size]
            trial = directions.expand(chunk.shape[0], -1, -1).clone()
            trial[:, position] = chunk
            scores, _ = scorer.score(trial)
            totals = scores.sum(dim=1)
            index = int(torch.argmax(totals))
            gain = float(totals[index]) - current
            if gain > 1e-12 and (best is None or gain > best[0]):
                best = (gain, position, start + index, scores[index])
    if best is None:
        return None
    return best[1], best[2], best[3]


def prune_doubtful(
    scorer: SparsityMatchingScorer,
    selection: Selection,
    *,
    deadline: Deadline = Deadline.never(),
    min_gain: float = 5e-3,
    max_pruned_fraction: float = 0.5,
) -> Selection:
    """Drop selected directions whose presence spoils the reconstruction of the others.

    Under noise the selection may hold a wrong direction (a sparse mixture standing in for a
    sample whose own direction was never found). Because ``X^T = Q^{-1} R`` couples all rows,
    one wrong row pollutes every sample's input, which shows as a low sparsity matching of
    the *other* samples. A row is dropped (replaced by the orthonormal completion, which
    claims nothing) when that raises the mean matching of the other rows by more than
    ``min_gain``; rows are dropped greedily, up to a tenth of them at once when each helps
    on its own and the extra ones help beyond the best single drop. Dropped rows are
    reported as not found. When the matching carries no signal (heavy noise on wide layers
    it sits near 0.5 for every row) this cannot tell right from wrong rows, and
    ``max_pruned_fraction`` bounds the damage.
    """
    b = scorer.factors.batch_size
    kept = selection.directions[selection.found]
    kept = kept / kept.norm(dim=1, keepdim=True)
    floor = max(1, math.ceil((1.0 - max_pruned_fraction) * b))
    current = _no_deadline(_kept_matching(scorer, kept[None], b))[0]
    while kept.shape[0] > floor and not deadline.expired():
        k = kept.shape[0]
        # a dropped row's own matching must not count: compare the other rows only
        others = (current.sum() - current) / (k - 1)
        leave_one_out = torch.stack([torch.cat([kept[:i], kept[i + 1 :]]) for i in range(k)])
        trials = _kept_matching(scorer, leave_one_out, b, deadline=deadline)
        if trials is None:
            break
        gains = trials.mean(dim=-1) - others
        best = int(torch.argmax(gains))
        if float(gains[best]) <= min_gain:
            break
        mask = _keep_mask(k, torch.tensor([best], device=kept.device), kept.device)
        value = trials[best]
        helpful = torch.nonzero(gains >= max(min_gain, 0.5 * float(gains[best]))).flatten()
        helpful = helpful[torch.argsort(gains[helpful], descending=True)][: max(1, min(k - floor, k // 10))]
        if helpful.numel() > 1:
            # several at once only when the extra drops do not hurt the rows that stay
            bulk = _keep_mask(k, helpful, kept.device)
            bulk_value = _no_deadline(_kept_matching(scorer, kept[bulk][None], b))[0]
            single_on_bulk = value[bulk[mask]]
            if float(bulk_value.mean()) >= float(single_on_bulk.mean()) + min_gain:
                mask, value = bulk, bulk_value
        kept, current = kept[mask], value
    if kept.shape[0] == int(selection.found.sum()):
        return selection
    directions = torch.cat([kept, orthonormal_completion(kept, b).to(kept.dtype)], dim=0)
    per_sample, q_inv = scorer.score(directions)
    found = torch.arange(b, device=kept.device) < kept.shape[0]
    per_sample = torch.where(found, per_sample, torch.zeros_like(per_sample))
    return Selection(directions, found, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean()))


def _keep_mask(size: int, drop: torch.Tensor, device: torch.device) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool, device=device)
    mask[drop] = False
    return mask


def _no_deadline(values: torch.Tensor | None) -> torch.Tensor:
    """The matching of a call made without a deadline (which therefore always returns)."""
    assert values is not None
    return values


def _kept_matching(
    scorer: SparsityMatchingScorer, kept_sets: torch.Tensor, b: int, *, deadline: Deadline = Deadline.never()
) -> torch.Tensor | None:
    """Per-row matching ``(s, k)`` of the kept rows of each ``(s, k, b)`` set completed to
    ``b`` rows; None when the deadline passes first."""
    sets, k = kept_sets.shape[0], kept_sets.shape[1]
    m = scorer.factors.left.shape[0]
    # bounded memory (~ size * m * b doubles) and time between deadline checks
    size = min(32, chunk_rows(score_seconds(m, b) + qr_seconds(b), device=kept_sets.device))
    values = []
    for start in range(0, sets, size):
        if deadline.expired():
            return None
        chunk = kept_sets[start : start + size]
        if k < b:
            basis, _ = torch.linalg.qr(chunk.transpose(-1, -2), mode="complete")
            chunk = torch.cat([chunk, basis[..., k:].transpose(-1, -2)], dim=-2)
        per_sample, _ = scorer.score(chunk)
        values.append(per_sample[..., :k])
    return torch.cat(values)
