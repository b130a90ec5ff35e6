"""One hidden layer before the output layer: head-guided proposals (fl_attack.pipeline.side_information.output_layer)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from synthetic_layer import relu_layer_update
from torch import nn

from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.budget import deadline as deadline_module
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.candidates import CandidatePool, duplicate_cos_tolerance
from fl_attack.pipeline.search.sparsity import ZeroTolerance, least_squares_kernel, min_sparsity
from fl_attack.pipeline.search.sphere import (
    SphereSchedule,
    get_surrogate,
    optimize_on_sphere,
    random_directions,
)
from fl_attack.pipeline.side_information.output_layer import (
    HeadPrior,
    HeadRounds,
    interleave_head_rounds,
    round_classes,
    sign_aware_l1,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear, output_gradient

WIDTH, BATCH, SEED = 200, 8, 0


@dataclass(frozen=True)
class ShallowBatch:
    """A one-hidden-layer victim's FedSGD gradient and the truth behind it."""

    model: nn.Sequential
    inputs: torch.Tensor
    labels: torch.Tensor
    weight_grad: torch.Tensor
    bias_grad: torch.Tensor
    output_grad: torch.Tensor

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model[3].weight.detach()

    @property
    def layer(self) -> nn.Linear:
        return first_linear(self.model)[1]


@pytest.fixture(scope="module")
def shallow() -> ShallowBatch:
    """Four threes and four eights: same-class samples are what trap the plain search."""
    data = load_dataset("digits")
    chosen = torch.cat([torch.nonzero(data.labels == label).flatten()[: BATCH // 2] for label in (3, 8)])
    inputs, labels = data.images[chosen].reshape(BATCH, -1), data.labels[chosen]
    model = build_victim("spear++", input_dim=data.input_dim, width=WIDTH, num_classes=10, depth=2, seed=SEED)
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    return ShallowBatch(model, inputs, labels, weight_grad, bias_grad, output_gradient(model, inputs, labels))


@dataclass(frozen=True)
class Search:
    """The informative rows of the batch's low-rank factors, and the true unit directions there."""

    factors: LowRankFactors
    rows: torch.Tensor
    tolerance: ZeroTolerance
    truth: torch.Tensor


@pytest.fixture(scope="module")
def search(shallow: ShallowBatch) -> Search:
    factors = decompose(shallow.weight_grad.double(), batch_size=BATCH)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    rows = factors.left.norm(dim=1) > tolerance.absolute
    factors = replace(factors, left=factors.left[rows].contiguous())
    truth = shallow.output_grad[:, rows] @ factors.left  # left @ q_i = dL/dz_i
    return Search(factors, rows, tolerance, truth / truth.norm(dim=1, keepdim=True))


def _pool(search: Search) -> CandidatePool:
    m = int(search.rows.sum())
    tau = min_sparsity(m, false_rejection=1e-5)
    return CandidatePool(
        search.factors,
        search.tolerance,
        min_zeros=max(BATCH + 1, math.ceil(tau * m)),
        weak_min_zeros=max(BATCH + 1, math.ceil(0.5 * tau * m)),
        cos_tolerance=duplicate_cos_tolerance(search.factors.spectrum.relative_noise),
    )


def _on_true_direction(directions: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Which rows of ``directions`` are a true direction up to sign (float64 digits)."""
    unit = directions / directions.norm(dim=1, keepdim=True)
    return (unit @ truth.T).abs().max(dim=1).values > 1 - 1e-9


def test_the_gradient_columns_are_masked_copies_of_the_class_prototypes(shallow: ShallowBatch) -> None:
    # the premise: dL/dz_i = relu'(z_i) * (W2^T g_i) with g_i close to 1/c - e_{y_i}
    head = shallow.head_weight.double()
    prior = HeadPrior.from_head_weight(head, width=WIDTH)
    columns = shallow.output_grad
    against = (torch.sign(columns) * prior.signs[shallow.labels] < 0).sum(dim=1)
    assert against.tolist() == [0] * BATCH
    assert int((prior.signs != 0).sum(dim=1).min()) > 0.7 * WIDTH


def test_sign_aware_l1_weights_wrong_signs_and_repels_known_directions() -> None:
    signs = torch.tensor([[1.0, 1.0, 0.0, -1.0]])
    slope = sign_aware_l1(signs, penalty=3.0).derivative(torch.tensor([[1.0, -1.0, 2.0, -0.5]]), 0.0)
    assert slope.tolist() == [[1.0, -3.0, 1.0, -1.0]]
    # orthonormal left = identity: the point is the values themselves; cos 0.95 > 0.9 with e_0
    left, away = torch.eye(4), torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    point = torch.tensor([[0.95, math.sqrt(1 - 0.95**2), 0.0, 0.0]])
    pushed = sign_aware_l1(torch.zeros(1, 4), left=left, repel=away, repel_cos=0.9, repel_weight=1.0)
    # plain l1 slope sign(v) plus the push sqrt(4) * sign(cos) * e_0
    assert pushed.derivative(point, 0.0).tolist() == [[3.0, 1.0, 0.0, 0.0]]
    far = torch.tensor([[0.5, math.sqrt(0.75), 0.0, 0.0]])
    assert pushed.derivative(far, 0.0).tolist() == [[1.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="penalty must be >= 1"):
        sign_aware_l1(signs, penalty=0.5)
    with pytest.raises(ValueError, match="needs the left factor"):
        sign_aware_l1(signs, repel=away)


def test_the_sign_prior_turns_the_search_minima_into_samples(shallow: ShallowBatch, search: Search) -> None:
    # the plain l1 search is drawn into differences of same-class samples; with each start's
    # class signs most minima are true directions
    prior = HeadPrior.from_head_weight(shallow.head_weight, width=WIDTH, rows=search.rows)
    classes = torch.tensor([3, 8]).repeat_interleave(40)
    starts = random_directions(80, BATCH, generator=torch.Generator().manual_seed(1))
    schedule = SphereSchedule(steps=100, lr=0.5, milestones=(40, 80))
    rows = int(0.3 * int(search.rows.sum()))
    plain = optimize_on_sphere(search.factors.left, starts, surrogate=get_surrogate("l1"), schedule=schedule)
    signed = optimize_on_sphere(
        search.factors.left, starts, surrogate=sign_aware_l1(prior.signs[classes]), schedule=schedule
    )
    plain_hits = _on_true_direction(least_squares_kernel(search.factors, plain, rows=rows), search.truth)
    signed_hits = _on_true_direction(least_squares_kernel(search.factors, signed, rows=rows), search.truth)
    assert int(plain_hits.sum()) <= 4
    assert int(signed_hits.sum()) >= 60


def test_one_head_proposal_finds_every_sample_of_the_batch(shallow: ShallowBatch, search: Search) -> None:
    prior = HeadPrior.from_head_weight(shallow.head_weight, width=WIDTH, rows=search.rows)
    pool = _pool(search)
    head = HeadRounds(
        search.factors,
        prior,
        tolerance=search.tolerance,
        min_zeros=pool.weak_min_zeros,
        generator=torch.Generator().manual_seed(SEED),
    )
    pool.add(head.propose(pool.directions, avoid=pool.mixtures))
    assert bool(_on_true_direction(search.truth, pool.directions).all())
    assert head.searches == 2 and head.initializations >= 10 * 8
    # every true direction is assigned its sample's label, oriented to agree with the class signs
    classes, orientation = head.classify(search.truth)
    assert classes.tolist() == shallow.labels.tolist()
    columns = (search.truth * orientation[:, None]) @ search.factors.left.T
    assert bool((columns * prior.signs[classes] >= -search.tolerance.absolute).all())


def test_the_head_path_recovers_a_one_hidden_layer_batch_exactly(shallow: ShallowBatch) -> None:
    attack = SpearPlusPlus(time_budget=30.0, seed=SEED, progress=False)
    rec = attack.invert(
        shallow.weight_grad.numpy(),
        shallow.bias_grad.numpy(),
        weight=shallow.layer.weight.detach().numpy(),
        bias=shallow.layer.bias.detach().numpy(),
        batch_size=BATCH,
        head_weight=shallow.head_weight.numpy(),
    )
    quality = evaluate_reconstruction(rec.inputs, shallow.inputs.double())
    assert rec.complete and quality.exact_fraction == 1.0 and float(quality.psnr.min()) > 90.0
    # the first batch of proposals was the head's, and it was enough
    assert rec.stats["rounds"] == 1 and rec.stats["head_searches"] == 2
    assert torch.allclose(rec.inputs[quality.order], shallow.inputs.double(), atol=1e-4)


def test_a_head_that_does_not_fit_costs_time_not_exactness(shallow: ShallowBatch) -> None:
    # the weight of another model: its signs say nothing about this gradient; the attack's own
    # proposals still recover the batch, and complete is claimed only for an exact result
    wrong = torch.randn(10, WIDTH, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs, labels, _ = sample_batch(load_dataset("digits"), 6, seed=SEED, distinct_labels=True)
    inputs = inputs.reshape(6, -1)
    weight_grad, bias_grad = client_gradient(shallow.model, inputs, labels)
    rec = SpearPlusPlus(time_budget=30.0, seed=SEED, progress=False).invert(
        weight_grad,
        bias_grad,
        weight=shallow.layer.weight,
        bias=shallow.layer.bias,
        batch_size=6,
        head_weight=wrong,
    )
    quality = evaluate_reconstruction(rec.inputs, inputs.double())
    assert rec.complete and quality.exact_fraction == 1.0


def test_complete_is_claimed_only_for_an_exact_reconstruction(shallow: ShallowBatch) -> None:
    # a budget too short to search: whatever comes back, complete must agree with exactness
    rec = SpearPlusPlus(time_budget=0.01, seed=SEED, progress=False).invert(
        shallow.weight_grad,
        shallow.bias_grad,
        weight=shallow.layer.weight,
        bias=shallow.layer.bias,
        batch_size=BATCH,
        head_weight=shallow.head_weight,
    )
    quality = evaluate_reconstruction(rec.inputs, shallow.inputs.double())
    assert not rec.complete
    assert quality.exact_fraction < 1.0
    # under load the decomposition may not even finish in 0.01 s: then no head search ran at all
    assert rec.stats.get("head_searches", 0) <= 2


@pytest.mark.parametrize(
    ("head_weight", "error", "message"),
    [
        (
            np.zeros((10, WIDTH + 1)),
            ValueError,
            r"\(c, m\) weight .* m = 200 neurons\), got shape \(10, 201\)",
        ),
        (np.zeros((0, WIDTH)), ValueError, r"c >= 1 outputs"),
        (np.zeros(WIDTH), ValueError, r"got shape \(200,\)"),
        (np.full((10, WIDTH), np.nan), ValueError, "NaN or Inf"),
        (np.zeros((10, WIDTH), dtype=complex), TypeError, "real numbers"),
        ([[0.0] * WIDTH] * 10, TypeError, "numpy array or a torch tensor, got list"),
    ],
)
def test_a_malformed_head_weight_is_refused(
    shallow: ShallowBatch, head_weight: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SpearPlusPlus(time_budget=5.0, progress=False).invert(
            shallow.weight_grad,
            shallow.bias_grad,
            weight=shallow.layer.weight,
            bias=shallow.layer.bias,
            batch_size=BATCH,
            head_weight=head_weight,  # type: ignore[arg-type]
        )


def test_prior_rows_and_classes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"rows must be an \(4,\) boolean mask"):
        HeadPrior.from_head_weight(torch.ones(3, 4), width=4, rows=torch.ones(4))
    prior = HeadPrior.from_head_weight(
        torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -2.0]]), width=3, rows=torch.tensor([True, False, True])
    )
    # prototypes: mean of the rows minus row k, on the kept neurons 0 and 2
    assert prior.signs.tolist() == [[-1.0, -1.0], [1.0, 1.0]]
    assert round_classes(10, 20, generator=torch.Generator()).tolist() == [
        k for k in range(10) for _ in range(16)
    ]
    many = round_classes(1000, 20, generator=torch.Generator().manual_seed(0))
    assert many.numel() == 4096 and int(many.max()) < 1000


class _Pool:
    def __init__(self) -> None:
        self.directions = torch.zeros(0, 2, dtype=torch.float64)
        self.mixtures = torch.zeros(0, 2, dtype=torch.float64)

    def __len__(self) -> int:
        return int(self.directions.shape[0])


class _Head:
    """Proposes one new direction per call for ``useful`` calls, then nothing new."""

    def __init__(self, pool: _Pool, useful: int) -> None:
        self.pool, self.useful, self.calls = pool, useful, 0

    def propose(self, known: torch.Tensor, *, avoid: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return torch.full(
            (1, 2), -1.0 if self.calls > self.useful else float(self.calls), dtype=torch.float64
        )


def test_head_proposals_come_first_and_stop_when_they_stop_helping() -> None:
    pool = _Pool()
    head = _Head(pool, useful=2)
    base: Iterator[torch.Tensor] = iter(torch.full((1, 2), 100.0 + k, dtype=torch.float64) for k in range(6))
    order = []
    for proposals in interleave_head_rounds(base, head, pool=pool, patience=2):  # type: ignore[arg-type]
        value = float(proposals[0, 0])
        order.append(value)
        if value > 0 and value < 100:  # the caller adds the new direction to its pool
            pool.directions = torch.cat([pool.directions, proposals])
    # head 1, base, head 2, base, head (nothing new), base, head (nothing new): patience spent
    assert order == [1.0, 100.0, 2.0, 101.0, -1.0, 102.0, -1.0, 103.0, 104.0, 105.0]
    assert head.calls == 4


def _head_rounds(
    shallow: ShallowBatch, search: Search, *, deadline: Deadline = Deadline.never()
) -> HeadRounds:
    prior = HeadPrior.from_head_weight(shallow.head_weight, width=WIDTH, rows=search.rows)
    return HeadRounds(
        search.factors,
        prior,
        tolerance=search.tolerance,
        min_zeros=_pool(search).weak_min_zeros,
        generator=torch.Generator().manual_seed(SEED),
        deadline=deadline,
    )


def test_head_rounds_at_a_passed_deadline_search_nothing(shallow: ShallowBatch, search: Search) -> None:
    head = _head_rounds(shallow, search, deadline=Deadline(0.0))
    assert head.propose(search.truth[:2]).shape == (0, BATCH)
    assert head.stats() == {"head_searches": 0, "head_initializations": 0}


def _samples_hit(directions: torch.Tensor, truth: torch.Tensor) -> set[int]:
    unit = directions / directions.norm(dim=1, keepdim=True)
    similarity = (unit @ truth.T).abs()
    return set(similarity.argmax(dim=1)[similarity.max(dim=1).values > 1 - 1e-9].tolist())


def test_small_chunks_give_the_same_head_proposals(
    shallow: ShallowBatch, search: Search, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each chunk of starts gets the sign rows of its own classes: one start per chunk finds
    # what one chunk of all starts finds, every sample but the 3 known (repelled) ones; float32
    # minima that have not converged may differ in their last digits between batch sizes
    whole = _head_rounds(shallow, search).propose(search.truth[:3])
    monkeypatch.setattr(deadline_module, "CHUNK_SECONDS", 1e-9)
    head = _head_rounds(shallow, search)
    chunked = head.propose(search.truth[:3])
    assert chunked.shape == whole.shape and head.stats()["head_initializations"] == whole.shape[0] // 2
    assert _samples_hit(chunked, search.truth) == _samples_hit(whole, search.truth) == set(range(3, BATCH))
    hits_whole = int(_on_true_direction(whole, search.truth).sum())
    hits_chunked = int(_on_true_direction(chunked, search.truth).sum())
    assert abs(hits_chunked - hits_whole) <= 0.1 * hits_whole


def test_the_head_path_returns_within_its_budget() -> None:
    # a batch of 100 at m = 1000: far more than a second of search; the head rounds stop at
    # the attack's deadline like every other stage
    inputs = torch.randn(100, 120, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    update = relu_layer_update(inputs, width=1000, seed=1, dtype=torch.float32)
    head_weight = torch.randn(10, 1000, generator=torch.Generator().manual_seed(2))
    budget = 1.0
    start = time.perf_counter()
    rec = SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(
        **update.arrays(), head_weight=head_weight
    )
    wall = time.perf_counter() - start
    assert rec.seconds <= wall <= 1.1 * budget + 0.5, (wall, rec.summary())
    assert not rec.complete and rec.stats["stopped_by"] == "time_budget"
    assert rec.stats["head_searches"] >= 1
