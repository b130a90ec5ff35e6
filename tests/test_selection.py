"""Selection of b directions, sparsity matching, mixture splitting and the last-direction scan.

The true columns of the disaggregation matrix are computed from the client's true ``dL/dZ``:
``q_i = left^T dZ[:, i]`` (normalized), where ``left`` is the orthonormal factor of the
float32 gradient's decomposition.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.pipeline.search.candidates import duplicate_cos_tolerance
from fl_attack.pipeline.search.last_direction import scan_missing_directions
from fl_attack.pipeline.search.mixtures import split_mixtures
from fl_attack.pipeline.search.sparsity import ZeroTolerance, min_sparsity, refine_on_zeros, zero_masks
from fl_attack.pipeline.selection.select import (
    SparsityMatchingScorer,
    orthonormal_completion,
    select,
    sparsest_independent,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear
from fl_attack.types import ObservedUpdate

COS_EXACT = 1 - 1e-8


@dataclass(frozen=True)
class Truth:
    update: ObservedUpdate
    factors: LowRankFactors
    tolerance: ZeroTolerance
    directions: torch.Tensor  # (b, b) unit rows, row i = true q_i
    dz: torch.Tensor  # (m, b) true dL/dZ, float64
    inputs: torch.Tensor  # (b, n) true flat inputs, float64

    @property
    def batch(self) -> int:
        return int(self.directions.shape[0])

    def scorer(self) -> SparsityMatchingScorer:
        return SparsityMatchingScorer(self.update, self.factors, self.tolerance)

    def active(self) -> torch.Tensor:
        """Neurons whose gradient row is not zero for the whole batch (as the attack keeps)."""
        return self.factors.left.norm(dim=1) > self.tolerance.absolute


@functools.cache
def _truth(name: str, batch: int, width: int, seed: int) -> Truth:
    data = load_dataset(name, split="all")
    images, labels, _ = sample_batch(data, batch, seed=batch + 10 * seed)
    model = build_victim(
        "spear++", input_dim=data.input_dim, width=width, num_classes=data.num_classes, seed=seed
    )
    weight_grad, bias_grad = client_gradient(model, images, labels)
    layer = first_linear(model)[1]
    update = ObservedUpdate.from_arrays(
        weight_grad,
        bias_grad,
        weight=layer.weight.detach(),
        bias=layer.bias.detach(),
        device=torch.device("cpu"),
    )
    factors = decompose(update.weight_update)
    assert factors.batch_size == batch
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=width)
    flat = images.reshape(batch, -1)
    z = layer(flat).detach().requires_grad_(True)
    (dz,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model[2:](z), labels), z)
    dz = dz.T.double()  # (m, b)
    directions = (factors.left.T @ dz).T
    directions = directions / directions.norm(dim=1, keepdim=True)
    return Truth(update, factors, tolerance, directions, dz, flat.double())


def _restricted(truth: Truth) -> LowRankFactors:
    active = truth.active()
    from dataclasses import replace

    return replace(truth.factors, left=truth.factors.left[active].contiguous())


def _best_cos(proposals: torch.Tensor, target: torch.Tensor) -> float:
    assert proposals.ndim == 2 and proposals.shape[1] == target.shape[0]
    if proposals.shape[0] == 0:
        return 0.0
    unit = proposals / proposals.norm(dim=1, keepdim=True)
    return float((unit @ (target / target.norm())).abs().max())


CASES = [("faces", 4, 100, 0), ("photo-patches", 10, 200, 0), ("faces", 16, 200, 0)]
IDS = ["faces-b4", "photo-b10", "faces-b16"]


# --------------------------------------------------------------------------------------
# the true directions and the sparsity-matching coefficient
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_true_directions_are_sparse_with_exactly_the_true_zeros(case) -> None:
    truth = _truth(*case)
    masks = zero_masks(truth.factors, truth.directions, truth.tolerance)  # (b, m)
    assert torch.equal(masks, (truth.dz == 0).T)
    # every true direction passes the SPEAR sparsity filter (tau on all m neurons)
    tau = min_sparsity(truth.factors.left.shape[0], false_rejection=1e-5)
    assert bool((masks.sum(dim=1) >= math.ceil(tau * truth.factors.left.shape[0])).all())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_true_directions_have_full_sparsity_matching(case) -> None:
    truth = _truth(*case)
    scorer = truth.scorer()
    per_sample, q_inv = scorer.score(truth.directions)
    assert torch.equal(per_sample, torch.ones_like(per_sample))
    # and they invert the gradient: X^T = Q^{-1} R is the batch, in the order of the directions
    inputs = scorer.inputs(truth.directions)
    assert torch.allclose(inputs, truth.inputs, atol=1e-4, rtol=0)
    # the scales of the directions reproduce the bias gradient
    scales = scorer.scales(truth.directions)
    columns = truth.factors.left @ truth.directions.T
    assert torch.allclose(
        columns @ scales, truth.update.bias_update, atol=1e-6 * float(truth.update.bias_update.abs().max())
    )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_select_returns_the_true_directions_with_matching_one(case) -> None:
    truth = _truth(*case)
    b = truth.batch
    counts = zero_masks(truth.factors, truth.directions, truth.tolerance).sum(dim=1)
    # shuffle, flip signs, and hide them among mixtures that are not samples
    gen = torch.Generator().manual_seed(0)
    mixtures = torch.randn(3 * b, b, generator=gen, dtype=torch.float64) @ truth.directions
    mixtures = mixtures / mixtures.norm(dim=1, keepdim=True)
    candidates = torch.cat([mixtures, -truth.directions.flip(0)])
    zero_counts = torch.cat([torch.zeros(3 * b, dtype=torch.long), counts.flip(0)])
    selection = select(truth.scorer(), candidates, zero_counts)
    assert selection.complete
    assert selection.sparsity_matching == 1.0
    chosen = selection.directions / selection.directions.norm(dim=1, keepdim=True)
    assert bool(((chosen @ truth.directions.T).abs().max(dim=1).values > COS_EXACT).all())
    # the inputs are the batch, up to the order
    distance = torch.cdist(selection.inputs, truth.inputs)
    assert float(distance.min(dim=1).values.max()) < 1e-3


def _twin(direction: torch.Tensor, angle: float, seed: int = 0) -> torch.Tensor:
    """A unit vector at ``angle`` radians from ``direction``."""
    gen = torch.Generator().manual_seed(seed)
    unit = direction / direction.norm()
    side = torch.randn(unit.shape[0], generator=gen, dtype=torch.float64)
    side = side - (side @ unit) * unit
    return math.cos(angle) * unit + math.sin(angle) * side / side.norm()


@pytest.mark.parametrize("case", CASES[1:], ids=IDS[1:])
def test_select_never_takes_two_twins_of_one_sample(case) -> None:
    """A second rounding of one sample's direction (a FedAvg update's drifted zeros give
    kernels ~1e-3 apart) must not push out another sample: at (150, 4000) eight such twins
    made Q singular and every sample reconstructed as noise."""
    truth = _truth(*case)
    b = truth.batch
    counts = zero_masks(truth.factors, truth.directions, truth.tolerance).sum(dim=1)
    twins = torch.stack([_twin(truth.directions[i], 2e-3, seed=i) for i in range(3)])
    # the twins look sparsest, so the sparsest-first stage meets them before the originals
    candidates = torch.cat([twins, truth.directions])
    zero_counts = torch.cat([torch.full((3,), int(counts.max()) + 1), counts])
    chosen_rows = sparsest_independent(candidates, zero_counts, b)
    assert chosen_rows[:3] == [0, 1, 2] and len(chosen_rows) == b
    assert not {3, 4, 5} & set(chosen_rows), "a twin and its original were both chosen"
    selection = select(truth.scorer(), candidates, zero_counts, max_swap_rounds=0)
    assert selection.complete
    unit = selection.directions / selection.directions.norm(dim=1, keepdim=True)
    # every sample is represented once, so the inputs are the batch up to the twins' error
    assert bool(((unit @ truth.directions.T).abs().max(dim=0).values > 1 - 1e-5).all())
    distance = torch.cdist(selection.inputs, truth.inputs)
    assert float(distance.min(dim=1).values.max()) < 0.1 * float(truth.inputs.norm(dim=1).min())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_duplicate_tolerance_merges_twins_but_no_two_samples(case) -> None:
    truth = _truth(*case)
    noise = max(truth.factors.spectrum.relative_noise, 1e-5)
    tolerance = duplicate_cos_tolerance(noise)
    # two roundings of one sample, 20 x the relative noise apart, are one candidate
    twin = _twin(truth.directions[0], 20 * noise)
    assert 1 - float(twin @ truth.directions[0]) < tolerance
    cos = (truth.directions @ truth.directions.T).abs().fill_diagonal_(0)
    assert 1 - float(cos.max()) > duplicate_cos_tolerance(1.0)  # the cap keeps samples apart
    assert duplicate_cos_tolerance(0.0) == 1e-9
    for bad in (-1e-3, float("nan")):
        with pytest.raises(ValueError, match="relative_noise"):
            duplicate_cos_tolerance(bad)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("weight", [0.5, 2.0])
def test_sparsity_matching_drops_when_a_direction_is_a_mixture(case, weight: float) -> None:
    truth = _truth(*case)
    scorer = truth.scorer()
    mixed = truth.directions.clone()
    mixed[0] = truth.directions[0] + weight * truth.directions[1]
    per_sample, _ = scorer.score(mixed)
    assert float(per_sample.mean()) < 1.0
    assert float(per_sample[0]) < 1.0
    # a mixture still gives a valid (invertible) set: the drop is a real mismatch, not a failure flag
    assert float(per_sample.min()) >= 0.0


def test_degenerate_direction_sets_score_as_failures_without_reaching_lapack_with_nan() -> None:
    truth = _truth("faces", 4, 100, 0)
    scorer = truth.scorer()
    sets = truth.directions.expand(3, -1, -1).clone()
    sets[1, 2] = 0.0  # a zero direction: its unit vector is NaN
    sets[2, 0] = float("nan")
    per_sample, q_inv = scorer.score(sets)
    assert torch.equal(per_sample[0], torch.ones(4, dtype=per_sample.dtype))
    assert torch.equal(per_sample[1:], torch.full((2, 4), -1.0, dtype=per_sample.dtype))
    assert bool(torch.isfinite(q_inv[1:]).all())  # the stand-in identity was inverted, not NaN


def test_a_set_repeating_a_direction_is_singular_and_scored_as_a_failure() -> None:
    truth = _truth("faces", 4, 100, 0)
    sets = truth.directions.expand(2, -1, -1).clone()
    sets[1, 3] = sets[1, 1]  # what a swap trial does when the pool repeats a chosen direction
    per_sample, _ = truth.scorer().score(sets)
    assert torch.equal(per_sample[0], torch.ones(4, dtype=per_sample.dtype))
    assert torch.equal(per_sample[1], torch.full((4,), -1.0, dtype=per_sample.dtype))


def test_select_with_too_few_directions_completes_with_placeholders() -> None:
    truth = _truth("faces", 4, 100, 0)
    found = truth.directions[:2]
    counts = zero_masks(truth.factors, found, truth.tolerance).sum(dim=1)
    selection = select(truth.scorer(), found, counts)
    assert not selection.complete
    assert selection.found.tolist() == [True, True, False, False]
    assert torch.equal(selection.per_sample[2:], torch.zeros(2, dtype=selection.per_sample.dtype))
    assert selection.inputs.shape == truth.inputs.shape
    # rows of a full, invertible set
    assert abs(float(torch.linalg.det(selection.directions))) > 1e-6


def test_select_on_an_empty_pool() -> None:
    truth = _truth("faces", 4, 100, 0)
    selection = select(
        truth.scorer(), torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    )
    assert not bool(selection.found.any())
    assert selection.sparsity_matching == 0.0
    assert torch.allclose(
        selection.directions @ selection.directions.T, torch.eye(4, dtype=torch.float64), atol=1e-12
    )


# --------------------------------------------------------------------------------------
# sparsest_independent and orthonormal_completion
# --------------------------------------------------------------------------------------


def test_sparsest_independent_skips_dependent_candidates() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c, d = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    candidates = torch.stack([a, -2.0 * a, b, a + b, c, 3 * c - 0.5 * b, d])
    zero_counts = torch.tensor([10, 9, 8, 7, 6, 5, 4])
    assert sparsest_independent(candidates, zero_counts, 4) == [0, 2, 4, 6]
    # the sparsest first, whatever the row order
    assert sparsest_independent(candidates.flip(0), zero_counts.flip(0), 4) == [6, 4, 2, 0]
    # stops at `size`
    assert sparsest_independent(candidates, zero_counts, 2) == [0, 2]
    # fewer independent candidates than asked for
    assert sparsest_independent(candidates[:4], zero_counts[:4], 4) == [0, 2]


def test_sparsest_independent_nearly_dependent_candidate() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    tiny = torch.randn(3, generator=gen, dtype=torch.float64) * 1e-9
    candidates = torch.stack([a, b, a + b + tiny])
    assert sparsest_independent(candidates, torch.tensor([3, 2, 1]), 3) == [0, 1]


@pytest.mark.parametrize(("k", "size"), [(1, 5), (3, 7), (6, 7), (1, 2)])
def test_orthonormal_completion(k: int, size: int) -> None:
    gen = torch.Generator().manual_seed(k * size)
    given = torch.randn(k, size, generator=gen, dtype=torch.float64) * 3.0  # neither unit nor orthogonal
    rows = orthonormal_completion(given, size)
    assert rows.shape == (size - k, size)
    assert torch.allclose(rows @ rows.T, torch.eye(size - k, dtype=torch.float64), atol=1e-12)
    assert float((rows @ given.T).abs().max()) < 1e-12
    full = torch.cat([given, rows])
    assert int(torch.linalg.matrix_rank(full)) == size


def test_orthonormal_completion_of_nothing_is_the_identity() -> None:
    rows = orthonormal_completion(torch.zeros(0, 4, dtype=torch.float64), 4)
    assert torch.equal(rows, torch.eye(4, dtype=torch.float64))


# --------------------------------------------------------------------------------------
# split_mixtures and scan_missing_directions
# --------------------------------------------------------------------------------------


SPLIT_CASES = [
    pytest.param(("faces", 4, 100, 0), id="faces-b4"),
    pytest.param(("photo-patches", 10, 200, 0), id="photo-b10"),
    pytest.param(("faces", 16, 200, 0), id="faces-b16"),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize(("x", "f"), [(0, 1), (2, 3)])
def test_split_mixtures_recovers_the_hidden_direction(case, x: int, f: int) -> None:
    truth = _truth(*case)
    factors = _restricted(truth)
    q_x, q_f = truth.directions[x], truth.directions[f]
    mixture = q_x + 0.5 * q_f
    mixture = mixture / mixture.norm()
    assert _best_cos(mixture[None], q_x) < 0.99  # the mixture itself is far from q_x
    proposals = split_mixtures(factors, mixture[None], q_f[None], truth.tolerance)
    assert proposals.shape[1] == truth.batch
    assert _best_cos(proposals, q_x) > COS_EXACT


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_split_mixtures_proposal_is_close_to_the_hidden_direction(case) -> None:
    """Whatever its final precision, the proposal lies within the angular window of the search."""
    truth = _truth(*case)
    q_x, q_f = truth.directions[0], truth.directions[1]
    mixture = (q_x + 0.5 * q_f) / (q_x + 0.5 * q_f).norm()
    proposals = split_mixtures(_restricted(truth), mixture[None], q_f[None], truth.tolerance)
    width = min(0.05, max(1e-7, 10.0 * truth.tolerance.absolute * math.sqrt(truth.factors.left.shape[0])))
    assert _best_cos(proposals, q_x) > math.cos(width)


@pytest.mark.parametrize(
    ("case", "x", "f"),
    [(("faces", 4, 100, 0), 0, 1), (("photo-patches", 10, 200, 0), 3, 4), (("faces", 16, 200, 0), 0, 1)],
    ids=["faces-b4", "photo-b10", "faces-b16"],
)
def test_refine_on_zeros_does_not_degrade_a_near_exact_direction(case, x: int, f: int) -> None:
    truth = _truth(*case)
    factors = _restricted(truth)
    eps = 1e-4 if case[1] < 16 else 1e-3
    start = truth.directions[x] + eps * truth.directions[f]  # 1-cos ~ eps^2 / 2
    assert int(zero_masks(factors, start[None], truth.tolerance).sum()) >= truth.batch - 1
    refined = refine_on_zeros(factors, start[None], truth.tolerance)
    assert _best_cos(refined, truth.directions[x]) >= _best_cos(start[None], truth.directions[x]) - 1e-12


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_refine_on_zeros_polishes_a_slightly_perturbed_direction(case) -> None:
    """Control: with every true zero still detected, refinement lands on the exact direction."""
    truth = _truth(*case)
    factors = _restricted(truth)
    start = truth.directions[1] + 1e-6 * truth.directions[0] / math.sqrt(factors.left.shape[0])
    true_zeros = zero_masks(factors, truth.directions[1:2], truth.tolerance)
    assert torch.equal(zero_masks(factors, start[None], truth.tolerance), true_zeros)
    refined = refine_on_zeros(factors, start[None], truth.tolerance)
    assert _best_cos(refined, truth.directions[1]) > 1 - 1e-14


def test_split_mixtures_picks_the_right_partner_among_several() -> None:
    truth = _truth("photo-patches", 10, 200, 0)
    factors = _restricted(truth)
    q = truth.directions
    mixture = q[4] - 0.5 * q[7]
    mixture = mixture / mixture.norm()
    found = torch.cat([q[:4], q[5:]])  # every direction but the hidden one
    proposals = split_mixtures(factors, mixture[None], found, truth.tolerance)
    assert _best_cos(proposals, q[4]) > COS_EXACT


def test_split_mixtures_of_nothing_proposes_nothing() -> None:
    truth = _truth("faces", 4, 100, 0)
    empty = torch.zeros(0, 4, dtype=torch.float64)
    assert split_mixtures(truth.factors, empty, truth.directions, truth.tolerance).shape == (0, 4)
    assert split_mixtures(truth.factors, truth.directions[:1], empty, truth.tolerance).shape == (0, 4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("missing", [0, -1])
def test_scan_missing_directions_finds_the_missing_one(case, missing: int) -> None:
    truth = _truth(*case)
    b = truth.batch
    missing = missing % b
    active = truth.active()
    scorer = truth.scorer()
    found = torch.cat([truth.directions[:missing], truth.directions[missing + 1 :]])
    proposals = scan_missing_directions(
        _restricted(truth),
        found,
        pre_activation_basis=scorer.pre_activation_basis[active],
        bias=truth.update.bias[active],
        tolerance=truth.tolerance,
        min_zeros=b,
    )
    assert 1 <= proposals.shape[0] <= 8
    assert _best_cos(proposals, truth.directions[missing]) > COS_EXACT


def test_scan_missing_directions_finds_two_missing_ones() -> None:
    truth = _truth("faces", 4, 100, 0)
    scorer = truth.scorer()
    proposals = scan_missing_directions(
        truth.factors,
        truth.directions[:2],
        pre_activation_basis=scorer.pre_activation_basis,
        bias=truth.update.bias,
        tolerance=truth.tolerance,
        min_zeros=4,
    )
    assert proposals.shape[0] >= 1
    best = max(_best_cos(proposals, truth.directions[2]), _best_cos(proposals, truth.directions[3]))
    assert best > COS_EXACT


def test_scan_missing_directions_needs_at_most_two_missing() -> None:
    truth = _truth("faces", 4, 100, 0)
    scorer = truth.scorer()
    proposals = scan_missing_directions(
        truth.factors,
        truth.directions[:1],
        pre_activation_basis=scorer.pre_activation_basis,
        bias=truth.update.bias,
        tolerance=truth.tolerance,
        min_zeros=4,
    )
    assert proposals.shape == (0, 4)


def test_select_also_starts_from_an_incumbent_among_the_candidates() -> None:
    # a pool whose sparsest set is wrong (mixtures ranked sparsest), without any swaps: only the
    # start decides; an earlier selection that is still in the pool must win over that start
    truth = _truth("photo-patches", 10, 200, 0)
    b = truth.batch
    gen = torch.Generator().manual_seed(1)
    mixtures = torch.randn(2 * b, b, generator=gen, dtype=torch.float64) @ truth.directions
    mixtures = mixtures / mixtures.norm(dim=1, keepdim=True)
    candidates = torch.cat([mixtures, truth.directions])
    zero_counts = torch.cat([torch.full((2 * b,), 10**6), torch.zeros(b, dtype=torch.long)])
    scorer = truth.scorer()

    cold = select(scorer, candidates, zero_counts, max_swap_rounds=0)
    warm = select(scorer, candidates, zero_counts, max_swap_rounds=0, incumbent=-truth.directions.flip(0))
    elsewhere = torch.randn(b, b, generator=gen, dtype=torch.float64)
    ignored = select(scorer, candidates, zero_counts, max_swap_rounds=0, incumbent=elsewhere)

    assert cold.sparsity_matching < 1.0
    assert warm.sparsity_matching == 1.0
    chosen = warm.directions / warm.directions.norm(dim=1, keepdim=True)
    assert bool(((chosen @ truth.directions.T).abs().max(dim=1).values > COS_EXACT).all())
    assert torch.equal(ignored.directions, cold.directions)
