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

#: Below this many choices of one step, each is judged on its own (a batched judgement costs
#: more than a few single ones).
JUDGE_TOGETHER = 8

#: Children of one search node whose samples are judged together (the rest of the chunk is
#: wasted when an early child's subtree ends the search).
CHILD_CHUNK = 64

#: Elements of the ``(k, m, N)`` pre-activations of the last step's ``k`` candidate orders that
#: are judged together (about 64 MiB of float64).
LEAF_CHUNK_ELEMENTS = 8_000_000


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
    active
        ``(m, N)`` bool: the neurons each sample leaves active (beyond the ambiguity) at its own step;
        neither inactive nor active is within the ambiguity of zero.
    """

    batch_size: int
    momentum: float
    decay: float
    steps: tuple[tuple[int, ...], ...]
    inactive: torch.Tensor
    active: torch.Tensor

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
    decay: float | None = None,
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
    decay
        ``lr * weight_decay`` per step when the client's configuration says it; None derives it
        from ``decay_scale`` for each tried size and momentum. Used only where a shrinkage was
        removed (``decay_scale != 0``): an update left with its shrinkage is fitted without it.
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
        products = _StepProducts(patterns)  # the momenta of one size try the same steps
        for momentum in momenta:
            step_decay = (
                decay
                if decay is not None and decay_scale != 0
                else decay_for_scale(decay_scale, steps=steps, momentum=momentum)
            )
            schedule = sgd_schedule(steps=steps, momentum=momentum, decay=step_decay)
            counts = [size] * (steps - 1) + [n - size * (steps - 1)]
            run = _Run(patterns, schedule, counts, products)
            found = run.peel([], [], list(range(n)), budget)
            if found is not None:
                order, own_step = found
                inactive, active = own_step < -patterns.ambiguity, own_step > patterns.ambiguity
                return EpochFit(size, momentum, step_decay, tuple(order), inactive, active)
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


def _lasting(patterns: EpochPatterns, schedule: SgdSchedule, counts: list[int]) -> torch.Tensor:
    """``(N,)``: the last step at which each sample still matches when every other sample's
    contribution is taken in at the share of the average sample placed before that step."""
    others = patterns.columns @ patterns.gram - patterns.columns * patterns.gram.diagonal()[None, :]
    total = sum(counts)
    shares, start_scales = schedule.share.tolist(), schedule.start_scale.tolist()
    last = torch.full((patterns.size,), -1, dtype=torch.int64, device=patterns.start.device)
    for t in range(len(counts)):
        placed = sum(shares[t][s] * counts[s] for s in range(t)) / max(total - 1, 1)
        pre = start_scales[t] * patterns.start + placed * others
        last = torch.where(_consistent(patterns, pre), torch.full_like(last, t), last)
    return last


class _StepProducts:
    """Each step's ``(m, N)`` contribution ``C_s G_s`` before its share, kept (up to
    ``LEAF_CHUNK_ELEMENTS`` elements) for the other momenta, which try the same steps."""

    def __init__(self, patterns: EpochPatterns) -> None:
        self.patterns = patterns
        self.kept: dict[tuple[int, ...], torch.Tensor] = {}
        self.room = LEAF_CHUNK_ELEMENTS // max(1, patterns.start.numel())

    def get(self, members: tuple[int, ...]) -> torch.Tensor:
        product = self.kept.get(members)
        if product is None:
            index = list(members)
            product = self.patterns.columns[:, index] @ self.patterns.gram[index, :]
            if len(self.kept) < self.room:
                self.kept[members] = product
        return product


class _Run:
    """The peeling search of one mini-batch size and momentum: what does not depend on the order
    of the samples (the ``_lasting`` steps) is computed once, and each placed step's product
    ``C_s G_s`` once per branch."""

    def __init__(
        self, patterns: EpochPatterns, schedule: SgdSchedule, counts: list[int], products: _StepProducts
    ) -> None:
        self.patterns = patterns
        self.schedule = schedule
        self.share: list[list[float]] = schedule.share.tolist()  # read at every node: Python floats
        self.start_scale: list[float] = schedule.start_scale.tolist()
        self.counts = counts
        self.step_product = products.get
        self._lasting: list[int] | None = None

    def lasting(self) -> list[int]:
        """:func:`_lasting` of this size and momentum (the same at every node)."""
        if self._lasting is None:
            self._lasting = _lasting(self.patterns, self.schedule, self.counts).tolist()
        return self._lasting

    def pre_activations(self, products: list[torch.Tensor], *, step: int | None = None) -> torch.Tensor:
        """``(m, N)`` pre-activations at the weights of ``step`` (default: ``len(products)``, right
        after the steps placed) from the placed steps' ``products``."""
        t = len(products) if step is None else step
        pre = self.start_scale[t] * self.patterns.start
        for s, product in enumerate(products):
            pre = pre + self.share[t][s] * product
        return pre

    def peel(
        self,
        order: list[tuple[int, ...]],
        products: list[torch.Tensor],
        remaining: list[int],
        budget: list[int],
        consistent: list[bool] | None = None,
    ) -> tuple[list[tuple[int, ...]], torch.Tensor] | None:
        """Depth-first: the samples of step ``len(order)`` among those matching its weights
        (``consistent``, per sample, when the parent judged them with its siblings)."""
        patterns, counts = self.patterns, self.counts
        budget[0] -= 1
        if budget[0] < 0:
            return None
        t = len(order)
        if consistent is None:
            consistent = _consistent(patterns, self.pre_activations(products)).tolist()
        candidates = [i for i in remaining if consistent[i]]
        need = counts[t]
        if len(candidates) < need:
            return None
        if t == len(counts) - 1:
            return self.result(order, products, remaining) if len(candidates) == len(remaining) else None
        # samples that stop matching soonest as the others' contributions grow are placed first
        lasting = self.lasting()
        candidates.sort(key=lambda i: lasting[i])
        if t == len(counts) - 2:
            return self.peel_last_two(order, products, remaining, candidates, budget)
        choices = itertools.combinations(candidates, need)
        if math.comb(len(candidates), need) < JUDGE_TOGETHER:
            for chosen in choices:
                rest = [i for i in remaining if i not in chosen]
                found = self.peel([*order, chosen], [*products, self.step_product(chosen)], rest, budget)
                if found is not None:
                    return found
                if budget[0] <= 0:
                    return None
            return None
        # many children: each one's samples are judged at its weights with a chunk of its siblings
        base = self.pre_activations(products, step=t + 1)
        share = self.share[t + 1][t]
        chunk = max(1, min(CHILD_CHUNK, LEAF_CHUNK_ELEMENTS // max(1, patterns.start.numel())))
        while True:
            batch = list(itertools.islice(choices, min(chunk, max(1, budget[0]))))
            if not batch:
                return None
            chosen_rows = _indicator(batch, patterns.size, device=patterns.start.device)
            judged = _choices_consistent(patterns, base, share, chosen_rows, remaining).tolist()
            for chosen, row in zip(batch, judged, strict=True):
                rest = [i for i in remaining if i not in chosen]
                child = dict(zip(remaining, row, strict=True))
                found = self.peel(
                    [*order, chosen],
                    [*products, self.step_product(chosen)],
                    rest,
                    budget,
                    [child.get(i, False) for i in range(patterns.size)],
                )
                if found is not None:
                    return found
                if budget[0] <= 0:
                    return None

    def result(
        self, order: list[tuple[int, ...]], products: list[torch.Tensor], remaining: list[int]
    ) -> tuple[list[tuple[int, ...]], torch.Tensor]:
        """The steps with ``remaining`` as the last, and each sample's pre-activations at its own step."""
        own_step = torch.zeros_like(self.patterns.start)
        for s, members in enumerate([*order, tuple(remaining)]):
            index = list(members)
            own_step[:, index] = self.pre_activations(products[:s])[:, index]
        return [*order, tuple(remaining)], own_step

    def peel_last_two(
        self,
        order: list[tuple[int, ...]],
        products: list[torch.Tensor],
        remaining: list[int],
        candidates: list[int],
        budget: list[int],
    ) -> tuple[list[tuple[int, ...]], torch.Tensor] | None:
        """:meth:`peel`'s loop over the last but one step's choices, whose children (the last
        step: every sample left must match) are judged a chunk at a time, in the same order and
        with the same node count as one :meth:`peel` call each."""
        m, n = self.patterns.start.shape
        chunk = max(1, LEAF_CHUNK_ELEMENTS // max(1, m * n))
        t = len(order) + 1  # the last step
        share = self.share[t][t - 1]
        base = self.pre_activations(products, step=t)  # before the last but one step's share
        need = self.counts[t - 1]
        judge = _LastStepJudge(
            self.patterns, base, share, remaining, choices=math.comb(len(candidates), need)
        )
        choices = itertools.combinations(candidates, need)
        while True:
            if budget[0] <= 0:  # the next child runs out of nodes
                budget[0] -= 1
                return None
            batch = list(itertools.islice(choices, min(chunk, budget[0])))
            if not batch:
                return None
            first = judge.first_fit(batch)
            if first is not None:  # its earlier siblings each cost a node, as it does
                budget[0] -= first + 1
                chosen = batch[first]
                return self.result(
                    [*order, chosen], [*products, self.step_product(chosen)], self._rest(remaining, chosen)
                )
            budget[0] -= len(batch)
            if budget[0] <= 0:
                return None

    @staticmethod
    def _rest(remaining: list[int], chosen: tuple[int, ...]) -> list[int]:
        return [i for i in remaining if i not in chosen]


class _LastStepJudge:
    """Which choices of the last but one step leave every remaining sample matching at the last
    step's weights ``base + share * C_S G_S``.

    A choice fails as soon as one sample left fails, so the samples are judged in two groups,
    the second only over the choices the first left standing: first those that do not match
    ``base`` (the chosen step must repair them, and mostly does not), then the others.
    """

    def __init__(
        self, patterns: EpochPatterns, base: torch.Tensor, share: float, remaining: list[int], *, choices: int
    ) -> None:
        self.patterns = patterns
        self.base = base
        self.share = share
        if choices < JUDGE_TOGETHER:  # too few to gain from splitting
            self.groups = [remaining]
            return
        consistent = _consistent(patterns, base).tolist()
        groups = ([i for i in remaining if not consistent[i]], [i for i in remaining if consistent[i]])
        self.groups = [group for group in groups if group]

    def first_fit(self, batch: list[tuple[int, ...]]) -> int | None:
        """Index in ``batch`` of the first choice under which every sample left matches."""
        standing = list(range(len(batch)))
        for samples in self.groups:
            chosen = _indicator([batch[k] for k in standing], self.patterns.size, device=self.base.device)
            judged = _choices_consistent(self.patterns, self.base, self.share, chosen, samples)
            passes = (judged | chosen[:, samples]).all(dim=1).tolist()  # a chosen sample is not left to judge
            standing = [k for k, ok in zip(standing, passes, strict=True) if ok]
            if not standing:
                return None
        return standing[0]


def _indicator(batch: Sequence[tuple[int, ...]], size: int, *, device: torch.device) -> torch.Tensor:
    """``(k, size)`` bool: the samples of each choice."""
    rows = torch.zeros(len(batch), size, dtype=torch.bool)
    rows[torch.arange(len(batch))[:, None], torch.tensor(batch, dtype=torch.int64)] = True
    return rows.to(device)


def _choices_consistent(
    patterns: EpochPatterns,
    base: torch.Tensor,
    share: float,
    chosen: torch.Tensor,
    samples: list[int],
) -> torch.Tensor:
    """``(k, g)`` bool: :func:`_consistent` of ``samples`` at ``base + share * C_S G_S`` for each
    choice ``S`` (a row of the ``(k, N)`` bool ``chosen``), all choices in one batched product."""
    device = patterns.start.device
    index = torch.tensor(samples, dtype=torch.int64, device=device)
    gram = patterns.gram[:, index][None] * chosen[:, :, None]  # (k, N, g): the chosen samples' rows
    pre = base[None, :, index] + share * (patterns.columns @ gram)  # (k, m, g)
    zero = patterns.zero[None, :, index]
    ambiguity = patterns.ambiguity[None, :, index]
    mismatch = ((pre < -ambiguity) & ~zero).any(dim=1)
    quiet = ((pre > ambiguity) & zero).sum(dim=1)
    return ~mismatch & (quiet <= int(QUIET_FRACTION * patterns.zero.shape[0]))
