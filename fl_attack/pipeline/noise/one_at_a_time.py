"""Selecting directions one at a time on wide layers under heavy DP noise.

The joint selection (:func:`fl_attack.pipeline.selection.select.select`) scores a set of ``b`` directions by
the sparsity matching of the inputs ``X^T = Q^{-1} R`` they imply. Every input depends on every
direction, so under heavy noise a few wrong directions spoil the matching of all the others: on
CIFAR-10 at (b, m) = (150, 4000) with DP noise of 0.5x the median gradient entry the true
directions match at 0.82 together, and at 0.55 once 5 of them are replaced by random ones. Swaps
and pruning then see no signal, and a selection of 123 true and 27 wrong directions recovers
nothing (8 dB).

A direction's *own* matching is decoupled from the rest when the other rows are a set ``T`` of
directions already trusted, completed by an orthonormal basis of the rest of ``R^b`` (which
claims nothing): the row of ``Q^{-1}`` of a candidate ``c`` is then its residual against
``span(T)`` divided by ``r . c``, its scale that row times the bias gradient (in the coordinates
of the left factor), and its input's ReLU pattern follows at ``O(m b)`` per candidate. On the
batch above a true direction matches at 0.72-0.80 this way, a wrong one at 0.43-0.73 (median
0.50, chance). :func:`trusted_selection` grows ``T`` greedily, sparsest candidate (largest
excess of zeros) first, admits a candidate whose own matching reaches ``min_matching``, then
re-checks every member against the others (leave one out) and every candidate against the final
set, a few times. The directions it does not trust stay unclaimed (the completion), and the
search can aim at them (:func:`complement_of_trusted`).
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.noise.blend_refit import blend_refit
from fl_attack.pipeline.noise.joint_refit import joint_refit
from fl_attack.pipeline.selection.select import (
    Selection,
    SparsityMatchingScorer,
    orthonormal_completion,
    prune_doubtful,
)

#: Own matching (see the module docstring) at which a candidate is trusted. Measured on CIFAR-10
#: at (150, 4000), DP noise 0.5x the median: true directions 0.72-0.80 (median 0.74), wrong ones
#: median 0.50 (chance) and 0.73 at most; 0.6 kept 120 of 125 true and 1 of 633 wrong ones.
MIN_OWN_MATCHING = 0.6

#: ``|cos|`` above which a candidate is a twin of a trusted direction and never joins it (distinct
#: samples' directions stay further apart: every true direction keeps a residual above 0.5
#: against the span of the others on CIFAR-10 at b = 150).
TWIN_COS = 0.9

#: Own matching by which a twin must beat the member it replaces: the own matching ranks copies
#: of one sample only coarsely (on the (150, 4000) batch above, replacing at any gain lost 2 dB,
#: at a gain of 0.05 it won 0.2 dB over never replacing).
TWIN_MARGIN = 0.05

#: Candidates judged together (each beside the others) before the greedy growth (:func:`_seed`).
SEED_SIZE = 10

#: Passes of re-checking the trusted set against itself and the pool.
RECHECK_PASSES = 3


def _unit(directions: torch.Tensor) -> torch.Tensor:
    return directions / directions.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def own_matching(scorer: SparsityMatchingScorer, rows: torch.Tensor) -> torch.Tensor:
    """Sparsity matching of each direction from the rows of ``Q^{-1}`` that belong to it.

    Parameters
    ----------
    scorer
        The attack's scorer (left factor, weight, bias, bias gradient, zero tolerance).
    rows
        ``(k, 2, b)``: for each direction its unit vector ``u`` (``rows[:, 0]``) and its row
        ``p`` of ``Q^{-1}`` (``rows[:, 1]``, with ``p . u = 1``).

    Returns
    -------
    torch.Tensor
        ``(k,)`` the share of the ``m`` neurons on which the zeros of the gradient column
        ``left @ u`` agree with the inactive neurons of the implied input ``p R / s``, with the
        scale ``s = p . (left^T dL/db)``; -1 where the scale is 0 or not finite.
    """
    unit, dual = rows[:, 0], rows[:, 1]
    left = scorer.factors.left
    scales = dual @ (left.T @ scorer.update.bias_update)
    valid = torch.isfinite(scales) & (scales != 0) & torch.isfinite(dual).all(dim=1)
    safe = torch.where(valid, scales, torch.ones_like(scales))
    pre_activation = scorer.pre_activation_basis @ (dual / safe[:, None]).T + scorer.update.bias[:, None]
    columns = left @ unit.T  # (m, k)
    is_zero = columns.abs() <= scorer.tolerance.thresholds(unit)[None, :]
    agree = ((pre_activation <= 0) == is_zero).to(unit.dtype).mean(dim=0)
    return torch.where(valid, agree, torch.full_like(agree, -1.0))


def _duals(members: torch.Tensor) -> torch.Tensor:
    """Rows ``p_i`` in ``span(members)`` with ``p_i . u_j = delta_ij`` (``members`` unit rows)."""
    gram = members @ members.T
    return torch.linalg.solve(gram, members)


def _residual_rows(members: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """For each candidate ``c`` its row of ``Q^{-1}`` beside ``members`` and the completion:
    the residual ``r`` of ``c`` against ``span(members)``, divided by ``r . c``."""
    if members.shape[0] == 0:
        residual = candidates
    else:
        basis, _ = torch.linalg.qr(members.T)  # (b, k)
        residual = candidates - (candidates @ basis) @ basis.T
    norm = (residual * candidates).sum(dim=1, keepdim=True)
    return residual / torch.where(norm.abs() > 1e-12, norm, torch.full_like(norm, math.nan))


def _twin_free(members: torch.Tensor, candidate: torch.Tensor) -> bool:
    return members.shape[0] == 0 or float((members @ candidate).abs().max()) <= TWIN_COS


def trusted_selection(
    scorer: SparsityMatchingScorer,
    candidates: torch.Tensor,
    excess: torch.Tensor,
    *,
    min_matching: float = MIN_OWN_MATCHING,
    deadline: Deadline = Deadline.never(),
) -> Selection:
    """The candidates trusted one at a time by their own matching, completed to ``b`` rows.

    Parameters
    ----------
    scorer
        The attack's scorer.
    candidates
        ``(c, b)`` candidate directions.
    excess
        ``(c,)`` their excess of zeros over a dense column
        (:func:`fl_attack.pipeline.search.sparsity.excess_zeros`): the order in which they are tried.
    min_matching
        Own matching at which a candidate is trusted.
    deadline
        Deadline after which no further candidate is tried and no re-check
        pass starts (the seed, :func:`_seed`, is always judged).

    Returns
    -------
    Selection
        The trusted directions (``found``) first, then an orthonormal completion (not found);
        ``per_sample`` is the matching of the whole set (0 for the completion).

    Raises
    ------
    ValueError
        If ``candidates`` is not ``(c, b)`` or ``excess`` not ``(c,)``, or ``min_matching`` is
        not in (0, 1].
    """
    b = scorer.factors.batch_size
    if candidates.dim() != 2 or candidates.shape[1] != b:
        raise ValueError(f"candidates must have shape (c, {b}), got {tuple(candidates.shape)}")
    if excess.shape != (candidates.shape[0],):
        raise ValueError(f"excess must have shape ({candidates.shape[0]},), got {tuple(excess.shape)}")
    if not 0 < min_matching <= 1:
        raise ValueError(f"min_matching must be in (0, 1], got {min_matching}")
    unit = _unit(candidates)
    order = torch.argsort(excess, descending=True, stable=True).tolist()
    chosen = _seed(scorer, unit, order, min_matching=min_matching)
    for index in order:
        if deadline.expired():
            break  # what is trusted so far stands; the rest stays unclaimed
        if index in chosen:
            continue
        if len(chosen) == b:
            break
        members = unit[chosen]
        if not _twin_free(members, unit[index]):
            continue
        row = _residual_rows(members, unit[index : index + 1])
        own = own_matching(scorer, torch.stack([unit[index : index + 1], row], dim=1))
        if float(own[0]) >= min_matching:
            chosen.append(index)
    for _ in range(RECHECK_PASSES):
        if deadline.expired() or not chosen:
            break
        updated = _recheck(scorer, unit, excess, chosen, min_matching=min_matching)
        if updated == chosen:
            break
        chosen = updated
    return _completed(scorer, unit[chosen])


def _seed(
    scorer: SparsityMatchingScorer, unit: torch.Tensor, order: list[int], *, min_matching: float
) -> list[int]:
    """The first ``SEED_SIZE`` twin-free candidates in ``order`` that match beside each other.

    A lone direction's input is a blend of every sample (its row of ``Q^{-1}`` is the direction
    itself), so its own matching says little (a true direction of the CIFAR-10 batch of
    :data:`MIN_OWN_MATCHING` scored 0.26 alone, 0.74 beside 5 other true ones): the sparsest few are
    judged together, each beside the others (leave one out), before the greedy growth.
    """
    seeds: list[int] = []
    for index in order:
        if len(seeds) == min(SEED_SIZE, unit.shape[1]):
            break
        if _twin_free(unit[seeds], unit[index]):
            seeds.append(index)
    if len(seeds) < 2:
        return []
    members = unit[seeds]
    scores = own_matching(scorer, torch.stack([members, _duals(members)], dim=1))
    return [index for index, score in zip(seeds, scores.tolist(), strict=True) if score >= min_matching]


def _recheck(
    scorer: SparsityMatchingScorer,
    unit: torch.Tensor,
    excess: torch.Tensor,
    chosen: list[int],
    *,
    min_matching: float,
) -> list[int]:
    """Members that still match beside the others, then candidates that match beside them.

    A candidate that is a twin of a member (``|cos| > TWIN_COS``: the same sample found twice,
    one copy less precise) replaces it when it matches better, by ``TWIN_MARGIN``, beside the
    other members.
    """
    members = unit[chosen]
    scores = own_matching(scorer, torch.stack([members, _duals(members)], dim=1))
    kept = [index for index, score in zip(chosen, scores.tolist(), strict=True) if score >= min_matching]
    own = {index: score for index, score in zip(chosen, scores.tolist(), strict=True)}
    taken = set(kept)
    others = [
        index for index in torch.argsort(excess, descending=True, stable=True).tolist() if index not in taken
    ]
    if not others:
        return kept
    # one batched screen beside the kept set; a twin of a member screens low (its residual is small)
    rows = _residual_rows(unit[kept], unit[others])
    screen = own_matching(scorer, torch.stack([unit[others], rows], dim=1))
    twin_of_kept = (unit[others] @ unit[kept].T).abs().amax(dim=1) > TWIN_COS if kept else screen < 0
    for index, passed, twin in zip(
        others, (screen >= min_matching).tolist(), twin_of_kept.tolist(), strict=True
    ):
        if not (passed or twin):
            continue
        cos = (unit[kept] @ unit[index]).abs() if kept else unit.new_zeros(0)
        twins = torch.nonzero(cos > TWIN_COS).flatten().tolist()
        if len(twins) > 1 or (not twins and len(kept) == unit.shape[1]):
            continue
        beside = [member for position, member in enumerate(kept) if position not in twins]
        row = _residual_rows(unit[beside], unit[index : index + 1])
        score = float(own_matching(scorer, torch.stack([unit[index : index + 1], row], dim=1))[0])
        if score < min_matching or (twins and score <= own[kept[twins[0]]] + TWIN_MARGIN):
            continue
        if twins:
            taken.discard(kept[twins[0]])
            kept[twins[0]] = index
        else:
            kept.append(index)
        own[index] = score
        taken.add(index)
    return kept


def _completed(scorer: SparsityMatchingScorer, members: torch.Tensor) -> Selection:
    b = scorer.factors.batch_size
    k = members.shape[0]
    completion = orthonormal_completion(members, b).to(members.dtype) if k < b else members[:0]
    directions = torch.cat([members, completion], dim=0) if k else completion
    per_sample, q_inv = scorer.score(directions)
    found = torch.arange(b, device=directions.device) < k
    per_sample = torch.where(found, per_sample, torch.zeros_like(per_sample))
    inputs = q_inv @ scorer.factors.right
    return Selection(directions, found, inputs, per_sample, float(per_sample.mean()))


def complement_of_trusted(selection: Selection | None) -> torch.Tensor | None:
    """The trusted rows of a partial selection, for a search that aims at the others; None when
    there is no partial selection to aim past."""
    if selection is None or selection.complete or not bool(selection.found.any()):
        return None
    return selection.directions[selection.found]


#: Layers at least this wide (with noisy gradients) select by own matching: per-direction
#: statistics need many neurons; narrower layers (the (20, 200) DP table) keep the joint selection.
TRUSTED_MIN_WIDTH = 1000

#: Share of a round's initializations that the first round of a trusted search uses, so that
#: rounds aimed at the untrusted directions fit in the budget, and that the first round ends
#: within it on a loaded CPU (a round cut by the deadline proposes nothing: at half a round,
#: CIFAR-10 (150, 4000) at load ~5 and a 240 s budget found no direction).
FIRST_ROUND_SHARE = 0.25

#: Initializations per untrusted direction in an aimed round (drawn orthogonal to the trusted
#: ones), and at least this many: measured at (150, 4000), DP 0.5x, 200 aimed initializations
#: beside 124 trusted directions gave 156 true minima, 19 of the 26 missing directions.
AIMED_PER_MISSING = 8
MIN_AIMED = 256


def uses_trusted_selection(*, noisy: bool, width: int, batch_size: int) -> bool:
    """Whether the attack selects by own matching (:func:`trusted_selection`) and aims its
    later rounds past the trusted directions (:func:`round_plan`)."""
    return noisy and width >= TRUSTED_MIN_WIDTH and batch_size > 1


def round_plan(
    per_round: int, *, rounds_done: int, latest: Selection | None
) -> tuple[int, torch.Tensor | None]:
    """Initializations of the next sphere-search round of a trusted search, and the directions
    they are drawn orthogonal to (None: uniform on the sphere).

    The first round uses ``FIRST_ROUND_SHARE`` of ``per_round``; once a partial selection is
    trusted, every later round draws ``AIMED_PER_MISSING`` initializations per direction still
    missing (at least ``MIN_AIMED``, at most ``per_round``) from the complement of the trusted
    ones, where every missing direction has a component.

    Raises
    ------
    ValueError
        If ``per_round`` or ``rounds_done`` is negative or ``per_round`` is 0.
    """
    if per_round < 1 or rounds_done < 0:
        raise ValueError(f"need per_round >= 1 and rounds_done >= 0, got {per_round} and {rounds_done}")
    if rounds_done == 0:
        return max(1, int(FIRST_ROUND_SHARE * per_round)), None
    aim = complement_of_trusted(latest)
    if aim is None or latest is None:
        return per_round, None
    missing = int((~latest.found).sum())
    return min(per_round, max(MIN_AIMED, AIMED_PER_MISSING * missing)), aim


#: Share of the batch that must be found before the final joint re-fit (:func:`finish_noisy`): the
#: ReLU patterns it relies on come from the inputs, which the missing samples pollute (with 100 of
#: 150 directions found on CIFAR-10 at (150, 4000), DP 0.5x, it raised the matching but lost 0.4 dB).
REFIT_MIN_FOUND = 0.9


def finish_noisy(
    scorer: SparsityMatchingScorer, selection: Selection, *, width: int, deadline: Deadline
) -> Selection:
    """The last steps of a noisy attack: :func:`fl_attack.pipeline.selection.select.prune_doubtful`, then on
    wide layers (:func:`uses_trusted_selection`) with at least ``REFIT_MIN_FOUND`` of the batch
    found, the joint re-fit of :mod:`fl_attack.pipeline.noise.joint_refit` and the re-fit of blended rows of
    :mod:`fl_attack.pipeline.noise.blend_refit`; all stop at ``deadline``."""
    b = selection.directions.shape[0]
    pruned = prune_doubtful(scorer, selection, deadline=deadline)
    if not uses_trusted_selection(noisy=True, width=width, batch_size=b):
        return pruned
    if int(pruned.found.sum()) < REFIT_MIN_FOUND * b:
        return pruned
    return blend_refit(scorer, joint_refit(scorer, pruned, deadline=deadline), deadline=deadline)
