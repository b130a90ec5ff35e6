"""When the input side's proposals join the attack's own rounds.

:mod:`fl_attack.pipeline.side_information.input_cone` turns vertices of the cone of non-negative inputs into
gradient-side directions; this module schedules them around the attack's sphere-search rounds.

Where some input feature is zero for the whole batch (the cheap sign of sparse non-negative
inputs: ReLU activations of an earlier layer, pooled CNN features, pixel backgrounds), a *sweep*
runs before the attack's first round: linear programmes, each steered away from the samples the
ones before it reached (:func:`fl_attack.pipeline.side_information.missing_samples.reach_samples`
with no sample known), so that ``b`` samples cost about ``b`` small programmes. Deep layers need
it: the inputs of layer 5 of SPEAR's victim are alike (mean pairwise cosine 0.8) and their
gradient columns have a quarter of the informative neurons at zero, below SPEAR's sparsity
threshold, so the sphere search proposes sparse mixtures by the thousand while every cone vertex
is one sample, exact to the float rounding.

Where the update shows one-hot column groups (:mod:`fl_attack.pipeline.side_information.onehot_groups`: tabular
rows, whose signed continuous columns leave the cone empty), the sweep first tries the one-hot
rows (:mod:`fl_attack.pipeline.side_information.onehot_rows`), and :mod:`fl_attack.pipeline.side_information.onehot_rounds` tries
them again after each of the attack's rounds where near-twins left them ambiguous.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from fl_attack.pipeline.search.sparsity import deduplicate, zero_masks
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.side_information.input_cone import (
    MIN_ROUND_SECONDS,
    NOT_NEEDED,
    InputSideSlot,
    SearchContext,
    cone_vertices,
    gradient_directions,
)
from fl_attack.pipeline.side_information.missing_samples import reach_samples, some_feature_dead
from fl_attack.pipeline.side_information.onehot_rounds import onehot_between
from fl_attack.pipeline.side_information.onehot_rows import one_hot_proposals

#: Input-side rounds stop after this many rounds in a row add no new candidate to the pool.
STALE_ROUNDS = 3

#: The sweep before the attack's first round spends at most this share of the search time
#: (at least ``MIN_ROUND_SECONDS``): where its vertices are not the samples, it stops after a
#: few programmes, and the sphere search keeps its time.
SWEEP_SHARE = 0.25

#: The sweep scans ReLU patterns with at least ``b + SWEEP_EXTRA_ZEROS`` inactive neurons (the
#: candidate pool remembers directions from that many zeros on), and lowers the pool's weak
#: threshold to the fewest zeros among the samples it reached, never below that.
SWEEP_EXTRA_ZEROS = 2


def sweep_proposals(state: SearchContext, scorer: SparsityMatchingScorer) -> torch.Tensor | None:
    """Gradient-side directions of the samples reached by a sweep of the cone, or None where it does not run.

    It runs where some input feature is zero for the whole batch. Where the update shows one-hot
    groups and their rows pin samples, those samples' directions are the sweep (``state.stats``:
    ``onehot_lineality``, ``onehot_rows``, ``onehot_sweep``, ``onehot_sweep_seconds``);
    otherwise, where the input side applies (``state.input_side.get``), ``b`` programmes steered
    apart by the directions found (:func:`~fl_attack.pipeline.side_information.missing_samples.reach_samples`), stopped after
    ``SWEEP_SHARE`` of the search time. The samples reached set ``state.pool.weak_min_zeros``
    (see ``SWEEP_EXTRA_ZEROS``). ``state.stats`` records ``input_side_sweep`` (the proposals),
    ``input_side_sweep_reached``, ``input_side_sweep_seconds`` and ``weak_min_zeros``.

    Parameters
    ----------
    state
        The attack's search state, with ``state.input_side`` set.
    scorer
        The attack's scorer.

    Returns
    -------
    torch.Tensor | None
        ``(k, b)`` unit directions (``k`` may be 0), or None when the sweep did not run.
    """
    slot = state.input_side
    if slot is None or state.factors.batch_size < 2 or not some_feature_dead(state, scorer):
        return None
    onehot = _onehot_sweep(state, slot)
    if onehot is not None:
        return onehot
    side = slot.get(state)
    if side is None:
        return None
    started = time.perf_counter()
    until = state.deadline.within(max(MIN_ROUND_SECONDS, SWEEP_SHARE * state.deadline.remaining()))
    b, pool = state.factors.batch_size, state.pool
    proposals, reached = reach_samples(
        side,
        state.factors.left.new_zeros(0, b),
        left=state.factors.left,
        pre_activation_basis=scorer.pre_activation_basis[state.active],
        bias=scorer.update.bias[state.active],
        tolerance=pool.tolerance,
        # every pattern with more zeros than a generic kernel: the vertex already certifies the sample
        min_zeros=b + SWEEP_EXTRA_ZEROS,
        # its own stream: a sweep that reaches nothing leaves the attack's random rounds as they were
        generator=torch.Generator().manual_seed(state.generator.initial_seed()),
        deadline=until,
    )
    _record_reached(state, slot, reached)
    state.stats.update(
        input_side="used",
        input_side_sweep=int(proposals.shape[0]),
        input_side_sweep_reached=int(reached.shape[0]),
        input_side_sweep_seconds=time.perf_counter() - started,
        weak_min_zeros=pool.weak_min_zeros,
    )
    return proposals


def _record_reached(state: SearchContext, slot: InputSideSlot, reached: torch.Tensor) -> None:
    """Remember the samples a sweep reached, and lower the weak threshold to the fewest zeros among them."""
    slot.swept_samples = int(reached.shape[0])
    if reached.shape[0]:
        # a sample reached on the input side, with fewer gradient zeros than the weak threshold, is
        # still a sample (alike inputs leave some with a fifth of the informative neurons at zero)
        pool, b = state.pool, state.factors.batch_size
        fewest = int(zero_masks(state.factors, reached, pool.tolerance).sum(dim=1).min())
        pool.weak_min_zeros = min(pool.weak_min_zeros, max(b + SWEEP_EXTRA_ZEROS, fewest))


def _onehot_sweep(state: SearchContext, slot: InputSideSlot) -> torch.Tensor | None:
    """Directions of the samples pinned by their one-hot rows (:mod:`fl_attack.pipeline.side_information.onehot_rows`).

    None where the update shows no one-hot group or the rows pin no sample (lineality 2 or
    more: the missing-sample proposals try again with the directions the search trusts).
    """
    side = slot.get_onehot(state)
    if side is None:
        return None
    started = time.perf_counter()
    b = state.factors.batch_size
    result = one_hot_proposals(
        side,
        state.factors.left.new_zeros(0, b),
        tolerance=state.pool.tolerance,
        min_zeros=b + SWEEP_EXTRA_ZEROS,
        deadline=state.deadline.within(max(MIN_ROUND_SECONDS, SWEEP_SHARE * state.deadline.remaining())),
    )
    state.stats.update(
        onehot_lineality=result.lineality,
        onehot_rows=result.one_hot_rows,
        onehot_sweep=int(result.directions.shape[0]),
        onehot_sweep_seconds=time.perf_counter() - started,
    )
    if result.directions.shape[0] == 0:
        return None
    _record_reached(state, slot, result.directions)
    state.stats.update(input_side="used", weak_min_zeros=state.pool.weak_min_zeros)
    return result.directions


def interleave_input_side(
    proposals: Iterator[torch.Tensor], state: SearchContext, scorer: SparsityMatchingScorer
) -> Iterator[torch.Tensor]:
    """The attack's proposal rounds with input-side rounds before and between them, where they apply.

    Where some feature is zero for the whole batch, :func:`sweep_proposals` comes first, before
    the attack's own first round. Otherwise the rounds start after the attack's first round
    (``input_side`` reads :data:`NOT_NEEDED` when it stops there); ``state.input_side`` shares the
    one set-up with the missing-sample programmes.
    After each of the attack's rounds, an input-side round spends at most as long on cone
    vertices, and as long again on turning them into gradient-side directions (each at least
    ``MIN_ROUND_SECONDS``). The input side is not used when the live features are fewer than
    ``MIN_FEATURES_PER_SAMPLE`` per sample (a random subspace of so few dimensions meets the
    non-negative orthant anyway), when the cone is empty (inputs of both signs: one linear
    programme, given ``PROBE_FRACTION`` of the remaining time, at least ``MIN_ROUND_SECONDS``
    when some feature is zero for the whole batch; one that does not finish counts as empty),
    or when the first round finds no vertex sparser than a generic one, or none whose ReLU patterns
    have a kernel (and the sweep, if it ran, reached no sample either). The rounds stop once
    ``STALE_ROUNDS`` rounds in a row add nothing to the pool, or at the deadline.
    ``state.stats`` records ``input_side`` (``"used"`` or why not) and the vertex and proposal counts.

    Parameters
    ----------
    proposals
        The attack's own rounds of ``(k, b)`` directions.
    state
        The attack's search state; ``state.input_side`` is set here.
    scorer
        The attack's scorer (its pre-activation basis turns inputs into gradient-side directions).

    Yields
    ------
    torch.Tensor
        ``(k, b)`` directions: the sweep's, the attack's rounds, the input-side rounds.
    """
    state.input_side = InputSideSlot(scorer)
    swept = sweep_proposals(state, scorer)
    if swept is not None:
        yield swept
    rounds = onehot_between(_timed(proposals), state)
    first = next(rounds, None)
    if first is None:
        return
    if swept is None:
        # an attack done after its first round (dense inputs usually are) never pays for the set-up
        state.stats["input_side"] = NOT_NEEDED
    yield first[1]
    if state.deflation is not None and state.deflation.space(deadline=state.deadline) is not None:
        # the next layer certified samples of the first round: the deflated search needs no vertices
        state.stats["input_side"] = "not needed: the next layer's update deflates the search"
        yield from (directions for _, directions in rounds)
        return
    side = state.input_side.get(state)
    if side is None:
        yield from (directions for _, directions in rounds)
        return
    state.stats.update(input_side="used", input_side_vertices=0, input_side_proposals=0)
    factors, b = state.factors, state.factors.batch_size
    seconds, stale = first[0], 0
    while True:
        if stale < STALE_ROUNDS and not state.deadline.expired():
            before = len(state.pool)
            until = state.deadline.within(max(MIN_ROUND_SECONDS, seconds))
            vertices = cone_vertices(
                side, count=2 * b, generator=state.generator, known=state.pool.directions, deadline=until
            )
            refined, _ = side.refine(vertices)
            refined = refined[deduplicate(refined, cos_tolerance=state.pool.cos_tolerance)]  # one scan each
            if state.stats["input_side_vertices"] == 0 and refined.shape[0] == 0:
                state.stats["input_side"] = "no sparse non-negative vertex"
                stale = STALE_ROUNDS
            else:
                candidates = gradient_directions(
                    side,
                    refined,
                    left=factors.left,
                    pre_activation_basis=scorer.pre_activation_basis[state.active],
                    bias=scorer.update.bias[state.active],
                    tolerance=state.pool.tolerance,
                    min_zeros=state.pool.weak_min_zeros,
                    # the scans get as long again as the vertices: on wide layers they cost more
                    deadline=state.deadline.within(max(MIN_ROUND_SECONDS, seconds)),
                )
                first_round = state.stats["input_side_vertices"] == 0
                state.stats["input_side_vertices"] += int(refined.shape[0])
                state.stats["input_side_proposals"] += int(candidates.shape[0])
                yield candidates
                stale = stale + 1 if len(state.pool) == before else 0
                if first_round and candidates.shape[0] == 0 and not state.stats.get("input_side_sweep"):
                    # sparse non-negative vertices without a ReLU-pattern kernel are no samples: the
                    # inputs are not in the cone (one-hot columns beside signed ones, as in Adult)
                    state.stats["input_side"] = "no vertex is a sample"
                    stale = STALE_ROUNDS
        following = next(rounds, None)
        if following is None:
            return
        seconds, directions = following
        yield directions


def _timed(proposals: Iterator[torch.Tensor]) -> Iterator[tuple[float, torch.Tensor]]:
    """``proposals`` with the seconds each took to produce."""
    while True:
        started = time.perf_counter()
        try:
            directions = next(proposals)
        except StopIteration:
            return
        yield time.perf_counter() - started, directions


__all__ = ["STALE_ROUNDS", "SWEEP_EXTRA_ZEROS", "SWEEP_SHARE", "interleave_input_side", "sweep_proposals"]
