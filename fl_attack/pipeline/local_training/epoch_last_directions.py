"""The last one or two samples of one local epoch that the search did not meet.

With ``b - d`` columns of the disaggregation matrix known (``d`` in {1, 2}), the missing inputs
lie in a known ``d``-dimensional space (:mod:`fl_attack.pipeline.search.last_direction`), but
the exact scan there finds a sample only where its column vanishes exactly on its inactive
neurons at ``W_0``: a sample of a later mini-batch step vanishes where it is inactive at its own
step's weights instead (CIFAR-10 (20, 200), 4 mini-batches of 5 at lr 0.1, seed 1: one sample,
27 of its 89 zeros off its pattern at ``W_0``; with momentum 0.9, two samples). The kernels of
the rows deepest below zero along lines of that space
(:func:`fl_attack.pipeline.search.deepest_rows.deepest_row_kernels`, judged at ``W_0`` and at the
end weights ``W_0 + dW``) still reach them.

Such kernels are proposed when, with the known columns, they make a batch the one-epoch scorer
accepts (:class:`fl_attack.pipeline.local_training.epoch_scorer.LocalEpochScorer`: a fit of one
local epoch of mini-batches). Where none does, a known column may be a blend chosen in a
sample's place (CIFAR-10, momentum 0.9: 17 samples and a blend known, three missing, two of
them reached); kernels with as many zeros as a confident candidate are then proposed, so that
the next selection can push the blend out. Nothing else is proposed (a kernel of deep rows is
mostly a blend), and every proposal goes through the pool, the selection, the fit and the
self-check as any other. The known columns are the selection's confident candidates whatever
their matching at ``W_0``, which later steps' samples miss by nature. This runs only where the
other last-direction proposals found nothing, once per set of known columns.
"""

from __future__ import annotations

import itertools
import math
from typing import Protocol

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.local_training.epoch_scorer import LocalEpochScorer
from fl_attack.pipeline.search.candidates import CandidatePool, is_member
from fl_attack.pipeline.search.deepest_rows import deepest_row_kernels
from fl_attack.pipeline.search.last_direction import PAIR_SCAN_FLOPS
from fl_attack.pipeline.search.sparsity import zero_masks
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

__all__ = ["epoch_last_directions"]

#: Lines through the origin of a two-dimensional missing space whose deepest rows are tried
#: (deep rows stay deep near a sample's line, so a coarse fan reaches it), at most.
PAIR_LINES = 128
#: Kernels tried per missing sample (the sparsest first); with two missing, every pair of them.
KERNELS_PER_SAMPLE = 8
#: Completions (one kernel, or a pair of them) judged by the one-epoch scorer per set of known columns, at most.
MAX_COMPLETIONS = 16


class EpochSearch(Protocol):
    """What :func:`epoch_last_directions` reads of the attack's search state."""

    factors: LowRankFactors
    pool: CandidatePool
    deadline: Deadline
    active: torch.Tensor
    epoch_tried: list[torch.Tensor]


def epoch_last_directions(
    state: EpochSearch, scorer: SparsityMatchingScorer, selection: Selection, *, accept_matching: float
) -> torch.Tensor:
    """The one or two directions that complete ``selection``'s confident candidates into a batch
    fitting one local epoch; ``(0, b)`` when there are none, ``scorer`` is not a
    :class:`LocalEpochScorer`, or these known columns were tried before (``state.epoch_tried``)."""
    factors = state.factors
    left = factors.left
    b = left.shape[1]
    empty = left.new_zeros(0, b)
    if not isinstance(scorer, LocalEpochScorer) or b < 3:
        return empty
    known = selection.directions[selection.found & is_member(selection.directions, state.pool.directions)]
    missing = b - known.shape[0]
    if missing not in (1, 2) or state.deadline.expired():
        return empty
    known = known / known.norm(dim=1, keepdim=True)
    if any(tried.shape == known.shape and bool(is_member(known, tried).all()) for tried in state.epoch_tried):
        return empty
    state.epoch_tried.append(known)
    update, active = scorer.update, state.active
    complete, _ = torch.linalg.qr(known.T, mode="complete")
    dual = complete[:, b - missing :]  # (b, d): orthogonal to every known direction
    start_basis = scorer.pre_activation_basis[active]
    end_basis = start_basis + left @ (factors.right @ factors.right.T)  # (W_0 + dW) R^T
    lines = _lines(missing, width=left.shape[0], batch=b, dtype=left.dtype).to(left.device)  # (d, k)
    bias = update.bias[active]
    kernels = deepest_row_kernels(
        left,
        start_basis @ dual @ lines,
        bias,
        known=known,
        tolerance=state.pool.tolerance,
        min_zeros=state.pool.weak_min_zeros,
        end=(end_basis @ dual @ lines, bias + update.bias_update[active]),
        max_proposals=KERNELS_PER_SAMPLE * missing,
        deadline=state.deadline,
    )
    # the sparsest kernels' combinations first; each costs a one-epoch fit (up to its node limit)
    combinations = sorted(itertools.combinations(range(kernels.shape[0]), missing), key=sum)
    for chosen in combinations[:MAX_COMPLETIONS]:
        if state.deadline.expired():
            break
        directions = torch.cat([known, kernels[list(chosen)]], dim=0)
        per_sample, q_inv = scorer.score(directions)
        found = torch.ones(b, dtype=torch.bool, device=left.device)
        candidate = Selection(directions, found, q_inv @ factors.right, per_sample, float(per_sample.mean()))
        if scorer.accepts(candidate, accept_matching=accept_matching):
            return kernels[list(chosen)]
    # no completion fits: a known column may be wrong (a blend chosen in a sample's place), which
    # a kernel as sparse as a confident candidate can push out of the next selection
    counts = zero_masks(factors, kernels, state.pool.tolerance).sum(dim=1)
    return kernels[counts >= state.pool.min_zeros]


def _lines(missing: int, *, width: int, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """``(d, k)``: unit directions of the lines through the origin of a ``d``-dimensional space
    (``d = 1``: the space itself; ``d = 2``: a fan of angles, fewer on large layers)."""
    if missing == 1:
        return torch.ones(1, 1, dtype=dtype)
    count = int(max(8, min(PAIR_LINES, PAIR_SCAN_FLOPS / ((width + 1) * 8.0 * batch**3))))
    angles = math.pi * (torch.arange(count, dtype=dtype) + 0.5) / count
    return torch.stack([angles.cos(), angles.sin()])
