"""When the one-hot proposals run, and with which known directions.

:func:`fl_attack.pipeline.side_information.onehot_rows.one_hot_proposals` pins every sample whose one-hot row
leaves a lineality of at most 1. With no direction known that is the sweep before the attack's
first round (:mod:`fl_attack.pipeline.side_information.input_rounds`). Where near-twins leave a lineality of 2 or
more, known directions cut it: ``a^T q = 0`` for every sample but the one of ``q``, and a
near-twin's ``q`` is not orthogonal to the twins' difference. This module picks those
directions, after each of the attack's rounds (:func:`onehot_between`) and whenever a selection
misses samples (:func:`onehot_missing`):

* the selection's trusted directions together, then each alone;
* a greedy choice among the pool's candidates that look like one sample
  (:func:`fl_attack.pipeline.side_information.onehot_rows.cutting_directions`), from up to ``CUT_ATTEMPTS``
  different first candidates: a wrong candidate (a mixture) cuts off the samples it mixes, and
  another start avoids it.

Each set of known directions is used once per attack (``InputSideSlot.onehot_tried``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from fl_attack.pipeline.search.candidates import is_member
from fl_attack.pipeline.side_information.input_cone import InputSideSlot, SearchContext, live_features
from fl_attack.pipeline.side_information.onehot_rows import (
    cutting_directions,
    one_hot_proposals,
    single_sample_mask,
)

#: Greedy sets of cutting directions tried per call, each from another first candidate.
CUT_ATTEMPTS = 3


def _pool_candidates(state: SearchContext) -> torch.Tensor:
    """The pool's confident then weak candidates, each by most zeros first."""
    pool = state.pool
    weak, weak_counts = pool.weak()
    confident = pool.directions[torch.argsort(pool.zero_counts, descending=True)]
    return torch.cat([confident, weak[torch.argsort(weak_counts, descending=True)]], dim=0)


def _cut_sets(state: SearchContext, slot: InputSideSlot) -> list[torch.Tensor]:
    """Up to ``CUT_ATTEMPTS`` greedy sets of pool directions that cut the lineality to 1."""
    side = slot.onehot
    if side is None:
        return []
    candidates = _pool_candidates(state)
    candidates = candidates[single_sample_mask(side, candidates, tolerance=state.pool.tolerance)]
    sets: list[torch.Tensor] = []
    for start in range(min(CUT_ATTEMPTS, candidates.shape[0])):
        known = cutting_directions(side, candidates[start:])
        if known is None:
            break  # later starts see fewer candidates: none reaches the target either
        sets.append(known)
    return sets


def _run(state: SearchContext, slot: InputSideSlot, sets: list[torch.Tensor], *, wanted: int) -> torch.Tensor:
    """Proposals of each not yet tried set of known directions, until ``wanted`` or the deadline."""
    side, b = slot.onehot, state.factors.batch_size
    found = state.factors.left.new_zeros(0, b)
    if side is None:
        return found
    for known in sets:
        if found.shape[0] >= wanted or state.deadline.expired():
            break
        if any(
            previous.shape == known.shape and bool(is_member(known, previous).all())
            for previous in slot.onehot_tried
        ):
            continue
        slot.onehot_tried.append(known)
        result = one_hot_proposals(
            side,
            known,
            tolerance=state.pool.tolerance,
            min_zeros=state.pool.weak_min_zeros,
            deadline=state.deadline,
        )
        found = torch.cat([found, result.directions], dim=0)
    return found


def _twins_left(state: SearchContext, slot: InputSideSlot) -> bool:
    """Whether the sweep's one-hot rows left a lineality of 2 or more (near-twins)."""
    return slot.onehot is not None and int(state.stats.get("onehot_lineality", 0)) >= 2


def onehot_between(
    rounds: Iterator[tuple[float, torch.Tensor]], state: SearchContext
) -> Iterator[tuple[float, torch.Tensor]]:
    """``rounds`` (seconds, directions) with the proposals of pool-chosen cuts after each (0 seconds).

    Only where the sweep left a lineality of 2 or more. The attack's round is in the pool when
    this generator resumes. ``state.stats`` counts ``onehot_round_proposals``.
    """
    for item in rounds:
        yield item
        slot = state.input_side
        if slot is None or not _twins_left(state, slot) or state.deadline.expired():
            continue
        found = _run(state, slot, _cut_sets(state, slot), wanted=state.factors.batch_size)
        state.stats["onehot_round_proposals"] = state.stats.get("onehot_round_proposals", 0) + int(
            found.shape[0]
        )
        if found.shape[0]:
            yield 0.0, found


def onehot_missing(state: SearchContext, trusted: torch.Tensor) -> torch.Tensor:
    """Proposals for the samples missing from a selection's ``(k, b)`` ``trusted`` directions.

    The trusted set, each of its directions alone, then pool-chosen cuts (see the module
    docstring). The groups are looked for only where some feature is zero for the whole batch
    (unused categories), as the sweep does. ``state.stats`` counts ``onehot_missing_proposals``.
    """
    b = state.factors.batch_size
    slot = state.input_side
    if slot is None or trusted.shape[0] >= b:
        return state.factors.left.new_zeros(0, b)
    if not slot.onehot_ready:
        relative_zero = state.pool.tolerance.absolute * math.sqrt(slot.scorer.update.width)
        if bool(live_features(state.factors, relative_zero=relative_zero).all()):
            return state.factors.left.new_zeros(0, b)
    if slot.get_onehot(state) is None:
        return state.factors.left.new_zeros(0, b)
    sets = [trusted, *(trusted[i : i + 1] for i in range(trusted.shape[0]))] if trusted.shape[0] else []
    if _twins_left(state, slot):
        sets += _cut_sets(state, slot)
    found = _run(state, slot, sets, wanted=b - trusted.shape[0])
    state.stats["onehot_missing_proposals"] = state.stats.get("onehot_missing_proposals", 0) + int(
        found.shape[0]
    )
    return found


__all__ = ["CUT_ATTEMPTS", "onehot_between", "onehot_missing"]
