"""Exact gradients of a client's batch loss at one linear layer, and the truth they hide.

What an honest FedSGD client computes in float32 for the attacked layer
(:func:`client_gradient`, :func:`layer_gradient`), and the oracle quantities benchmarks score
against (:func:`output_gradient`, :attr:`LayerGradient.inputs`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .models import first_linear, followed_by_relu, linear_layers, relu_linear_layers

__all__ = [
    "LOSSES",
    "LayerGradient",
    "check_batch",
    "client_gradient",
    "layer_gradient",
    "loss_function",
    "next_layer_gradient",
    "output_gradient",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _mse_one_hot(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    target = nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
    return nn.functional.mse_loss(logits, target)


LOSSES: dict[str, LossFn] = {
    "ce": _cross_entropy,
    "mse": _mse_one_hot,
}
"""Client training losses by name, each the mean over the batch."""


def loss_function(loss: str) -> LossFn:
    """The loss named ``loss`` in :data:`LOSSES`.

    Raises
    ------
    ValueError
        If no loss has that name (the message lists the names).
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; available: {sorted(LOSSES)}")
    return LOSSES[loss]


def check_batch(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a client batch against the model's first linear layer.

    Parameters
    ----------
    model
        The victim network.
    inputs
        ``(B, ...)`` inputs with ``n`` features per sample, ``n`` the first layer's input size.
    labels
        ``(B,)`` integer class labels.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        The inputs detached and cast to the first layer's dtype and device, and the labels
        as int64 on that device.

    Raises
    ------
    ValueError
        On non-tensors, an empty batch, labels of the wrong shape or a float dtype, or a
        feature count the first layer does not take.
    """
    if not isinstance(inputs, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise ValueError("inputs and labels must be torch tensors")
    if inputs.dim() < 2 or inputs.shape[0] == 0:
        raise ValueError(f"inputs must be a non-empty batch (B, ...), got shape {tuple(inputs.shape)}")
    if labels.dim() != 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"labels must have shape ({inputs.shape[0]},) to match the inputs, got {tuple(labels.shape)}"
        )
    if labels.is_floating_point():
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    _, layer = first_linear(model)
    n = inputs[0].numel()
    if n != layer.in_features:
        raise ValueError(
            f"inputs have {n} features per sample but the first linear layer expects {layer.in_features}"
        )
    param = layer.weight
    return inputs.detach().to(device=param.device, dtype=param.dtype), labels.to(
        device=param.device, dtype=torch.int64
    )


def client_gradient(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss: str = "ce"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of the client's mean batch loss w.r.t. the first linear layer.

    Parameters
    ----------
    model
        The victim network (float32); its parameters and ``.grad`` are left untouched.
    inputs
        ``(B, C, H, W)`` or ``(B, n)`` client inputs, cast to the model's dtype.
    labels
        ``(B,)`` integer class labels.
    loss
        Name in :data:`LOSSES`: ``"ce"`` (mean cross-entropy) or ``"mse"`` (mean squared error
        against one-hot labels).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(dL/dW, dL/db)`` of shapes ``(m, n)`` and ``(m,)``, detached.
    """
    loss_fn = loss_function(loss)
    x, y = check_batch(model, inputs, labels)
    _, layer = first_linear(model)
    with torch.enable_grad():
        value = loss_fn(model(x), y)
        weight_grad, bias_grad = torch.autograd.grad(value, (layer.weight, layer.bias))
    return weight_grad.detach(), bias_grad.detach()


def next_layer_gradient(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss: str = "ce"
) -> torch.Tensor | None:
    """Gradient of the mean batch loss w.r.t. the weight of the linear layer fed by the first
    linear layer's ReLU (what a FedSGD client also sends), detached; None when the first layer is
    not followed by a ReLU and another linear layer. The model's parameters are left untouched."""
    _, first = first_linear(model)
    layers = [module for _, module in linear_layers(model)]
    position = layers.index(first)
    if not followed_by_relu(model, first) or position + 1 >= len(layers):
        return None
    loss_fn = loss_function(loss)
    x, y = check_batch(model, inputs, labels)
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(loss_fn(model(x), y), (layers[position + 1].weight,))
    return gradient.detach()


def output_gradient(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss: str = "ce"
) -> torch.Tensor:
    """The true ``dL/dZ`` ``(B, m)`` at the first linear layer's outputs, in float64.

    Ground truth for benchmarks and tests (what an oracle would know); the attack never sees it.
    The model is copied, so its parameters and ``.grad`` are left untouched.
    """
    model = copy.deepcopy(model).double()
    loss_fn = loss_function(loss)
    x, y = check_batch(model, inputs, labels)
    _, layer = first_linear(model)
    captured: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        captured.append(output)
        return output

    handle = layer.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            value = loss_fn(model(x), y)
            (gradient,) = torch.autograd.grad(value, captured[0])
    finally:
        handle.remove()
    return gradient.detach()


@dataclass(frozen=True)
class LayerGradient:
    """What the server observes of one linear layer, and the ground truth it hides.

    Attributes
    ----------
    layer
        1-based index of the layer among the model's linear layers.
    name
        Its qualified module name (the ``state_dict`` prefix).
    weight_grad, bias_grad
        ``(m, n)`` and ``(m,)`` float32 gradients of the mean batch loss (detached).
    weight, bias
        ``(m, n)`` and ``(m,)`` copies of the layer's parameters at which they were taken.
    inputs
        ``(B, n)`` float32 true inputs of the layer for the batch (the previous layer's
        ReLU activations for ``layer >= 2``, the flattened client inputs for ``layer = 1``):
        what an exact attack on this layer recovers, rows in batch order.
    """

    layer: int
    name: str
    weight_grad: torch.Tensor
    bias_grad: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    inputs: torch.Tensor


def _attackable_layer(model: nn.Module, layer: int) -> tuple[str, nn.Linear]:
    """The ``layer``-th linear layer (1-based), checked to have a bias and a ReLU after it."""
    layers = linear_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= len(layers):
        raise ValueError(
            f"layer must be an integer between 1 and {len(layers)} (the model has "
            f"{len(layers)} linear layers, numbered from 1), got {layer!r}"
        )
    name, module = layers[layer - 1]
    attackable = [index for index, _, _ in relu_linear_layers(model)]
    if module.bias is None:
        raise ValueError(
            f"linear layer {layer} ({name!r}) has no bias; the attack needs the bias gradient. "
            f"Attackable layers: {attackable}"
        )
    if not followed_by_relu(model, module):
        raise ValueError(
            f"linear layer {layer} ({name!r}) is not followed by a ReLU"
            + (" (it is the output layer)" if layer == len(layers) else "")
            + f"; SPEAR needs a ReLU after the attacked layer. Attackable layers: {attackable}"
        )
    return name, module


def layer_gradient(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    layer: int,
    loss: str = "ce",
) -> LayerGradient:
    """Gradient of the client's mean batch loss w.r.t. the ``layer``-th linear layer.

    SPEAR Sec. 3.2 / Table 4: any linear layer followed by a ReLU leaks its own inputs the
    way the first layer leaks the client's data, so the attack on layer ``l`` recovers the
    activations that feed it.

    Parameters
    ----------
    model
        The victim network (float32); its parameters and ``.grad`` are left untouched.
    inputs
        ``(B, C, H, W)`` or ``(B, n)`` client inputs, cast to the model's dtype.
    labels
        ``(B,)`` integer class labels.
    layer
        1-based index among the model's linear layers (``1`` is the first layer, as in
        :func:`client_gradient`); it must be followed by a ReLU and have a bias.
    loss
        Name in :data:`LOSSES`.

    Returns
    -------
    LayerGradient
        The layer's gradient and parameters, and its true inputs for the batch.

    Raises
    ------
    ValueError
        When ``layer`` is not an integer in ``1..L`` (L linear layers), when that layer has
        no bias or is not followed by a ReLU (e.g. the output layer), when the layer does
        not see one 2-D row per sample, or on a malformed batch.
    """
    name, module = _attackable_layer(model, layer)
    loss_fn = loss_function(loss)
    x, y = check_batch(model, inputs, labels)
    seen: list[torch.Tensor] = []

    def capture(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(args[0].detach())

    handle = module.register_forward_pre_hook(capture)
    try:
        with torch.enable_grad():
            value = loss_fn(model(x), y)
            weight_grad, bias_grad = torch.autograd.grad(value, (module.weight, module.bias))
    finally:
        handle.remove()
    if len(seen) != 1 or seen[0].dim() != 2 or seen[0].shape[0] != x.shape[0]:
        shapes = [tuple(t.shape) for t in seen]
        raise ValueError(
            f"linear layer {layer} ({name!r}) must be called once on a (B, n) batch with "
            f"B={x.shape[0]}, but saw inputs of shapes {shapes}"
        )
    return LayerGradient(
        layer=layer,
        name=name,
        weight_grad=weight_grad.detach(),
        bias_grad=bias_grad.detach(),
        weight=module.weight.detach().clone(),
        bias=module.bias.detach().clone(),
        inputs=seen[0].clone(),
    )
