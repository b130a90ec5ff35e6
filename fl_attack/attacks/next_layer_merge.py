"""Complete an exact attack's reconstruction with the next-layer route's rows.

When the attacked layer is followed by another linear layer whose update the server also
holds (FedSGD), :func:`fl_attack.attacks.next_layer.recover_from_next_layer` can find inputs
that the exact attack on the layer's update alone did not. :func:`complete_with_next_layer`
runs it on a reconstruction that is not complete and merges its rows:

1. the route's *checked* rows (its own input-side check passed, see
   :attr:`fl_attack.attacks.next_layer.RecoveredSample.verified`): these are claimed;
2. the exact attack's rows whose ReLU pattern agrees with the update everywhere it is read
   (confidence at least :data:`CONFIDENT_MATCHING`), unless its self-check found near-identical
   samples with another batch as good (``SelfCheck.ambiguous_twins``);
3. the route's unchecked rows (a ReLU pattern consistent with both updates, but an input that
   its check could not confirm) and the exact attack's other rows, together, by how well each
   row's own ReLU pattern agrees with the update (:func:`pattern_agreement`; an exact attack's
   row first on a tie): kept for the scoring, never claimed; the all-zero rows of directions the
   attack never found last;

dropping any row within a cosine of :data:`fl_attack.attacks.next_layer.DUPLICATE_COSINE` of
one kept before it, until the batch's ``b`` rows are filled. The result is ``complete`` only
when every row is a claimed one and the whole batch passes the attack's own self-check
(:func:`fl_attack.pipeline.selection.self_check.self_check`); with any unclaimed row it never is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.selection.self_check import self_check
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import LayerUpdate, ObservedUpdate

from .next_layer import DUPLICATE_COSINE, NextLayerResult, checked_next_layer, recover_from_next_layer

__all__ = [
    "CONFIDENT_MATCHING",
    "batch_matching",
    "complete_with_next_layer",
    "merged_rows",
    "route_budget",
]

#: The route's seconds when the attack has no time budget.
UNBOUNDED_ROUTE_SECONDS = 60.0
#: Fewer seconds left than this: the route is not started.
MIN_ROUTE_SECONDS = 0.5
#: An exact attack's row at or above this per-sample matching is claimed beside the route's.
CONFIDENT_MATCHING = 0.999
#: A route's certified row whose own ReLU pattern agrees with the first layer's update below this
#: contradicts it (a wrong certification agreed at 0.7; true rows of a batch of 32 stay far above).
CONTRADICTED_BELOW = 0.9
#: Zero tolerance of unit gradient columns, times the relative noise (SPEAR++'s default).
ZERO_TOLERANCE_FACTOR = 30.0

#: Where a merged row came from: the route (checked or not), the exact attack, or a duplicate
#: of a kept row (only when too few distinct rows fill the batch: never claimed).
ROUTE_CHECKED, EXACT_ATTACK, ROUTE_UNCHECKED, EXACT_ATTACK_WEAK, DUPLICATE = range(5)


def route_budget(budget: Budget | None) -> float:
    """Seconds the route may spend: what is left of the attack's ``budget`` (None or unbounded:
    :data:`UNBOUNDED_ROUTE_SECONDS`).

    Where the route may follow, the exact attack ran on
    :meth:`fl_attack.pipeline.budget.budget.Budget.exact_attack_share` of the same budget, so
    that both end by it.
    """
    if budget is None or not budget.bounded:
        return UNBOUNDED_ROUTE_SECONDS
    return max(budget.remaining(), 0.0)


def pattern_agreement(
    inputs: np.ndarray, *, observed: LayerUpdate[np.ndarray], left: np.ndarray, relative_noise: float
) -> np.ndarray:
    """Per-row sparsity matching (SPEAR Def. 4.1) of ``(k, n)`` inputs against the update.

    A row's ReLU pattern (``W x + b <= 0``) picks the rows of the update's orthonormal left
    factor ``left`` (``(m, b)``) its gradient column must vanish on; the column is their
    common kernel, and the matching is the share of neurons where "the column is zero"
    (below SPEAR++'s zero tolerance) agrees with "the neuron is inactive".
    """
    m, b = left.shape
    threshold = min(max(ZERO_TOLERANCE_FACTOR * relative_noise, 1e-10), 0.5) / math.sqrt(m)
    agreement = np.zeros(inputs.shape[0])
    for row, values in enumerate(inputs):
        inactive = observed.weight @ values + observed.bias <= 0
        if inactive.sum() < b - 1 or not np.any(values):
            continue
        column = left @ np.linalg.svd(left[inactive])[2][-1]
        agreement[row] = float(np.mean((np.abs(column) <= threshold) == inactive))
    return agreement


def batch_matching(
    rows: np.ndarray, *, observed: LayerUpdate[np.ndarray], factors: LowRankFactors, relative_noise: float
) -> np.ndarray:
    """Per-sample sparsity matching of a whole batch of ``b`` rows, as SPEAR++ scores its own.

    The rows fix the disaggregation matrix (``X = Q^-1 R``); its columns are the samples'
    gradient directions, scored by :class:`fl_attack.pipeline.selection.select.SparsityMatchingScorer`
    with SPEAR++'s zero tolerance. Meaningful only when every row is a sample: one wrong row
    changes every direction.
    """
    update = ObservedUpdate.from_update(observed, device=torch.device("cpu"))
    tolerance = ZeroTolerance.from_noise(relative_noise, width=update.width, factor=ZERO_TOLERANCE_FACTOR)
    scorer = SparsityMatchingScorer(update, factors, tolerance)
    inverse = torch.from_numpy(rows) @ torch.linalg.pinv(factors.right)
    per_sample, _ = scorer.score(torch.linalg.inv(inverse).T)
    return np.asarray(per_sample.numpy(), dtype=np.float64)


def _cosine(first: np.ndarray, second: np.ndarray) -> float:
    norms = float(np.linalg.norm(first) * np.linalg.norm(second))
    return abs(float(first @ second)) / norms if norms > 0 else 1.0


def merged_rows(
    route: NextLayerResult,
    attack_rows: np.ndarray,
    attack_confidence: np.ndarray,
    batch_size: int,
    *,
    route_agreement: np.ndarray | None = None,
    attack_agreement: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(b, n)`` merged rows and each one's source (``ROUTE_CHECKED`` ... ``DUPLICATE``).

    ``attack_rows`` holds the exact attack's ``b`` rows, so the candidates always fill the batch.
    The unclaimed rows (the route's unchecked ones, the exact attack's below
    :data:`CONFIDENT_MATCHING`) are ranked together by ``route_agreement`` and
    ``attack_agreement``, each row's :func:`pattern_agreement` (defaults: 0 for the route's rows,
    ``attack_confidence`` for the attack's).
    """
    # a certification whose row's own ReLU pattern contradicts the first layer's update is dropped
    # (its row is ranked with the unclaimed ones): the route must never displace an exact row
    contradicted = (
        np.zeros(len(route.samples), dtype=bool)
        if route_agreement is None
        else np.asarray(route_agreement) < CONTRADICTED_BELOW
    )
    if route_agreement is None:
        route_agreement = np.zeros(len(route.samples))
    if attack_agreement is None:
        attack_agreement = attack_confidence
    unclaimed_tier = 2
    # (tier, -agreement, the attack's row before the route's on a tie, source, row); sorted stably
    ranked: list[tuple[int, float, int, int, np.ndarray]] = []
    for sample, agreement, against in zip(route.samples, route_agreement, contradicted, strict=True):
        if not np.any(sample.inputs):
            continue
        if sample.verified and not against:
            ranked.append((0, 0.0, 1, ROUTE_CHECKED, sample.inputs))
        else:
            ranked.append((unclaimed_tier, -float(agreement), 1, ROUTE_UNCHECKED, sample.inputs))
    for values, confidence, agreement in zip(attack_rows, attack_confidence, attack_agreement, strict=True):
        if confidence >= CONFIDENT_MATCHING:
            ranked.append((1, -float(confidence), 0, EXACT_ATTACK, values))
        else:
            ranked.append((unclaimed_tier, -float(agreement), 0, EXACT_ATTACK_WEAK, values))
    ranked.sort(key=lambda item: item[:3])
    rows: list[np.ndarray] = []
    sources: list[int] = []
    duplicates: list[np.ndarray] = []
    for _, _, _, source, values in ranked:
        if any(_cosine(values, kept) > DUPLICATE_COSINE for kept in rows):
            duplicates.append(values)
        elif len(rows) < batch_size:
            rows.append(values)
            sources.append(source)
    for values in duplicates[: batch_size - len(rows)]:
        rows.append(values)
        sources.append(DUPLICATE)
    return np.array(rows), np.array(sources)


def complete_with_next_layer(
    reconstruction: Reconstruction,
    observed: LayerUpdate[np.ndarray],
    *,
    budget: Budget | None,
    seed: int = 0,
) -> Reconstruction:
    """``reconstruction`` merged with the next-layer route's rows (see the module docstring).

    Parameters
    ----------
    reconstruction
        An exact attack's result on ``observed``'s first update (with its self-check).
    observed
        The attacked layer, its update and the next linear layer's update.
    budget
        The attack's time budget (None: no budget); the route stops by :func:`route_budget`
        (what is left of it), and is not started with less than
        :data:`MIN_ROUTE_SECONDS` left (``next_layer_skipped`` in the ``stats``).
    seed
        Seeds the route's starts.

    Returns
    -------
    Reconstruction
        ``reconstruction`` itself when it is complete, has no self-check, or its batch size
        is not below both layers' widths; the same rows when the route found none; else the
        merged result. The ``stats`` add
        ``next_layer_found``, ``next_layer_checked``, ``next_layer_unchecked`` (rows kept of
        each kind), ``next_layer_attack_rows`` (the exact attack's rows kept),
        ``next_layer_rounds`` and ``next_layer_seconds``. ``confidence`` is the exact attack's
        for its rows and :func:`pattern_agreement` for the route's; for a complete batch, every
        row's :func:`batch_matching` (what SPEAR++ reports for its own complete batches).

    Raises
    ------
    ValueError
        If ``observed`` fails :func:`fl_attack.attacks.next_layer.checked_next_layer`.
    """
    b = reconstruction.batch_size
    m, following = observed.weight.shape[0], checked_next_layer(observed).shape[0]
    if reconstruction.complete or reconstruction.self_check is None or not 1 < b < min(m, following):
        return reconstruction
    seconds = route_budget(budget)
    if seconds < MIN_ROUTE_SECONDS:
        skipped = f"{seconds:.2f} s left of the time budget"
        return dataclasses.replace(
            reconstruction, stats={**reconstruction.stats, "next_layer_skipped": skipped}
        )
    route = recover_from_next_layer(observed, batch_size=b, time_budget=seconds, seed=seed, min_rounds=0)
    stats: dict[str, Any] = dict(reconstruction.stats)
    stats.update(
        next_layer_found=len(route.samples),
        next_layer_checked=0,
        next_layer_unchecked=0,
        next_layer_rounds=route.rounds,
        next_layer_seconds=route.seconds,
    )
    if not route.samples:
        return dataclasses.replace(
            reconstruction, stats=stats, seconds=reconstruction.seconds + route.seconds
        )
    attack_rows = reconstruction.inputs.double().numpy()
    attack_confidence = reconstruction.confidence.double().numpy()
    claimable = attack_confidence
    if reconstruction.self_check.ambiguous_twins:
        # near-identical samples: another batch explains the update as well, none of these is claimed
        claimable = np.minimum(attack_confidence, np.nextafter(CONFIDENT_MATCHING, 0.0))
    relative_noise = float(stats.get("relative_noise", 0.0))
    factors = decompose(torch.from_numpy(observed.weight_update), batch_size=b)
    left = factors.left.numpy()

    def agreement(inputs: np.ndarray) -> np.ndarray:
        return pattern_agreement(inputs, observed=observed, left=left, relative_noise=relative_noise)

    route_rows = np.array([sample.inputs for sample in route.samples])
    rows, sources = merged_rows(
        route,
        attack_rows,
        claimable,
        b,
        route_agreement=agreement(route_rows),
        attack_agreement=agreement(attack_rows),
    )
    from_route = (sources == ROUTE_CHECKED) | (sources == ROUTE_UNCHECKED)
    confidence = _attack_confidence(rows, attack_rows, attack_confidence)
    confidence[from_route] = agreement(rows[from_route])
    claimed = (sources == ROUTE_CHECKED) | (sources == EXACT_ATTACK)
    stats.update(
        next_layer_checked=int((sources == ROUTE_CHECKED).sum()),
        next_layer_unchecked=int((sources == ROUTE_UNCHECKED).sum()),
        next_layer_attack_rows=int((~from_route).sum()),
        directions_found=int((from_route | (confidence > 0)).sum()),
    )
    inputs = torch.from_numpy(rows)
    check = self_check(
        inputs,
        factors=factors,
        weight=torch.from_numpy(observed.weight),
        bias=torch.from_numpy(observed.bias),
        bias_grad=torch.from_numpy(observed.bias_update),
        relative_noise=relative_noise,
        exact=not bool(stats.get("noisy", False)),
        found=torch.from_numpy(claimed),
    )
    stats.update(check.stats())
    complete = bool(claimed.all()) and check.passed
    if complete:  # a whole batch: the same per-sample matching as SPEAR++'s own complete batches
        confidence = batch_matching(rows, observed=observed, factors=factors, relative_noise=relative_noise)
    return dataclasses.replace(
        reconstruction,
        inputs=inputs,
        confidence=torch.from_numpy(confidence),
        complete=complete,
        sparsity_matching=float(confidence.mean()),
        seconds=reconstruction.seconds + route.seconds,
        stats=stats,
        self_check=check,
    )


def _attack_confidence(
    rows: np.ndarray, attack_rows: np.ndarray, attack_confidence: np.ndarray
) -> np.ndarray:
    """Each merged row's confidence from the exact attack (the row it is; 0 for the route's rows)."""
    confidence = np.zeros(rows.shape[0])
    for index, values in enumerate(rows):
        same = np.flatnonzero((attack_rows == values).all(axis=1))
        if same.size:
            confidence[index] = attack_confidence[same[0]]
    return confidence
