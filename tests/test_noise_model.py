"""The noise model of noisy (DP) gradients: noise level, per-direction zeros, pruning.

Under i.i.d. Gaussian noise of std sigma on the weight gradient, the entries of a unit
gradient column ``left @ q`` that are truly zero are perturbed by about
``sigma * ||S_b^{-1} q||``. These tests check that the attack's estimate of sigma and its
per-direction zero thresholds match what the noise really does to the true ``dL/dZ``
columns, and that pruning removes a wrong direction that spoils the other samples.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.search.sparsity import NOISE_SIGMAS, ZeroTolerance, excess_zeros, zero_masks
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, prune_doubtful
from fl_attack.pipeline.spectrum.decompose import decompose, noise_std
from fl_attack.simulate.victims import (
    build_victim,
    client_gradient,
    first_linear,
    median_abs_entry,
    noisy_gradient,
    output_gradient,
)
from fl_attack.types import ObservedUpdate


@functools.cache
def _faces() -> ImageData:
    return load_dataset("faces", split="all")


@functools.cache
def _noisy_case(batch: int = 10, width: int = 200, factor: float = 0.25, seed: int = 3):
    data = _faces()
    model = build_victim(
        "spear++", input_dim=data.input_dim, width=width, num_classes=data.num_classes, seed=seed
    )
    images, labels, _ = sample_batch(data, batch, seed=seed)
    weight_grad, bias_grad = client_gradient(model, images, labels)
    sigma = factor * median_abs_entry(weight_grad)
    noisy_w, noisy_b = noisy_gradient(weight_grad, bias_grad, sigma=sigma, seed=seed)
    layer = first_linear(model)[1]
    update = ObservedUpdate.from_arrays(
        noisy_w, noisy_b, weight=layer.weight.detach(), bias=layer.bias.detach(), device="cpu"
    )
    factors = decompose(update.weight_update, batch_size=batch)
    truth = output_gradient(model, images, labels)
    # the true directions as the attacker's subspace can represent them
    coordinates = (truth / truth.norm(dim=1, keepdim=True)) @ factors.left
    true_directions = coordinates / coordinates.norm(dim=1, keepdim=True)
    return data, images, update, factors, truth, true_directions, sigma


def test_noise_std_recovers_the_gradient_noise_level() -> None:
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(300, 6, generator=generator, dtype=torch.float64) @ torch.randn(
        6, 200, generator=generator, dtype=torch.float64
    )
    sigma = 0.05
    noisy = signal + sigma * torch.randn(300, 200, generator=generator, dtype=torch.float64)
    singular_values = torch.linalg.svdvals(noisy)
    assert noise_std(singular_values, batch_size=6, shape=(300, 200)) == pytest.approx(sigma, rel=0.03)
    # a clean low-rank matrix has (numerically) no noise
    clean = noise_std(torch.linalg.svdvals(signal), batch_size=6, shape=(300, 200))
    assert clean < 1e-12


def test_attack_estimates_the_dp_noise_of_a_real_gradient() -> None:
    _, _, update, factors, _, _, sigma = _noisy_case()
    estimate = noise_std(
        factors.singular_values, batch_size=factors.batch_size, shape=tuple(update.weight_update.shape)
    )
    assert estimate == pytest.approx(sigma, rel=0.1)


def test_per_direction_thresholds_predict_the_noise_at_true_zeros() -> None:
    """The measured spread of each true column's zero entries is the predicted one.

    First order in the noise: the median ratio is close to 1, and no column is off by more
    than 60% (the weakest samples also lose some of their column to the noise subspace).
    """
    _, _, update, factors, truth, true_directions, _ = _noisy_case()
    b = factors.batch_size
    sigma_hat = noise_std(factors.singular_values, batch_size=b, shape=tuple(update.weight_update.shape))
    tolerance = ZeroTolerance.from_noise(0.3, width=factors.left.shape[0]).with_entry_noise(
        sigma_hat, factors.singular_values[:b]
    )
    predicted = tolerance.thresholds(true_directions) / NOISE_SIGMAS
    columns = true_directions @ factors.left.T
    zeros = truth == 0
    measured = torch.stack([columns[i][zeros[i]].pow(2).mean().sqrt() for i in range(b)])
    ratio = measured / predicted
    assert 0.9 < float(ratio.median()) < 1.1, ratio
    assert bool(((ratio > 0.6) & (ratio < 1.6)).all()), ratio
    # the thresholds differ per direction (weak samples get wider zeros) ...
    assert float(predicted.max() / predicted.min()) > 1.2
    # ... and count nearly all true zeros while admitting few non-zeros
    detected = zero_masks(factors, true_directions, tolerance)
    assert float((detected & zeros).sum() / zeros.sum()) > 0.95
    assert float((detected & ~zeros).sum() / (~zeros).sum()) < 0.15
    # true directions have far more zeros than a dense column would under the same thresholds
    excess = excess_zeros(factors, true_directions, tolerance, detected.sum(dim=1))
    dense = torch.randn(200, b, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dense_excess = excess_zeros(factors, dense, tolerance, zero_masks(factors, dense, tolerance).sum(dim=1))
    assert float(excess.min()) > 6.0 > float(dense_excess.quantile(0.99)), (excess, dense_excess.max())


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_entry_noise_must_be_finite_and_non_negative(bad: float) -> None:
    with pytest.raises(ValueError, match="entry_noise"):
        ZeroTolerance.from_noise(0.1, width=100).with_entry_noise(bad, torch.ones(3, dtype=torch.float64))


def _selection(scorer: SparsityMatchingScorer, directions: torch.Tensor) -> Selection:
    per_sample, q_inv = scorer.score(directions)
    found = torch.ones(directions.shape[0], dtype=torch.bool)
    return Selection(directions, found, q_inv @ scorer.factors.right, per_sample, float(per_sample.mean()))


def test_pruning_drops_a_wrong_direction_and_keeps_the_right_ones() -> None:
    data, images, update, factors, _, true_directions, _ = _noisy_case()
    b = factors.batch_size
    sigma_hat = noise_std(factors.singular_values, batch_size=b, shape=tuple(update.weight_update.shape))
    tolerance = ZeroTolerance.from_noise(0.3, width=factors.left.shape[0]).with_entry_noise(
        sigma_hat, factors.singular_values[:b]
    )
    scorer = SparsityMatchingScorer(update, factors, tolerance)
    reference = images.reshape(b, -1).double()

    def mean_psnr_of_others(selection: Selection, wrong: int) -> float:
        quality = evaluate_reconstruction(selection.inputs, reference, denormalize=data.denormalize)
        keep = torch.ones(b, dtype=torch.bool)
        keep[wrong] = False
        return float(quality.psnr[keep].mean())

    correct = _selection(scorer, true_directions.clone())
    assert prune_doubtful(scorer, correct) is correct  # nothing to drop from a right selection

    wrong = 4
    mixed = true_directions.clone()
    mixed[wrong] = true_directions[1] + true_directions[2]  # a mixture standing in for sample 4
    mixed[wrong] /= mixed[wrong].norm()
    spoiled = _selection(scorer, mixed)
    pruned = prune_doubtful(scorer, spoiled)
    assert int(pruned.found.sum()) == b - 1 and not pruned.complete
    kept = pruned.directions[pruned.found]
    assert bool(((kept @ mixed[wrong]).abs() < 1 - 1e-9).all()), "the mixture must be the row dropped"
    assert bool((pruned.per_sample[~pruned.found] == 0).all())
    assert mean_psnr_of_others(pruned, wrong) > mean_psnr_of_others(spoiled, wrong) + 3.0
