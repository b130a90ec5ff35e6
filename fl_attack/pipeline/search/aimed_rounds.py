"""Aiming the clean sphere search at the directions still missing.

On a noiseless gradient a selected direction that is a confident pool candidate is exact: its
gradient column vanishes on exactly the neurons the sample left inactive. Random initializations
keep falling into the basins of such directions: on CIFAR-10 at (b, m) = (100, 1000) a second
round of 3200 uniform starts met 2566 true minima but only 7 directions not yet found, the basins
of a few samples taking most starts.

A start drawn orthogonally to the found directions has no component along them and, optimized
with a small step, stays near that complement, where every missing direction has a component
(the columns are linearly independent). On that batch, with 87 of 100 found, one such round of
3200 starts at step size 0.15 met all 13 missing directions (1362 true minima), where a uniform
round at 0.15 (86 found) met 2 of 14. With a large complement the small step reaches nothing
(see ``MIN_FOUND_SHARE``), and a large step leaves the complement in its first steps. An aimed
round needs fewer starts the fewer directions are missing, so it is sized by the count missing.

On crowded layers (b = m/10) ordinary rounds take the largest step size (:func:`ordinary_lr`).
Measured with ``experiments/search_profile.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.pipeline.search.candidates import is_member
from fl_attack.pipeline.selection.select import Selection

#: Initializations per missing direction in an aimed round, and at least this many per round.
AIMED_STARTS_PER_MISSING = 24
MIN_AIMED_STARTS = 256

#: Aimed rounds start once this share of the batch is found. Measured on CIFAR-10 at
#: (200, 2000) with 64 of 200 found, 1000 aimed starts at step size 0.15 met 1 new direction,
#: at 0.5 met 2, at 2.0 met 24 (18 for uniform starts at 2.0): with a large complement the small
#: step does not reach the missing basins; at (100, 1000) with 87 of 100 found it met all 13.
MIN_FOUND_SHARE = 0.75

#: Layers at most this many neurons per sample are crowded (SPEAR++ Table 1's b = m/10 cells) ...
CROWDED_NEURONS_PER_SAMPLE = 12
#: ... when the batch has at least this many samples. There ordinary rounds take the largest
#: step size of the cycle: on CIFAR-10 a round of uniform starts met true minima at
#: step size 2.0 / 0.5 / 0.15 in 80% / 25% / 7% of starts at (100, 1000), 34% / 2% / 0.1% at
#: (200, 2000), and 13% / 0% / - at (400, 4000).
CROWDED_MIN_BATCH = 100


def ordinary_lr(learning_rates: tuple[float, ...], *, rounds_done: int, width: int, batch_size: int) -> float:
    """The step size of an ordinary (not aimed) clean round: the cycle's, or on a crowded layer
    (see ``CROWDED_NEURONS_PER_SAMPLE``) its largest."""
    if batch_size >= CROWDED_MIN_BATCH and width <= CROWDED_NEURONS_PER_SAMPLE * batch_size:
        return max(learning_rates)
    return learning_rates[rounds_done % len(learning_rates)]


@dataclass(frozen=True)
class AimedRound:
    """One aimed round: how many starts, the exact directions they avoid, the step size."""

    starts: int
    avoid: torch.Tensor
    lr: float


def exact_found(
    selection: Selection | None, pool_directions: torch.Tensor, *, accept_matching: float
) -> torch.Tensor:
    """The ``(k, b)`` directions of a clean ``selection`` taken as exact: found and confident pool
    candidates (an exact kernel with SPEAR's count of zeros, which a mixture of samples, vanishing
    only where both do, does not reach), in a complete selection also matching at
    ``accept_matching`` or better. In a partial selection the matching of every row is spoilt by
    the unfound rows beside it, so it is not asked for there."""
    if selection is None:
        return pool_directions.new_zeros(0, pool_directions.shape[1])
    keep = selection.found & is_member(selection.directions, pool_directions)
    if selection.complete:
        keep &= selection.per_sample >= accept_matching
    return selection.directions[keep]


def aimed_round(
    per_round: int,
    *,
    rounds_done: int,
    latest: Selection | None,
    pool_directions: torch.Tensor,
    accept_matching: float,
    lr: float,
) -> AimedRound | None:
    """The next clean round aimed past the exact directions, or None for an ordinary round.

    None for the first round, before any selection, when fewer than ``MIN_FOUND_SHARE`` of the
    batch (or none) is exact, or when every direction is. Otherwise the round draws
    ``AIMED_STARTS_PER_MISSING`` starts per missing direction (at least ``MIN_AIMED_STARTS``, at
    most ``per_round``) orthogonally to the exact ones, at step size ``lr``.

    Raises
    ------
    ValueError
        If ``per_round`` < 1, ``rounds_done`` < 0 or ``lr`` <= 0.
    """
    if per_round < 1 or rounds_done < 0 or not lr > 0:
        raise ValueError(
            f"need per_round >= 1, rounds_done >= 0 and lr > 0, got {per_round}, {rounds_done} and {lr}"
        )
    if rounds_done == 0 or latest is None:
        return None
    b = int(latest.found.numel())
    exact = exact_found(latest, pool_directions, accept_matching=accept_matching)
    missing = b - int(exact.shape[0])
    if missing == 0 or exact.shape[0] < max(1, MIN_FOUND_SHARE * b):
        return None
    starts = min(per_round, max(MIN_AIMED_STARTS, AIMED_STARTS_PER_MISSING * missing))
    return AimedRound(starts=starts, avoid=exact, lr=lr)
