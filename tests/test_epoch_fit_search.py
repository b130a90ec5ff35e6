"""The one-epoch fit's batched search against a plain one, and the bound that refuses before it.

:func:`fit_one_epoch` judges many choices of a step in one batched product; the reference here
visits the same tree one node at a time (every node's weights rebuilt from scratch), so the
two must agree on the fit, the inactive neurons and where the nodes run out. :func:`unreachable`
refuses a selection before any search; it must never refuse one that fits.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fl_attack.pipeline.local_training import local_epochs
from fl_attack.pipeline.local_training.epoch_reach import reach_bounds, unreachable
from fl_attack.pipeline.local_training.local_epochs import QUIET_FRACTION, EpochPatterns, fit_one_epoch
from fl_attack.pipeline.local_training.sgd_schedule import SgdSchedule, sgd_schedule
from fl_attack.simulate.local_sgd import sgd_steps
from fl_attack.types import ObservedUpdate

MOMENTA = (0.0, 0.9, 0.5)


def _patterns(update: ObservedUpdate, inputs: torch.Tensor) -> EpochPatterns:
    columns = update.weight_update @ inputs.T @ torch.linalg.inv(inputs @ inputs.T)
    start = update.weight @ inputs.T + update.bias[:, None]
    gram = inputs @ inputs.T + 1.0
    ambiguity = 1e-9 * (
        update.weight.norm(dim=1)[:, None] * inputs.norm(dim=1)[None, :] + columns.abs() @ gram
    )
    zero = columns.abs() <= 1e-9 * columns.abs().max()
    return EpochPatterns(start=start, columns=columns, zero=zero, gram=gram, ambiguity=ambiguity)


def _one_epoch(
    *, seed: int, samples: int, batch: int, momentum: float, lr: float, blend: bool = False
) -> EpochPatterns:
    """One shuffled epoch of mini-batches of ``batch`` on a width-30 ReLU layer; ``blend`` mixes
    the first sample of the first step with the last of the last step, as a wrong selection does."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3)).double()
    inputs = torch.randn(samples, 12, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    order = torch.randperm(samples, generator=generator)
    layer = model[0]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    batches = [order[s : s + batch] for s in range(0, samples, batch)]
    sgd_steps(model, inputs, labels, batches=batches, lr=lr, momentum=momentum)
    update = ObservedUpdate(layer.weight.detach() - weight, layer.bias.detach() - bias, weight, bias)
    seen = inputs.clone()
    if blend:
        i, j = int(order[-1]), int(order[0])
        seen[i], seen[j] = 0.7 * inputs[i] + 0.3 * inputs[j], 0.3 * inputs[i] + 0.7 * inputs[j]
    return _patterns(update, seen)


def _consistent(patterns: EpochPatterns, pre: torch.Tensor) -> list[bool]:
    mismatch = ((pre < -patterns.ambiguity) & ~patterns.zero).any(dim=0)
    quiet = ((pre > patterns.ambiguity) & patterns.zero).sum(dim=0)
    return (~mismatch & (quiet <= int(QUIET_FRACTION * patterns.zero.shape[0]))).tolist()


def _weights(
    patterns: EpochPatterns, schedule: SgdSchedule, order: list[tuple[int, ...]], t: int
) -> torch.Tensor:
    """Pre-activations at step ``t``'s weights, rebuilt from the steps before it."""
    pre = float(schedule.start_scale[t]) * patterns.start
    for s, members in enumerate(order[:t]):
        index = list(members)
        pre = pre + float(schedule.share[t, s]) * (patterns.columns[:, index] @ patterns.gram[index, :])
    return pre


def _lasting(patterns: EpochPatterns, schedule: SgdSchedule, counts: list[int]) -> list[int]:
    others = patterns.columns @ patterns.gram - patterns.columns * patterns.gram.diagonal()[None, :]
    last = [-1] * patterns.size
    for t in range(len(counts)):
        placed = sum(float(schedule.share[t, s]) * counts[s] for s in range(t)) / max(sum(counts) - 1, 1)
        pre = float(schedule.start_scale[t]) * patterns.start + placed * others
        last = [t if ok else old for ok, old in zip(_consistent(patterns, pre), last, strict=True)]
    return last


def _visit(
    patterns: EpochPatterns,
    schedule: SgdSchedule,
    counts: list[int],
    lasting: list[int],
    order: list[tuple[int, ...]],
    remaining: list[int],
    budget: list[int],
) -> list[tuple[int, ...]] | None:
    """One node: the choices of step ``len(order)`` among the samples matching its weights."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    t = len(order)
    matching = _consistent(patterns, _weights(patterns, schedule, order, t))
    candidates = sorted((i for i in remaining if matching[i]), key=lambda i: lasting[i])
    if len(candidates) < counts[t]:
        return None
    if t == len(counts) - 1:
        return [*order, tuple(remaining)] if len(candidates) == len(remaining) else None
    for chosen in itertools.combinations(candidates, counts[t]):
        rest = [i for i in remaining if i not in chosen]
        found = _visit(patterns, schedule, counts, lasting, [*order, chosen], rest, budget)
        if found is not None:
            return found
        if budget[0] <= 0:
            return None
    return None


def _reference_fit(
    patterns: EpochPatterns, *, node_limit: int
) -> tuple[int, float, tuple[tuple[int, ...], ...], torch.Tensor] | None:
    """Depth-first over the steps, one node (one step's choice) at a time, largest mini-batch
    first, then each momentum; samples that stop matching soonest are chosen first."""
    n = patterns.size
    budget = [node_limit]
    for size in range(min(n - 1, sum(_consistent(patterns, patterns.start))), 0, -1):
        steps = math.ceil(n / size)
        counts = [size] * (steps - 1) + [n - size * (steps - 1)]
        for momentum in MOMENTA:
            schedule = sgd_schedule(steps=steps, momentum=momentum, decay=0.0)
            lasting = _lasting(patterns, schedule, counts)
            found = _visit(patterns, schedule, counts, lasting, [], list(range(n)), budget)
            if found is not None:
                inactive = torch.zeros_like(patterns.zero)
                for s, members in enumerate(found):
                    index = list(members)
                    pre = _weights(patterns, schedule, found, s)
                    inactive[:, index] = (pre < -patterns.ambiguity)[:, index]
                return size, momentum, tuple(found), inactive
            if budget[0] <= 0:
                return None
    return None


CASES = [
    {"seed": 3, "samples": 6, "batch": 2, "momentum": 0.9, "lr": 1.0},
    {"seed": 4, "samples": 6, "batch": 2, "momentum": 0.9, "lr": 0.5, "blend": True},
    {"seed": 5, "samples": 8, "batch": 3, "momentum": 0.0, "lr": 1.0},
    {"seed": 6, "samples": 8, "batch": 3, "momentum": 0.5, "lr": 0.5, "blend": True},
    {"seed": 7, "samples": 9, "batch": 3, "momentum": 0.9, "lr": 1.0},
    {"seed": 8, "samples": 9, "batch": 3, "momentum": 0.0, "lr": 0.5, "blend": True},
    {"seed": 9, "samples": 8, "batch": 4, "momentum": 0.5, "lr": 1.0, "blend": True},
]


@pytest.mark.parametrize("chunks", ["shipped", "tiny"])
def test_the_batched_search_visits_the_tree_of_one_node_at_a_time(
    chunks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same fit (mini-batch size, momentum, steps, inactive neurons) or the same refusal at every
    node limit, with the shipped chunks and with chunks of 2 or 3 choices (batched even for a
    few children), so the node count crosses chunk boundaries."""
    if chunks == "tiny":
        monkeypatch.setattr(local_epochs, "JUDGE_TOGETHER", 1)
        monkeypatch.setattr(local_epochs, "CHILD_CHUNK", 2)
        monkeypatch.setattr(local_epochs, "LEAF_CHUNK_ELEMENTS", 3 * 30 * 9)
    found = refused = 0
    for case in CASES:
        patterns = _one_epoch(**case)  # type: ignore[arg-type]
        for node_limit in (1, 4, 9, 40, 300, 4000):
            expected = _reference_fit(patterns, node_limit=node_limit)
            fit = fit_one_epoch(patterns, momenta=MOMENTA, node_limit=node_limit)
            assert (fit is None) == (expected is None), (case, node_limit)
            if fit is None or expected is None:
                refused += 1
                continue
            found += 1
            assert (fit.batch_size, fit.momentum, fit.steps) == expected[:3], (case, node_limit)
            assert torch.equal(fit.inactive, expected[3])
    assert found >= 10 and refused >= 10  # both outcomes are compared


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 20])
def test_without_weight_decay_a_step_is_a_share_of_one_or_less_of_its_final_contribution(steps: int) -> None:
    """What the bound rests on: shares in [0, 1] and the start's factor exactly 1."""
    for momentum in local_epochs.MOMENTA:
        schedule = sgd_schedule(steps=steps, momentum=momentum, decay=0.0)
        assert bool((schedule.share >= 0.0).all()) and bool((schedule.share <= 1.0).all())
        assert bool((schedule.start_scale == 1.0).all())


@pytest.mark.parametrize("seed", range(4))
def test_every_order_keeps_each_sample_within_its_reach_bounds(seed: int) -> None:
    """Random orders, mini-batch sizes and momenta: each sample's pre-activations at its own
    step lie between the bounds (to their rounding room)."""
    patterns = _one_epoch(seed=20 + seed, samples=9, batch=3, momentum=0.9, lr=1.0, blend=seed % 2 == 1)
    lower, upper, room = reach_bounds(patterns)
    rounding = room - patterns.ambiguity
    generator = torch.Generator().manual_seed(seed)
    for _ in range(12):
        size = int(torch.randint(1, 9, (1,), generator=generator))
        momentum = local_epochs.MOMENTA[
            int(torch.randint(0, len(local_epochs.MOMENTA), (1,), generator=generator))
        ]
        shuffled = torch.randperm(9, generator=generator).tolist()
        order = [tuple(shuffled[s : s + size]) for s in range(0, 9, size)]
        schedule = sgd_schedule(steps=len(order), momentum=momentum, decay=0.0)
        for t, members in enumerate(order):
            pre = _weights(patterns, schedule, order, t)[:, list(members)]
            assert bool((pre >= lower[:, list(members)] - rounding[:, list(members)]).all())
            assert bool((pre <= upper[:, list(members)] + rounding[:, list(members)]).all())


def test_the_reach_bound_never_refuses_a_fit_and_refuses_blends() -> None:
    """True one-epoch updates (sizes, momenta, learning rates) fit and pass the bound; blends of a
    first-step and a last-step sample, which no order fits, are refused by it before any search."""
    fits = blends_refused = 0
    for seed, (samples, batch) in enumerate([(6, 2), (8, 3), (9, 3), (10, 4)]):
        for momentum in (0.0, 0.5, 0.9):
            for lr in (0.5, 1.0):
                true = _one_epoch(seed=40 + seed, samples=samples, batch=batch, momentum=momentum, lr=lr)
                if fit_one_epoch(true) is not None:
                    fits += 1
                    assert not unreachable(true), (samples, batch, momentum, lr)
                blended = _one_epoch(
                    seed=40 + seed, samples=samples, batch=batch, momentum=momentum, lr=lr, blend=True
                )
                if unreachable(blended):
                    blends_refused += 1
                    assert fit_one_epoch(blended) is None
    assert fits >= 20 and blends_refused >= 12
