"""Deep layers of SPEAR's victim (SPEAR Table 4): the input side sweeps the cone before the first round.

The inputs of layer 5 are ReLU activations of layer 4 at initialisation: non-negative, about half
exact zeros, alike (mean pairwise cosine 0.8), and their gradient columns have fewer zeros than
SPEAR's sparsity threshold. The sphere search then proposes sparse mixtures; the cone of
non-negative inputs has each sample as a vertex (:mod:`fl_attack.pipeline.side_information.input_rounds`).
"""

from __future__ import annotations

import math
from unittest import mock

import torch

from fl_attack import Reconstruction, SpearPlusPlus
from fl_attack.attacks.spear import SearchState
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.candidates import CandidatePool, informative_rows
from fl_attack.pipeline.search.sparsity import ZeroTolerance, zero_masks
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.side_information.input_cone import InputSide, InputSideSlot, cone_vertices
from fl_attack.pipeline.side_information.input_rounds import SWEEP_EXTRA_ZEROS, sweep_proposals
from fl_attack.pipeline.side_information.missing_samples import EXTRA_PROGRAMMES, missing_sample_directions
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.simulate.victims import LayerGradient, build_victim, layer_gradient
from fl_attack.types import ObservedUpdate

BATCH, WIDTH, FEATURES = 20, 400, 400


def deep_layer_update(seed: int, *, layer: int = 5) -> LayerGradient:
    """The float32 gradient of layer ``layer`` of SPEAR's 6-layer victim on a Gaussian batch."""
    torch.set_num_threads(1)
    inputs = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(seed))
    model = build_victim("spear", input_dim=FEATURES, width=WIDTH, num_classes=10, seed=seed)
    return layer_gradient(model, inputs, torch.arange(BATCH) % 10, layer=layer)


def attack(update: LayerGradient, *, budget: float) -> Reconstruction:
    attacker = SpearPlusPlus(device="cpu", seed=0, time_budget=budget, progress=False)
    return attacker.invert(
        update.weight_grad, update.bias_grad, weight=update.weight, bias=update.bias, batch_size=BATCH
    )


def exact_rows(reconstruction: Reconstruction, truth: torch.Tensor) -> int:
    truth = truth.to(torch.float64)
    distances = torch.cdist(truth, reconstruction.inputs.to(torch.float64)).min(dim=1).values
    return int((distances / truth.norm(dim=1) < 1e-5).sum())


def float32_input_side(update: LayerGradient) -> InputSide:
    """The input side as the attack sets it up on this update (tolerance from its spectrum)."""
    factors = decompose(update.weight_grad.to(torch.float64), batch_size=BATCH)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    return InputSide.from_factors(
        factors,
        relative_noise=tolerance.relative_noise,
        relative_zero=tolerance.absolute * math.sqrt(WIDTH),
    )


def true_columns(update: LayerGradient, factors: LowRankFactors) -> torch.Tensor:
    """Rows: the true gradient columns ``L q_i`` of the samples, unit, on all ``m`` neurons."""
    inverse = update.inputs.to(torch.float64) @ torch.linalg.pinv(factors.right)
    columns = factors.left @ torch.linalg.inv(inverse)
    unit: torch.Tensor = (columns / columns.norm(dim=0, keepdim=True)).T
    return unit


def test_layer_five_is_recovered_exactly_by_the_sweep_alone() -> None:
    # before the sweep (and the slack in the programme's scale): 0 of 20 rows at a 20 s budget
    update = deep_layer_update(0)
    reconstruction = attack(update, budget=20.0)
    assert reconstruction.complete
    assert exact_rows(reconstruction, update.inputs) == BATCH
    stats = reconstruction.stats
    assert stats["input_side"] == "used" and stats["input_side_sweep"] >= BATCH
    # the sweep's round was the only one: no sphere search ran
    assert stats["rounds"] == 1 and "initializations" not in stats
    # every true direction has fewer zeros than SPEAR's threshold: chosen among weak candidates alone
    assert stats["candidates"] == 0


def test_vertices_of_sparse_float32_inputs_are_samples() -> None:
    update = deep_layer_update(1)
    side = float32_input_side(update)
    vertices = cone_vertices(side, count=4, generator=torch.Generator().manual_seed(0))
    refined, zeros = side.refine(vertices)
    # a slack of tol (not tol / sqrt(n')) left the zeros at -14 tol on unit inputs: all refused
    assert refined.shape[0] == 4
    truth = update.inputs.to(torch.float64)[:, side.live]
    unit_truth = truth / truth.norm(dim=1, keepdim=True)
    cosines, samples = (side.inputs(refined) @ unit_truth.T).max(dim=1)
    exact = cosines > 1 - 1e-9
    # three are samples, with exactly their zeros; the fourth is near one (cosine 0.9993, 35
    # zeros): a vertex of the slack, which the gradient side's filters and selection refuse
    assert exact.tolist() == [True, True, False, True]
    assert zeros[exact].tolist() == (truth[samples[exact]] == 0).sum(dim=1).tolist()


def test_a_sweep_from_nothing_reaches_every_sample() -> None:
    update = deep_layer_update(1)
    side = float32_input_side(update)
    observed = ObservedUpdate.from_arrays(
        update.weight_grad,
        update.bias_grad,
        weight=update.weight,
        bias=update.bias,
        device=torch.device("cpu"),
    )
    factors = decompose(observed.weight_update, batch_size=BATCH)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    informative, rows = informative_rows(factors, tolerance)
    proposals = missing_sample_directions(
        side,
        factors.left.new_zeros(0, BATCH),
        left=informative.left,
        pre_activation_basis=SparsityMatchingScorer(observed, factors, tolerance).pre_activation_basis[rows],
        bias=observed.bias[rows],
        tolerance=tolerance,
        min_zeros=BATCH - 1,
        generator=torch.Generator().manual_seed(0),
    )
    # the true column of Q of each sample: rows of the inverse of X^T = Q^{-1} R
    inverse = update.inputs.to(torch.float64) @ torch.linalg.pinv(factors.right)
    columns = torch.linalg.inv(inverse).T
    columns = columns / columns.norm(dim=1, keepdim=True)
    hits = (proposals @ columns.T).abs().max(dim=0).values > 1 - 1e-9
    assert int(hits.sum()) == BATCH


def test_a_sweep_whose_vertices_are_no_samples_stops_after_a_few_programmes() -> None:
    # strictly positive dense inputs: every vertex has only the b - 1 zeros any vertex has
    generator = torch.Generator().manual_seed(5)
    inputs = torch.rand(8, 60, generator=generator, dtype=torch.float64) + 0.5
    basis, _ = torch.linalg.qr(inputs.T)
    side = InputSide(
        basis=basis,
        scales=torch.ones(8, dtype=torch.float64),
        tolerance=ZeroTolerance(absolute=1e-9, relative_noise=1e-12),
        live=torch.ones(60, dtype=torch.bool),
    )
    left = torch.linalg.qr(torch.randn(30, 8, generator=generator, dtype=torch.float64))[0]
    with mock.patch.object(InputSide, "vertex", autospec=True, side_effect=InputSide.vertex) as programmes:
        proposals = missing_sample_directions(
            side,
            left.new_zeros(0, 8),
            left=left,
            pre_activation_basis=left,
            bias=torch.zeros(30, dtype=torch.float64),
            tolerance=ZeroTolerance(absolute=1e-9, relative_noise=1e-12),
            min_zeros=7,
            generator=generator,
        )
    assert proposals.shape == (0, 8)
    assert programmes.call_count == EXTRA_PROGRAMMES + 1


def test_the_sweep_lowers_the_weak_threshold_to_the_samples_it_reached() -> None:
    # on CIFAR-10 at layer 5 (seeds 18, 29) two samples have 44-45 informative zeros against a weak
    # threshold of 46: the pool hid them from the selection, and 4 rows came out wrong
    update = deep_layer_update(1)
    observed = ObservedUpdate.from_arrays(
        update.weight_grad,
        update.bias_grad,
        weight=update.weight,
        bias=update.bias,
        device=torch.device("cpu"),
    )
    factors = decompose(observed.weight_update, batch_size=BATCH)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    scorer = SparsityMatchingScorer(observed, factors, tolerance)
    informative, rows = informative_rows(factors, tolerance)
    # a threshold above every sample's zeros, as on those batches
    pool = CandidatePool(informative, tolerance, min_zeros=250, weak_min_zeros=250, cos_tolerance=1e-9)
    state = SearchState(
        factors=informative,
        pool=pool,
        generator=torch.Generator().manual_seed(0),
        deadline=Deadline.never(),
        stats={},
        active=rows,
        noisy=False,
        input_side=InputSideSlot(scorer),
    )
    proposals = sweep_proposals(state, scorer)
    assert proposals is not None and state.stats["input_side_sweep_reached"] == BATCH
    columns = true_columns(update, factors)[:, rows]
    columns = columns @ informative.left  # the same directions in the informative rows' basis
    columns = columns / columns.norm(dim=1, keepdim=True)
    fewest = int(zero_masks(informative, columns, tolerance).sum(dim=1).min())
    assert fewest > BATCH + SWEEP_EXTRA_ZEROS
    assert pool.weak_min_zeros == state.stats["weak_min_zeros"] == fewest
    pool.add(proposals)
    weak, _ = pool.weak()
    assert bool(((weak @ columns.T).abs().max(dim=0).values > 1 - 1e-9).all())
