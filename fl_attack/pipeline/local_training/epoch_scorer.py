"""Acceptance and self-check of one-epoch mini-batch updates (:mod:`fl_attack.pipeline.local_training.local_epochs`).

:class:`LocalEpochScorer` is the plain sparsity-matching scorer (everything is still matched at
``W_0`` while searching) whose acceptance also takes a complete selection that
:func:`fl_attack.pipeline.local_training.local_epochs.fit_one_epoch` explains step by step: so a right batch
is accepted, and the search stops, as soon as it is found. The self-check then judges each
sample against its pattern at its own step (:func:`epoch_fit_for`).
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.local_training.epoch_reach import unreachable
from fl_attack.pipeline.local_training.known import KnownTraining
from fl_attack.pipeline.local_training.local_epochs import MOMENTA, EpochFit, EpochPatterns, fit_one_epoch
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.selection.self_check import AMBIGUITY_FACTOR, PRECISION_FLOOR
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ObservedUpdate

__all__ = ["LocalEpochScorer", "epoch_fit_for"]

#: Reach of the other samples' contributions (``share <= 1``) with room for weight decay,
#: which lets a share exceed 1 by ``|a_T - 1|``.
REACH_MARGIN = 1.05


#: Rows closer than this (relative distance) are look-alikes whose blends keep nearly one
#: pattern: the fit (patterns only, over several steps) cannot rule them out, so no claim rests on
#: it. Measured: two samples 1e-3 apart, two epochs, were claimed as blends 6e-3 off; distinct
#: CIFAR-10 rows stay 0.7 apart.
LOOK_ALIKE_DISTANCE = 0.05


def _closest_pair(products: torch.Tensor) -> float:
    """Smallest relative distance ``||x_i - x_j|| / max(||x_i||, ||x_j||)`` from ``X X^T``."""
    size = products.shape[0]
    squared = products.diagonal()
    scale = torch.maximum(squared[:, None], squared[None, :]).clamp_min(1e-300)
    relative = ((squared[:, None] + squared[None, :] - 2 * products) / scale).clamp_min(0.0)
    relative = relative + torch.diag(
        torch.full((size,), math.inf, dtype=products.dtype, device=products.device)
    )
    return math.sqrt(float(relative.min()))


class LocalEpochScorer(SparsityMatchingScorer):
    """Plain sparsity matching that also accepts a batch fitting one local epoch of mini-batches.

    ``update`` must be the client's change ``W_T - W_0`` itself (weight decay removed, its
    ``decay_scale = a_T - 1`` given). ``known``: the client's training as its server configured
    it; the fit then tries only its mini-batch size, momentum and ``lr * weight_decay``.
    """

    def __init__(
        self,
        update: ObservedUpdate,
        factors: LowRankFactors,
        tolerance: ZeroTolerance,
        *,
        decay_scale: float = 0.0,
        known: KnownTraining | None = None,
    ) -> None:
        super().__init__(update, factors, tolerance)
        self.decay_scale = decay_scale
        self.known = KnownTraining() if known is None else known
        self.precision = min(1.0, max(tolerance.relative_noise, PRECISION_FLOOR))
        self.row_norms = update.weight.norm(dim=1)
        self._fits: dict[bytes, EpochFit | None] = {}

    def patterns(self, selection: Selection) -> EpochPatterns:
        """The :class:`EpochPatterns` of a complete selection."""
        unit = selection.directions / selection.directions.norm(dim=1, keepdim=True)
        _, q_inv = self.score(unit)
        scales = self.scales(unit)
        unit_columns = self.factors.left @ unit.T  # (m, b)
        columns = unit_columns * scales[None, :]
        squared = self.factors.right.square().sum(dim=1)  # rows of right are orthogonal
        gram = (q_inv * squared[None, :]) @ q_inv.T + 1.0
        norms = gram.diagonal().sub(1.0).clamp_min(0.0).sqrt()
        start = self.pre_activation_basis @ q_inv.T + self.update.bias[:, None]
        reach = columns.abs() @ gram.abs()
        ambiguity = AMBIGUITY_FACTOR * self.precision * (self.row_norms[:, None] * norms[None, :] + reach)
        zero = unit_columns.abs() <= self.tolerance.thresholds(unit)[None, :]
        return EpochPatterns(start=start, columns=columns, zero=zero, gram=gram, ambiguity=ambiguity)

    def fit(self, selection: Selection) -> EpochFit | None:
        """The one-epoch fit of a complete selection (cached per selection), or None."""
        key = selection.directions.detach().cpu().numpy().tobytes()
        if key not in self._fits:
            self._fits[key] = self._fit(selection)
        return self._fits[key]

    def _fit(self, selection: Selection) -> EpochFit | None:
        patterns = self.patterns(selection)
        if _closest_pair(patterns.gram - 1.0) < LOOK_ALIKE_DISTANCE:
            return None
        # necessary for any order: every mismatch at W_0 lies within reach of the other samples'
        # contributions (shares are at most 1); a blend's mismatches lie deep
        inactive = patterns.start < -patterns.ambiguity
        active = patterns.start > patterns.ambiguity
        mismatch = (inactive & ~patterns.zero) | (active & patterns.zero)
        others = patterns.columns.abs() @ patterns.gram.abs() - (
            patterns.columns.abs() * patterns.gram.diagonal().abs()[None, :]
        )
        reach = REACH_MARGIN * others + abs(self.decay_scale) * patterns.start.abs() + patterns.ambiguity
        if bool((mismatch & (patterns.start.abs() > reach)).any()):
            return None
        if self.decay_scale >= 0.0 and unreachable(patterns):
            return None  # sharper, without weight decay: the sign of each sample's contribution
        known = self.known
        return fit_one_epoch(
            patterns,
            batch_sizes=None if known.mini_batch_size is None else [known.mini_batch_size],
            momenta=MOMENTA if known.momentum is None else (known.momentum,),
            decay_scale=self.decay_scale,
            decay=known.decay,
        )

    def own_step_matching(self, selection: Selection, fit: EpochFit) -> torch.Tensor:
        """``(N,)``: each sample's sparsity matching at its own step of ``fit``.

        The share of neurons on which the column's zeros agree with the input's ReLU pattern at
        the weights of the sample's own step (a sample of a later step matches there, not at
        ``W_0``): a non-zero entry where the input is inactive, or a zero where it is active,
        disagrees; a neuron within the ambiguity of zero (the fit's own test) may be either.
        """
        zero = self.patterns(selection).zero
        inactive, active = fit.inactive.to(zero.device), fit.active.to(zero.device)
        disagree = (inactive & ~zero) | (active & zero)
        return 1.0 - disagree.to(selection.per_sample.dtype).mean(dim=0)

    def accepts(self, selection: Selection, *, accept_matching: float) -> bool:
        """Plain acceptance, or a complete selection some of whose samples match ``W_0``
        (step 0's) and that fits one local epoch."""
        if super().accepts(selection, accept_matching=accept_matching):
            return True
        return epoch_fit_for(self, selection, accept_matching=accept_matching) is not None


def epoch_fit_for(
    scorer: SparsityMatchingScorer, selection: Selection, *, accept_matching: float
) -> EpochFit | None:
    """The one-epoch fit that accepts ``selection`` where plain matching at ``W_0`` does not;
    None for any other scorer, an incomplete selection, or one plain matching accepts."""
    if (
        not isinstance(scorer, LocalEpochScorer)
        or not selection.complete
        or selection.directions.shape[0] < 2
    ):
        return None
    if SparsityMatchingScorer.accepts(scorer, selection, accept_matching=accept_matching):
        return None
    if float(selection.per_sample.max()) < accept_matching:
        return None  # no sample matches W_0: there is no first step
    return scorer.fit(selection)
