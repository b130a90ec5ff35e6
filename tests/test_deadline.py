"""The time budget is a deadline for every stage of the exact attacks.

End to end: large-ish attacks with tiny budgets return within 110% of the budget (plus a small
constant for a loaded test machine), incomplete, and say that the budget ran out. Stage by
stage: each stage given a deadline that has already passed does (almost) nothing, and running
a stage in many small chunks gives exactly what one chunk gives.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from synthetic_layer import SyntheticUpdate, relu_layer_update

from fl_attack import Spear, SpearPlusPlus
from fl_attack.pipeline.budget import deadline as deadline_module
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import chunk_rows, map_rows
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.last_direction import scan_missing_directions
from fl_attack.pipeline.search.mixtures import split_mixtures
from fl_attack.pipeline.search.sparsity import ZeroTolerance, normalize_columns, round_minima
from fl_attack.pipeline.search.sphere import (
    SphereSchedule,
    get_surrogate,
    optimize_on_sphere,
    sampling_rounding,
)
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, prune_doubtful, select
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.types import ObservedUpdate

#: Seconds of slack on top of the promised 110%: scheduling noise of a shared test machine.
SLACK = 0.5
PASSED = Deadline(0.0)  # a deadline that has always passed


def _large_update(*, batch: int = 100, width: int = 1000, features: int = 120) -> SyntheticUpdate:
    """A batch that takes SPEAR++ far longer than a second (one search round alone does)."""
    inputs = torch.randn(batch, features, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return relu_layer_update(inputs, width=width, seed=1, dtype=torch.float32)


def _assert_stopped_in_time(rec, *, budget: float, wall: float) -> None:
    assert rec.seconds <= wall <= 1.1 * budget + SLACK, (wall, rec.summary())
    assert rec.complete is False
    assert rec.stats["stopped_by"] == "time_budget"
    assert rec.stats["budget_exhausted"] is True
    assert rec.stats["time_budget"] == budget


@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_spear_plus_plus_returns_within_its_budget_incomplete(budget: float) -> None:
    update = _large_update()
    start = time.perf_counter()
    rec = SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(**update.arrays())
    _assert_stopped_in_time(rec, budget=budget, wall=time.perf_counter() - start)
    assert rec.batch_size == 100
    assert rec.stats["self_check_passed"] is False  # placeholder rows never pass


def test_noisy_attack_with_pruning_returns_within_its_budget() -> None:
    update = _large_update()
    generator = torch.Generator().manual_seed(2)
    sigma = 0.3 * float(update.weight_grad.abs().median())
    weight_grad = update.weight_grad + sigma * torch.randn(update.weight_grad.shape, generator=generator)
    bias_grad = update.bias_grad + sigma * torch.randn(update.bias_grad.shape, generator=generator)
    budget = 1.0
    start = time.perf_counter()
    rec = SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(
        weight_grad, bias_grad, weight=update.weight, bias=update.bias, batch_size=100
    )
    _assert_stopped_in_time(rec, budget=budget, wall=time.perf_counter() - start)
    assert rec.stats["noisy"] is True and "pruned" in rec.stats


def test_spear_sampling_returns_within_its_budget() -> None:
    update = _large_update(batch=60, width=600, features=80)
    budget = 0.5
    start = time.perf_counter()
    rec = Spear(seed=0, time_budget=budget, progress=False).invert(**update.arrays())
    _assert_stopped_in_time(rec, budget=budget, wall=time.perf_counter() - start)


def test_unlimited_budget_is_reported_and_not_exhausted() -> None:
    inputs = torch.randn(3, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    update = relu_layer_update(inputs, width=40, seed=3)
    rec = SpearPlusPlus(seed=0, time_budget=None, max_initializations=512, progress=False).invert(
        **update.arrays()
    )
    assert rec.complete, rec.summary()
    assert rec.stats["time_budget"] is None
    assert rec.stats["budget_exhausted"] is False
    assert "stopped_by" not in rec.stats


# --------------------------------------------------------------------------------------
# each stage stops at a deadline that has passed
# --------------------------------------------------------------------------------------


def _factors_and_pool(batch: int = 6, width: int = 60, features: int = 20):
    inputs = torch.randn(batch, features, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    update = relu_layer_update(inputs, width=width, seed=4)
    observed = ObservedUpdate.from_update(update.layer_update(), device=torch.device("cpu"))
    factors = decompose(observed.weight_update)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=width)
    pool = CandidatePool(
        factors, tolerance, min_zeros=batch + 1, weak_min_zeros=batch + 1, cos_tolerance=1e-9
    )
    return observed, factors, tolerance, pool


def _random_units(count: int, size: int, seed: int = 5) -> torch.Tensor:
    draws = torch.randn(count, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return draws / draws.norm(dim=1, keepdim=True)


def test_sphere_search_at_a_passed_deadline_returns_its_starting_points() -> None:
    _, factors, _, _ = _factors_and_pool()
    start = _random_units(50, factors.batch_size)
    minima = optimize_on_sphere(factors.left, start, surrogate=get_surrogate("l1"), deadline=PASSED)
    assert torch.equal(minima, start)


def test_rounding_at_a_passed_deadline_rounds_nothing() -> None:
    _, factors, _, _ = _factors_and_pool()
    b = factors.batch_size
    minima = _random_units(50, b)
    assert round_minima(factors, minima, rows=b + 5, exact=True, deadline=PASSED).shape == (0, b)
    rounded = sampling_rounding(
        factors.left,
        minima,
        pool_fraction=0.5,
        samples=2,
        generator=torch.Generator().manual_seed(0),
        deadline=PASSED,
    )
    assert rounded.shape == (0, b)


def test_pooling_at_a_passed_deadline_adds_nothing() -> None:
    _, factors, _, pool = _factors_and_pool()
    assert pool.add(_random_units(40, factors.batch_size), deadline=PASSED) == 0
    assert len(pool) == 0 and pool.proposals_seen == 0


def test_selection_at_a_passed_deadline_makes_no_swap() -> None:
    observed, factors, tolerance, _ = _factors_and_pool()
    scorer = SparsityMatchingScorer(observed, factors, tolerance)
    b = factors.batch_size
    candidates = _random_units(3 * b, b)
    counts = torch.arange(3 * b, 0, -1)
    chosen = select(scorer, candidates, counts, deadline=PASSED)
    # the sparsest independent set is kept as it is: the first b candidates
    assert torch.equal(chosen.directions, candidates[:b])
    improved = select(scorer, candidates, counts)
    assert improved.sparsity_matching >= chosen.sparsity_matching


def test_splitting_and_scanning_at_a_passed_deadline_propose_nothing() -> None:
    observed, factors, tolerance, _ = _factors_and_pool()
    b = factors.batch_size
    found = _random_units(b - 1, b, seed=6)
    assert split_mixtures(factors, _random_units(8, b), found, tolerance, deadline=PASSED).shape == (0, b)
    for missing in (1, 2):
        proposals = scan_missing_directions(
            factors,
            found[: b - missing],
            pre_activation_basis=observed.weight @ factors.right.T,
            bias=observed.bias,
            tolerance=tolerance,
            min_zeros=b,
            deadline=PASSED,
        )
        assert proposals.shape == (0, b)


def test_pruning_at_a_passed_deadline_keeps_the_selection() -> None:
    observed, factors, tolerance, _ = _factors_and_pool()
    scorer = SparsityMatchingScorer(observed, factors, tolerance)
    b = factors.batch_size
    directions = _random_units(b, b)
    per_sample, q_inv = scorer.score(directions)
    selection = Selection(
        directions,
        torch.ones(b, dtype=torch.bool),
        q_inv @ factors.right,
        per_sample,
        float(per_sample.mean()),
    )
    assert prune_doubtful(scorer, selection, deadline=PASSED) is selection


# --------------------------------------------------------------------------------------
# chunking changes nothing but when the deadline is checked
# --------------------------------------------------------------------------------------


def test_map_rows_stops_between_chunks_and_keeps_the_order() -> None:
    rows = torch.arange(10.0)[:, None]
    assert torch.equal(map_rows(lambda chunk: 2 * chunk, rows, seconds_per_row=0.01), 2 * rows)
    assert map_rows(lambda chunk: 2 * chunk, rows, seconds_per_row=0.01, deadline=PASSED).shape == (0, 1)
    calls = []

    def slow(chunk: torch.Tensor) -> torch.Tensor:
        calls.append(chunk.shape[0])
        time.sleep(0.02)
        return chunk

    # five rows per chunk; the deadline passes during the first chunk
    done = map_rows(
        slow, rows, seconds_per_row=deadline_module.CHUNK_SECONDS / 5, deadline=Deadline.in_seconds(0.01)
    )
    assert calls == [5] and torch.equal(done, rows[:5])


def test_chunk_rows_follows_the_cost_model() -> None:
    assert chunk_rows(deadline_module.CHUNK_SECONDS / 7) == 7
    assert chunk_rows(1e3) == 1
    assert chunk_rows(deadline_module.CHUNK_SECONDS / 7, device=torch.device("meta")) == 700
    with pytest.raises(ValueError, match="seconds_per_row"):
        chunk_rows(0.0)
    with pytest.raises(ValueError, match="seconds_per_row"):
        chunk_rows(math.inf)


def test_small_chunks_give_the_same_search_and_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    _, factors, _, _ = _factors_and_pool(batch=8, width=80, features=30)
    b = factors.batch_size
    start = _random_units(64, b).float()
    left = factors.left.float()
    schedule = SphereSchedule(steps=60, lr=0.5, milestones=(30,))
    surrogate = get_surrogate("l1")
    whole = optimize_on_sphere(left, start, surrogate=surrogate, schedule=schedule)
    # rounded from points without ties among their smallest entries (converged float32
    # minima have exact zeros, and top-k may break such ties differently in other batch sizes)
    points = _random_units(64, b, seed=8)
    rounded = normalize_columns(round_minima(factors, points, rows=3 * b, exact=True))
    monkeypatch.setattr(deadline_module, "CHUNK_SECONDS", 1e-9)  # one row per chunk
    assert torch.equal(optimize_on_sphere(left, start, surrogate=surrogate, schedule=schedule), whole)
    chunked = normalize_columns(round_minima(factors, points, rows=3 * b, exact=True))
    assert torch.allclose(chunked, rounded, atol=1e-12, rtol=0)


def test_small_chunks_give_the_same_reconstruction(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = torch.randn(5, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    update = relu_layer_update(inputs, width=60, seed=7)
    attack = SpearPlusPlus(seed=0, time_budget=None, max_initializations=256, progress=False)
    whole = attack.invert(**update.arrays())
    monkeypatch.setattr(deadline_module, "CHUNK_SECONDS", 1e-4)
    chunked = attack.invert(**update.arrays())
    assert whole.complete and chunked.complete
    assert torch.allclose(whole.inputs, chunked.inputs, atol=1e-9, rtol=0)
