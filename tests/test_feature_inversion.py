"""Inputs back from recovered features (fl_attack.attacks.feature_inversion, head_gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_attack.attacks.feature_inversion import invert_features_to_inputs, prefix_gradient_misfit
from fl_attack.attacks.head_gradients import feature_gradients_from_head

SHAPE = (3, 8, 8)


def smooth_prefix_batch(
    batch_size: int,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A strided conv + tanh prefix, a batch of 8x8 images, its features, dL_i/df_i and the prefix gradient.

    36 features per 192-pixel image: the features alone leave most of each image free, and the
    prefix's 112 gradient entries pin more of it.
    """
    torch.manual_seed(0)
    prefix = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(), nn.Flatten())
    images = torch.rand(batch_size, *SHAPE)
    features = prefix(images)
    head = nn.Linear(features.shape[1], 3)
    labels = torch.arange(batch_size) % 3
    detached = features.detach().requires_grad_(True)
    (feature_grads,) = torch.autograd.grad(F.cross_entropy(head(detached), labels, reduction="sum"), detached)
    observed = torch.autograd.grad(F.cross_entropy(head(prefix(images)), labels), list(prefix.parameters()))
    return prefix, images, features.detach(), feature_grads, list(observed)


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).square().mean().sqrt())


def test_gradient_term_brings_the_inputs_closer_than_features_alone() -> None:
    torch.set_num_threads(1)
    prefix, images, features, feature_grads, observed = smooth_prefix_batch(2)
    settings = {"prefix": prefix, "features": features, "input_shape": SHAPE, "tv_weight": 0.0, "steps": 250}
    alone = invert_features_to_inputs(**settings, device="cpu")  # type: ignore[arg-type]
    joint = invert_features_to_inputs(
        **settings,  # type: ignore[arg-type]
        feature_grads=feature_grads,
        observed_prefix_grads=observed,
        device="cpu",
    )
    assert alone.gradient_error is None
    assert float(alone.feature_error.max()) < 1e-3  # the features alone are matched...
    assert rmse(alone.inputs, images) > 0.25  # ...by images far from the truth (measured 0.273)
    assert joint.gradient_error is not None and joint.gradient_error < 0.1
    assert rmse(joint.inputs, images) < 0.9 * rmse(alone.inputs, images)  # measured 0.227: 17% lower
    assert (
        joint.inputs.shape == images.shape
        and float(joint.inputs.min()) >= 0
        and float(joint.inputs.max()) <= 1
    )


def test_true_inputs_explain_the_observed_prefix_gradient() -> None:
    prefix, images, _, feature_grads, observed = smooth_prefix_batch(3)
    misfit = prefix_gradient_misfit(
        parameters=list(prefix.parameters()),
        features=prefix(images),
        feature_grads=feature_grads,
        observed=observed,
        create_graph=False,
    )
    assert float(misfit) < 1e-10
    wrong = prefix_gradient_misfit(
        parameters=list(prefix.parameters()),
        features=prefix(images.flip(0)),
        feature_grads=feature_grads,
        observed=observed,
        create_graph=False,
    )
    assert float(wrong) > 1e-2


def test_warm_start_and_box() -> None:
    prefix, images, features, _, _ = smooth_prefix_batch(2)
    fitted = invert_features_to_inputs(
        prefix=prefix, features=features, input_shape=SHAPE, init=images, steps=1, lr=1e-6, device="cpu"
    )
    assert rmse(fitted.inputs, images) < 1e-5  # starts from init, one tiny step
    boxed = invert_features_to_inputs(
        prefix=prefix,
        features=features,
        input_shape=SHAPE,
        lower=0.25,
        upper=torch.tensor([0.5, 0.6, 0.7]).view(3, 1, 1),
        steps=20,
        device="cpu",
    )
    assert float(boxed.inputs.min()) >= 0.25
    assert float(boxed.inputs[:, 0].max()) <= 0.5 and float(boxed.inputs[:, 2].max()) <= 0.7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"features": torch.ones(2, 35)}, r"features of shape \(2, 36\), but features has shape \(2, 35\)"),
        ({"features": torch.full((2, 36), float("nan"))}, "features contains 72 NaN or Inf entries"),
        ({"features": torch.ones(36)}, r"features must be a non-empty \(B, n\) array"),
        ({"feature_grads": torch.ones(2, 36)}, "needs both observed_prefix_grads"),
        (
            {"feature_grads": torch.ones(3, 36), "observed_prefix_grads": "GRADS"},
            r"feature_grads has shape \(3, 36\)",
        ),
        (
            {"feature_grads": torch.full((2, 36), float("inf")), "observed_prefix_grads": "GRADS"},
            "feature_grads contains 72 NaN or Inf entries",
        ),
        (
            {"feature_grads": "GRADS_PER_SAMPLE", "observed_prefix_grads": "SHORT"},
            "got 1 gradients but the model has 2",
        ),
        ({"lower": 1.0, "upper": 1.0}, "upper must exceed lower everywhere"),
        ({"lower": torch.zeros(2, 1, 1)}, r"lower of shape \(2, 1, 1\) does not broadcast"),
        ({"init": torch.zeros(1, *SHAPE)}, r"init has shape \(1, 3, 8, 8\)"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"tv_weight": -1.0}, "tv_weight must be a finite non-negative number"),
        ({"feature_weight": 0.0, "tv_weight": 0.0}, "nothing to fit"),
    ],
)
def test_bad_input_is_named(change: dict[str, object], message: str) -> None:
    prefix, _, features, feature_grads, observed = smooth_prefix_batch(2)
    replacements = {"GRADS": observed, "GRADS_PER_SAMPLE": feature_grads, "SHORT": observed[:1]}
    arguments: dict[str, object] = {"prefix": prefix, "features": features, "input_shape": SHAPE, "steps": 2}
    arguments.update(
        {key: replacements[value] if isinstance(value, str) else value for key, value in change.items()}
    )
    with pytest.raises(ValueError, match=message):
        invert_features_to_inputs(**arguments, device="cpu")  # type: ignore[arg-type]


def head_batch(batch_size: int) -> tuple[nn.Linear, nn.Sequential, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear layer with a two-layer head, a batch of its inputs, labels and the layer's mean gradient."""
    torch.manual_seed(1)
    layer = nn.Linear(30, 20).double()
    head = nn.Sequential(nn.ReLU(), nn.Linear(20, 15), nn.ReLU(), nn.Linear(15, 5)).double()
    features = torch.rand(batch_size, 30, dtype=torch.float64)
    labels = torch.tensor([3, 0, 4, 1, 1, 2][:batch_size])
    loss = F.cross_entropy(head(layer(features)), labels)
    (weight_grad,) = torch.autograd.grad(loss, [layer.weight])
    return layer, head, features, labels, weight_grad


def test_labels_and_feature_gradients_come_from_the_layer_update() -> None:
    layer, head, features, labels, weight_grad = head_batch(6)
    known = [0, 2, 5]  # only half of the batch recovered
    result = feature_gradients_from_head(
        features=features[known],
        weight=layer.weight.detach(),
        bias=layer.bias.detach(),
        head=head,
        observed_weight_grad=weight_grad * 0.1,  # any positive multiple, e.g. the update / lr
        batch_size=6,
    )
    assert result.labels.tolist() == labels[known].tolist()
    own = features[known].clone().requires_grad_(True)
    loss = F.cross_entropy(head(layer(own)), labels[known], reduction="sum")
    (expected,) = torch.autograd.grad(loss, [own])
    torch.testing.assert_close(result.feature_grads, expected, rtol=1e-10, atol=1e-12)
    assert float(result.residuals.max()) < 1e-8 and float(result.runner_up.min()) > 1e-2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"features": torch.ones(2, 29, dtype=torch.float64)}, r"features must be \(k, 30\)"),
        ({"bias": torch.ones(19, dtype=torch.float64)}, r"bias must have shape \(20,\)"),
        (
            {"observed_weight_grad": torch.ones(30, 20)},
            r"observed_weight_grad must have weight's shape \(20, 30\)",
        ),
        (
            {"observed_weight_grad": torch.full((20, 30), float("nan"))},
            "observed_weight_grad contains 600 NaN",
        ),
        ({"batch_size": 0}, r"batch_size must be an integer in \[1, 20\]"),
        ({"head": nn.Linear(20, 1).double()}, r"head must map \(2, 20\) outputs to \(2, C >= 2\) logits"),
    ],
)
def test_head_gradients_name_bad_input(change: dict[str, object], message: str) -> None:
    layer, head, features, _, weight_grad = head_batch(2)
    arguments: dict[str, object] = {
        "features": features,
        "weight": layer.weight.detach(),
        "bias": layer.bias.detach(),
        "head": head,
        "observed_weight_grad": weight_grad,
        "batch_size": 2,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        feature_gradients_from_head(**arguments)  # type: ignore[arg-type]
