"""Proposals for the samples a drifted FedAvg selection still misses (see :mod:`fl_attack.pipeline.local_training.drift`).

A true column of a drifted update is an exact kernel of its zero rows, but with a large
learning rate its l1 minimum on the sphere lies near it (cos 0.74-0.998 on CIFAR-10 (20, 200),
10 steps at lr 0.1) with non-zeros of briefly active neurons among its smallest rows, so
rounding on those rows misses it. The inputs implied by trusted directions plus such
approximations predict which neurons the missing sample leaves inactive at both ends; kernels
of random ``b - 1`` of those rows hit the exact direction in 1-98% of draws, and a hit reveals
itself by its many zeros.

Two sets are trusted in turn: the latest selection's drift-consistent directions (or, when a
wrong or missing direction spoils the inputs of the whole selection, its directions with as
many zeros as the pool's confident candidates), and the sparsest independent pool candidates,
weak ones included, up to ``b - 1``: a single missing sample's inputs then follow exactly from
the others'.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.local_training.drift import DriftMatchingScorer
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.sparsity import zero_masks
from fl_attack.pipeline.search.sphere import (
    SphereSchedule,
    get_surrogate,
    optimize_on_sphere,
    random_directions,
)
from fl_attack.pipeline.selection.select import (
    Selection,
    SparsityMatchingScorer,
    orthonormal_completion,
    sparsest_independent,
)

#: Fractions of a missing sample's predicted-inactive rows (the smallest first) from which
#: ``b - 1`` rows are drawn, and the draws per fraction and missing sample.
DRAW_FRACTIONS = (1.0, 0.7, 0.5)
DRAWS_PER_FRACTION = 96

#: Initializations of the sphere search in the complement of the trusted directions.
COMPLEMENT_INITIALIZATIONS = 256
#: Learning rate of that search (Riemannian Adam on the unit sphere, as SPEAR++'s first round).
COMPLEMENT_LR = 0.5
#: Minima closer than this (|cos|) to a trusted direction, or to an approximation already
#: chosen, are not new approximations.
SAME_DIRECTION_COS = 0.95


class DriftSearch(Protocol):
    """What :func:`interleave_drift_rounds` reads of the attack's search state."""

    generator: torch.Generator
    deadline: Deadline
    stats: dict[str, Any]
    latest: Selection | None
    pool: CandidatePool


def interleave_drift_rounds(
    proposals: Iterator[torch.Tensor], state: DriftSearch, scorer: SparsityMatchingScorer
) -> Iterator[torch.Tensor]:
    """After every round of ``proposals`` that the latest selection (``state.latest``) does not
    accept, one round of :func:`drift_proposals`, trusting the selection and the pool in turn;
    ``proposals`` unchanged unless ``scorer`` is a :class:`DriftMatchingScorer`."""
    if not isinstance(scorer, DriftMatchingScorer):
        yield from proposals
        return
    rounds = 0
    for batch in proposals:
        yield batch
        latest = state.latest
        if latest is None or state.deadline.expired() or scorer.accepts(latest):
            continue
        if rounds % 2 == 0:
            trusted = selection_trusted(scorer, latest, confident_zeros=state.pool.min_zeros)
        else:
            trusted = pool_trusted(state.pool)
        rounds += 1
        extra = drift_proposals(scorer, trusted, generator=state.generator, deadline=state.deadline)
        state.stats["drift_proposals"] = state.stats.get("drift_proposals", 0) + int(extra.shape[0])
        yield extra


def selection_trusted(
    scorer: DriftMatchingScorer, selection: Selection, *, confident_zeros: int
) -> torch.Tensor:
    """The unit directions of ``selection`` to build on: its drift-consistent ones when they are
    the majority of a complete selection, else those that are consistent or have at least
    ``confident_zeros`` zeros (a mixture of two samples is zero only where both are)."""
    b = selection.directions.shape[0]
    violations = scorer.violations(selection.directions)
    consistent = selection.found & violations.passed(b)
    if selection.complete and 2 * int(consistent.sum()) >= b:
        mask = consistent
    else:
        mask = selection.found & (consistent | (violations.zeros >= confident_zeros))
    trusted = selection.directions[mask]
    return trusted / trusted.norm(dim=1, keepdim=True) if trusted.shape[0] else trusted


def pool_trusted(pool: CandidatePool) -> torch.Tensor:
    """Up to ``b - 1`` independent unit pool candidates: confident ones first, then weak ones,
    each sparsest first."""
    b = pool.factors.batch_size
    weak, weak_counts = pool.weak()
    candidates = torch.cat([pool.directions, weak], dim=0)
    if candidates.shape[0] == 0:
        return candidates
    m = pool.factors.left.shape[0]
    counts = torch.cat([pool.zero_counts, weak_counts - m], dim=0)
    chosen = sparsest_independent(candidates, counts, b - 1)
    trusted = candidates[chosen]
    return trusted / trusted.norm(dim=1, keepdim=True)


def drift_proposals(
    scorer: DriftMatchingScorer,
    trusted: torch.Tensor,
    *,
    generator: torch.Generator,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Exact-kernel proposals for the samples not among the ``(t, b)`` ``trusted`` unit directions.

    A sphere search in the orthogonal complement of ``trusted`` gives approximate directions of
    the others (the sparsest distinct minima); the inputs implied by the whole set predict each
    approximated sample's inactive neurons, and kernels of random ``b - 1`` of those rows (drawn
    from all of them, or only from the smallest in the approximation) are returned when they
    have more than ``b + 1`` zeros. Returns ``(k, b)`` directions, possibly none.
    """
    left = scorer.factors.left
    b = left.shape[1]
    empty = left.new_zeros(0, b)
    missing = b - int(trusted.shape[0])
    if b < 2 or missing <= 0:
        return empty
    approximations = _approximations(left, trusted, count=missing, generator=generator, deadline=deadline)
    if approximations.shape[0] == 0 or deadline.expired():
        return empty
    known = torch.cat([trusted, approximations], dim=0)
    directions = torch.cat([known, orthonormal_completion(known, b).to(left.dtype)], dim=0)
    per_sample, q_inv = scorer.score(directions)
    if bool((per_sample < 0).all()):
        return empty  # a singular set implies no inputs
    inactive = scorer.inactive(q_inv)  # (m, b)
    draws = []
    for slot in range(trusted.shape[0], known.shape[0]):
        predicted = torch.nonzero(inactive[:, slot]).flatten()
        if predicted.numel() < b - 1:
            continue
        magnitude = (left[predicted] @ directions[slot]).abs()
        ordered = predicted[torch.argsort(magnitude)]
        for fraction in DRAW_FRACTIONS:
            rows = ordered[: max(b - 1, int(fraction * ordered.numel()))]
            keys = torch.rand(DRAWS_PER_FRACTION, rows.numel(), generator=generator, dtype=torch.float64)
            draws.append(rows[torch.argsort(keys, dim=1)[:, : b - 1].to(rows.device)])
    if not draws:
        return empty
    subsets = left[torch.cat(draws, dim=0)]  # (k, b - 1, b)
    basis, _ = torch.linalg.qr(subsets.transpose(1, 2), mode="complete")
    kernels = basis[:, :, -1]
    counts = zero_masks(scorer.factors, kernels, scorer.tolerance).sum(dim=1)
    return kernels[counts > b + 1]


def _approximations(
    left: torch.Tensor,
    trusted: torch.Tensor,
    *,
    count: int,
    generator: torch.Generator,
    deadline: Deadline,
) -> torch.Tensor:
    """Up to ``count`` approximate directions of samples not in ``trusted``: l1 minima on the
    sphere started in the complement of ``trusted``, sparsest first, distinct from the trusted
    directions and from each other."""
    b = left.shape[1]
    starts = random_directions(
        COMPLEMENT_INITIALIZATIONS,
        b,
        generator=generator,
        avoid=trusted if trusted.shape[0] else None,
        dtype=torch.float32,
        device=left.device,
    )
    minima = optimize_on_sphere(
        left.to(torch.float32),
        starts,
        surrogate=get_surrogate("l1"),
        schedule=SphereSchedule(lr=COMPLEMENT_LR),
        deadline=deadline,
    ).to(left.dtype)
    minima = minima[torch.isfinite(minima).all(dim=1)]
    minima = minima / minima.norm(dim=1, keepdim=True).clamp_min(1e-300)
    if trusted.shape[0]:
        minima = minima[(minima @ trusted.T).abs().amax(dim=1) < SAME_DIRECTION_COS]
    order = torch.argsort((minima @ left.T).abs().sum(dim=1))
    chosen: list[torch.Tensor] = []
    for index in order.tolist():
        candidate = minima[index]
        if chosen and float((torch.stack(chosen) @ candidate).abs().max()) >= SAME_DIRECTION_COS:
            continue
        chosen.append(candidate)
        if len(chosen) == count:
            break
    return torch.stack(chosen) if chosen else left.new_zeros(0, b)
