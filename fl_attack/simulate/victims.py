"""The first-layer updates that clients of the SPEAR victim networks send.

What the server observes for the attacked layer, computed exactly as an honest client would
in float32, under FedSGD, FedAvg, DP-SGD and additive noise. The networks themselves and the
exact gradients live in :mod:`fl_attack.simulate.models` and :mod:`fl_attack.simulate.gradients`;
this module re-exports them, so ``fl_attack.simulate.victims`` names everything a benchmark
needs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .gradients import (
    LOSSES,
    LayerGradient,
    check_batch,
    client_gradient,
    layer_gradient,
    next_layer_gradient,
    output_gradient,
)
from .local_sgd import sgd_steps
from .models import (
    VICTIMS,
    build_victim,
    first_linear,
    linear_layers,
    relu_linear_layers,
    spear_mlp,
    spear_plus_plus_mlp,
)

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
    "next_layer_gradient",
    "noisy_gradient",
    "output_gradient",
    "relu_linear_layers",
    "spear_mlp",
    "spear_plus_plus_mlp",
]

_PER_SAMPLE_BUDGET = 1 << 26  # floats of per-sample gradients held at once by dp_sgd_gradient


def _epoch_batches(
    x: torch.Tensor, epochs: int, mini_batch_size: int | None, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Index batches of ``epochs`` passes over ``x``: fresh permutations, or the full batch in order."""
    batch = x.shape[0]
    step = batch if mini_batch_size is None else mini_batch_size
    for _ in range(epochs):
        order = torch.arange(batch) if mini_batch_size is None else torch.randperm(batch, generator=generator)
        for start in range(0, batch, step):
            yield order[start : start + step].to(x.device)


def fedavg_update(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    lr: float,
    epochs: int,
    mini_batch_size: int | None = None,
    seed: int | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First-layer change after a client's local FedAvg training.

    The client runs ``epochs`` passes of SGD (as ``torch.optim.SGD`` with ``momentum`` and
    ``weight_decay``; plain SGD by default) with the mean cross-entropy loss on a deep copy of
    ``model``; the server observes only the weight difference.

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
    momentum, weight_decay
        The optimizer's momentum factor in ``[0, 1)`` and L2 penalty ``>= 0``.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(W_E - W_0, b_E - b_0)`` of the first linear layer, float32 like the model.
    """
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if mini_batch_size is not None and (not isinstance(mini_batch_size, int) or mini_batch_size < 1):
        raise ValueError(f"mini_batch_size must be a positive integer or None, got {mini_batch_size!r}")
    x, y = check_batch(model, inputs, labels)
    local = copy.deepcopy(model)
    _, layer = first_linear(local)
    weight_0, bias_0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    batches = _epoch_batches(x, epochs, mini_batch_size, generator)
    sgd_steps(local, x, y, batches=batches, lr=lr, momentum=momentum, weight_decay=weight_decay)
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


def _per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return LOSSES["ce"](logits, yi.unsqueeze(0))

    per_sample: dict[str, torch.Tensor] = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    return per_sample


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
    x, y = check_batch(model, inputs, labels)
    name, layer = first_linear(model)
    prefix = f"{name}." if name else ""
    num_params = sum(p.numel() for p in model.parameters())
    # Per-sample gradients of the whole model take B * num_params floats; chunk the batch.
    chunk = max(1, _PER_SAMPLE_BUDGET // max(num_params, 1))
    weight_sum = torch.zeros_like(layer.weight, requires_grad=False)
    bias_sum = torch.zeros_like(layer.bias, requires_grad=False)
    for start in range(0, x.shape[0], chunk):
        per_sample = _per_sample_gradients(model, x[start : start + chunk], y[start : start + chunk])
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
