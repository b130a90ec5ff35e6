"""Attacking deeper layers (SPEAR Sec. 3.2 / Table 4): a layer's gradient leaks its inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.evaluation.metrics import match_samples
from fl_attack.simulate.victims import (
    LayerGradient,
    build_victim,
    client_gradient,
    layer_gradient,
    linear_layers,
    relu_linear_layers,
)

WIDTH, BATCH, SEED = 200, 5, 4


@pytest.fixture(scope="module")
def digits_batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_dataset("digits")
    inputs, labels, _ = sample_batch(data, BATCH, seed=SEED)
    return inputs, labels


@pytest.fixture()
def mlp() -> nn.Sequential:
    """Four linear layers: Flatten, (Linear, ReLU) x 3, Linear."""
    return build_victim("spear++", input_dim=64, width=WIDTH, num_classes=10, seed=SEED)


def test_relu_linear_layers_lists_the_attackable_layers(mlp: nn.Sequential) -> None:
    listed = relu_linear_layers(mlp)
    assert [(index, name) for index, name, _ in listed] == [(1, "1"), (2, "3"), (3, "5")]
    assert [module for _, _, module in listed] == [mlp[1], mlp[3], mlp[5]]
    assert [name for name, _ in linear_layers(mlp)] == ["1", "3", "5", "7"]
    spear = build_victim("spear", input_dim=12, width=16)
    assert [index for index, _, _ in relu_linear_layers(spear)] == [1, 2, 3, 4, 5]
    mixed = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(),
        nn.Linear(6, 6, bias=False), nn.ReLU(), nn.Linear(6, 2),
    )  # fmt: skip
    assert [index for index, _, _ in relu_linear_layers(mixed)] == [2]


def test_layer_one_is_the_first_layer_gradient(
    mlp: nn.Sequential, digits_batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    inputs, labels = digits_batch
    observed = layer_gradient(mlp, inputs, labels, layer=1)
    weight_grad, bias_grad = client_gradient(mlp, inputs, labels)
    assert isinstance(observed, LayerGradient) and observed.layer == 1 and observed.name == "1"
    assert torch.equal(observed.weight_grad, weight_grad)
    assert torch.equal(observed.bias_grad, bias_grad)
    assert torch.equal(observed.inputs, inputs.flatten(1))
    assert torch.equal(observed.weight, mlp[1].weight) and observed.weight is not mlp[1].weight


@pytest.mark.parametrize("layer", [2, 3])
def test_layer_gradient_returns_the_activations_feeding_the_layer(
    mlp: nn.Sequential, digits_batch: tuple[torch.Tensor, torch.Tensor], layer: int
) -> None:
    inputs, labels = digits_batch
    before = copy.deepcopy(mlp.state_dict())
    observed = layer_gradient(mlp, inputs, labels, layer=layer)
    position = 2 * layer - 1  # model[position] is the layer-th Linear
    module = mlp[position]
    expected_inputs = mlp[:position](inputs).detach()
    assert torch.equal(observed.inputs, expected_inputs)
    assert observed.inputs.shape == (BATCH, WIDTH) and bool((observed.inputs >= 0).all())
    # the gradient of the layer itself, computed independently from its own inputs
    x = expected_inputs.clone()
    loss = nn.functional.cross_entropy(mlp[position:](x), labels)
    weight_grad, bias_grad = torch.autograd.grad(loss, (module.weight, module.bias))
    assert torch.allclose(observed.weight_grad, weight_grad, atol=1e-7)
    assert torch.allclose(observed.bias_grad, bias_grad, atol=1e-7)
    assert observed.weight_grad.dtype == torch.float32
    assert observed.weight_grad.shape == (WIDTH, WIDTH)
    assert torch.equal(observed.weight, module.weight) and torch.equal(observed.bias, module.bias)
    assert torch.linalg.matrix_rank(observed.weight_grad.double(), rtol=1e-5) == BATCH
    assert all(p.grad is None for p in mlp.parameters())
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())


@pytest.mark.parametrize("layer", [2, 3])
def test_spear_plus_plus_recovers_the_inputs_of_deeper_layers(
    mlp: nn.Sequential, digits_batch: tuple[torch.Tensor, torch.Tensor], layer: int
) -> None:
    inputs, labels = digits_batch
    observed = layer_gradient(mlp, inputs, labels, layer=layer)
    rec = SpearPlusPlus(seed=0, time_budget=30, device="cpu", progress=False).invert(
        observed.weight_grad, observed.bias_grad, weight=observed.weight, bias=observed.bias
    )
    truth = observed.inputs.to(torch.float64)
    assert rec.batch_size == BATCH and rec.complete
    order = match_samples(rec.inputs, truth)
    assert sorted(order.tolist()) == list(range(BATCH))
    error = (rec.inputs[order] - truth).abs()
    # exact up to float32 gradient round-off, relative to the activations' scale
    assert float(error.max()) < 1e-5 * float(truth.abs().max())
    # ... and not the client's images: the layer's own inputs
    assert rec.inputs.shape[1] == WIDTH != inputs[0].numel()


@pytest.mark.parametrize("bad", [0, -1, 5, True, 2.0, "2"])
def test_layer_index_out_of_range(
    mlp: nn.Sequential, digits_batch: tuple[torch.Tensor, torch.Tensor], bad: object
) -> None:
    inputs, labels = digits_batch
    with pytest.raises(ValueError, match=r"between 1 and 4 .*4 linear layers"):
        layer_gradient(mlp, inputs, labels, layer=bad)  # type: ignore[arg-type]


def test_output_layer_and_layers_without_relu_or_bias_are_refused(
    mlp: nn.Sequential, digits_batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    inputs, labels = digits_batch
    output_layer = r"layer 4 .*not followed by a ReLU \(it is the output layer\)"
    with pytest.raises(ValueError, match=output_layer):
        layer_gradient(mlp, inputs, labels, layer=4)
    mixed = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(),
        nn.Linear(6, 6, bias=False), nn.ReLU(), nn.Linear(6, 10),
    )  # fmt: skip
    tanh_layer = r"layer 1 .*not followed by a ReLU.*Attackable layers: \[2\]"
    with pytest.raises(ValueError, match=tanh_layer):
        layer_gradient(mixed, inputs, labels, layer=1)
    with pytest.raises(ValueError, match=r"layer 3 .*has no bias"):
        layer_gradient(mixed, inputs, labels, layer=3)
    assert layer_gradient(mixed, inputs, labels, layer=2).inputs.shape == (BATCH, 6)
    with pytest.raises(ValueError, match="no nn.Linear"):
        layer_gradient(nn.Sequential(nn.ReLU()), inputs, labels, layer=1)
    with pytest.raises(ValueError, match="labels"):
        layer_gradient(mlp, inputs, labels[:-1], layer=2)
