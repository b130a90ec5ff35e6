"""Samples certified through the next layer's update, and the search deflated past them (issue #18).

A direction of the first layer gives its sample's zeros; the next layer's update spans the batch's
ReLU outputs, so those zeros pin the sample's activations and, through the known weights, its
input. Certified inputs give rows of ``Q^{-1}``, to which every missing direction is orthogonal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import fl_attack.attacks.spear as spear_module
import fl_attack.pipeline.side_information.next_layer as deflation_module
from fl_attack import SpearPlusPlus
from fl_attack.audit import AttackSettings, Auditor
from fl_attack.audit.observations import ClientIdentity, ClientUpdate
from fl_attack.data.images import load_dataset
from fl_attack.pipeline.search.candidates import informative_rows
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection
from fl_attack.pipeline.side_information.next_layer import Deflation, confirm_weak_rows, with_certified_rows
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear, next_layer_gradient
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR
from tests.synthetic_layer import SyntheticUpdate, next_layer_update, relu_layer_update

BATCH, WIDTH, FEATURES, NEXT = 12, 120, 40, 60


@dataclass(frozen=True)
class Problem:
    """A layer's update decomposed as the attack does, the next layer's update and the truth."""

    update: SyntheticUpdate
    following: torch.Tensor
    factors: LowRankFactors  # informative rows only
    active: torch.Tensor
    tolerance: ZeroTolerance
    truth: torch.Tensor  # (b, b) unit true directions, rows in batch order

    def deflation(self, *, following: torch.Tensor | None = None, min_zeros: int = BATCH) -> Deflation:
        return Deflation(
            self.factors,
            self.following if following is None else following,
            weight=self.update.weight,
            bias=self.update.bias,
            active=self.active,
            tolerance=self.tolerance,
            relative_noise=self.factors.spectrum.relative_noise,
            min_zeros=min_zeros,
        )


def problem(
    *, seed: int = 0, vanishing: tuple[tuple[int, int], ...] = (), inputs: torch.Tensor | None = None
) -> Problem:
    if inputs is None:
        inputs = torch.randn(
            BATCH, FEATURES, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
    update = relu_layer_update(inputs, width=WIDTH, seed=seed, vanishing=vanishing)
    following = next_layer_update(update, width=NEXT, seed=seed + 1)
    factors = decompose(update.weight_grad, batch_size=inputs.shape[0])
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    search, active = informative_rows(factors, tolerance)
    output_grad = update.weight_grad @ torch.linalg.pinv(update.inputs)  # (m, b): dL/dZ, the truth
    truth = (search.left.T @ output_grad[active]).T
    return Problem(update, following, search, active, tolerance, truth / truth.norm(dim=1, keepdim=True))


def test_each_true_direction_certifies_its_sample_exactly() -> None:
    case = problem()
    deflation = case.deflation()
    assert deflation.certify(case.truth) == BATCH
    assert deflation.off is None and deflation.found == BATCH
    error = (deflation.inputs() - case.update.inputs).norm(dim=1) / case.update.inputs.norm(dim=1)
    assert float(error.max()) < 1e-9
    # the certified rows of Q^{-1}: biorthogonal to the (unit) directions of the other samples
    duals = torch.stack([sample.dual for sample in deflation.samples])
    products = duals @ case.truth.T
    off_diagonal = products - torch.diag(products.diagonal())
    assert float(off_diagonal.abs().max()) < 1e-9 * float(products.diagonal().abs().min())
    assert max(sample.residual for sample in deflation.samples) < 1e-10


def test_the_search_space_left_holds_exactly_the_missing_directions() -> None:
    case = problem(seed=1)
    deflation = case.deflation()
    assert deflation.certify(case.truth[:5]) == 5
    space = deflation.complement()
    assert space.shape == (BATCH, BATCH - 5)
    assert torch.allclose(space.T @ space, torch.eye(BATCH - 5, dtype=space.dtype), atol=1e-12)
    missing = case.truth[5:]
    outside = missing - (missing @ space) @ space.T
    assert float(outside.norm(dim=1).max()) < 1e-9
    # a certified direction has no place there: its dual row is orthogonal to the whole space
    duals = torch.stack([sample.dual for sample in deflation.samples])
    assert float((duals @ space).abs().max()) < 1e-9 * float(duals.norm(dim=1).min())


def test_mixtures_are_refused_and_repeats_are_not_fitted_again() -> None:
    case = problem(seed=2)
    deflation = case.deflation()
    mixture = case.truth[0] + case.truth[1]
    assert deflation.certify(mixture[None]) == 0
    assert deflation.tried == 1 and deflation.found == 0
    assert deflation.certify(case.truth[:1]) == 1
    assert deflation.certify(case.truth[:1]) == 0
    assert deflation.tried == 2  # the repeat was skipped before any fit


def _active_neuron(update: SyntheticUpdate, sample: int) -> int:
    pre_activations = update.weight @ update.inputs[sample] + update.bias
    return int(torch.nonzero(pre_activations > 0.5 * float(pre_activations.max())).flatten()[0])


def test_an_active_neuron_whose_gradient_vanishes_is_dropped_as_a_wrong_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = problem(seed=3)
    neuron = _active_neuron(plain.update, 4)
    case = problem(seed=3, vanishing=((4, neuron),))
    assert float(case.update.weight_grad.sub(plain.update.weight_grad).abs().max()) > 0
    deflation = case.deflation()
    assert deflation.certify(case.truth[4:5]) == 1
    (sample,) = deflation.samples
    error = (sample.inputs - case.update.inputs[4]).norm() / case.update.inputs[4].norm()
    assert float(error) < 1e-9
    # without dropping it the wrong zero spoils the activations and nothing is certified
    monkeypatch.setattr(deflation_module, "OUTLIER_ROUNDS", 1)
    assert case.deflation().certify(case.truth[4:5]) == 0


def test_float32_gradients_of_a_victim_certify_every_sample() -> None:
    data = load_dataset("digits")
    inputs, labels = data.images[:16].reshape(16, -1), data.labels[:16]
    model = build_victim("spear++", input_dim=inputs.shape[1], width=200, num_classes=10, depth=4, seed=0)
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    following = next_layer_gradient(model, inputs, labels)
    assert following is not None and following.dtype == torch.float32 and following.shape == (200, 200)
    _, layer = first_linear(model)
    update = SyntheticUpdate(
        inputs.double(),
        weight_grad.double(),
        bias_grad.double(),
        layer.weight.detach().double(),
        layer.bias.detach().double(),
    )
    factors = decompose(update.weight_grad, batch_size=16)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=200)
    search, active = informative_rows(factors, tolerance)
    output_grad = update.weight_grad @ torch.linalg.pinv(update.inputs)
    truth = (search.left.T @ output_grad[active]).T
    deflation = Deflation(
        search,
        following.double(),
        weight=update.weight,
        bias=update.bias,
        active=active,
        tolerance=tolerance,
        relative_noise=factors.spectrum.relative_noise,
        min_zeros=16,
    )
    assert deflation.certify(truth) == 16
    error = (deflation.inputs() - update.inputs).norm(dim=1) / update.inputs.norm(dim=1)
    assert float(error.max()) < 1e-4


def test_the_deflated_search_recovers_a_crowded_batch_the_plain_one_misses() -> None:
    # b = m/6 Gaussian inputs: the same 3000 sphere starts find no sample without the next layer
    inputs = torch.randn(70, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    update = relu_layer_update(inputs, width=420, seed=1)
    following = next_layer_update(update, width=200, seed=2)

    def attack(next_weight_grad: torch.Tensor | None) -> tuple[bool, float, dict[str, Any]]:
        attacker = SpearPlusPlus(seed=0, time_budget=300.0, max_initializations=3000, progress=False)
        result = attacker.invert(**update.arrays(), batch_size=70, next_weight_grad=next_weight_grad)
        error = torch.cdist(result.inputs.double(), inputs).min(dim=1).values / inputs.norm(dim=1)
        return result.complete, float(error.max()), result.stats

    complete, error, stats = attack(following)
    assert complete and error < 1e-6, stats
    assert stats["next_layer"] == "on" and stats["next_layer_certified"] > 0
    complete, error, stats = attack(None)
    assert not complete and "next_layer" not in stats


def test_a_partial_result_keeps_the_certified_samples_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # stopped after its second round: the first round's directions are certified, the batch is not whole
    inputs = torch.randn(70, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    update = relu_layer_update(inputs, width=420, seed=1)
    following = next_layer_update(update, width=200, seed=2)

    def exact_rows() -> tuple[int, int, bool]:
        attacker = SpearPlusPlus(seed=0, time_budget=300.0, max_initializations=2300, progress=False)
        result = attacker.invert(**update.arrays(), batch_size=70, next_weight_grad=following)
        error = torch.cdist(result.inputs.double(), inputs).min(dim=1).values / inputs.norm(dim=1)
        return int((error < 1e-6).sum()), int(result.stats["next_layer_certified"]), result.complete

    exact, certified, complete = exact_rows()
    assert not complete and certified >= 10 and exact >= certified
    # the selection's own rows of a partial batch mix in the completion of its unfound directions
    monkeypatch.setattr(spear_module, "with_certified_rows", lambda selection, deflation, **_: selection)
    without, _, _ = exact_rows()
    assert without < certified


@pytest.mark.parametrize(
    ("following", "reason"),
    [
        (lambda case: case.following[:BATCH], "it cannot span the activations of 12 samples"),
        (
            lambda case: (
                case.following
                + 1e-2 * case.following.abs().max() * torch.randn(case.following.shape, dtype=torch.float64)
            ),
            "the next layer's update is not of rank 12",
        ),
    ],
    ids=["narrow", "noisy"],
)
def test_a_next_layer_that_cannot_certify_turns_the_deflation_off(
    following: Callable[[Problem], torch.Tensor], reason: str
) -> None:
    case = problem(seed=4)
    deflation = case.deflation(following=following(case))
    assert deflation.certify(case.truth) == 0 and deflation.found == 0
    assert deflation.off is not None and reason in deflation.off
    assert deflation.stats()["next_layer"] == f"off: {deflation.off}"


def test_noisy_or_multi_step_updates_do_not_use_the_next_layer() -> None:
    case = problem(seed=5)
    generator = torch.Generator().manual_seed(0)
    noisy = case.update.weight_grad + 0.05 * case.update.weight_grad.abs().median() * torch.randn(
        case.update.weight_grad.shape, generator=generator, dtype=torch.float64
    )
    arrays = {**case.update.arrays(), "weight_grad": noisy}
    attacker = SpearPlusPlus(seed=0, time_budget=20.0, progress=False)
    result = attacker.invert(**arrays, batch_size=BATCH, next_weight_grad=case.following)
    assert result.stats["next_layer"] == "off: the update is noisy: no zero is exact"
    result = attacker.invert(
        **case.update.arrays(), batch_size=BATCH, next_weight_grad=case.following, local_steps=2
    )
    assert str(result.stats["next_layer"]).startswith("off: 2 local steps")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: g[:, :-1], r"next_weight_grad must be the \(k, m\) update .* m = 120 columns, got shape \(60, 119\)"),
        (lambda g: g[0], r"got shape \(120,\)"),
        (lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"), dtype=g.dtype)), "next_weight_grad contains 1 NaN or Inf"),
        (torch.zeros_like, "next_weight_grad is all zeros"),
    ],
    ids=["columns", "one-dimensional", "nan", "zeros"],
)  # fmt: skip
def test_a_bad_next_layer_update_is_refused(
    mutate: Callable[[torch.Tensor], torch.Tensor], message: str
) -> None:
    case = problem(seed=6)
    with pytest.raises(ValueError, match=message):
        SpearPlusPlus(progress=False).invert(
            **case.update.arrays(), batch_size=BATCH, next_weight_grad=mutate(case.following.clone())
        )


def _client_step(
    batch: int, width: int, features: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], torch.Tensor]:
    """Global arrays, the arrays one FedSGD client sends (lr 0.1, float32) and its Gaussian batch."""
    inputs = torch.randn(batch, features, generator=torch.Generator().manual_seed(0))
    model = build_victim("spear++", input_dim=features, width=width, depth=4, seed=0)
    before = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    loss = torch.nn.functional.cross_entropy(model(inputs), torch.arange(batch) % 10)
    gradients = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for parameter, gradient in zip(model.parameters(), gradients, strict=True):
            parameter.sub_(0.1 * gradient)
    after = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    return before, after, inputs.double()


def _audited(global_arrays: dict[str, np.ndarray], sent: dict[str, np.ndarray], batch: int) -> Any:
    auditor = Auditor(
        SpearPlusPlus(seed=0, progress=False), attack=AttackSettings(batch_size=batch, time_budget=60.0)
    )
    auditor.start_round(1, global_arrays)
    (record,) = auditor.audit_round(1, [ClientUpdate(identity=ClientIdentity(node_id=7), arrays=sent)])
    auditor.close()
    return record


def test_the_auditor_deflates_a_crowded_clients_search_with_its_next_layer() -> None:
    global_arrays, sent, inputs = _client_step(70, 420, 300)
    record = _audited(global_arrays, sent, 70)
    assert record.status == "ok" and record.attack["next_layer"] == "on", record.attack
    assert record.attack["next_layer_certified"] > 0 and record.attack["complete"] is True
    errors = torch.cdist(torch.as_tensor(record.inputs), inputs).min(dim=1).values / inputs.norm(dim=1)
    assert float(errors.max()) < 1e-4


def test_a_client_that_left_the_next_layer_unchanged_is_attacked_without_it() -> None:
    global_arrays, sent, _ = _client_step(8, 60, 20)
    sent = {**sent, "3.weight": global_arrays["3.weight"].copy()}  # a frozen next layer: zero change
    record = _audited(global_arrays, sent, 8)
    assert record.status == "ok", record.error
    assert "next_layer" not in record.attack and record.attack["complete"] is True


def _tabular_mlp_step() -> tuple[torch.nn.Sequential, torch.nn.Sequential, torch.Tensor]:
    """Issue 35's case: a tabular MLP, one SGD step at lr 0.05 on 8 rows of 6 standard-normal
    columns and two 4-way one-hot groups; the global model, the client's and the batch."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Linear(14, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 2),
    )
    rng = np.random.default_rng(1002)
    normal = rng.standard_normal((200, 6))
    groups = [np.eye(4)[rng.integers(0, 4, 200)] for _ in range(2)]
    data = torch.tensor(np.concatenate([normal, *groups], axis=1), dtype=torch.float32)
    labels = torch.tensor(rng.integers(0, 2, 200))
    batch = torch.randperm(200, generator=torch.Generator().manual_seed(102))[:8]
    client = copy.deepcopy(model)
    optimizer = torch.optim.SGD(client.parameters(), lr=0.05)
    torch.nn.functional.cross_entropy(client(data[batch]), labels[batch]).backward()
    optimizer.step()
    return model, client, data[batch]


def test_the_next_layer_never_costs_the_rows_the_bare_attack_recovers() -> None:
    # float32 deltas: one sample's directions from two starts differ by more than 1e-6 in cosine,
    # so the next layer once certified 6 samples 8 times, left no direction to search and
    # recovered 1 row of 8 where the bare call recovers 8
    torch.set_num_threads(1)
    model, client, inputs = _tabular_mlp_step()
    first, after = model[0], client[0]
    update = {
        "weight_grad": (after.weight - first.weight).detach(),
        "bias_grad": (after.bias - first.bias).detach(),
        "weight": first.weight.detach(),
        "bias": first.bias.detach(),
    }
    next_update = (client[2].weight - model[2].weight).detach()

    def exact_rows(next_weight_grad: torch.Tensor | None) -> int:
        attack = SpearPlusPlus(device="cpu", seed=0, progress=False, time_budget=30.0)
        rec = attack.invert(**update, next_weight_grad=next_weight_grad)
        errors = torch.cdist(inputs.double(), rec.inputs.double()) / inputs.double().norm(dim=1, keepdim=True)
        return int((errors.min(dim=1).values < EXACT_RELATIVE_ERROR).sum())

    deflated = exact_rows(next_update)
    assert deflated == 8
    assert deflated >= exact_rows(None)


def _selection(found: list[bool], per_sample: list[float]) -> Selection:
    directions = torch.eye(4, dtype=torch.float64)
    inputs = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    matching = torch.tensor(per_sample, dtype=torch.float64)
    return Selection(directions, torch.tensor(found), inputs, matching, float(matching.mean()))


def _certified(direction: list[float], inputs: list[float], agreement: float) -> SimpleNamespace:
    unit = torch.tensor(direction, dtype=torch.float64)
    return SimpleNamespace(
        direction=unit / unit.norm(), inputs=torch.tensor(inputs, dtype=torch.float64), agreement=agreement
    )


def test_certified_rows_replace_the_weakest_rows_of_a_complete_batch_not_accepted() -> None:
    # near-twins can leave a complete but unaccepted selection nearly singular, each of its rows off;
    # the certified samples' inputs are exact by themselves and take the rows
    selection = _selection([True] * 4, [1.0, 0.5, 0.9, 0.8])
    on_row_2 = _certified([0.0, 0.0, 1.0, 0.0], [-1.0, -2.0, -3.0], 1.0)
    elsewhere = _certified([1.0, 1.0, 0.0, 0.0], [7.0, 7.0, 7.0], 0.99)
    again = _certified([1.0, -1.0, 0.0, 0.0], [5.0, 5.0, 5.0], 0.98)
    deflation = SimpleNamespace(samples=[on_row_2, elsewhere, again])
    kept = with_certified_rows(selection, deflation)  # type: ignore[arg-type]
    assert kept.inputs[2].tolist() == [-1.0, -2.0, -3.0]
    assert kept.inputs[1].tolist() == [7.0, 7.0, 7.0]  # the weakest row (0.5)
    assert kept.inputs[3].tolist() == [5.0, 5.0, 5.0]  # then the weakest row not yet certified (0.8)
    assert kept.inputs[0].tolist() == [0.0, 1.0, 2.0]
    assert kept.per_sample.tolist() == [1.0, 0.99, 1.0, 0.98] and kept.complete
    # an accepted batch stays as it is
    assert with_certified_rows(selection, deflation, keep_complete=True) is selection  # type: ignore[arg-type]


def test_certified_rows_fill_the_unfound_rows_of_a_partial_batch() -> None:
    selection = _selection([True, False, True, False], [1.0, 0.0, 0.9, 0.0])
    first = _certified([0.0, 1.0, 1.0, 0.0], [7.0, 7.0, 7.0], 1.0)
    second = _certified([0.0, 1.0, -1.0, 1.0], [5.0, 5.0, 5.0], 1.0)
    kept = with_certified_rows(selection, SimpleNamespace(samples=[first, second]), keep_complete=True)  # type: ignore[arg-type]
    assert kept.inputs[1].tolist() == [7.0, 7.0, 7.0] and kept.inputs[3].tolist() == [5.0, 5.0, 5.0]
    assert kept.found.tolist() == [True] * 4 and kept.inputs[0].tolist() == [0.0, 1.0, 2.0]


def test_a_weak_row_is_confirmed_by_the_next_layer_and_a_blend_is_not() -> None:
    plain = problem(seed=3)
    neuron = _active_neuron(plain.update, 4)
    case = problem(seed=3, vanishing=((4, neuron),))
    inputs = case.update.inputs.clone()
    confidence = torch.ones(BATCH, dtype=torch.float64)
    confidence[4] = 0.99  # its vanishing gradient at an active neuron
    selection = Selection(case.truth.clone(), torch.ones(BATCH, dtype=torch.bool), inputs, confidence, 0.999)
    stats = confirm_weak_rows(case.deflation(), selection, confidence)
    assert stats == {"weak_rows": 1, "next_layer_confirmed_rows": 1, "unconfirmed_min_confidence": 1.0}
    # a row standing for a blend of two samples is not confirmed, nor a right direction whose row is off
    blend = case.truth.clone()
    blend[5] = (case.truth[5] + 0.3 * case.truth[6]) / (case.truth[5] + 0.3 * case.truth[6]).norm()
    confidence[5] = 0.97
    off = inputs.clone()
    off[4] = inputs[4] * (1.0 + 1e-3)
    for directions, rows in ((blend, inputs), (case.truth, off)):
        chosen = Selection(directions, torch.ones(BATCH, dtype=torch.bool), rows, confidence, 0.99)
        stats = confirm_weak_rows(case.deflation(), chosen, confidence)
        assert stats["next_layer_confirmed_rows"] < stats["weak_rows"]
        assert stats["unconfirmed_min_confidence"] < 0.999
    assert confirm_weak_rows(None, selection, confidence) == {}
    assert confirm_weak_rows(case.deflation(), selection, torch.ones(BATCH, dtype=torch.float64)) == {}


def test_an_attack_confirms_a_sample_whose_active_neuron_has_no_gradient() -> None:
    inputs = torch.randn(8, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = relu_layer_update(inputs, width=100, seed=0)
    neuron = int(torch.argmax(plain.weight @ inputs[2] + plain.bias))
    update = relu_layer_update(inputs, width=100, seed=0, vanishing=((2, neuron),))
    following = next_layer_update(update, width=30, seed=1)
    attacker = SpearPlusPlus(seed=0, time_budget=120.0, progress=False)
    result = attacker.invert(**update.arrays(), batch_size=8, next_weight_grad=following)
    error = torch.cdist(result.inputs.double(), inputs).min(dim=1).values / inputs.norm(dim=1)
    assert result.complete and float(error.max()) < 1e-9 and float(result.confidence.min()) < 0.999
    assert result.stats["weak_rows"] == result.stats["next_layer_confirmed_rows"] == 1
    assert result.stats["unconfirmed_min_confidence"] == 1.0
    alone = SpearPlusPlus(seed=0, time_budget=120.0, progress=False).invert(**update.arrays(), batch_size=8)
    assert alone.complete and "weak_rows" not in alone.stats  # no next layer: nothing confirms it
