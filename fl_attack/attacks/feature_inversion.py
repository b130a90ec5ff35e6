"""Inputs back from a layer's recovered inputs, through the known layers before it.

When the attacked linear layer follows other layers (a CNN's ``fc1`` after its convolutions),
the exact attack recovers that layer's inputs, the *features* ``f_i = prefix(x_i)``, not the
client's inputs ``x_i``. The server knows the prefix (the global weights it sent) and, in
FedSGD, also the prefix's own update: ``-lr`` times the batch-mean gradient of the prefix's
parameters. Each sample's share of that gradient is the vector-Jacobian product of the prefix
at ``x_i`` with ``g_i = dL_i/df_i``, the gradient of the sample's loss at its features
(:func:`fl_attack.attacks.head_gradients.feature_gradients_from_head` recovers it from the
features and the attacked layer's update). :func:`invert_features_to_inputs` looks for inputs
that explain both, by projected Adam on

    mean_i ||prefix(x_i) - f_i||^2 / ||f_i||^2
    + gradient_weight * mean_p ||G_p(x) - O_p||^2 / ||O_p||^2
    + tv_weight * TV(x)

where ``G_p(x) = (1/B) sum_i VJP_p(x_i, g_i)`` is the batch-mean gradient of parameter ``p`` the
candidate inputs would produce, ``O_p`` the observed one, and TV the mean absolute difference of
neighbouring pixels, with the inputs kept in the data's box. The result is an approximation:
nothing here is exact, and the returned residuals say how well the inputs explain what was seen.
Through ReLU and max-pooling the gradient term depends on which units are active and which
pooled position wins, and these move with the inputs: there it is hard to optimise, and a
features-only fit refined with it (``init``, a small ``lr``) is the safer use
(``examples/quickstart_cnn/README.md`` measures what it buys on a CNN).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fl_attack.attacks.inverting_gradients_inputs import GradientsLike, gradient_list
from fl_attack.types import ArrayLike
from fl_attack.validation import resolve_device

__all__ = ["FeatureInversion", "invert_features_to_inputs", "prefix_gradient_misfit"]


@dataclass(frozen=True)
class FeatureInversion:
    """Inputs fitted to recovered features (and, optionally, to the prefix's observed gradient).

    Attributes
    ----------
    inputs
        ``(B, *input_shape)`` float32 CPU tensor in the prefix's input space, inside ``[lower, upper]``.
    feature_error
        ``(B,)`` float64: ``||prefix(x_i) - f_i|| / ||f_i||`` of the returned inputs.
    gradient_error
        ``||G(x) - O|| / ||O||`` over all prefix parameters together (see the module docstring)
        for the returned inputs, or None when no gradient was given.
    steps
        Adam steps taken.
    seconds
        Wall-clock time of the fit.
    device
        Where the fit ran (``cpu`` or ``cuda:N``).
    """

    inputs: torch.Tensor
    feature_error: torch.Tensor
    gradient_error: float | None
    steps: int
    seconds: float
    device: str


def _finite(value: ArrayLike, *, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.is_complex() or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
    tensor = value.detach().to(device=device, dtype=torch.float32)
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ValueError(f"{name} contains {bad} NaN or Inf entries")
    return tensor


def _box(
    value: float | ArrayLike, *, name: str, input_shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    tensor = _finite(
        torch.as_tensor(value) if isinstance(value, (int, float)) else value, name=name, device=device
    )
    try:
        return torch.broadcast_to(tensor, input_shape).clone()
    except RuntimeError as error:
        raise ValueError(
            f"{name} of shape {tuple(tensor.shape)} does not broadcast to the input shape {input_shape}"
        ) from error


def _check_settings(*, steps: int, lr: float, weights: Mapping[str, float]) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    for name, value in weights.items():
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{name} must be a finite non-negative number, got {value}")


def prefix_gradient_misfit(
    *,
    parameters: Sequence[torch.Tensor],
    features: torch.Tensor,
    feature_grads: torch.Tensor,
    observed: Sequence[torch.Tensor],
    create_graph: bool,
) -> torch.Tensor:
    """Relative squared misfit of the prefix gradient that ``features`` imply, averaged over parameters.

    Parameters
    ----------
    parameters
        The prefix's parameters (requiring grad), in the order of ``observed``.
    features
        ``(B, n)`` prefix outputs of the candidate inputs, in the autograd graph.
    feature_grads
        ``(B, n)`` per-sample ``dL_i/df_i``.
    observed
        The observed batch-mean gradient of each parameter.
    create_graph
        Keep the graph so that the misfit can be differentiated w.r.t. the inputs.

    Returns
    -------
    torch.Tensor
        Scalar ``mean_p ||G_p - O_p||^2 / ||O_p||^2`` with ``G_p = (1/B) sum_i VJP_p(x_i, g_i)``.
    """
    pairing = (features * feature_grads).sum() / features.shape[0]
    implied = torch.autograd.grad(pairing, list(parameters), create_graph=create_graph, allow_unused=True)
    terms = []
    for grad, target in zip(implied, observed, strict=True):
        value = torch.zeros_like(target) if grad is None else grad
        terms.append((value - target).square().sum() / target.square().sum().clamp_min(1e-30))
    return torch.stack(terms).mean()


def _total_variation(unit: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbours along the last two axes (images) or the last one."""
    if unit.dim() >= 3:
        return (unit[..., 1:, :] - unit[..., :-1, :]).abs().mean() + (
            unit[..., :, 1:] - unit[..., :, :-1]
        ).abs().mean()
    return (unit[..., 1:] - unit[..., :-1]).abs().mean()


def _observed_gradients(
    observed_prefix_grads: GradientsLike | None,
    feature_grads: ArrayLike | None,
    *,
    prefix: nn.Module,
    features: torch.Tensor,
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    if observed_prefix_grads is None and feature_grads is None:
        return None
    if observed_prefix_grads is None or feature_grads is None:
        raise ValueError(
            "the gradient term needs both observed_prefix_grads (the prefix's batch-mean gradient) and "
            "feature_grads (dL_i/df_i per sample); got only "
            + ("feature_grads" if observed_prefix_grads is None else "observed_prefix_grads")
        )
    grads = _finite(feature_grads, name="feature_grads", device=device)
    if grads.shape != features.shape:
        raise ValueError(
            f"feature_grads has shape {tuple(grads.shape)} but features has shape {tuple(features.shape)}"
        )
    named = [(name, param) for name, param in prefix.named_parameters()]
    if not named:
        raise ValueError("the prefix has no parameters, so it has no gradient to match")
    observed = gradient_list(observed_prefix_grads, named, device=device, dtype=torch.float32)
    return observed, grads


def invert_features_to_inputs(
    *,
    prefix: nn.Module,
    features: ArrayLike,
    input_shape: Sequence[int],
    feature_grads: ArrayLike | None = None,
    observed_prefix_grads: GradientsLike | None = None,
    lower: float | ArrayLike = 0.0,
    upper: float | ArrayLike = 1.0,
    gradient_weight: float = 1.0,
    feature_weight: float = 1.0,
    tv_weight: float = 0.05,
    steps: int = 2000,
    lr: float = 0.01,
    seed: int = 0,
    init: ArrayLike | None = None,
    device: str | torch.device = "auto",
) -> FeatureInversion:
    """Inputs whose prefix features match ``features`` (and whose prefix gradient matches the observed one).

    Parameters
    ----------
    prefix
        The layers before the attacked one, with the weights the client received, mapping a
        ``(B, *input_shape)`` batch to ``(B, n)`` features (flattened). It is copied, never changed;
        it is used in its current train/eval mode.
    features
        ``(B, n)`` recovered inputs of the attacked layer, one row per sample.
    input_shape
        One input's shape, e.g. ``(3, 32, 32)``.
    feature_grads
        ``(B, n)`` per-sample ``dL_i/df_i`` (the gradient of sample ``i``'s own loss at its
        features), or None to fit the features alone.
    observed_prefix_grads
        The prefix's observed batch-mean gradient, one tensor per parameter (a sequence in
        ``prefix.parameters()`` order or a mapping by name); in FedSGD ``-(new - old) / lr``.
        It must come from exactly the samples in ``features``. Given iff ``feature_grads`` is.
    lower, upper
        The box of valid inputs in the prefix's input space (scalars or broadcastable to
        ``input_shape``), e.g. ``(0 - mean) / std`` and ``(1 - mean) / std`` per channel.
    gradient_weight, feature_weight, tv_weight
        Weights of the gradient, feature and total-variation terms (non-negative). The total
        variation is measured on the inputs rescaled to the unit box.
    steps, lr
        Adam steps and learning rate (on the unit-box scale, cosine-decayed to zero).
    seed
        Seeds the initial inputs (the box's middle plus 1% of the box's width as Gaussian noise).
    init
        ``(B, *input_shape)`` initial inputs instead (clipped to the box), e.g. a features-only
        fit to refine with the gradient term.
    device
        ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:N]"``.

    Returns
    -------
    FeatureInversion
        The fitted inputs and how well they explain the features and the gradient.

    Raises
    ------
    ValueError
        On features that are not a finite ``(B, n)`` array, a prefix whose output does not have
        ``n`` features, a ``feature_grads`` or gradient of the wrong shape or with NaN/Inf, only
        one of the two gradient arguments, an empty box, an ``init`` of the wrong shape, bad
        settings, or weights that leave nothing to fit.
    """
    started = time.perf_counter()
    _check_settings(
        steps=steps,
        lr=lr,
        weights={
            "gradient_weight": gradient_weight,
            "feature_weight": feature_weight,
            "tv_weight": tv_weight,
        },
    )
    place = resolve_device(device)
    target = _finite(features, name="features", device=place)
    if target.dim() != 2 or target.shape[0] < 1 or target.shape[1] < 1:
        raise ValueError(f"features must be a non-empty (B, n) array, got shape {tuple(target.shape)}")
    shape = tuple(int(size) for size in input_shape)
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"input_shape must be non-empty positive sizes, got {tuple(input_shape)}")
    low = _box(lower, name="lower", input_shape=shape, device=place)
    high = _box(upper, name="upper", input_shape=shape, device=place)
    if not bool((high > low).all()):
        raise ValueError("upper must exceed lower everywhere: the box of valid inputs is empty")
    network = copy.deepcopy(prefix).to(device=place, dtype=torch.float32)
    gradients = _observed_gradients(
        observed_prefix_grads, feature_grads, prefix=network, features=target, device=place
    )
    if feature_weight == 0 and tv_weight == 0 and (gradients is None or gradient_weight == 0):
        raise ValueError("nothing to fit: feature_weight and tv_weight are 0 and no gradient term is used")
    parameters = [param for _, param in network.named_parameters()]
    for param in parameters:
        param.requires_grad_(gradients is not None)
    if init is None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        start = (0.5 + 0.01 * torch.randn((target.shape[0], *shape), generator=generator)).to(place)
    else:
        start = _finite(init, name="init", device=place)
        if start.shape != (target.shape[0], *shape):
            raise ValueError(
                f"init has shape {tuple(start.shape)} but {target.shape[0]} inputs of shape {shape} are fitted"
            )
        start = (start - low) / (high - low)
    unit = start.clamp(0.0, 1.0).requires_grad_(True)
    with torch.no_grad():
        produced = network(low + (high - low) * unit)
    if produced.dim() != 2 or produced.shape != target.shape:
        raise ValueError(
            f"the prefix maps {target.shape[0]} inputs of shape {shape} to features of shape "
            f"{tuple(produced.shape)}, but features has shape {tuple(target.shape)}"
        )
    scale = target.square().sum(dim=1).clamp_min(1e-30)
    optimizer = torch.optim.Adam([unit], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    for _ in range(steps):
        optimizer.zero_grad()
        inputs = low + (high - low) * unit
        fitted = network(inputs)
        loss = feature_weight * ((fitted - target).square().sum(dim=1) / scale).mean()
        if gradients is not None and gradient_weight > 0:
            observed, grads = gradients
            misfit = prefix_gradient_misfit(
                parameters=parameters,
                features=fitted,
                feature_grads=grads,
                observed=observed,
                create_graph=True,
            )
            loss = loss + gradient_weight * misfit
        if tv_weight > 0:
            loss = loss + tv_weight * _total_variation(unit)
        (gradient_of_unit,) = torch.autograd.grad(loss, [unit])
        unit.grad = gradient_of_unit
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            unit.clamp_(0.0, 1.0)
    final = (low + (high - low) * unit).detach()
    fitted = network(final)
    feature_error = ((fitted - target).norm(dim=1) / scale.sqrt()).detach().double().cpu()
    gradient_error = None
    if gradients is not None:
        observed, grads = gradients
        pairing = (fitted * grads).sum() / fitted.shape[0]
        implied = torch.autograd.grad(pairing, parameters, allow_unused=True)
        residual = sum(
            float((o if g is None else g - o).square().sum()) for g, o in zip(implied, observed, strict=True)
        )
        gradient_error = (residual / sum(float(o.square().sum()) for o in observed)) ** 0.5
    return FeatureInversion(
        inputs=final.float().cpu(),
        feature_error=feature_error,
        gradient_error=gradient_error,
        steps=steps,
        seconds=time.perf_counter() - started,
        device=str(place),
    )
