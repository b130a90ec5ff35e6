"""Two-class heads: two-valued proposals for one-hidden-layer victims (fl_attack.pipeline.side_information.binary_head)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from fl_attack import SpearPlusPlus
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.side_information import input_cone as input_side
from fl_attack.pipeline.side_information.binary_head import BinaryHead
from fl_attack.pipeline.side_information.onehot_groups import OneHotGroups
from fl_attack.pipeline.side_information.output_layer import HeadPrior, HeadRounds
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.reconstruction import Reconstruction
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear, output_gradient

WIDTH, BATCH, SEED = 200, 20, 2

#: Adult's categorical widths (workclass, education, marital status, ...): one-hot blocks whose
#: first categories dominate, so that rows share most of their ones, as Adult's do.
CATEGORIES = (9, 16, 7, 15, 6, 5, 2, 12)


def one_hot_rows(batch: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tabular rows: skewed one-hot blocks plus four standardised columns; labels in {0, 1}."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for size in CATEGORIES:
        weights = 0.55 ** torch.arange(size, dtype=torch.float64)
        chosen = torch.multinomial(weights, batch, replacement=True, generator=generator)
        blocks.append(nn.functional.one_hot(chosen, size).to(torch.float64))
    blocks.append(torch.randn(batch, 4, generator=generator, dtype=torch.float64))
    return torch.cat(blocks, dim=1), torch.randint(2, (batch,), generator=generator)


@dataclass(frozen=True)
class Victim:
    """A one-hidden-layer victim's float32 FedSGD gradient on a batch, and the truth behind it."""

    model: nn.Sequential
    inputs: torch.Tensor
    labels: torch.Tensor
    weight_grad: torch.Tensor
    bias_grad: torch.Tensor
    output_grad: torch.Tensor

    @property
    def head(self) -> torch.Tensor:
        output_layer = self.model[3]
        assert isinstance(output_layer, nn.Linear)
        return output_layer.weight.detach()

    def invert(self, *, time_budget: float, head_weight: torch.Tensor | None = None) -> Reconstruction:
        layer = first_linear(self.model)[1]
        return SpearPlusPlus(time_budget=time_budget, seed=SEED, progress=False).invert(
            self.weight_grad,
            self.bias_grad,
            weight=layer.weight.detach(),
            bias=layer.bias.detach(),
            batch_size=self.inputs.shape[0],
            head_weight=self.head if head_weight is None else head_weight,
        )


def make_victim(batch: int, *, classes: int, seed: int) -> Victim:
    inputs, labels = one_hot_rows(batch, seed=seed)
    labels = labels if classes == 2 else torch.arange(batch) % classes
    model = build_victim(
        "spear++", input_dim=inputs.shape[1], width=WIDTH, num_classes=classes, depth=2, seed=seed
    )
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    return Victim(model, inputs, labels, weight_grad, bias_grad, output_gradient(model, inputs, labels))


@pytest.fixture(scope="module")
def victim() -> Victim:
    return make_victim(BATCH, classes=2, seed=SEED)


@dataclass(frozen=True)
class Search:
    """Informative rows of the factors, the head difference there and the true unit directions."""

    factors: LowRankFactors
    rows: torch.Tensor
    difference: torch.Tensor
    relative_noise: float
    truth: torch.Tensor


@pytest.fixture(scope="module")
def search(victim: Victim) -> Search:
    factors = decompose(victim.weight_grad.double(), batch_size=BATCH)
    noise = factors.spectrum.relative_noise
    rows = factors.left.norm(dim=1) > ZeroTolerance.from_noise(noise, width=WIDTH).absolute
    factors = replace(factors, left=factors.left[rows].contiguous())
    truth = victim.output_grad[:, rows] @ factors.left
    head = victim.head.double()
    return Search(factors, rows, (head[0] - head[1])[rows], noise, truth / truth.norm(dim=1, keepdim=True))


def _samples_hit(directions: torch.Tensor, truth: torch.Tensor, *, cos: float = 1 - 1e-8) -> set[int]:
    unit = directions / directions.norm(dim=1, keepdim=True)
    similarity = (unit @ truth.T).abs()
    return set(similarity.argmax(dim=1)[similarity.max(dim=1).values > cos].tolist())


def _max_row_error(reconstruction: torch.Tensor, inputs: torch.Tensor) -> float:
    """Largest entry error after matching each true row to its nearest reconstructed row."""
    distances = torch.cdist(inputs, reconstruction.to(inputs.dtype))
    nearest = distances.argmin(dim=1)
    if len(set(nearest.tolist())) < inputs.shape[0]:
        return math.inf
    return float((reconstruction[nearest].to(inputs.dtype) - inputs).abs().max())


def test_two_class_columns_are_two_valued_and_a_mixture_is_not(victim: Victim) -> None:
    # dL/dz_i = a_i * mask_i * (W2[0] - W2[1]): one value on the support, the class in its sign
    head = victim.head.double()
    difference = head[0] - head[1]
    ratios = victim.output_grad / difference
    values = []
    for i in range(BATCH):
        support = victim.output_grad[i] != 0
        value = ratios[i, support]
        assert float((value.max() - value.min()) / value.abs().mean()) < 1e-9
        values.append(float(value.mean()))
        assert (values[-1] < 0) == (int(victim.labels[i]) == 0)  # a_i = (p_i0 - y_i0) / B
    # the two closest ReLU patterns of opposite classes: their mixture takes four values
    masks = victim.output_grad != 0
    distance = (masks[:, None, :] != masks[None, :, :]).sum(dim=2).double()
    distance[victim.labels[:, None] == victim.labels[None, :]] = math.inf
    i, k = divmod(int(distance.argmin()), BATCH)
    assert float(distance[i, k]) < 0.35 * WIDTH
    mixture = ratios[i] + ratios[k]
    levels = torch.unique(torch.round(mixture[mixture.abs() > 0] / abs(values[i]) * 1e6))
    assert levels.numel() == 3  # a_i, a_k and a_i + a_k; 0 is left out
    # and no single level fits it: the best two-valued fit leaves a large residual
    column = victim.output_grad[i] + victim.output_grad[k]
    residuals = [
        float(
            (column - level * difference * (mixture.sub(level).abs() < 1e-9 * abs(level))).norm()
            / column.norm()
        )
        for level in (values[i], values[k], values[i] + values[k])
    ]
    assert min(residuals) > 0.2


def test_binary_rounds_find_every_sample_of_a_one_hot_batch(search: Search) -> None:
    binary = BinaryHead(
        search.factors,
        search.difference,
        relative_noise=search.relative_noise,
        generator=torch.Generator().manual_seed(SEED),
    )
    proposals = binary.propose(search.factors.left.new_zeros(0, BATCH))
    assert _samples_hit(proposals, search.truth) == set(range(BATCH))
    stats = binary.stats()
    assert stats["binary_directions"] == proposals.shape[0] >= BATCH and stats["binary_rounds"] >= 2
    assert not binary.exhausted
    # a second call finds nothing new and says so
    assert binary.propose(proposals).shape == (0, BATCH) and binary.exhausted
    # the true directions are fixed points at the noise level (of a search that knows none yet)
    fresh = BinaryHead(
        search.factors, search.difference, relative_noise=search.relative_noise, generator=torch.Generator()
    )
    points = fresh.iterate(search.truth)
    assert float(points.residuals.max()) < 1e-5 < fresh.limit
    assert _samples_hit(points.directions, search.truth) == set(range(BATCH))


def test_the_attack_recovers_a_two_class_one_hot_batch_exactly(victim: Victim) -> None:
    rec = victim.invert(time_budget=30.0)
    assert rec.complete and rec.self_check is not None and rec.self_check.passed
    assert _max_row_error(rec.inputs, victim.inputs) < 1e-4
    stats = rec.stats
    assert stats["binary_directions"] >= BATCH and stats["rounds"] == 1 and stats["head_searches"] == 0


def test_without_two_valued_proposals_or_one_hot_rows_the_batch_stays_unrecovered(
    victim: Victim, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the pipeline before binary_head and onehot_side: sign-guided head searches and SPEAR++'s
    # own (5 s here; main without these modules ran out of 10 s on this batch, and of 30 s on
    # every Adult batch)
    monkeypatch.setattr(BinaryHead, "propose", lambda self, known, avoid=None: known.new_zeros(0, BATCH))
    monkeypatch.setattr(input_side, "detect_onehot_groups", lambda *args, **kwargs: OneHotGroups((), ()))
    rec = victim.invert(time_budget=5.0)
    assert not rec.complete
    assert _max_row_error(rec.inputs, victim.inputs) > 1e-2


def test_one_hot_rows_alone_recover_the_batch(victim: Victim, monkeypatch: pytest.MonkeyPatch) -> None:
    # the other route to the same batch: its one-hot columns (fl_attack.pipeline.side_information.onehot_rows)
    monkeypatch.setattr(BinaryHead, "propose", lambda self, known, avoid=None: known.new_zeros(0, BATCH))
    # about 20 s of a quiet core: the budget leaves room for a loaded machine (it stops once complete)
    rec = victim.invert(time_budget=90.0)
    assert rec.complete and rec.stats["onehot_groups"] >= 1
    assert _max_row_error(rec.inputs, victim.inputs) < 1e-4


def test_only_a_two_class_head_gets_binary_rounds(victim: Victim, search: Search) -> None:
    two = HeadPrior.from_head_weight(victim.head, width=WIDTH, rows=search.rows)
    assert torch.equal(two.difference, search.difference)
    wide = make_victim(6, classes=3, seed=SEED)
    three = HeadPrior.from_head_weight(wide.head, width=WIDTH, rows=search.rows)
    assert three.difference.numel() == 0
    tolerance = ZeroTolerance.from_noise(search.relative_noise, width=WIDTH)
    generator = torch.Generator().manual_seed(0)
    rounds = HeadRounds(search.factors, two, tolerance=tolerance, min_zeros=30, generator=generator)
    assert isinstance(rounds.binary, BinaryHead)
    assert (
        HeadRounds(search.factors, three, tolerance=tolerance, min_zeros=30, generator=generator).binary
        is None
    )
    # with three classes g_i spans two dimensions: a column is not one value times any fixed vector
    head = wide.head.double()
    for i in range(6):
        support = wide.output_grad[i] != 0
        ratio = wide.output_grad[i, support] / (head[0] - head[1])[support]
        assert float((ratio.max() - ratio.min()) / ratio.abs().median()) > 0.5
    rec = wide.invert(time_budget=30.0)
    assert rec.complete and _max_row_error(rec.inputs, wide.inputs) < 1e-4
    assert not any(key.startswith("binary") for key in rec.stats)


def _planted_factors(seed: int) -> tuple[LowRankFactors, torch.Tensor, torch.Tensor]:
    """Exact factors of masked columns ``a_i v mask_i`` where ``m0 + m1 - m2`` is binary too."""
    generator = torch.Generator().manual_seed(seed)
    m, b, n = 80, 6, 40
    masks = torch.rand(m, b, generator=generator) < 0.5
    both, either = masks[:, 0] & masks[:, 1], masks[:, 0] ^ masks[:, 1]
    masks[:, 2] = both | (either & (torch.rand(m, generator=generator) < 0.5))
    difference = torch.randn(m, generator=generator, dtype=torch.float64)
    scales = torch.tensor([0.3, -0.7, 0.5, -0.2, 0.9, -0.4], dtype=torch.float64)
    columns = masks.double() * difference[:, None] * scales
    gradient = columns @ torch.randn(b, n, generator=generator, dtype=torch.float64)
    return decompose(gradient, batch_size=b), difference, masks


def test_two_valued_is_not_a_certificate_of_a_sample() -> None:
    # m0 + m1 - m2 is a binary vector in the span that is no sample's pattern: it is proposed
    # beside the samples (the pool, the selection and the self-check decide), never instead
    factors, difference, masks = _planted_factors(0)
    binary = BinaryHead(factors, difference, relative_noise=1e-12, generator=torch.Generator().manual_seed(0))
    proposals = binary.propose(factors.left.new_zeros(0, 6))
    columns = (proposals @ factors.left.T) / difference
    found = {tuple((column.abs() > 1e-9 * column.abs().max()).tolist()) for column in columns}
    truth = {tuple(masks[:, i].tolist()) for i in range(6)}
    planted = tuple((masks[:, 0].int() + masks[:, 1].int() - masks[:, 2].int()).bool().tolist())
    assert truth <= found and planted in found


@pytest.mark.parametrize("budget", [0.01, 0.5])
def test_complete_is_claimed_only_for_an_exact_reconstruction(victim: Victim, budget: float) -> None:
    rec = victim.invert(time_budget=budget)
    exact = _max_row_error(rec.inputs, victim.inputs) < 1e-4
    assert rec.complete == exact
    if budget == 0.01:
        assert not rec.complete


def test_a_two_class_head_that_does_not_fit_costs_time_not_exactness() -> None:
    # another model's head: no two-valued column, the attack's other proposals recover the batch
    small = make_victim(6, classes=2, seed=SEED)
    wrong = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(5))
    rec = small.invert(time_budget=30.0, head_weight=wrong)
    assert rec.stats["binary_directions"] == 0
    assert rec.complete and _max_row_error(rec.inputs, small.inputs) < 1e-4


def test_binary_head_checks_its_input_and_deadline(search: Search) -> None:
    generator = torch.Generator().manual_seed(0)
    m = search.factors.left.shape[0]
    with pytest.raises(ValueError, match=rf"difference must be an \({m},\) vector .* got shape \(5,\)"):
        BinaryHead(search.factors, torch.ones(5), relative_noise=0.0, generator=generator)
    with pytest.raises(ValueError, match="NaN or Inf"):
        BinaryHead(search.factors, torch.full((m,), math.nan), relative_noise=0.0, generator=generator)
    with pytest.raises(ValueError, match="relative_noise must be >= 0"):
        BinaryHead(search.factors, search.difference, relative_noise=-1.0, generator=generator)
    with pytest.raises(ValueError, match="starts must be >= 1, got 0"):
        BinaryHead(search.factors, search.difference, relative_noise=0.0, generator=generator, starts=0)
    # a head difference usable on fewer than b + 1 neurons pins nothing down: no proposals
    flat = torch.zeros(m, dtype=torch.float64)
    flat[:BATCH] = 1.0
    empty = BinaryHead(search.factors, flat, relative_noise=0.0, generator=generator)
    assert empty.propose(search.truth).shape == (0, BATCH) and empty.stats()["binary_rounds"] == 0
    late = BinaryHead(
        search.factors, search.difference, relative_noise=0.0, generator=generator, deadline=Deadline(0.0)
    )
    assert late.propose(search.truth).shape == (0, BATCH)
    assert late.stats() == {"binary_rounds": 0, "binary_starts": 0, "binary_directions": 0}


def test_a_single_logit_head_is_two_valued_too() -> None:
    # BCEWithLogits on one output: dL/dz_i = (sigmoid - y_i) * relu'(z_i) * w, the two-class case
    # with v = w (the logits (z, 0) under softmax); the Auditor passes such a (1, m) head as well
    inputs, labels = one_hot_rows(BATCH, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(inputs.shape[1], WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    loss = nn.functional.binary_cross_entropy_with_logits(model(inputs.float())[:, 0], labels.float())
    layer = model[0]
    assert isinstance(layer, nn.Linear)
    weight_grad, bias_grad = torch.autograd.grad(loss, [layer.weight, layer.bias])
    head = model[2].weight.detach()
    prior = HeadPrior.from_head_weight(head, width=WIDTH)
    assert torch.equal(prior.difference, head[0].double()) and prior.num_classes == 2
    rec = SpearPlusPlus(time_budget=30.0, seed=SEED, progress=False).invert(
        weight_grad,
        bias_grad,
        weight=layer.weight.detach(),
        bias=layer.bias.detach(),
        batch_size=BATCH,
        head_weight=head,
    )
    assert rec.complete and rec.stats["binary_directions"] >= BATCH
    assert _max_row_error(rec.inputs, inputs) < 1e-4
