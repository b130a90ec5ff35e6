"""What the honest-but-curious server observes of one trial, section by section.

A *trial* is one client batch and one freshly initialised victim, both drawn from the trial's
seed. Each section turns it into an :class:`Observation`: the attacked layer's update as an
:class:`fl_attack.types.ObservedUpdate`, the ground truth it hides (the layer's true inputs),
and facts about the update (noise level, local steps, ...) reported beside the attack.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from experiments.config import Setting
from experiments.dp_ceilings import ceiling_facts
from fl_attack.data.images import ImageData, sample_batch
from fl_attack.data.tabular import TabularData, sample_tabular_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import (
    LOSSES,
    build_victim,
    client_gradient,
    dp_sgd_gradient,
    fedavg_update,
    first_linear,
    layer_gradient,
    median_abs_entry,
    next_layer_gradient,
    noisy_gradient,
    output_gradient,
)
from fl_attack.types import ObservedUpdate

Data = ImageData | TabularData
Facts = dict[str, float]  # what an observation reports about its update (noise level, local steps, ...)
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Trial:
    """One client batch and the victim it is fed to, drawn from ``seed``."""

    index: int
    seed: int
    inputs: torch.Tensor
    labels: torch.Tensor
    model: nn.Module

    @property
    def reference(self) -> torch.Tensor:
        """The client's inputs as the first layer sees them: ``(b, n)`` float64."""
        return self.inputs.reshape(self.inputs.shape[0], -1).to(torch.float64)


@dataclass(frozen=True)
class Observation:
    """The attacked layer's update, the true inputs it hides, and facts about it."""

    update: ObservedUpdate
    reference: torch.Tensor
    facts: Facts = field(default_factory=dict)
    gradients: dict[str, torch.Tensor] | None = None
    """Every parameter's gradient (section ``full``), for the Inverting Gradients baseline."""
    local_steps: int = 1
    """Full-batch local steps of a FedAvg update ``W_E - W_0`` (1 otherwise), which the server
    configured and may give the attack (option ``known_local_steps``)."""
    next_weight_update: torch.Tensor | None = None
    """The gradient of the linear layer fed by the attacked layer's ReLU from the same step
    (section ``fedsgd``), which the server sees too and may give the attack (option ``next_layer``)."""


def draw_trial(data: Data, setting: Setting, *, index: int, seed: int) -> Trial:
    """Trial ``index``: a batch of ``setting.cell.batch_size`` samples and a fresh victim."""
    b = setting.cell.batch_size
    if isinstance(data, TabularData):
        inputs, labels, _ = sample_tabular_batch(data, batch_size=b, seed=seed)
    else:
        inputs, labels, _ = sample_batch(data, b, seed=seed)
    shape = {"input_dim": data.input_dim, "width": setting.cell.width, "num_classes": data.num_classes}
    model = build_victim(setting.architecture, **shape, depth=setting.depth, seed=seed)
    return Trial(index, seed, inputs, labels, model)


def first_layer_update(model: nn.Module, weight_grad: Tensor, bias_grad: Tensor) -> ObservedUpdate:
    """A first-layer update with the layer's parameters at which it was taken."""
    _, layer = first_linear(model)
    return ObservedUpdate.from_arrays(
        weight_grad, bias_grad, weight=layer.weight, bias=layer.bias, device=_CPU
    )


def _fedsgd(setting: Setting, trial: Trial, data: Data) -> Observation:
    weight_grad, bias_grad = client_gradient(trial.model, trial.inputs, trial.labels)
    following = next_layer_gradient(trial.model, trial.inputs, trial.labels)
    update = first_layer_update(trial.model, weight_grad, bias_grad)
    return Observation(update, trial.reference, next_weight_update=following)


def _full(setting: Setting, trial: Trial, data: Data) -> Observation:
    """The gradients of every parameter from one backward pass; the first layer's is attacked."""
    named = list(trial.model.named_parameters())
    with torch.enable_grad():
        loss = LOSSES["ce"](trial.model(trial.inputs), trial.labels)
        grads = torch.autograd.grad(loss, [parameter for _, parameter in named])
    gradients = {name: grad.detach() for (name, _), grad in zip(named, grads, strict=True)}
    prefix, _ = first_linear(trial.model)
    update = first_layer_update(trial.model, gradients[f"{prefix}.weight"], gradients[f"{prefix}.bias"])
    return Observation(update, trial.reference, gradients=gradients)


def oracle_quality(trial: Trial, weight_grad: Tensor, data: ImageData, *, threshold_db: float) -> Facts:
    """The best linear recovery from a noisy gradient by someone who knows the true ``dL/dZ``.

    With ``D = dL/dZ`` the least-squares inputs ``(D D^T)^{-1} D G`` are the maximum-likelihood
    estimate under Gaussian noise on ``G``: no attack that must also estimate ``D`` can expect
    more without a prior on the inputs (it also knows each sample's scale, which the update fixes
    only through the noisy bias gradient; see :mod:`experiments.dp_ceilings`).
    """
    d = output_gradient(trial.model, trial.inputs, trial.labels)
    inputs = torch.linalg.solve(d @ d.T, d @ weight_grad.double())
    quality = evaluate_reconstruction(
        inputs, trial.reference, denormalize=data.denormalize, image_shape=data.image_shape
    )
    return {"oracle_mean_psnr": quality.mean_psnr, "oracle_success": float(quality.mean_psnr > threshold_db)}


def _dp(setting: Setting, trial: Trial, data: Data) -> Observation:
    """FedSGD gradient plus Gaussian noise of std ``noise_factor x median |dL/dW|``."""
    if not isinstance(data, ImageData):
        raise ValueError("the dp section needs image data (its oracle scores PSNR)")
    weight_grad, bias_grad = client_gradient(trial.model, trial.inputs, trial.labels)
    median = median_abs_entry(weight_grad)
    sigma = setting.params["noise_factor"] * median
    noisy_w, noisy_b = noisy_gradient(weight_grad, bias_grad, sigma=sigma, seed=trial.seed)
    facts = {"median_abs": median, "sigma": sigma}
    facts |= oracle_quality(trial, noisy_w, data, threshold_db=setting.threshold_db)
    if sigma > 0:
        columns = output_gradient(trial.model, trial.inputs, trial.labels)
        update = {"weight_grad": noisy_w, "bias_grad": noisy_b, "reference": trial.reference}
        facts |= ceiling_facts(columns=columns, **update, sigma=sigma, data=data)
    return Observation(first_layer_update(trial.model, noisy_w, noisy_b), trial.reference, facts)


def _dpsgd(setting: Setting, trial: Trial, data: Data) -> Observation:
    """DP-SGD: per-sample clipping to C, noise of std ``noise_factor x median |clipped dL/dW|``."""
    clip, factor = setting.params["clip_norm"], setting.params["noise_factor"]
    weight_grad, bias_grad = dp_sgd_gradient(
        trial.model, trial.inputs, trial.labels, noise_multiplier=0.0, max_grad_norm=clip
    )
    median = median_abs_entry(weight_grad)
    sigma = factor * median
    # dp_sgd_gradient adds noise of std noise_multiplier * C to the sum, then divides by b.
    multiplier = sigma * trial.inputs.shape[0] / clip
    if factor > 0:
        noisy = {"noise_multiplier": multiplier, "max_grad_norm": clip, "seed": trial.seed}
        weight_grad, bias_grad = dp_sgd_gradient(trial.model, trial.inputs, trial.labels, **noisy)
    facts = {"median_abs": median, "sigma": sigma, "noise_multiplier": multiplier}
    return Observation(first_layer_update(trial.model, weight_grad, bias_grad), trial.reference, facts)


def _fedavg(setting: Setting, trial: Trial, data: Data) -> Observation:
    """FedAvg update ``W_E - W_0``; a mini-batch of at least b is one full batch."""
    epochs, mini_batch = setting.params["epochs"], setting.params["mini_batch_size"]
    b = trial.inputs.shape[0]
    local = {
        "lr": setting.params["lr"],
        "epochs": epochs,
        "mini_batch_size": None if mini_batch >= b else mini_batch,
    }
    weight_delta, bias_delta = fedavg_update(
        trial.model, trial.inputs, trial.labels, **local, seed=trial.seed
    )
    facts = {"local_steps": float(epochs * math.ceil(b / mini_batch))}
    update = first_layer_update(trial.model, weight_delta, bias_delta)
    full_batch_steps = epochs if mini_batch >= b else 1  # mini-batches: each sample's first step is later
    return Observation(update, trial.reference, facts, local_steps=full_batch_steps)


def _secagg(setting: Setting, trial: Trial, data: Data) -> Observation:
    """The sum of k clients' FedSGD gradients on the same model (the trial's batch split in k)."""
    size = setting.params["client_batch"]
    parts = [
        client_gradient(
            trial.model, trial.inputs[c * size : (c + 1) * size], trial.labels[c * size : (c + 1) * size]
        )
        for c in range(setting.params["clients"])
    ]
    weight_sum, bias_sum = parts[0]
    for weight_grad, bias_grad in parts[1:]:  # in client order, as a secure-aggregation sum
        weight_sum, bias_sum = weight_sum + weight_grad, bias_sum + bias_grad
    return Observation(first_layer_update(trial.model, weight_sum, bias_sum), trial.reference)


def input_similarity(inputs: torch.Tensor) -> float:
    """Mean pairwise cosine similarity of a batch's rows (1 = all inputs alike)."""
    x = inputs.to(torch.float64)
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
    gram = unit @ unit.T
    b = gram.shape[0]
    return float((gram.sum() - gram.diagonal().sum()) / max(b * (b - 1), 1))


def _layer(setting: Setting, trial: Trial, data: Data) -> Observation:
    """The gradient of linear layer ``layer``; its true inputs are the previous ReLU's outputs."""
    observed = layer_gradient(trial.model, trial.inputs, trial.labels, layer=setting.params["layer"])
    update = ObservedUpdate.from_arrays(
        observed.weight_grad, observed.bias_grad, weight=observed.weight, bias=observed.bias, device=_CPU
    )
    reference = observed.inputs.to(torch.float64)
    return Observation(update, reference, {"input_similarity": input_similarity(reference)})


OBSERVERS: dict[str, Callable[[Setting, Trial, Data], Observation]] = {
    "fedsgd": _fedsgd,
    "full": _full,
    "dp": _dp,
    "dpsgd": _dpsgd,
    "fedavg": _fedavg,
    "fedavg-grid": _fedavg,
    "lr-grid": _fedavg,
    "secagg": _secagg,
    "layer": _layer,
}
"""How each section turns a trial into what the server observes."""

FACTS: dict[str, tuple[str, ...]] = {
    "dp": (
        "median_abs",
        "sigma",
        "oracle_mean_psnr",
        "oracle_success",
        "oracle_denoised_mean_psnr",
        "bias_scale_mean_psnr",
        "bias_scale_denoised_mean_psnr",
    ),
    "dpsgd": ("median_abs", "sigma", "noise_multiplier"),
    "fedavg": ("local_steps",),
    "fedavg-grid": ("local_steps",),
    "lr-grid": ("local_steps",),
    "layer": ("input_similarity",),
}
"""The facts each section reports about its updates."""


def observe(setting: Setting, trial: Trial, data: Data) -> Observation:
    """What the server observes of ``trial`` under ``setting``.

    Raises
    ------
    ValueError
        When the update cannot be formed (e.g. a layer not followed by a ReLU, or an all-zero
        gradient).
    """
    return OBSERVERS[setting.section](setting, trial, data)
