"""The decomposition under a deadline: it stops (or does not start) in time, and gives the same factors.

A large layer's decomposition is a few LAPACK calls that cannot be interrupted (singular values,
an eigendecomposition) between matrix products that can. Products check the deadline between
chunks; a LAPACK call whose estimated cost does not fit before the deadline is not started; an
attack whose decomposition does not fit returns placeholder rows at once, stopped by the budget.
Whenever the deadline is not reached, the factors are those computed without one.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from synthetic_layer import relu_layer_update

import fl_attack.pipeline.spectrum.decompose as decomposition
from fl_attack import SpearPlusPlus
from fl_attack.pipeline.budget.budget import DECOMPOSITION_SHARE, Budget, Deadline
from fl_attack.pipeline.budget.deadline import (
    DeadlineReached,
    chunked_gram,
    chunked_product,
    require_time,
    svd_seconds,
    svdvals_seconds,
    symmetric_eigen_seconds,
)
from fl_attack.pipeline.budget.out_of_time import out_of_time
from fl_attack.pipeline.spectrum.decompose import decompose

#: Seconds of slack on top of the promised 110%: scheduling noise of a shared test machine.
SLACK = 0.5
PASSED = Deadline(0.0)  # a deadline that has always passed
LATER = Deadline(math.nextafter(math.inf, 0.0))  # a finite deadline no test reaches


def _matrix(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _clean_update(*, batch: int, width: int, features: int, seed: int = 0) -> torch.Tensor:
    """A float32 first-layer gradient of a random ReLU layer, as float64."""
    inputs = _matrix(batch, features, seed).abs()
    return relu_layer_update(inputs, width=width, seed=seed + 1, dtype=torch.float32).weight_grad.double()


def _previous_top_singular_triplets(
    weight_grad: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The subspace iteration as it was before it checked a deadline (one product per call)."""
    k = rank + decomposition.SUBSPACE_OVERSAMPLE
    probe = torch.randn(
        weight_grad.shape[1], k, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    basis = torch.linalg.qr(weight_grad @ probe).Q
    for _ in range(decomposition.SUBSPACE_ITERATIONS):
        basis = torch.linalg.qr(weight_grad @ torch.linalg.qr(weight_grad.T @ basis).Q).Q
    small_u, top, vh = torch.linalg.svd(basis.T @ weight_grad, full_matrices=False)
    return basis @ small_u, top, vh


# --------------------------------------------------------------------------------------
# cost model and chunked products
# --------------------------------------------------------------------------------------


def test_cost_model_of_the_lapack_calls() -> None:
    # 4000 x 3072: 4 M N^2 - 4/3 N^3 = 1.123e11 flops at 1e-10 s each
    assert svdvals_seconds(4000, 3072) == pytest.approx(11.23, rel=1e-3)
    assert svdvals_seconds(3072, 4000) == svdvals_seconds(4000, 3072)
    assert svd_seconds(4000, 3072) == pytest.approx(11.23 + 58.0, rel=1e-3)
    assert symmetric_eigen_seconds(3072) == pytest.approx(26.09, rel=1e-3)


def test_require_time_names_the_work_and_the_time_left() -> None:
    require_time(1e9, deadline=Deadline.never(), what="anything")  # no deadline: never raises
    require_time(1.0, deadline=Deadline.in_seconds(60.0), what="a call that fits")
    with pytest.raises(DeadlineReached, match=r"the SVD of X would take about 5 s and [0-9.]+ s are left"):
        require_time(5.0, deadline=Deadline.in_seconds(1.0), what="the SVD of X")
    with pytest.raises(DeadlineReached, match=r"and 0 s are left"):
        require_time(1e-9, deadline=PASSED, what="a call after the deadline")
    # the CPU cost model would refuse an accelerator work it does in a fraction of the time
    soon = Deadline.in_seconds(1.0)
    require_time(5.0, deadline=soon, what="the SVD of X", device=torch.device("cuda"))
    with pytest.raises(DeadlineReached):
        require_time(5.0, deadline=soon, what="the SVD of X", device=torch.device("cpu"))


def test_chunked_product_is_the_product_bit_for_bit() -> None:
    left, right = _matrix(3000, 700, 1), _matrix(700, 60, 2)
    assert torch.equal(chunked_product(left, right, deadline=LATER), left @ right)
    assert torch.equal(
        chunked_product(left.T, _matrix(3000, 9, 3), deadline=LATER), left.T @ _matrix(3000, 9, 3)
    )
    with pytest.raises(DeadlineReached, match="after 0 of 3000 rows"):
        chunked_product(left, right, deadline=PASSED)


def test_chunked_gram_is_the_gram_matrix() -> None:
    matrix = _matrix(1500, 300, 4)
    gram = chunked_gram(matrix, deadline=LATER)
    assert torch.equal(gram, gram.T)
    assert float((gram - matrix.T @ matrix).abs().max() / (matrix.T @ matrix).abs().max()) < 1e-14
    with pytest.raises(DeadlineReached, match="after 0 of 1500 rows of a Gram matrix"):
        chunked_gram(matrix, deadline=PASSED)


# --------------------------------------------------------------------------------------
# the decomposition
# --------------------------------------------------------------------------------------


def test_large_layer_factors_are_unchanged_by_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same factors as the subspace iteration without chunks, with or without an unreached deadline."""
    weight_grad = _clean_update(batch=15, width=500, features=300)
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
    free = decompose(weight_grad)
    bounded = decompose(weight_grad, deadline=Deadline.in_seconds(600.0))
    assert free.batch_size == bounded.batch_size == 15
    assert not free.spectrum.noisy
    assert torch.equal(free.left, bounded.left) and torch.equal(free.right, bounded.right)
    u, top, vh = _previous_top_singular_triplets(weight_grad, 15)
    assert torch.equal(free.left, u[:, :15]) and torch.equal(free.right, top[:15, None] * vh[:15])


def test_small_layer_factors_are_unchanged_by_a_deadline() -> None:
    weight_grad = _clean_update(batch=9, width=120, features=80)
    free = decompose(weight_grad)
    bounded = decompose(weight_grad, deadline=Deadline.in_seconds(600.0))
    u, s, vh = torch.linalg.svd(weight_grad, full_matrices=False)
    assert free.batch_size == bounded.batch_size == 9
    assert torch.equal(free.left, bounded.left) and torch.equal(free.singular_values, s)
    assert torch.equal(free.left, u[:, :9]) and torch.equal(free.right, s[:9, None] * vh[:9])


@pytest.mark.parametrize("large", [True, False], ids=["svdvals", "full-svd"])
def test_no_lapack_call_starts_after_the_deadline(monkeypatch: pytest.MonkeyPatch, large: bool) -> None:
    weight_grad = _clean_update(batch=5, width=200, features=150)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a LAPACK call started after the deadline")

    monkeypatch.setattr(decomposition.torch.linalg, "svdvals", forbidden)
    monkeypatch.setattr(decomposition.torch.linalg, "svd", forbidden)
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100 if large else 10_000)
    what = "singular values" if large else "SVD"
    with pytest.raises(DeadlineReached, match=f"the {what} of a 200 x 150 update would take about"):
        decompose(weight_grad, deadline=PASSED)


def test_subspace_iteration_stops_between_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The singular values ran into the deadline: the vectors are not computed."""
    weight_grad = _clean_update(batch=5, width=200, features=150)
    real_svdvals = torch.linalg.svdvals
    deadline = Deadline.in_seconds(0.3)

    def slow_svdvals(matrix: torch.Tensor) -> torch.Tensor:
        time.sleep(max(0.0, deadline.remaining()) + 0.01)
        return real_svdvals(matrix)

    monkeypatch.setattr(decomposition.torch.linalg, "svdvals", slow_svdvals)
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
    with pytest.raises(DeadlineReached, match="rows of a product"):
        decompose(weight_grad, deadline=deadline)


# --------------------------------------------------------------------------------------
# the attack
# --------------------------------------------------------------------------------------


def _wide_layer_update(batch: int = 20):
    """A real layer of 2100 x 2100 (the large-layer path): its singular values alone are
    estimated at 2.5 s, beyond a 1 s budget."""
    inputs = _matrix(batch, 2100, 5).abs()
    return relu_layer_update(inputs, width=2100, seed=6, dtype=torch.float32)


@pytest.mark.parametrize("batch_size", [None, 20])
def test_attack_returns_at_once_when_the_decomposition_cannot_fit(batch_size: int | None) -> None:
    update = _wide_layer_update()
    assert min(update.weight_grad.shape) >= decomposition.LARGE_SIDE
    budget = 1.0
    start = time.perf_counter()
    rec = SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(
        **update.arrays(), batch_size=batch_size
    )
    wall = time.perf_counter() - start
    assert rec.seconds <= wall <= 1.1 * budget + SLACK, (wall, rec.summary())
    assert rec.complete is False and rec.found == 0
    assert rec.stats["stopped_by"] == "time_budget" and rec.stats["budget_exhausted"] is True
    assert rec.stats["time_budget"] == budget
    assert rec.stats["stop_reason"].startswith(
        "the singular values of a 2100 x 2100 update would take about 2.47 s"
    )
    rows = batch_size or 0  # the batch size is not known before the spectrum
    assert rec.batch_size == rows and rec.inputs.shape == (rows, 2100)
    assert torch.equal(rec.inputs, torch.zeros(rows, 2100, dtype=torch.float64))
    assert torch.equal(rec.confidence, torch.zeros(rows, dtype=torch.float64))


def test_attack_stops_when_the_decomposition_ends_past_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full SVD slower than its estimate (a loaded machine): no search starts after it."""
    inputs = _matrix(6, 40, 7).abs()
    update = relu_layer_update(inputs, width=200, seed=8)
    budget = 1.0
    real_full_svd = decomposition._full_svd

    def slow_full_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        time.sleep(DECOMPOSITION_SHARE * budget)
        return real_full_svd(matrix)

    monkeypatch.setattr(decomposition, "_full_svd", slow_full_svd)
    start = time.perf_counter()
    rec = SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(**update.arrays())
    wall = time.perf_counter() - start
    assert wall <= 1.1 * budget + SLACK, (wall, rec.summary())
    assert rec.stats["stop_reason"] == "the decomposition ended past its share of the time budget"
    assert rec.stats["stopped_by"] == "time_budget" and rec.complete is False
    assert rec.batch_size == 6 and rec.inputs.shape == (6, 40) and rec.found == 0


def test_attack_with_time_to_spare_gives_the_unbounded_reconstruction() -> None:
    inputs = _matrix(4, 15, 9)
    update = relu_layer_update(inputs, width=50, seed=9)
    bounded = SpearPlusPlus(seed=0, time_budget=600.0, progress=False).invert(**update.arrays())
    free = SpearPlusPlus(seed=0, time_budget=None, progress=False).invert(**update.arrays())
    assert bounded.complete and free.complete
    assert torch.equal(bounded.inputs, free.inputs)
    assert "stop_reason" not in bounded.stats


def test_out_of_time_rejects_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="need batch_size >= 0 and input_dim >= 1, got -1 and 5"):
        out_of_time("spear++", batch_size=-1, input_dim=5, budget=Budget.start(1.0), reason="x")
