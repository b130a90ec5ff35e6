"""The optimization-based baseline (Geiping et al. 2020, "Inverting Gradients").

A small SPEAR++ victim on a few scikit-learn digits (8x8 gray, offline): the attack must lower
its gradient-matching loss far below the random start's and end much closer to the true images
than a random batch; bad input must be refused with a message naming the problem.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fl_attack import InvertingGradients, Reconstruction
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.simulate.victims import LOSSES, build_victim


@functools.cache
def _digits() -> ImageData:
    return load_dataset("digits", split="all")


@dataclass(frozen=True)
class Case:
    data: ImageData
    model: torch.nn.Sequential
    images: torch.Tensor
    labels: torch.Tensor
    gradients: tuple[torch.Tensor, ...]

    @property
    def flat(self) -> torch.Tensor:
        return self.images.reshape(self.images.shape[0], -1)

    @property
    def named(self) -> dict[str, torch.Tensor]:
        names = [name for name, _ in self.model.named_parameters()]
        return dict(zip(names, self.gradients, strict=True))

    def invert(self, attack: InvertingGradients, **overrides: object) -> Reconstruction:
        kwargs: dict[str, object] = {
            "model": self.model,
            "labels": self.labels,
            "input_shape": self.data.image_shape,
            "data_mean": self.data.mean,
            "data_std": self.data.std,
        }
        kwargs.update(overrides)
        gradients = kwargs.pop("gradients", self.gradients)
        return attack.invert(gradients, **kwargs)  # type: ignore[arg-type]

    def psnr(self, flat: torch.Tensor) -> float:
        return evaluate_reconstruction(flat, self.flat, denormalize=self.data.denormalize).mean_psnr


@functools.cache
def _case(batch: int = 3, width: int = 32, seed: int = 0) -> Case:
    data = _digits()
    images, labels, _ = sample_batch(data, batch, seed=seed)
    model = build_victim("spear++", input_dim=data.input_dim, width=width, num_classes=10, seed=seed)
    loss = LOSSES["ce"](model(images), labels)
    gradients = tuple(g.detach() for g in torch.autograd.grad(loss, list(model.parameters())))
    return Case(data, model, images, labels, gradients)


def _fast(**kwargs: object) -> InvertingGradients:
    settings: dict[str, object] = {"iterations": 300, "tv_weight": 0.0, "seed": 0, "device": "cpu"}
    settings.update(kwargs)
    return InvertingGradients(**settings)  # type: ignore[arg-type]


@functools.cache
def _reconstruction() -> Reconstruction:
    return _case().invert(_fast())


# --------------------------------------------------------------------------------------
# the attack works
# --------------------------------------------------------------------------------------


def test_matching_loss_drops_and_reconstruction_beats_random_start() -> None:
    case = _case()
    rec = _reconstruction()
    assert rec.stats["initial_matching_loss"] > 0.1
    assert rec.stats["matching_loss"] < 0.2 * rec.stats["initial_matching_loss"]
    assert rec.stats["cosine_similarity"] == pytest.approx(1 - rec.stats["matching_loss"])
    # a random start drawn like the attack's (standard normal, boxed to the pixel range)
    start = torch.randn(case.images.shape, generator=torch.Generator().manual_seed(123))
    low = ((0 - torch.tensor(case.data.mean)) / torch.tensor(case.data.std)).view(1, -1, 1, 1)
    high = ((1 - torch.tensor(case.data.mean)) / torch.tensor(case.data.std)).view(1, -1, 1, 1)
    start = torch.maximum(torch.minimum(start, high), low)
    random_psnr = case.psnr(start.reshape(start.shape[0], -1))
    assert case.psnr(rec.inputs) > random_psnr + 8.0


def test_reconstruction_fields() -> None:
    case = _case()
    rec = _reconstruction()
    b, n = case.flat.shape
    assert rec.inputs.shape == (b, n) and rec.inputs.dtype == torch.float64
    assert rec.inputs.device.type == "cpu"
    assert rec.batch_size == b
    assert rec.complete is False
    assert math.isnan(rec.sparsity_matching)
    assert rec.confidence.shape == (b,)
    assert torch.allclose(
        rec.confidence, torch.full((b,), rec.stats["cosine_similarity"], dtype=torch.float64)
    )
    assert rec.seconds > 0
    assert rec.stats["iterations"] == 300 and rec.stats["stopped_by"] == "iterations"
    assert rec.stats["tv_applied"] is False


def test_inputs_stay_in_the_pixel_box_and_model_is_untouched() -> None:
    case = _case()
    before = [p.detach().clone() for p in case.model.parameters()]
    rec = case.invert(_fast(iterations=40, tv_weight=0.2, lr=0.5))
    assert rec.stats["tv_applied"] is True
    pixels = case.data.denormalize(rec.inputs)
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    for old, param in zip(before, case.model.parameters(), strict=True):
        assert torch.equal(old, param.detach())
        assert param.grad is None


def test_mapping_of_names_numpy_and_sequence_agree() -> None:
    case = _case()
    attack = _fast(iterations=25)
    by_order = case.invert(attack)
    by_name = case.invert(attack, gradients={k: v.numpy() for k, v in case.named.items()})
    assert torch.equal(by_order.inputs, by_name.inputs)
    other_seed = case.invert(_fast(iterations=25, seed=1))
    assert not torch.equal(by_order.inputs, other_seed.inputs)


def test_restarts_keep_the_best_matching() -> None:
    rec = _case().invert(_fast(iterations=30, restarts=3))
    losses = rec.stats["restart_losses"]
    assert rec.stats["restarts_run"] == 3 and len(losses) == 3
    assert rec.stats["matching_loss"] == min(losses)


def test_time_budget_compresses_the_schedule() -> None:
    start = time.perf_counter()
    rec = _case().invert(_fast(iterations=1_000_000), budget=Budget.start(0.5))
    assert time.perf_counter() - start < 5.0
    assert rec.stats["stopped_by"] == "time_budget"
    assert 10 <= rec.stats["iterations"] < 1_000_000


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------


def _nan_first(case: Case) -> list[torch.Tensor]:
    grads = [g.clone() for g in case.gradients]
    grads[0][0, 0] = float("nan")
    return grads


def _bad_shape(case: Case) -> list[torch.Tensor]:
    grads = list(case.gradients)
    grads[2] = grads[2][:-1]
    return grads


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (lambda c: {"gradients": list(c.gradients)[:-1]}, "missing gradients"),
        (
            lambda c: {"gradients": {k: v for k, v in list(c.named.items())[1:]}},
            r"missing gradients for parameters \['1.weight'\]",
        ),
        (lambda c: {"gradients": {**c.named, "extra": c.gradients[0]}}, "unknown parameters"),
        (lambda c: {"gradients": _bad_shape(c)}, "gradient of 3.weight has shape"),
        (lambda c: {"gradients": _nan_first(c)}, "NaN or Inf"),
        (lambda c: {"gradients": [torch.zeros_like(g) for g in c.gradients]}, "all zeros"),
        (lambda c: {"gradients": c.gradients[0]}, "gradients must be a sequence"),
        (lambda c: {"batch_size": 5}, "labels has 3 entries but batch_size is 5"),
        (lambda c: {"labels": c.labels.float()}, "integer class indices"),
        (lambda c: {"labels": torch.tensor([0, 1, 10])}, "labels must be < 10"),
        (lambda c: {"labels": torch.tensor([0, -1, 2])}, "non-negative"),
        (lambda c: {"input_shape": (1, 8, 7)}, "model rejects inputs"),
        (lambda c: {"input_shape": (0, 8)}, "input_shape must be"),
        (lambda c: {"data_std": None}, "both data_mean and data_std"),
        (lambda c: {"data_std": (0.0,)}, "data_std must be positive"),
        (lambda c: {"data_mean": (0.1, 0.2)}, "data_mean needs 1 or 1 values"),
    ],
)
def test_bad_input_is_refused(overrides, message: str) -> None:  # type: ignore[no-untyped-def]
    case = _case()
    with pytest.raises(ValueError, match=message):
        case.invert(_fast(iterations=2), **overrides(case))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"iterations": 0}, "iterations must be a positive integer"),
        ({"lr": 0.0}, "lr must be positive"),
        ({"tv_weight": -1.0}, "tv_weight must be >= 0"),
        ({"restarts": 0}, "restarts must be a positive integer"),
        ({"milestones": (0.5, 1.5)}, "milestones must be fractions"),
        ({"loss": "hinge"}, "unknown loss"),
        ({"time_budget": 0.0}, "time_budget must be positive"),
        ({"time_budget": -1.0}, "time_budget must be positive"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        InvertingGradients(**kwargs)  # type: ignore[arg-type]


def test_non_image_inputs_skip_the_prior() -> None:
    """Flat tabular-like inputs: no TV, no normalization box unless asked."""
    case = _case()
    rec = case.invert(
        _fast(iterations=20, tv_weight=0.2, boxed=False), input_shape=(64,), data_mean=None, data_std=None
    )
    assert rec.stats["tv_applied"] is False
    assert rec.inputs.shape == case.flat.shape
    assert np.isfinite(rec.inputs.numpy()).all()
