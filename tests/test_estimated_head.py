"""A head prior estimated from the found samples, where no head_weight is given (issue #35 item 2)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.search.candidates import CandidatePool, duplicate_cos_tolerance
from fl_attack.pipeline.search.sparsity import ZeroTolerance, min_sparsity
from fl_attack.pipeline.side_information.estimated_head import (
    class_groups,
    estimate_head_prior,
    sign_agreement,
)
from fl_attack.pipeline.side_information.output_layer import HeadPrior
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear, output_gradient

WIDTH, BATCH, SEED = 200, 8, 0


def _batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Four threes and four eights of the bundled digits: same-class samples trap the plain search."""
    data = load_dataset("digits")
    chosen = torch.cat([torch.nonzero(data.labels == label).flatten()[: BATCH // 2] for label in (3, 8)])
    return data.images[chosen].reshape(BATCH, -1), data.labels[chosen], data.input_dim


def _pool_and_truth(
    depth: int,
) -> tuple[CandidatePool, torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Sequential]:
    """The attack's candidate pool for a victim of ``depth`` linear layers, the true unit
    directions in its coordinates, the neurons it keeps, the labels and the victim."""
    inputs, labels, input_dim = _batch()
    model = build_victim("spear++", input_dim=input_dim, width=WIDTH, num_classes=10, depth=depth, seed=SEED)
    weight_grad, _ = client_gradient(model, inputs, labels)
    factors = decompose(weight_grad.double(), batch_size=BATCH)
    tolerance = ZeroTolerance.from_noise(factors.spectrum.relative_noise, width=WIDTH)
    rows = factors.left.norm(dim=1) > tolerance.absolute
    factors = replace(factors, left=factors.left[rows].contiguous())
    m = int(rows.sum())
    tau = min_sparsity(m, false_rejection=1e-5)
    pool = CandidatePool(
        factors,
        tolerance,
        min_zeros=max(BATCH + 1, math.ceil(tau * m)),
        weak_min_zeros=max(BATCH + 1, math.ceil(0.5 * tau * m)),
        cos_tolerance=duplicate_cos_tolerance(factors.spectrum.relative_noise),
    )
    truth = output_gradient(model, inputs, labels)[:, rows] @ factors.left
    return pool, truth / truth.norm(dim=1, keepdim=True), rows, labels, model


def test_sign_agreement_is_orientation_free_and_ignores_nested_supports() -> None:
    columns = torch.tensor(
        [
            [1.0, -1.0] * 15 + [1.0] * 10 + [0.0] * 10,
            [-1.0, 1.0] * 15 + [0.0] * 10 + [-1.0] * 10,  # the first's negative on the common part
            [1.0, -1.0] * 15 + [1.0] * 10 + [1.0] * 10,  # contains the first's support
        ]
    )
    agreement, common = sign_agreement(columns, columns != 0)
    assert common[0, 1] == 30 and agreement[0, 1] == -1.0
    assert agreement[0, 2] == 0.0  # nested: a positive mixture of the first and another
    groups = class_groups(agreement, common)
    assert groups == [([0, 1], [1.0, -1.0]), ([2], [1.0])]


def test_the_found_samples_of_a_one_hidden_layer_victim_give_its_class_signs() -> None:
    pool, truth, rows, labels, model = _pool_and_truth(depth=2)
    prior = estimate_head_prior(truth, pool=pool)
    assert prior is not None and prior.num_classes == 2
    # the head's own class signs on the same neurons (known to the test, not to the estimate)
    given = HeadPrior.from_head_weight(model[3].weight.detach(), width=WIDTH, rows=rows).signs
    matched = []
    for row in prior.signs:
        known = row != 0
        assert int(known.sum()) > 0.5 * int(rows.sum())
        agreement = {label: float((given[label][known] * row[known]).mean()) for label in (3, 8)}
        label = max(agreement, key=lambda k: abs(agreement[k]))
        matched.append(label)
        assert abs(agreement[label]) > 0.9  # the same signs up to orientation
    assert sorted(matched) == [3, 8] and sorted(labels.unique().tolist()) == [3, 8]


def test_three_hidden_layers_show_no_classes() -> None:
    pool, truth, _, _, _ = _pool_and_truth(depth=4)
    assert estimate_head_prior(truth, pool=pool) is None


def test_without_head_weight_a_one_hidden_layer_batch_is_recovered_exactly() -> None:
    inputs, labels, input_dim = _batch()
    model = build_victim("spear++", input_dim=input_dim, width=WIDTH, num_classes=10, depth=2, seed=SEED)
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    layer = first_linear(model)[1]
    rec = SpearPlusPlus(time_budget=120.0, seed=SEED, progress=False).invert(
        weight_grad.numpy(),
        bias_grad.numpy(),
        weight=layer.weight.detach().numpy(),
        bias=layer.bias.detach().numpy(),
        batch_size=BATCH,
    )
    quality = evaluate_reconstruction(rec.inputs, inputs.double())
    assert rec.complete and quality.exact_fraction == 1.0
    # the estimated class signs steered the search: a few rounds, not the plain search's dozens
    assert rec.stats["estimated_head_classes"] == 2
    assert rec.stats["rounds"] <= 6 and rec.stats["initializations"] <= 640


@pytest.mark.parametrize("depth", [4])
def test_the_estimate_stays_off_on_deeper_victims(depth: int) -> None:
    inputs, labels, input_dim = _batch()
    model = build_victim("spear++", input_dim=input_dim, width=WIDTH, num_classes=10, depth=depth, seed=SEED)
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    layer = first_linear(model)[1]
    rec = SpearPlusPlus(time_budget=60.0, seed=SEED, progress=False).invert(
        weight_grad.numpy(),
        bias_grad.numpy(),
        weight=layer.weight.detach().numpy(),
        bias=layer.bias.detach().numpy(),
        batch_size=BATCH,
    )
    assert "estimated_head_classes" not in rec.stats
    assert rec.complete
