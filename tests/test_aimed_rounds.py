"""Clean sphere-search rounds aimed past the exact directions (fl_attack.pipeline.search.aimed_rounds)."""

from __future__ import annotations

import functools

import pytest
import torch

import fl_attack.attacks.spear as spear_module
from fl_attack import get_attack
from fl_attack.pipeline.search.aimed_rounds import (
    AIMED_STARTS_PER_MISSING,
    MIN_AIMED_STARTS,
    MIN_FOUND_SHARE,
    aimed_round,
    exact_found,
    ordinary_lr,
)
from fl_attack.pipeline.selection.select import Selection
from tests.synthetic_layer import relu_layer_update


def _selection(directions: torch.Tensor, found: list[bool], per_sample: list[float]) -> Selection:
    matching = torch.tensor(per_sample, dtype=torch.float64)
    inputs = torch.zeros(directions.shape[0], 3, dtype=torch.float64)
    return Selection(directions, torch.tensor(found), inputs, matching, float(matching.mean()))


def _unit_rows(count: int, size: int, seed: int) -> torch.Tensor:
    rows = torch.randn(count, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    unit: torch.Tensor = rows / rows.norm(dim=1, keepdim=True)
    return unit


def test_partial_selection_trusts_found_pool_members_only() -> None:
    directions = _unit_rows(10, 10, seed=0)
    pool = torch.cat([directions[:4], -directions[5:6]])  # sign does not matter
    found = [True] * 6 + [False] * 4  # row 4 found but not a pool candidate: a weak one
    selection = _selection(directions, found, [0.3] * 10)
    exact = exact_found(selection, pool, accept_matching=0.99)
    assert torch.equal(exact, directions[[0, 1, 2, 3, 5]])


def test_complete_selection_also_asks_for_the_matching() -> None:
    directions = _unit_rows(4, 4, seed=1)
    selection = _selection(directions, [True] * 4, [1.0, 0.98, 0.995, 1.0])
    exact = exact_found(selection, directions, accept_matching=0.99)
    assert torch.equal(exact, directions[[0, 2, 3]])


def test_no_aimed_round_first_or_with_too_few_found() -> None:
    directions = _unit_rows(20, 20, seed=2)
    plan = functools.partial(aimed_round, 500, pool_directions=directions, accept_matching=0.99, lr=0.15)
    most_found = _selection(directions, [True] * 15 + [False] * 5, [0.0] * 20)
    assert plan(rounds_done=0, latest=most_found) is None
    assert plan(rounds_done=3, latest=None) is None
    # 14 of 20 is below MIN_FOUND_SHARE (15 of 20)
    assert MIN_FOUND_SHARE == 0.75
    fewer = _selection(directions, [True] * 14 + [False] * 6, [0.0] * 20)
    assert plan(rounds_done=1, latest=fewer) is None
    everything = _selection(directions, [True] * 20, [1.0] * 20)
    assert plan(rounds_done=1, latest=everything) is None
    aimed = plan(rounds_done=1, latest=most_found)
    assert aimed is not None and torch.equal(aimed.avoid, directions[:15])


def test_aimed_round_is_sized_by_the_missing_directions() -> None:
    b = 100
    directions = _unit_rows(b, b, seed=3)
    plan = functools.partial(
        aimed_round, rounds_done=2, pool_directions=directions, accept_matching=0.99, lr=0.15
    )
    selection = _selection(directions, [True] * 80 + [False] * 20, [0.5] * b)
    aimed = plan(10_000, latest=selection)
    assert aimed is not None
    assert aimed.starts == AIMED_STARTS_PER_MISSING * 20
    assert aimed.lr == 0.15
    assert torch.equal(aimed.avoid, directions[:80])
    few_missing = _selection(directions, [True] * 99 + [False], [0.5] * b)
    small = plan(10_000, latest=few_missing)
    assert small is not None and small.starts == MIN_AIMED_STARTS
    capped = plan(300, latest=selection)
    assert capped is not None and capped.starts == 300


def test_crowded_layers_take_the_largest_step_size() -> None:
    rates = (0.5, 2.0, 0.15)
    assert [ordinary_lr(rates, rounds_done=r, width=4000, batch_size=400) for r in range(3)] == [2.0] * 3
    assert [ordinary_lr(rates, rounds_done=r, width=1200, batch_size=100) for r in range(3)] == [2.0] * 3
    # wider than 12 neurons per sample, or a small batch: the cycle
    assert [ordinary_lr(rates, rounds_done=r, width=4000, batch_size=150) for r in range(3)] == list(rates)
    assert [ordinary_lr(rates, rounds_done=r, width=200, batch_size=20) for r in range(4)] == [
        0.5,
        2.0,
        0.15,
        0.5,
    ]


@pytest.mark.parametrize(
    ("per_round", "rounds_done", "lr", "message"),
    [(0, 1, 0.1, "per_round >= 1"), (10, -1, 0.1, "rounds_done >= 0"), (10, 1, 0.0, "lr > 0")],
)
def test_bad_plan_arguments_are_named(per_round: int, rounds_done: int, lr: float, message: str) -> None:
    directions = _unit_rows(4, 4, seed=4)
    with pytest.raises(ValueError, match=message):
        aimed_round(
            per_round,
            rounds_done=rounds_done,
            latest=None,
            pool_directions=directions,
            accept_matching=0.99,
            lr=lr,
        )


def test_clean_attack_with_aimed_rounds_recovers_a_batch_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few starts per round force later rounds, which are aimed; the batch still comes back exact."""
    torch.set_num_threads(1)
    # the deepest rows' kernels complete this batch's last sample before any aimed round: off here
    monkeypatch.setattr(
        spear_module, "epoch_last_directions", lambda state, scorer, selection, **_: selection.directions[:0]
    )
    inputs = torch.randn(12, 60, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    update = relu_layer_update(inputs, width=160, seed=2)
    attack = get_attack("spear++", seed=0, time_budget=60.0, progress=False, initializations=4)
    rec = attack.invert(
        update.weight_grad, update.bias_grad, weight=update.weight, bias=update.bias, batch_size=12
    )
    assert rec.complete
    assert rec.stats["aimed_rounds"] >= 1
    error = (rec.inputs.to(torch.float64)[None] - inputs[:, None]).norm(dim=2).min(dim=1).values
    assert float(error.max()) < 1e-8
