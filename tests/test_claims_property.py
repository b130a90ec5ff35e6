"""``complete`` is a claim the attack must never get wrong.

A property test over random batches of a synthetic linear + ReLU layer (float64, small m and
n): Gaussian inputs, sparse non-negative ones, near-duplicate samples (differences of 1e-3),
repeated samples, all-zero and constant features, and batches close to ``min(m, n)``; and first-layer updates of a small network trained as clients train (random
mini-batch size, epochs, learning rate, momentum and weight decay).
Whenever SPEAR++ reports ``complete``, every recovered row is one of the true samples to a
relative error below 1e-6, no two rows are the same sample, and the self-check passed. Beside
it, deterministic cases show that the claim is made at all (so the property is not vacuous)
and that the self-check itself catches blended near-duplicates.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic_layer import SyntheticUpdate, relu_layer_update

from fl_attack import Reconstruction, SpearPlusPlus
from fl_attack.pipeline.selection.self_check import self_check
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.simulate.victims import fedavg_update

#: Every recovered sample of a complete reconstruction is a true one to this relative error.
EXACT = 1e-6

KINDS = (
    "gaussian",
    "sparse-nonnegative",
    "near-duplicates",
    "repeated",
    "zero-and-constant-features",
    "nearly-full",
)

#: What the attack may answer instead of a reconstruction: a refusal naming the reason.
REFUSALS = ("no low-rank structure", "not low-rank", "carry gradient", "not attackable", "rank below")


def _batch(kind: str, batch: int, features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, features, generator=generator, dtype=torch.float64)
    if kind == "sparse-nonnegative":
        x = x.clamp_min(0) * (torch.rand(batch, features, generator=generator) < 0.5)
    elif kind == "near-duplicates":
        twins = max(1, batch // 2)
        x[batch - twins :] = x[:twins] + 1e-3 * torch.randn(
            twins, features, generator=generator, dtype=torch.float64
        )
    elif kind == "repeated":
        copies = max(1, batch // 3)
        x[batch - copies :] = x[:copies]
    elif kind == "zero-and-constant-features":
        columns = torch.randperm(features, generator=generator)
        x[:, columns[: features // 4]] = 0.0
        x[:, columns[features // 4 : features // 2]] = 0.7
    return x


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, torch.Tensor, int, int]:
    kind = draw(st.sampled_from(KINDS))
    width = draw(st.integers(12, 40))
    features = draw(st.integers(6, 24))
    limit = min(width, features)
    if kind == "nearly-full":
        batch = limit - draw(st.integers(1, 2))
    else:
        batch = draw(st.integers(2, min(6, limit - 1)))
    seed = draw(st.integers(0, 2**16))
    return kind, _batch(kind, batch, features, seed), width, seed


def _attack(update: SyntheticUpdate) -> Reconstruction | None:
    attack = SpearPlusPlus(seed=0, time_budget=5.0, max_initializations=768, progress=False)
    try:
        return attack.invert(**update.arrays())
    except ValueError as error:
        assert any(reason in str(error) for reason in REFUSALS), error
        return None


def _assert_every_row_is_a_true_sample(rec: Reconstruction, truth: torch.Tensor) -> None:
    distance = torch.cdist(rec.inputs, truth)  # (recovered, true)
    relative = distance / truth.norm(dim=1).clamp_min(1e-12)[None, :]
    error, match = relative.min(dim=1)
    assert float(error.max()) < EXACT, (error, rec.summary())
    # two recovered rows are never the same sample (copies of one sample are one sample)
    distinct = torch.unique(truth[match], dim=0).shape[0]
    assert distinct == rec.batch_size, (match, rec.summary())


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_a_complete_reconstruction_is_always_the_true_batch(case: tuple[str, torch.Tensor, int, int]) -> None:
    kind, inputs, width, seed = case
    update = relu_layer_update(inputs, width=width, seed=seed)
    rec = _attack(update)
    if rec is None or not rec.complete:
        return
    assert rec.self_check is not None and rec.self_check.passed
    _assert_every_row_is_a_true_sample(rec, inputs)


# --------------------------------------------------------------------------------------
# the claim is made, and the self-check refuses blends
# --------------------------------------------------------------------------------------


def test_a_gaussian_batch_is_claimed_complete_and_is_exact() -> None:
    inputs = _batch("gaussian", 5, 16, seed=1)
    rec = _attack(relu_layer_update(inputs, width=40, seed=1))
    assert rec is not None and rec.complete, rec.summary() if rec else None
    _assert_every_row_is_a_true_sample(rec, inputs)
    assert rec.stats["self_check_passed"] is True and rec.stats["self_check_pattern_twins"] == 0


def test_repeated_samples_are_recovered_once_each() -> None:
    inputs = _batch("repeated", 6, 16, seed=2)  # rows 4, 5 repeat rows 0, 1
    rec = _attack(relu_layer_update(inputs, width=40, seed=2))
    assert rec is not None and rec.batch_size == 4  # the rank of the update
    if rec.complete:
        _assert_every_row_is_a_true_sample(rec, inputs)


def _blend(update: SyntheticUpdate, first: int, second: int, weight: float) -> torch.Tensor:
    """The true inputs with two rows replaced by affine blends of both (weights summing to 1).

    For two samples with one ReLU pattern, the blend explains the update exactly as well as
    the truth does (``G' X' = G X`` and ``G' 1 = G 1``): only the pattern tells them apart.
    """
    x = update.inputs.clone()
    a, c = x[first].clone(), x[second].clone()
    x[first] = (1 - weight) * a + weight * c
    x[second] = weight * a + (1 - weight) * c
    return x


def _check(update: SyntheticUpdate, inputs: torch.Tensor):
    factors = decompose(update.weight_grad, batch_size=inputs.shape[0])
    return self_check(
        inputs,
        factors=factors,
        weight=update.weight,
        bias=update.bias,
        bias_grad=update.bias_grad,
        relative_noise=factors.spectrum.relative_noise,
        exact=True,
    )


def test_self_check_refuses_look_alike_samples_that_a_blend_explains_as_well() -> None:
    inputs = _batch("gaussian", 4, 16, seed=3)
    inputs[3] = inputs[0] + 1e-3 * torch.randn(
        16, generator=torch.Generator().manual_seed(99), dtype=torch.float64
    )
    update = relu_layer_update(inputs, width=40, seed=3)
    pattern = (update.weight @ inputs.T + update.bias[:, None]) > 0
    assert torch.equal(pattern[:, 0], pattern[:, 3])  # the look-alikes share their ReLU pattern
    truth, blend = _check(update, inputs), _check(update, _blend(update, 0, 3, weight=0.3))
    for check in (truth, blend):
        # the blend re-synthesises the update as well as the truth: the batch is not identifiable
        assert check.residual <= check.tolerance and check.bias_residual <= check.bias_tolerance
        assert not check.passed
        assert check.pattern_twins == 1 and check.reasons == ("1 pair of rows shares one ReLU pattern",)


def _nested_copy(inputs: torch.Tensor, *, width: int, seed: int) -> torch.Tensor:
    """``inputs`` with row 3 moved from row 0 just past the first neuron threshold on a random line:
    the two patterns differ on that neuron alone."""
    probe = relu_layer_update(inputs, width=width, seed=seed)  # the layer depends on the seed only
    direction = torch.randn(
        inputs.shape[1], generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    crossing = -(probe.weight @ inputs[0] + probe.bias) / (probe.weight @ direction)
    first, second = crossing[crossing > 0].sort().values[:2].tolist()
    x = inputs.clone()
    x[3] = inputs[0] + 0.5 * (first + second) * direction
    return x


def test_self_check_refuses_samples_whose_patterns_nest_as_a_family_of_batches_explains_them() -> None:
    """Two samples apart on one neuron only: the truth and, for the one inactive there,
    ``x_i + a (x_i - x_j)`` (a > 0 small) both re-synthesise the update exactly, so the batch is
    refused (a multi-step update once held such a wrong pair exactly, where the true one drifted)."""
    inputs = _nested_copy(_batch("gaussian", 4, 16, seed=7), width=40, seed=7)
    update = relu_layer_update(inputs, width=40, seed=7)
    pattern = (update.weight @ inputs.T + update.bias[:, None]) > 0
    (neuron,) = torch.nonzero(pattern[:, 0] != pattern[:, 3]).flatten().tolist()
    inactive, other = (0, 3) if not bool(pattern[neuron, 0]) else (3, 0)
    family = inputs.clone()
    family[inactive] = inputs[inactive] + 0.05 * (inputs[inactive] - inputs[other])
    for check in (_check(update, inputs), _check(update, family)):
        assert check.residual <= check.tolerance and check.bias_residual <= check.bias_tolerance
        assert not check.passed and check.nested_patterns == 1 and check.pattern_twins == 0
        assert check.reasons == (
            "1 pair of rows with nested ReLU patterns (every neuron one leaves inactive the other does "
            "too): a family of other batches explains the update as well",
        )


def test_self_check_passes_the_true_batch() -> None:
    inputs = _batch("gaussian", 4, 16, seed=4)
    check = _check(relu_layer_update(inputs, width=40, seed=4), inputs)
    assert check.passed and check.reasons == ()
    assert check.rank == 4 and check.pattern_twins == 0
    assert check.residual <= check.tolerance and check.min_pair_distance > check.pair_distance_floor


def test_self_check_refuses_a_blend_of_two_different_samples() -> None:
    inputs = _batch("gaussian", 4, 16, seed=4)
    update = relu_layer_update(inputs, width=40, seed=4)
    blend = _check(update, _blend(update, 0, 1, weight=0.3))
    assert not blend.passed
    assert blend.residual > 1e3 * blend.tolerance  # the blend's own pattern cannot explain the update


# --------------------------------------------------------------------------------------
# FedAvg as clients train: local epochs of mini-batch SGD with momentum and weight decay
# --------------------------------------------------------------------------------------


def _local_training_update(
    inputs: torch.Tensor,
    *,
    width: int,
    seed: int,
    batch: int,
    epochs: int,
    lr: float,
    momentum: float,
    decay: float,
) -> SyntheticUpdate:
    """``W_E - W_0`` of a float64 ``Linear(n, m), ReLU, Linear(m, 3)`` client trained as
    ``torch.optim.SGD(lr, momentum, weight_decay)`` for ``epochs`` shuffled passes of mini-batches."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(inputs.shape[1], width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    ).double()
    labels = torch.randint(0, 3, (inputs.shape[0],), generator=torch.Generator().manual_seed(seed))
    weight_delta, bias_delta = fedavg_update(
        model,
        inputs,
        labels,
        lr=lr,
        epochs=epochs,
        mini_batch_size=batch,
        seed=seed,
        momentum=momentum,
        weight_decay=decay,
    )
    layer = model[0]
    return SyntheticUpdate(
        inputs=inputs,
        weight_grad=weight_delta,
        bias_grad=bias_delta,
        weight=layer.weight.detach().clone(),
        bias=layer.bias.detach().clone(),
    )


@st.composite
def _training_cases(draw: st.DrawFn) -> tuple[torch.Tensor, SyntheticUpdate]:
    kind = draw(st.sampled_from(("gaussian", "sparse-nonnegative", "near-duplicates", "repeated")))
    width = draw(st.integers(12, 40))
    features = draw(st.integers(8, 24))
    batch = draw(st.integers(2, min(6, min(width, features) - 1)))
    seed = draw(st.integers(0, 2**16))
    inputs = _batch(kind, batch, features, seed)
    update = _local_training_update(
        inputs,
        width=width,
        seed=seed,
        batch=draw(st.integers(1, batch)),
        epochs=draw(st.integers(1, 3)),
        lr=draw(st.sampled_from((0.01, 0.05, 0.1, 0.3, 0.5))),
        momentum=draw(st.sampled_from((0.0, 0.5, 0.9, 0.73))),
        decay=draw(st.sampled_from((0.0, 5e-4, 1e-2))),
    )
    return inputs, update


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_training_cases())
def test_an_exact_claim_on_local_training_is_always_the_true_batch(
    case: tuple[torch.Tensor, SyntheticUpdate],
) -> None:
    """Random N, mini-batch B, epochs E, lr, momentum and weight decay: an exact claim is never wrong."""
    inputs, update = case
    rec = _attack(update)
    if rec is None or not rec.complete:
        return
    assert rec.self_check is not None and rec.self_check.passed
    if rec.self_check.exact:
        _assert_every_row_is_a_true_sample(rec, inputs)


@pytest.mark.parametrize(("momentum", "decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4)])
def test_one_local_epoch_of_mini_batches_is_claimed_exact(momentum: float, decay: float) -> None:
    """Two mini-batches of 3 at lr 0.5: a later sample's pattern leaves W_0's, yet the batch is
    claimed, each sample judged at its own step (and weight decay's ``beta W_0`` removed)."""
    inputs = _batch("gaussian", 6, 24, seed=6)
    update = _local_training_update(
        inputs, width=40, seed=6, batch=3, epochs=1, lr=0.5, momentum=momentum, decay=decay
    )
    rec = _attack(update)
    assert rec is not None and rec.complete and rec.self_check is not None and rec.self_check.exact
    _assert_every_row_is_a_true_sample(rec, inputs)
    # some sample does not match W_0: the plain check would refuse
    assert rec.stats["local_epoch_start_matching"] < 0.99
    assert float(rec.confidence.min()) == 1.0  # each sample matches at its own step
    assert rec.stats["local_epoch"].startswith("fits one local epoch")
    assert ("weight_decay_scale" in rec.stats) is (decay > 0)


# --------------------------------------------------------------------------------------
# 8-bit images: claims that rest on the pixel grid
# --------------------------------------------------------------------------------------


def _image_batch(kind: str, batch: int, pixels: int, seed: int) -> torch.Tensor:
    """``(batch, 3 pixels)`` normalized 8-bit images (channels-first); near copies and copies that
    differ by even levels only are the cases where grid points other than the images lie in range."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 256, (batch, 3, pixels), generator=generator).double()
    if kind in ("near-copies", "even-differences"):
        step = 1 if kind == "near-copies" else 2
        shift = step * torch.randint(-2, 3, (3, pixels), generator=generator).double()
        levels[1] = (levels[0] + shift).clamp(0, 255)
    mean = torch.tensor((0.49, 0.48, 0.45), dtype=torch.float64).view(1, 3, 1)
    std = torch.tensor((0.25, 0.24, 0.26), dtype=torch.float64).view(1, 3, 1)
    return ((levels / 255 - mean) / std).reshape(batch, -1)


@st.composite
def _image_training_cases(draw: st.DrawFn) -> tuple[torch.Tensor, SyntheticUpdate]:
    kind = draw(st.sampled_from(("distinct", "near-copies", "even-differences")))
    batch = draw(st.integers(4, 8))
    pixels = draw(st.integers(64, 96))
    seed = draw(st.integers(0, 2**16))
    inputs = _image_batch(kind, batch, pixels, seed)
    update = _local_training_update(
        inputs,
        width=draw(st.integers(40, 120)),
        seed=seed,
        batch=draw(st.integers(1, batch)),
        epochs=draw(st.integers(1, 4)),
        lr=draw(st.sampled_from((0.01, 0.05, 0.1, 0.3))),
        momentum=draw(st.sampled_from((0.0, 0.9))),
        decay=draw(st.sampled_from((0.0, 5e-4))),
    )
    return inputs, update


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_image_training_cases())
def test_an_exact_claim_on_images_trained_locally_is_always_the_true_batch(
    case: tuple[torch.Tensor, SyntheticUpdate],
) -> None:
    """8-bit images, random N, B, E, lr, momentum and weight decay: a claim (through the pixel grid
    or the patterns) is never wrong, near copies included."""
    inputs, update = case
    rec = _attack(update)
    if rec is None or not rec.complete:
        return
    assert rec.self_check is not None and rec.self_check.passed
    _assert_every_row_is_a_true_sample(rec, inputs)
