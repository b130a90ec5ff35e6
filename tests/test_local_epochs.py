"""Local epochs as clients train: the SGD schedule, weight decay's share of the update, the one-epoch fit."""

from __future__ import annotations

import copy

import pytest
import torch
from synthetic_layer import relu_layer_update

from fl_attack.pipeline.local_training.local_epochs import EpochPatterns, fit_one_epoch
from fl_attack.pipeline.local_training.sgd_schedule import decay_for_scale, sgd_schedule
from fl_attack.pipeline.local_training.weight_decay import remove_weight_decay, weight_decay_scale
from fl_attack.simulate.local_sgd import sgd_steps
from fl_attack.types import ObservedUpdate


def _network(seed: int, features: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).double()


def test_sgd_steps_move_the_parameters_as_torch_sgd_does() -> None:
    model = _network(0)
    inputs = torch.randn(12, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(2))
    batches = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 12), torch.arange(0, 4)]
    ours, reference = copy.deepcopy(model), copy.deepcopy(model)
    sgd_steps(ours, inputs, labels, batches=batches, lr=0.1, momentum=0.9, weight_decay=5e-4)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for batch in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("momentum", "decay", "message"), [(1.0, 0.0, "momentum"), (0.0, -1e-4, "weight_decay")]
)
def test_sgd_steps_refuse_bad_settings(momentum: float, decay: float, message: str) -> None:
    inputs, labels = torch.zeros(2, 6, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        sgd_steps(
            _network(0),
            inputs,
            labels,
            batches=[torch.arange(2)],
            lr=0.1,
            momentum=momentum,
            weight_decay=decay,
        )


def test_the_schedule_of_momentum_sgd_has_its_closed_form() -> None:
    schedule = sgd_schedule(steps=4, momentum=0.9, decay=0.0)
    # a gradient of step s contributes 1 + mu + ... + mu^(t-1-s) by step t
    sums = [sum(0.9**k for k in range(r + 1)) for r in range(4)]
    assert torch.allclose(schedule.share[1, 0], torch.tensor(sums[0] / sums[3], dtype=torch.float64))
    assert torch.allclose(schedule.share[3, 1], torch.tensor(sums[1] / sums[2], dtype=torch.float64))
    assert torch.equal(schedule.share[4], torch.ones(4, dtype=torch.float64))
    assert torch.equal(schedule.start_scale, torch.ones(5, dtype=torch.float64))
    shrunk = sgd_schedule(steps=4, momentum=0.9, decay=5e-5)
    assert float(shrunk.start_scale[-1]) - 1 == pytest.approx(-5e-5 * sum(sums), rel=1e-3)
    assert decay_for_scale(float(shrunk.start_scale[-1]) - 1, steps=4, momentum=0.9) == pytest.approx(
        5e-5, rel=1e-9
    )


def _decayed(scale: float, *, noise: float = 0.0) -> tuple[ObservedUpdate, ObservedUpdate]:
    """A rank-5 update plus ``scale`` times the layer's weight (and bias), with optional noise."""
    inputs = torch.randn(5, 30, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    synthetic = relu_layer_update(inputs, width=40, seed=3)
    clean = ObservedUpdate(synthetic.weight_grad, synthetic.bias_grad, synthetic.weight, synthetic.bias)
    generator = torch.Generator().manual_seed(4)
    jitter = noise * torch.randn(clean.weight_update.shape, generator=generator, dtype=torch.float64)
    observed = ObservedUpdate(
        clean.weight_update + scale * clean.weight + jitter,
        clean.bias_update + scale * clean.bias,
        clean.weight,
        clean.bias,
    )
    return clean, observed


def test_weight_decay_is_read_off_the_update_and_removed() -> None:
    clean, observed = _decayed(-3e-3)
    scale = weight_decay_scale(observed, batch_size=5)
    assert scale == pytest.approx(-3e-3, rel=1e-9)
    cleaned = remove_weight_decay(observed, scale)
    torch.testing.assert_close(cleaned.weight_update, clean.weight_update, rtol=0, atol=1e-12)
    torch.testing.assert_close(cleaned.bias_update, clean.bias_update, rtol=0, atol=1e-12)


def test_no_weight_decay_is_read_off_a_plain_or_noisy_update() -> None:
    clean, _ = _decayed(0.0)
    assert weight_decay_scale(clean, batch_size=5) is None
    _, noisy = _decayed(0.0, noise=1e-2)
    assert weight_decay_scale(noisy, batch_size=5) is None


def _patterns(update: ObservedUpdate, inputs: torch.Tensor) -> EpochPatterns:
    columns = update.weight_update @ inputs.T @ torch.linalg.inv(inputs @ inputs.T)
    start = update.weight @ inputs.T + update.bias[:, None]
    gram = inputs @ inputs.T + 1.0
    ambiguity = 1e-9 * (
        update.weight.norm(dim=1)[:, None] * inputs.norm(dim=1)[None, :] + columns.abs() @ gram
    )
    zero = columns.abs() <= 1e-9 * columns.abs().max()
    return EpochPatterns(start=start, columns=columns, zero=zero, gram=gram, ambiguity=ambiguity)


def test_the_fit_orders_samples_into_their_steps_and_refuses_a_blend() -> None:
    """Three mini-batches of 2 at lr 1 with momentum 0.9: the later samples leave their W_0
    patterns; the fit finds steps under which each matches its own, and none for a blend."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).double()
    inputs = torch.randn(6, 12, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    labels = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(9))
    layer = model[0]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    sgd_steps(model, inputs, labels, batches=batches, lr=1.0, momentum=0.9)
    update = ObservedUpdate(layer.weight.detach() - weight, layer.bias.detach() - bias, weight, bias)
    patterns = _patterns(update, inputs)
    assert bool((patterns.zero != (patterns.start <= 0)).any())  # W_0's patterns do not hold
    fit = fit_one_epoch(patterns, batch_sizes=[2])
    assert fit is not None and fit.momentum == 0.9 and fit.steps[0] == (0, 1)
    assert {frozenset(step) for step in fit.steps} == {
        frozenset({0, 1}),
        frozenset({2, 3}),
        frozenset({4, 5}),
    }
    blended = inputs.clone()
    blended[4], blended[2] = 0.7 * inputs[4] + 0.3 * inputs[2], 0.3 * inputs[4] + 0.7 * inputs[2]
    assert fit_one_epoch(_patterns(update, blended)) is None


def _one_epoch_patterns(batches: list[torch.Tensor], *, seed: int) -> EpochPatterns:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).double()
    size = sum(int(batch.numel()) for batch in batches)
    inputs = torch.randn(size, 12, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    labels = torch.randint(0, 3, (size,), generator=torch.Generator().manual_seed(seed + 2))
    layer = model[0]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    sgd_steps(model, inputs, labels, batches=batches, lr=1.0, momentum=0.9)
    update = ObservedUpdate(layer.weight.detach() - weight, layer.bias.detach() - bias, weight, bias)
    return _patterns(update, inputs)


@pytest.mark.parametrize(
    "batches",
    [
        [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])],
        [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])],
    ],
)
@pytest.mark.parametrize("node_limit", [1, 2, 5, 4000])
def test_the_last_steps_judged_a_chunk_at_a_time_give_the_fit_of_one_at_a_time(
    batches: list[torch.Tensor], node_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step's candidate orders are judged in chunks; one order a chunk finds the same
    fit, and runs out of search nodes at the same point."""
    patterns = _one_epoch_patterns(batches, seed=11)
    chunked = fit_one_epoch(patterns, node_limit=node_limit)
    monkeypatch.setattr("fl_attack.pipeline.local_training.local_epochs.LEAF_CHUNK_ELEMENTS", 1)
    single = fit_one_epoch(patterns, node_limit=node_limit)
    assert (chunked is None) == (single is None)
    if node_limit == 4000:
        assert chunked is not None and {frozenset(step) for step in chunked.steps} == {
            frozenset(batch.tolist()) for batch in batches
        }
    if chunked is not None and single is not None:
        assert (chunked.batch_size, chunked.momentum, chunked.steps) == (
            single.batch_size,
            single.momentum,
            single.steps,
        )
        assert torch.equal(chunked.inactive, single.inactive)
