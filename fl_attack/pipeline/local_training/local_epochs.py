"""One local epoch of mini-batch SGD: each sample's ReLU pattern at its own step.

In one epoch of ``T = ceil(N / B)`` mini-batches every sample enters the update once, so
``dW = sum_i c_i x_i^T`` and ``db = sum_i c_i`` still hold, but ``c_i`` (its ``dL/dz`` scaled
by the optimizer) vanishes where sample ``i`` is inactive at the weights ``W_t`` of *its own*
step, not at ``W_0``. Those weights are known once the batch is: by
:mod:`fl_attack.pipeline.local_training.sgd_schedule`, ``W_t = a_t W_0 + sum_{s < t} rho_{t,s} P_s`` where
``P_s = sum_{j in step s} c_j x_j^T`` is step ``s``'s final contribution, so sample ``i``'s
pre-activations at step ``t`` are

``a_t z_i(W_0) + sum_{s < t} rho_{t,s} sum_{j in step s} c_j (x_j . x_i + 1)``,

all from the reconstruction itself. :func:`fit_one_epoch` looks for an order of the samples into
steps (and a momentum) under which every sample's column is zero exactly where it is inactive
at its own step: peeling, step 0 first (its samples match ``W_0`` exactly), each later step's
weights built from the samples already placed. A batch passing it is consistent with one
concrete run of SGD in which every step is a FedSGD step at its own weights, checked at the
same strictness as a FedSGD update at ``W_0`` (no mismatch beyond the ambiguity of
pre-activations within their noise of zero), which is what lets it be claimed.

The update must be the client's change ``W_T - W_0`` itself (as Flower clients send it), with
any weight-decay shrinkage ``(a_T - 1) W_0`` already removed
(:mod:`fl_attack.pipeline.local_training.weight_decay`); its scale ``a_T - 1`` is passed in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_attack.pipeline.local_training.sgd_schedule import SgdSchedule, decay_for_scale, sgd_schedule

__all__ = ["EpochFit", "EpochPatterns", "fit_one_epoch"]

#: Momenta tried when the client's is not known: plain SGD, then the common choices.
MOMENTA = (0.0, 0.9, 0.5, 0.8, 0.95, 0.99)

#: A neuron active for a sample whose downstream gradient is tiny leaves a (near) zero entry
#: although it is active (CIFAR-10 (20, 200): 2.8e-5 of the column's norm); as the plain
#: acceptance (matching >= 0.99) does, up to this fraction of such neurons is allowed. A non-zero
#: entry where the input is inactive is impossible and never allowed.
QUIET_FRACTION = 0.01

#: Search nodes (one step's choice of samples) one call of :func:`fit_one_epoch` may visit.
NODE_LIMIT = 4000


@dataclass(frozen=True)
class EpochPatterns:
    """What the fit reads of a complete reconstruction of ``N`` samples on ``m`` neurons.

    Attributes
    ----------
    start
        ``(m, N)`` pre-activations ``W_0 x_i + b_0``.
    columns
        ``(m, N)`` gradient columns ``c_i`` at the update's scale (``dW = C X``).
    zero
        ``(m, N)`` bool: entries of the columns that are exact zeros (within the noise).
    gram
        ``(N, N)`` ``X X^T + 1`` (the bias is an input fixed at 1).
    ambiguity
        ``(m, N)``: a pre-activation this close to zero may lie on either side.
    """

    start: torch.Tensor
    columns: torch.Tensor
    zero: torch.Tensor
    gram: torch.Tensor
    ambiguity: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.columns.shape[1])


@dataclass(frozen=True)
class EpochFit:
    """An order of the samples into SGD steps under which every pattern matches.

    Attributes
    ----------
    batch_size, momentum, decay
        The mini-batch size, momentum and ``lr * weight_decay`` of the fitted run.
    steps
        Sample indices of each step, in order.
    inactive
        ``(m, N)`` bool: the neurons each sample leaves inactive (beyond the ambiguity) at its own step.
    """

    batch_size: int
    momentum: float
    decay: float
    steps: tuple[tuple[int, ...], ...]
    inactive: torch.Tensor

    def describe(self) -> str:
        """One phrase: ``"fits one local epoch, 4 mini-batches of 5, momentum 0.9"``."""
        count = len(self.steps)
        text = f"fits one local epoch, {count} mini-batch{'es' if count != 1 else ''} of {self.batch_size}"
        if self.momentum:
            text += f", momentum {self.momentum:g}"
        if self.decay:
            text += f", lr x weight decay {self.decay:.2g}"
        return text


def fit_one_epoch(
    patterns: EpochPatterns,
    *,
    batch_sizes: Sequence[int] | None = None,
    momenta: Sequence[float] = MOMENTA,
    decay_scale: float = 0.0,
    node_limit: int = NODE_LIMIT,
) -> EpochFit | None:
    """Find mini-batches and a momentum under which every sample matches at its own step.

    Parameters
    ----------
    patterns
        The reconstruction's patterns (:class:`EpochPatterns`).
    batch_sizes
        Mini-batch sizes to try (the client's, when known); None tries every size below ``N``
        that step 0 can hold (samples matching ``W_0`` exactly), largest first.
    momenta
        Momenta to try, in order.
    decay_scale
        ``a_T - 1``, the shrinkage of ``W_0`` removed from the update (0: no weight decay).
    node_limit
        Search nodes the whole call may visit; None is returned when they run out.

    Returns
    -------
    EpochFit or None
        The first fit found; None when no order of the tried kinds matches every sample.
    """
    n = patterns.size
    if n < 2:
        return None
    first = _consistent(patterns, patterns.start)
    sizes = (
        [size for size in range(min(n - 1, int(first.sum())), 0, -1)]
        if batch_sizes is None
        else [size for size in batch_sizes if 1 <= size < n]
    )
    budget = [node_limit]
    for size in sizes:
        steps = math.ceil(n / size)
        for momentum in momenta:
            decay = decay_for_scale(decay_scale, steps=steps, momentum=momentum)
            schedule = sgd_schedule(steps=steps, momentum=momentum, decay=decay)
            counts = [size] * (steps - 1) + [n - size * (steps - 1)]
            found = _peel(patterns, schedule, counts, [], list(range(n)), budget)
            if found is not None:
                order, inactive = found
                return EpochFit(size, momentum, decay, tuple(order), inactive)
            if budget[0] <= 0:
                return None
    return None


def _consistent(patterns: EpochPatterns, pre_activation: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: no column non-zero where its input is inactive (beyond the ambiguity), and at
    most ``QUIET_FRACTION`` of the neurons zero where it is active."""
    inactive = pre_activation < -patterns.ambiguity
    active = pre_activation > patterns.ambiguity
    quiet = (active & patterns.zero).sum(dim=0)
    allowed = int(QUIET_FRACTION * patterns.zero.shape[0])
    return ~(inactive & ~patterns.zero).any(dim=0) & (quiet <= allowed)


def _pre_activations(
    patterns: EpochPatterns, schedule: SgdSchedule, order: list[tuple[int, ...]]
) -> torch.Tensor:
    """``(m, N)`` pre-activations of every sample at the weights of step ``len(order)``."""
    t = len(order)
    pre = float(schedule.start_scale[t]) * patterns.start
    for s, members in enumerate(order):
        index = list(members)
        pre = pre + float(schedule.share[t, s]) * (patterns.columns[:, index] @ patterns.gram[index, :])
    return pre


def _lasting(patterns: EpochPatterns, schedule: SgdSchedule, counts: list[int]) -> torch.Tensor:
    """``(N,)``: the last step at which each sample still matches when every other sample's
    contribution is taken in at the share of the average sample placed before that step."""
    others = patterns.columns @ patterns.gram - patterns.columns * patterns.gram.diagonal()[None, :]
    total = sum(counts)
    last = torch.full((patterns.size,), -1, dtype=torch.int64, device=patterns.start.device)
    for t in range(len(counts)):
        placed = sum(float(schedule.share[t, s]) * counts[s] for s in range(t)) / max(total - 1, 1)
        pre = float(schedule.start_scale[t]) * patterns.start + placed * others
        last = torch.where(_consistent(patterns, pre), torch.full_like(last, t), last)
    return last


def _peel(
    patterns: EpochPatterns,
    schedule: SgdSchedule,
    counts: list[int],
    order: list[tuple[int, ...]],
    remaining: list[int],
    budget: list[int],
) -> tuple[list[tuple[int, ...]], torch.Tensor] | None:
    """Depth-first: the samples of step ``len(order)`` among those matching its weights."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    t = len(order)
    pre = _pre_activations(patterns, schedule, order)
    consistent = _consistent(patterns, pre)
    candidates = [i for i in remaining if bool(consistent[i])]
    need = counts[t]
    if len(candidates) < need:
        return None
    if t == len(counts) - 1:
        if len(candidates) != len(remaining):
            return None
        inactive = torch.zeros_like(patterns.zero)
        for s, members in enumerate([*order, tuple(remaining)]):
            index = list(members)
            inactive[:, index] = (_pre_activations(patterns, schedule, order[:s]) < -patterns.ambiguity)[
                :, index
            ]
        return [*order, tuple(remaining)], inactive
    # samples that stop matching soonest as the others' contributions grow are placed first
    lasting = _lasting(patterns, schedule, counts)
    candidates.sort(key=lambda i: int(lasting[i]))
    for chosen in itertools.combinations(candidates, need):
        rest = [i for i in remaining if i not in chosen]
        found = _peel(patterns, schedule, counts, [*order, chosen], rest, budget)
        if found is not None:
            return found
        if budget[0] <= 0:
            return None
    return None
