"""FedAvg with ReLU drift: matching, proposals and the self-check for several local steps.

After ``E`` full-batch local SGD steps the server observes ``dW = W_E - W_0 = sum_t G_t`` with
``G_t = D_t^T X``: the row space is still exactly the batch's, and sample ``i``'s column of
``D = sum_t D_t`` vanishes exactly on the neurons its input leaves inactive at *every* step.
Those are a subset of the neurons inactive at ``W_0`` (exactly: step 0 is taken there), and
nearly a subset of those inactive at ``W_E = W_0 + dW`` (the last step is taken one step
before it). With a large learning rate the patterns move between steps: measured on CIFAR-10
at (20, 200) after 10 steps at lr 0.1, up to 21% of the neurons inactive at both ends were active
at some step in between, so true columns have fewer zeros (51-92 of 200 instead of ~100)
and match their own ``W_0`` pattern only at 0.77-0.94.

* :class:`DriftMatchingScorer` compares each column's zeros with the neurons its input leaves
  inactive at both ``W_0`` and ``W_E`` (true columns: 0.91-0.995) and counts the violations
  that no true column shows: a zero on a neuron active at ``W_0`` (impossible), a non-zero on a
  neuron inactive far from its threshold at both ends (measured, :data:`DEEP_INACTIVE`).
* :func:`fl_attack.pipeline.local_training.drift_proposals.drift_proposals` proposes the directions of the samples still missing. Their l1
  minima lie near the true directions (cos 0.74-0.998) but the smallest rows of a minimum
  hold non-zeros of neurons that were active only briefly, so rounding on them misses. The
  inputs implied by the trusted directions plus those approximations predict each missing
  sample's inactive neurons; kernels of random ``b - 1`` of the predicted rows (the smallest
  first) hit the exact direction in 1-98% of draws, and a hit reveals itself by its many zeros.
* :func:`drift_self_check` replaces the re-synthesis test of :mod:`fl_attack.pipeline.selection.self_check`,
  which assumes one pattern, by the drift-consistency test above (with :func:`drift_polish`
  for the final digits).

Everything here needs ``W_E``: the update must be the client's change ``W_E - W_0`` itself,
which the caller declares by passing its number of local steps (the server configured them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.polish import MIN_COS, polish
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.selection.self_check import (
    AMBIGUITY_FACTOR,
    PRECISION_FLOOR,
    SelfCheck,
    bias_outside_span,
    without_resynthesis,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ObservedUpdate
from fl_attack.validation import check_local_steps

#: A column is drift-consistent when at most this fraction of the neurons its input leaves
#: inactive at both ends are non-zero in it (active at some step in between). Measured on
#: CIFAR-10 (20, 200), 10 full-batch steps at lr 0.1: true columns up to 0.21; a mixture of
#: two samples is non-zero wherever only one of them is inactive (about half of them).
SOFT_LIMIT = 0.35

#: A neuron briefly active in between (non-zero in a true column though inactive at both ends)
#: stays near its threshold at both ends: measured on CIFAR-10 (20, 200), 10 steps at lr 0.1
#: (seeds 0-4), and bundled faces, its larger end pre-activation is at least -0.32 times the
#: endpoints' change ``delta = ||dW_k|| ||x|| + |db_k|``. A non-zero where both ends lie below
#: ``-DEEP_INACTIVE * delta`` is a deep violation: a mixture of two look-alike faces (34 dB)
#: showed four (-0.58 to -1.28) and passed every other test.
DEEP_INACTIVE = 0.5

#: A hard violation needs an entry below this fraction of the zero tolerance: exact zeros of
#: true columns lie below 0.016 of it (CIFAR-10 (20, 200), 5 steps at lr 0.01 and 10 at lr 0.1),
#: while a neuron active at ``W_0`` whose gradient barely matters leaves entries down to 0.1
#: of it (2-3 per batch at lr 0.01), which the zero tolerance alone would count as zeros.
HARD_ZERO_FRACTION = 0.1

#: Least-squares re-fits of :func:`drift_polish`.
POLISH_ROUNDS = 3


@dataclass(frozen=True)
class DriftViolations:
    """Per-sample drift consistency of one set of ``b`` directions, each ``(b,)``.

    Attributes
    ----------
    zeros
        Exact zeros of each sample's gradient column.
    hard
        Zeros (below ``HARD_ZERO_FRACTION`` of the tolerance) on neurons the sample's input leaves
        clearly active at ``W_0`` (never for a true column of a full-batch update, whose step 0 is
        taken at ``W_0``).
    soft
        Non-zeros on neurons inactive at both ``W_0`` and ``W_E``.
    deep
        Soft violations on neurons inactive at both ends by more than ``DEEP_INACTIVE`` times
        the change of their pre-activation between the ends.
    predicted
        Neurons inactive at both ``W_0`` and ``W_E``.
    """

    zeros: torch.Tensor
    hard: torch.Tensor
    soft: torch.Tensor
    deep: torch.Tensor
    predicted: torch.Tensor

    def passed(self, batch_size: int) -> torch.Tensor:
        """``(b,)`` bool: no hard or deep violation, at most ``SOFT_LIMIT`` soft ones, and at
        least ``2 (b - 1)`` zeros (twice what any kernel of ``b - 1`` rows has)."""
        soft_ok = self.soft <= SOFT_LIMIT * self.predicted
        clean = (self.hard == 0) & (self.deep == 0)
        return clean & soft_ok & (self.zeros >= 2 * (batch_size - 1))


class DriftMatchingScorer(SparsityMatchingScorer):
    """Sparsity matching against the neurons inactive at both ``W_0`` and ``W_E = W_0 + dW``.

    A selection is accepted when every direction is drift-consistent (:meth:`DriftViolations.passed`).

    ``update.weight_update`` and ``update.bias_update`` must be the client's change ``W_E - W_0``
    and ``b_E - b_0`` themselves (not a multiple of it).
    """

    def __init__(
        self,
        update: ObservedUpdate,
        factors: LowRankFactors,
        tolerance: ZeroTolerance,
    ) -> None:
        super().__init__(update, factors, tolerance)
        self.final_basis = (update.weight + update.weight_update) @ factors.right.T  # (m, b)
        self.final_bias = update.bias + update.bias_update
        self.precision = min(1.0, max(tolerance.relative_noise, PRECISION_FLOOR))
        self.row_norms = update.weight.norm(dim=1)
        self.change_norms = update.weight_update.norm(dim=1)

    def start_pre_activations(self, q_inv: torch.Tensor) -> torch.Tensor:
        """``(..., m, b)`` pre-activations at ``W_0`` of the inputs ``q_inv @ right``."""
        return self.pre_activation_basis @ q_inv.transpose(-1, -2) + self.update.bias[:, None]

    def final_pre_activations(self, q_inv: torch.Tensor) -> torch.Tensor:
        """``(..., m, b)`` pre-activations at ``W_E`` of the inputs ``q_inv @ right``."""
        return self.final_basis @ q_inv.transpose(-1, -2) + self.final_bias[:, None]

    def inactive(self, q_inv: torch.Tensor) -> torch.Tensor:
        return (self.start_pre_activations(q_inv) <= 0) & (self.final_pre_activations(q_inv) <= 0)

    def violations(self, directions: torch.Tensor) -> DriftViolations:
        """The drift consistency of one ``(b, b)`` set of directions (rows)."""
        _, q_inv = self.score(directions)
        unit = directions / directions.norm(dim=1, keepdim=True)
        columns = self.factors.left @ unit.T  # (m, b)
        threshold = self.tolerance.thresholds(unit)[None, :]
        zero = columns.abs() <= threshold
        strict_zero = columns.abs() <= HARD_ZERO_FRACTION * threshold
        start, final = self.start_pre_activations(q_inv), self.final_pre_activations(q_inv)
        inputs_norm = (q_inv @ self.factors.right).norm(dim=1)[None, :]
        ambiguous = AMBIGUITY_FACTOR * self.precision * self.row_norms[:, None] * inputs_norm
        change = self.change_norms[:, None] * inputs_norm + self.update.bias_update.abs()[:, None]
        predicted = (start <= 0) & (final <= 0)
        deep = ~zero & (torch.maximum(start, final) < -DEEP_INACTIVE * change)
        return DriftViolations(
            zeros=zero.sum(dim=0),
            hard=(strict_zero & (start > ambiguous)).sum(dim=0),
            soft=(predicted & ~zero).sum(dim=0),
            deep=deep.sum(dim=0),
            predicted=predicted.sum(dim=0),
        )

    def accepts(self, selection: Selection, *, accept_matching: float = 1.0) -> bool:
        """Whether every direction of a complete selection is drift-consistent (``accept_matching``,
        the single-pattern criterion, does not apply)."""
        if not selection.complete:
            return False
        b = selection.directions.shape[0]
        return bool(self.violations(drift_polish(self, selection).directions).passed(b).all())


def drift_polish(scorer: DriftMatchingScorer, selection: Selection) -> Selection:
    """``selection`` with every direction re-fitted on its zeros that its input leaves inactive at ``W_0``.

    A direction rounded from a few rows is exact only to ~1e-5 rad, so a true column's tiny
    non-zero entries (1e-5 of its norm on a neuron that stayed active but barely mattered) can
    fall under the zero tolerance; on a neuron active at ``W_0`` such a zero is impossible and
    is left out of the least-squares fit. Repeated ``POLISH_ROUNDS`` times, as the zeros and
    the inputs follow the re-fitted directions (a slight mixture of two look-alike samples
    converges to one of them). Kept only when no direction moves by more than ``1 - MIN_COS``
    and no sample gains a hard violation; otherwise ``selection`` is returned.
    """
    if not selection.complete:
        return selection
    unit = selection.directions / selection.directions.norm(dim=1, keepdim=True)
    left, b = scorer.factors.left, unit.shape[0]
    directions = unit
    for _ in range(POLISH_ROUNDS):
        _, q_inv = scorer.score(directions)
        zero = (left @ directions.T).abs() <= scorer.tolerance.thresholds(directions)[None, :]
        rows = zero & (scorer.start_pre_activations(q_inv) <= 0)  # (m, b)
        if bool((rows.sum(dim=0) < b - 1).any()):
            return selection
        gram = torch.einsum("mk,mi,mj->kij", rows.to(left.dtype), left, left)
        refitted = torch.linalg.eigh(gram).eigenvectors[:, :, 0]
        directions = refitted * torch.sign((refitted * directions).sum(dim=1))[:, None]
    if bool(((directions * unit).sum(dim=1) < MIN_COS).any()):
        return selection
    before, after = scorer.violations(selection.directions), scorer.violations(directions)
    if bool((after.hard > before.hard).any()):
        return selection
    per_sample, q_inv = scorer.score(directions)
    inputs = q_inv @ scorer.factors.right
    return Selection(directions, selection.found, inputs, per_sample, float(per_sample.mean()))


def polish_for(scorer: SparsityMatchingScorer, selection: Selection) -> Selection:
    """The final re-fit of a clean selection: :func:`drift_polish` for a drift-aware scorer,
    else :func:`fl_attack.pipeline.selection.polish.polish` (on the single ReLU pattern)."""
    if isinstance(scorer, DriftMatchingScorer):
        return drift_polish(scorer, selection)
    return polish(scorer, selection)


def scorer_for(
    update: ObservedUpdate,
    factors: LowRankFactors,
    tolerance: ZeroTolerance,
    *,
    local_steps: int,
    noisy: bool,
) -> SparsityMatchingScorer:
    """The drift-aware scorer for a clean (not ``noisy``) update of ``local_steps > 1`` full-batch
    steps of at least two samples, else the plain one (FedSGD; under DP noise no pattern is read).

    Raises
    ------
    ValueError
        If ``local_steps`` is not an integer >= 1.
    """
    check_local_steps(local_steps)
    if local_steps > 1 and not noisy and factors.batch_size > 1:
        return DriftMatchingScorer(update, factors, tolerance)
    return SparsityMatchingScorer(update, factors, tolerance)


def drift_self_check(
    check: SelfCheck, *, scorer: SparsityMatchingScorer, selection: Selection, stats: dict[str, Any]
) -> SelfCheck:
    """``check`` (from :func:`fl_attack.pipeline.selection.self_check.self_check`) for a drifted update;
    adds the drift figures (:func:`drift_stats`) to ``stats``. Unchanged (and ``stats`` too)
    unless ``scorer`` is a :class:`DriftMatchingScorer`.

    Its re-synthesis test masks the output gradient with the ``W_0`` pattern, which a drifted
    column violates by construction; it is replaced by the drift consistency of every
    direction (:meth:`DriftViolations.passed`) and by the bias update lying in the span of the
    weight update's left factor (``db = D 1``). Rank, distinct rows and pattern twins are kept.
    """
    if not isinstance(scorer, DriftMatchingScorer):
        return check
    b = selection.directions.shape[0]
    stats.update(drift_stats(scorer, selection), drift_aware=True)
    kept = without_resynthesis(check)
    violations = scorer.violations(selection.directions)
    failing = ~violations.passed(b) & selection.found
    if bool(failing.any()):
        hard, deep = int((violations.hard > 0).sum()), int((violations.deep > 0).sum())
        kept.append(
            f"{int(failing.sum())} directions are not drift-consistent ({hard} with zeros on "
            f"neurons active at the start, {deep} non-zero where inactive deep at both ends)"
        )
    bias_residual, bias_tolerance = bias_outside_span(scorer.factors, scorer.update.bias_update)
    if bias_residual > bias_tolerance:
        kept.append(f"bias update outside the weight update's span by {bias_residual:.2g}")
    return replace(
        check,
        passed=not kept,
        bias_residual=bias_residual,
        bias_tolerance=bias_tolerance,
        reasons=tuple(kept),
    )


def drift_stats(scorer: DriftMatchingScorer, selection: Selection) -> dict[str, float]:
    """Figures of a selection's drift consistency for the reconstruction's stats."""
    violations = scorer.violations(selection.directions)
    found = selection.found
    if not bool(found.any()):
        return {"drift_consistent": 0.0}
    soft = violations.soft[found].to(torch.float64) / violations.predicted[found].clamp_min(1)
    return {
        "drift_consistent": float(violations.passed(int(found.numel()))[found].sum()),
        "drift_hard_violations": float(violations.hard[found].sum()),
        "drift_deep_violations": float(violations.deep[found].sum()),
        "drift_max_soft_fraction": float(soft.max()),
        "drift_min_zeros": float(violations.zeros[found].min()),
    }
