"""Input-side proposals: vertices of the cone of non-negative inputs (``fl_attack.pipeline.side_information.input_cone``).

The batches are pooled-ReLU-like: non-negative rows with ~40% exact zeros, as fc1 of a CNN
receives. The layer is narrow (``m / b = 4``), where the gradient side's l1 search alone
misses directions, and the update is float32, as a client sends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import fl_attack.attacks.spear as spear_module
import fl_attack.pipeline.side_information.input_cone as input_side_module
from fl_attack import Reconstruction, SpearPlusPlus
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.side_information.input_cone import (
    MAX_KERNELS_PER_INPUT,
    NOT_NEEDED,
    InputSide,
    cone_vertices,
    gradient_directions,
)
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.types import ObservedUpdate
from tests.synthetic_layer import SyntheticUpdate, relu_layer_update

WIDTH, BATCH, FEATURES = 40, 10, 200


def pooled_relu_batch(seed: int, *, batch: int = BATCH, features: int = FEATURES) -> torch.Tensor:
    """``relu(N(0, 1) - 0.2)``: non-negative, ~42% exact zeros per row."""
    generator = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(batch, features, generator=generator, dtype=torch.float64) - 0.2)


def float32_update(seed: int) -> SyntheticUpdate:
    return relu_layer_update(pooled_relu_batch(seed), width=WIDTH, seed=seed, dtype=torch.float32)


def attack(update: SyntheticUpdate, *, budget: float) -> Reconstruction:
    attacker = SpearPlusPlus(device="cpu", seed=0, time_budget=budget, progress=False)
    return attacker.invert(update.weight_grad, update.bias_grad, weight=update.weight, bias=update.bias)


def recovered_rows(reconstruction: Reconstruction, truth: torch.Tensor, *, tolerance: float = 1e-4) -> int:
    """How many true rows have a recovered row within ``tolerance`` relative error."""
    distances = torch.cdist(truth, reconstruction.inputs.to(torch.float64)).min(dim=1).values
    return int((distances / truth.norm(dim=1) < tolerance).sum())


def true_input_side(update: SyntheticUpdate) -> tuple[InputSide, torch.Tensor]:
    """The input side of the exact update, and the true samples' unit directions ``u = V^T x``."""
    factors = decompose(update.weight_grad.double(), batch_size=BATCH)
    side = InputSide.from_factors(factors, relative_noise=1e-12, relative_zero=1e-8)
    truth = update.inputs[:, side.live] @ side.basis
    return side, truth / truth.norm(dim=1, keepdim=True)


def without_input_side(
    proposals: Iterator[torch.Tensor], state: object, scorer: object
) -> Iterator[torch.Tensor]:
    return proposals


def test_input_side_recovers_batch_the_gradient_side_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    update = float32_update(0)
    with monkeypatch.context() as patch:
        patch.setattr(spear_module, "interleave_input_side", without_input_side)
        gradient_only = attack(update, budget=6.0)
    assert not gradient_only.complete
    assert recovered_rows(gradient_only, update.inputs) < BATCH
    assert "input_side" not in gradient_only.stats

    both = attack(update, budget=6.0)
    assert both.stats["input_side"] == "used"
    assert both.stats["input_side_proposals"] > 0
    assert both.complete
    assert recovered_rows(both, update.inputs) == BATCH


def test_true_samples_are_vertices_with_their_own_zeros() -> None:
    update = relu_layer_update(pooled_relu_batch(1), width=WIDTH, seed=1)
    side, truth = true_input_side(update)
    refined, zeros = side.refine(truth)
    assert refined.shape[0] == BATCH
    assert torch.allclose(refined, truth, atol=1e-9)
    assert zeros.tolist() == (update.inputs[:, side.live] == 0).sum(dim=1).tolist()


def test_mixtures_are_rejected_or_ranked_below_their_samples() -> None:
    update = relu_layer_update(pooled_relu_batch(2), width=WIDTH, seed=2)
    side, truth = true_input_side(update)
    opposite = truth[0] - truth[1]
    kept, _ = side.refine(opposite[None])
    assert kept.shape[0] == 0  # both signs: not a non-negative input

    positive = truth[0] + truth[1]
    kept, zeros = side.refine(positive[None])
    _, own = side.refine(truth[:2])
    shared = int(((update.inputs[0] == 0) & (update.inputs[1] == 0))[side.live].sum())
    assert kept.shape[0] == 1
    assert int(zeros[0]) == shared
    assert int(zeros[0]) < int(own.min())


def test_cone_vertices_reach_true_samples() -> None:
    update = relu_layer_update(pooled_relu_batch(3), width=WIDTH, seed=3)
    side, truth = true_input_side(update)
    vertices = cone_vertices(side, count=60, generator=torch.Generator().manual_seed(0))
    refined, _ = side.refine(vertices)
    hits = ((refined @ truth.T).abs() > 1 - 1e-9).any(dim=0)
    assert int(hits.sum()) >= BATCH // 2


def test_gradient_directions_are_the_true_columns() -> None:
    update = relu_layer_update(pooled_relu_batch(4), width=WIDTH, seed=4)
    observed = ObservedUpdate.from_update(update.layer_update(), device=torch.device("cpu"))
    factors = decompose(observed.weight_update, batch_size=BATCH)
    side, truth = true_input_side(update)
    tolerance = ZeroTolerance.from_noise(1e-12, width=WIDTH)
    scorer = SparsityMatchingScorer(observed, factors, tolerance)
    directions = gradient_directions(
        side,
        truth,
        left=factors.left,
        pre_activation_basis=scorer.pre_activation_basis,
        bias=observed.bias,
        tolerance=tolerance,
        min_zeros=BATCH - 1,
    )
    # the true columns: G = left Q with X = Q^{-1} right
    inverse = update.inputs @ torch.linalg.pinv(factors.right.double())
    columns = torch.linalg.inv(inverse).T
    columns = columns / columns.norm(dim=1, keepdim=True)
    assert BATCH <= directions.shape[0] <= MAX_KERNELS_PER_INPUT * BATCH
    matches = (directions @ columns.T).abs() > 1 - 1e-9
    assert bool(matches.any(dim=0).all())  # every sample's column is among them


def test_inputs_of_both_signs_skip_the_input_side() -> None:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(6, 50, generator=generator, dtype=torch.float64)
    update = relu_layer_update(inputs, width=60, seed=5)
    reconstruction = attack(update, budget=20.0)
    # set up only when the first round did not finish the attack, and then refused by the probe
    assert reconstruction.stats["input_side"] in (NOT_NEEDED, "no non-negative inputs in the span")
    assert "input_side_proposals" not in reconstruction.stats
    assert reconstruction.complete
    assert recovered_rows(reconstruction, inputs, tolerance=1e-8) == 6


def test_complete_is_never_claimed_for_a_wrong_batch() -> None:
    torch.set_num_threads(1)
    claimed = 0
    for seed in (1, 2, 3):
        update = float32_update(seed)
        reconstruction = attack(update, budget=6.0)
        if reconstruction.complete:
            claimed += 1
            assert recovered_rows(reconstruction, update.inputs) == BATCH
    assert claimed >= 1


def test_directions_of_the_wrong_size_are_refused() -> None:
    update = relu_layer_update(pooled_relu_batch(9), width=WIDTH, seed=9)
    side, _ = true_input_side(update)
    wrong = torch.ones(2, BATCH + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"directions must have shape \(k, 10\), got \(2, 11\)"):
        side.refine(wrong)
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        cone_vertices(side, count=-1, generator=torch.Generator())


def test_known_columns_leave_only_the_other_sample_feasible() -> None:
    update = relu_layer_update(pooled_relu_batch(10), width=WIDTH, seed=10)
    side, truth = true_input_side(update)
    factors = decompose(update.weight_grad, batch_size=BATCH)
    inverse = update.inputs @ torch.linalg.pinv(factors.right)  # rows of Q^{-1}
    columns = torch.linalg.inv(inverse).T  # rows: the columns q_i of Q
    known = columns[1:].numpy()
    weights = torch.rand(side.basis.shape[0], generator=torch.Generator().manual_seed(0)).double().numpy()
    vertex = side.vertex(weights, orthogonal_to=known)
    assert vertex is not None
    unit = torch.from_numpy(vertex) / torch.from_numpy(vertex).norm()
    assert abs(float(unit @ truth[0])) > 1 - 1e-9
    free = side.vertex(weights)  # without the columns, these weights reach another vertex
    assert free is not None
    assert abs(float(torch.from_numpy(free) @ truth[0])) / float(torch.from_numpy(free).norm()) < 0.99


def test_emptiness_probe_stops_at_its_time_limit() -> None:
    torch.set_num_threads(1)
    features, batch = 3072, 400  # unlimited, HiGHS needs minutes on this programme (measured 169 s)
    inputs = torch.randn(batch, features, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    basis, _ = torch.linalg.qr(inputs.T)
    side = InputSide(
        basis=basis,
        scales=torch.ones(batch, dtype=torch.float64),
        tolerance=ZeroTolerance(absolute=1e-6, relative_noise=1e-7),
        live=torch.ones(features, dtype=torch.bool),
    )
    started = time.perf_counter()
    assert side.is_empty(seconds=0.05)  # not finished in time: counts as empty
    assert time.perf_counter() - started < 10.0


def test_an_attack_done_in_its_first_round_never_sets_up_the_input_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # dense inputs of both signs: the gradient side finishes in its first round
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(4, 30, generator=generator, dtype=torch.float64)
    update = relu_layer_update(inputs, width=60, seed=3)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the input side was set up")

    monkeypatch.setattr(input_side_module.InputSide, "from_factors", refuse)
    reconstruction = attack(update, budget=20.0)
    assert reconstruction.complete and reconstruction.stats["rounds"] == 1
    assert reconstruction.stats["input_side"] == NOT_NEEDED
