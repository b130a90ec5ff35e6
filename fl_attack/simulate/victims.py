"""The victim networks of the SPEAR papers and the first-layer updates their clients send.

SPEAR attacks the first ``nn.Linear`` layer of a fully connected ReLU network: its weight
gradient ``dL/dW = dL/dZ @ X^T`` is low-rank and ``dL/dZ`` is sparse wherever the ReLU is off.
This module builds those networks and computes, exactly as an honest client would in float32,
what the server observes for that layer under FedSGD, FedAvg, DP-SGD and additive noise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = [
    "LOSSES",
    "VICTIMS",
    "LayerGradient",
    "build_victim",
    "client_gradient",
    "dp_sgd_gradient",
    "fedavg_update",
    "fedsgd_update",
    "first_linear",
    "layer_gradient",
    "linear_layers",
    "median_abs_entry",
    "noisy_gradient",
    "relu_linear_layers",
    "spear_mlp",
    "spear_plus_plus_mlp",
]


def _relu_mlp(input_dim: int, width: int, num_classes: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    in_features = input_dim
    for _ in range(depth - 1):
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


def spear_plus_plus_mlp(
    input_dim: int, width: int, num_classes: int, depth: int | None = None
) -> nn.Sequential:
    """SPEAR++ victim: ``depth`` linear layers (default 4: three hidden ReLU layers of width m)."""
    return _relu_mlp(input_dim, width, num_classes, 4 if depth is None else depth)


def spear_mlp(
    input_dim: int, width: int, num_classes: int, depth: int | None = None
) -> nn.Sequential:
    """SPEAR victim: ``depth`` linear layers (default 6: five hidden ReLU layers of width m)."""
    return _relu_mlp(input_dim, width, num_classes, 6 if depth is None else depth)


VICTIMS: dict[str, Callable[..., nn.Sequential]] = {
    "spear++": spear_plus_plus_mlp,
    "spear": spear_mlp,
}
"""Victim architectures by name; each builder takes ``(input_dim, width, num_classes, depth)``."""


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _mse_one_hot(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    target = nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
    return nn.functional.mse_loss(logits, target)


_PER_SAMPLE_BUDGET = 1 << 26  # floats of per-sample gradients held at once by dp_sgd_gradient

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ce": _cross_entropy,
    "mse": _mse_one_hot,
}
"""Client training losses by name, each the mean over the batch."""


def build_victim(
    architecture: str = "spear++",
    *,
    input_dim: int,
    width: int,
    num_classes: int = 10,
    depth: int | None = None,
    seed: int | None = None,
) -> nn.Sequential:
    """Build a victim network from :data:`VICTIMS`.

    Parameters
    ----------
    architecture
        ``"spear++"`` (``Flatten, Linear(n, m), ReLU, Linear(m, m), ReLU, Linear(m, m), ReLU,
        Linear(m, C)``) or ``"spear"`` (the same pattern with 6 linear layers).
    input_dim
        Number of input features n (``C * H * W`` for images; inputs are flattened).
    width
        Hidden width m.
    num_classes
        Output classes C.
    depth
        Number of linear layers, overriding the architecture's default; at least 2 so that
        the attacked first layer is followed by a ReLU.
    seed
        Seeds PyTorch's default initialisation; the global RNG is left untouched. None draws
        from the global RNG.

    Returns
    -------
    torch.nn.Sequential
        A float32 CPU model; ``model[1]`` is the attacked first linear layer.
    """
    if architecture not in VICTIMS:
        raise ValueError(
            f"unknown victim architecture {architecture!r}; available: {sorted(VICTIMS)}"
        )
    for name, value, minimum in (
        ("input_dim", input_dim, 1),
        ("width", width, 1),
        ("num_classes", num_classes, 2),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if depth is not None and (not isinstance(depth, int) or depth < 2):
        raise ValueError(f"depth must be an integer >= 2 (linear layers), got {depth!r}")
    builder = VICTIMS[architecture]
    if seed is None:
        model = builder(input_dim, width, num_classes, depth)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = builder(input_dim, width, num_classes, depth)
    return model.to(torch.float32)


def first_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The first ``nn.Linear`` layer with a bias: the layer SPEAR attacks.

    Returns
    -------
    tuple[str, nn.Linear]
        Its qualified name (the ``state_dict`` prefix, e.g. ``"1"`` for
        ``model[1].weight``) and the module itself.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            return name, module
    raise ValueError(f"{type(model).__name__} has no nn.Linear layer with a bias")


def _check_batch(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(inputs, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise ValueError("inputs and labels must be torch tensors")
    if inputs.dim() < 2 or inputs.shape[0] == 0:
        raise ValueError(
            f"inputs must be a non-empty batch (B, ...), got shape {tuple(inputs.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"labels must have shape ({inputs.shape[0]},) to match the inputs, got "
            f"{tuple(labels.shape)}"
        )
    if labels.is_floating_point():
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    _, layer = first_linear(model)
    n = inputs[0].numel()
    if n != layer.in_features:
        raise ValueError(
            f"inputs have {n} features per sample but the first linear layer expects "
            f"{layer.in_features}"
        )
    param = layer.weight
    return inputs.detach().to(device=param.device, dtype=param.dtype), labels.to(
        device=param.device, dtype=torch.int64
    )


def _loss_fn(loss: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; available: {sorted(LOSSES)}")
    return LOSSES[loss]


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
    loss_fn = _loss_fn(loss)
    x, y = _check_batch(model, inputs, labels)
    _, layer = first_linear(model)
    with torch.enable_grad():
        value = loss_fn(model(x), y)
        weight_grad, bias_grad = torch.autograd.grad(value, (layer.weight, layer.bias))
    return weight_grad.detach(), bias_grad.detach()


def output_gradient(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss: str = "ce"
) -> torch.Tensor:
    """The true ``dL/dZ`` ``(B, m)`` at the first linear layer's outputs, in float64.

    Ground truth for benchmarks and tests (what an oracle would know); the attack never sees it.
    The model is copied, so its parameters and ``.grad`` are left untouched.
    """
    model = copy.deepcopy(model).double()
    loss_fn = _loss_fn(loss)
    x, y = _check_batch(model, inputs, labels)
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


def fedavg_update(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    lr: float,
    epochs: int,
    mini_batch_size: int | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First-layer change after a client's local FedAvg training.

    The client runs ``epochs`` passes of plain SGD (no momentum or weight decay) with the
    mean cross-entropy loss on a deep copy of ``model``; the server observes only the
    weight difference.

    Parameters
    ----------
    model
        The global model sent to the client; not modified.
    inputs, labels
        The client's local data, ``(B, ...)`` and ``(B,)``.
    lr
        Learning rate.
    epochs
        Number of local epochs (>= 1).
    mini_batch_size
        Local mini-batch size; each epoch visits a fresh permutation of the data and keeps the
        last, smaller mini-batch. None trains on the full batch (no shuffling).
    seed
        Seeds the shuffling; None shuffles without a seed.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(W_E - W_0, b_E - b_0)`` of the first linear layer, float32 like the model.
    """
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if mini_batch_size is not None and (
        not isinstance(mini_batch_size, int) or mini_batch_size < 1
    ):
        raise ValueError(
            f"mini_batch_size must be a positive integer or None, got {mini_batch_size!r}"
        )
    x, y = _check_batch(model, inputs, labels)
    local = copy.deepcopy(model)
    _, layer = first_linear(local)
    weight_0, bias_0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    params = [p for p in local.parameters() if p.requires_grad]
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    batch = x.shape[0]
    step = batch if mini_batch_size is None else mini_batch_size
    with torch.enable_grad():
        for _ in range(epochs):
            if mini_batch_size is None:
                order = torch.arange(batch)
            else:
                order = torch.randperm(batch, generator=generator)
            for start in range(0, batch, step):
                idx = order[start : start + step].to(x.device)
                grads = torch.autograd.grad(_cross_entropy(local(x[idx]), y[idx]), params)
                # The same update as torch.optim.SGD(lr) without momentum, whose construction
                # alone costs seconds (it imports torch._dynamo).
                with torch.no_grad():
                    for param, g in zip(params, grads, strict=True):
                        param.add_(g, alpha=-lr)
    return (layer.weight.detach() - weight_0), (layer.bias.detach() - bias_0)


def fedsgd_update(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, lr: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """First-layer change after one full-batch SGD step (FedSGD sending weights).

    Equals ``-lr * client_gradient(...)`` up to the float32 rounding of ``W - lr * g - W``,
    which is what a server differencing weights really observes.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(W_new - W_old, b_new - b_old)`` of the first linear layer.
    """
    return fedavg_update(model, inputs, labels, lr=lr, epochs=1, mini_batch_size=None)


def _per_sample_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return _cross_entropy(logits, yi.unsqueeze(0))

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)


def dp_sgd_gradient(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first-layer DP-SGD gradient, with Opacus' semantics.

    Each sample's gradient of the cross-entropy loss w.r.t. *all* model parameters is clipped
    to total L2 norm ``max_grad_norm`` (factor ``min(1, C / (||g_i|| + 1e-6))`` as in Opacus),
    the clipped gradients are summed, Gaussian noise of std ``noise_multiplier * max_grad_norm``
    is added, and the result is divided by the batch size. Per-sample gradients use
    ``torch.func`` (``vmap`` over ``grad``).

    Parameters
    ----------
    model
        The victim network; not modified.
    inputs, labels
        ``(B, ...)`` inputs and ``(B,)`` labels.
    noise_multiplier
        Noise std relative to ``max_grad_norm`` (>= 0).
    max_grad_norm
        Per-sample clipping norm C (> 0).
    seed
        Seeds the noise (drawn only for the first layer, which is all that is returned;
        noise on other layers is independent and does not affect it). None draws unseeded
        noise.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        Noisy averaged clipped ``(dW, db)`` of shapes ``(m, n)`` and ``(m,)``.
    """
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    x, y = _check_batch(model, inputs, labels)
    name, layer = first_linear(model)
    prefix = f"{name}." if name else ""
    num_params = sum(p.numel() for p in model.parameters())
    # Per-sample gradients of the whole model take B * num_params floats; chunk the batch.
    chunk = max(1, _PER_SAMPLE_BUDGET // max(num_params, 1))
    weight_sum = torch.zeros_like(layer.weight, requires_grad=False)
    bias_sum = torch.zeros_like(layer.bias, requires_grad=False)
    for start in range(0, x.shape[0], chunk):
        per_sample = _per_sample_gradients(
            model, x[start : start + chunk], y[start : start + chunk]
        )
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()], dim=1)
        clip = (max_grad_norm / (norms.norm(dim=1) + 1e-6)).clamp(max=1.0)
        weight_sum += torch.einsum("b,b...->...", clip, per_sample[prefix + "weight"])
        bias_sum += torch.einsum("b,b...->...", clip, per_sample[prefix + "bias"])
    if noise_multiplier > 0:
        generator = torch.Generator(device=weight_sum.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        std = noise_multiplier * max_grad_norm
        weight_sum = weight_sum + std * torch.randn(
            weight_sum.shape, generator=generator, dtype=weight_sum.dtype, device=weight_sum.device
        )
        bias_sum = bias_sum + std * torch.randn(
            bias_sum.shape, generator=generator, dtype=bias_sum.dtype, device=bias_sum.device
        )
    batch = x.shape[0]
    return weight_sum / batch, bias_sum / batch


def median_abs_entry(weight_grad: torch.Tensor) -> float:
    """Median of the absolute values of all entries of a gradient.

    SPEAR++ (Table 3) and SPEAR (App. E.6) express the noise level relative to this value.
    """
    if not isinstance(weight_grad, torch.Tensor) or weight_grad.numel() == 0:
        raise ValueError("weight_grad must be a non-empty tensor")
    # numpy: torch.quantile refuses tensors with more than 2**24 entries.
    return float(np.median(weight_grad.detach().abs().to("cpu", torch.float64).numpy()))


def noisy_gradient(
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    *,
    sigma: float,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add i.i.d. Gaussian noise of std ``sigma`` to a first-layer gradient.

    Parameters
    ----------
    weight_grad, bias_grad
        ``(m, n)`` and ``(m,)`` gradients; not modified.
    sigma
        Noise std (>= 0), e.g. a multiple of :func:`median_abs_entry`.
    seed
        Seeds the noise; None draws unseeded noise.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        Noisy copies with the input dtypes.
    """
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if weight_grad.dim() != 2 or bias_grad.shape != (weight_grad.shape[0],):
        raise ValueError(
            f"expected weight_grad (m, n) and bias_grad (m,), got {tuple(weight_grad.shape)} "
            f"and {tuple(bias_grad.shape)}"
        )
    generator = torch.Generator(device=weight_grad.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    weight_noise = torch.randn(
        weight_grad.shape, generator=generator, dtype=weight_grad.dtype, device=weight_grad.device
    )
    bias_noise = torch.randn(
        bias_grad.shape, generator=generator, dtype=bias_grad.dtype, device=bias_grad.device
    )
    return weight_grad + sigma * weight_noise, bias_grad + sigma * bias_noise


# --------------------------------------------------------------------------- deeper layers


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` in registration (forward) order.

    Returns
    -------
    list[tuple[str, nn.Linear]]
        ``(qualified name, module)`` pairs; layer ``l`` of :func:`layer_gradient` is entry
        ``l - 1``.
    """
    return [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if not any(True for _ in module.children())
    ]


def _followed_by_relu(model: nn.Module, layer: nn.Linear) -> bool:
    leaves = _leaf_modules(model)
    for position, (_, module) in enumerate(leaves):
        if module is layer:
            return position + 1 < len(leaves) and isinstance(leaves[position + 1][1], nn.ReLU)
    return False


def relu_linear_layers(model: nn.Module) -> list[tuple[int, str, nn.Linear]]:
    """The linear layers whose output goes straight into a ReLU: the layers SPEAR can attack.

    A layer counts as followed by a ReLU when the next leaf module registered after it is an
    ``nn.ReLU``, which is how :func:`build_victim` (and any ``nn.Sequential`` MLP) is laid
    out. Layers without a bias are left out: the attack needs the bias gradient.

    Parameters
    ----------
    model
        The victim network.

    Returns
    -------
    list[tuple[int, str, nn.Linear]]
        ``(l, qualified name, module)`` with ``l`` the 1-based index among *all* linear
        layers, as :func:`layer_gradient` takes it. For the 6-layer SPEAR victim these are
        ``l = 1..5``; the output layer 6 is not followed by a ReLU.
    """
    return [
        (index, name, module)
        for index, (name, module) in enumerate(linear_layers(model), start=1)
        if module.bias is not None and _followed_by_relu(model, module)
    ]


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
    if not _followed_by_relu(model, module):
        raise ValueError(
            f"linear layer {layer} ({name!r}) is not followed by a ReLU"
            + (" (it is the output layer)" if layer == len(layers) else "")
            + f"; SPEAR needs a ReLU after the attacked layer. Attackable layers: {attackable}"
        )
    loss_fn = _loss_fn(loss)
    x, y = _check_batch(model, inputs, labels)
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
