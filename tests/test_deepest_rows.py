"""The last missing sample of one local epoch: its direction from the rows deepest below zero.

A sample of a later mini-batch step vanishes where it is inactive at its own step's weights,
not at ``W_0``, so the exact last-direction scan (patterns at ``W_0``) misses it; the kernel of
the rows deepest below zero along its line does not (CIFAR-10 (20, 200), one epoch of 4
mini-batches at lr 0.1, seed 1: the sphere search never met one sample, the selection kept a
duplicate in its place and the client ran its whole budget).
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from fl_attack import SpearPlusPlus
from fl_attack.attacks.spear import SearchState
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.local_training.epoch_last_directions import epoch_last_directions
from fl_attack.pipeline.search.deepest_rows import deepest_row_kernels
from fl_attack.pipeline.search.pattern_scan import line_pattern_kernels
from fl_attack.pipeline.search.sparsity import ZeroTolerance, zero_masks
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, orthonormal_completion
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.simulate.victims import fedavg_update

SAMPLES, FEATURES, WIDTH = 20, 40, 60
#: A later step's sample of seed 0 whose zeros differ from its pattern at W_0 on 2 neurons.
LATER_SAMPLE = 0
COS_EXACT = 1.0 - 1e-9


def _one_epoch(
    seed: int = 0, *, momentum: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gaussian inputs, and ``W_1 - W_0``, ``b_1 - b_0``, ``W_0``, ``b_0`` of one epoch of 4
    mini-batches of 5 at lr 0.1 (SGD with ``momentum``) of a float64 ``Linear(40, 60), ReLU, Linear(60, 3)``."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 3)
    ).double()
    labels = torch.randint(0, 3, (SAMPLES,), generator=generator)
    weight_delta, bias_delta = fedavg_update(
        model, inputs, labels, lr=0.1, epochs=1, mini_batch_size=5, seed=seed, momentum=momentum
    )
    layer = model[0]
    return inputs, weight_delta, bias_delta, layer.weight.detach(), layer.bias.detach()


def _true_directions(inputs: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(b, b)`` unit rows: each sample's direction ``q_i`` (``X = Q^{-1} R``)."""
    q_inv = inputs @ right.T @ torch.linalg.inv(right @ right.T)
    directions = torch.linalg.inv(q_inv).T
    return directions / directions.norm(dim=1, keepdim=True)


def _best_cos(proposals: torch.Tensor, direction: torch.Tensor) -> float:
    if proposals.shape[0] == 0:
        return 0.0
    unit = proposals / proposals.norm(dim=1, keepdim=True)
    return float((unit @ direction).abs().max())


def test_a_later_steps_last_sample_is_proposed_from_its_deepest_rows() -> None:
    inputs, weight_delta, _, weight, bias = _one_epoch()
    factors = decompose(weight_delta, batch_size=SAMPLES)
    truth = _true_directions(inputs, factors.right)
    tolerance = ZeroTolerance.from_noise(1e-12, width=WIDTH)
    zeros = zero_masks(factors, truth, tolerance)[LATER_SAMPLE]
    inactive = (weight @ inputs[LATER_SAMPLE] + bias) <= 0
    assert int((zeros != inactive).sum()) > 0  # its zeros are not its pattern at W_0
    found = torch.cat([truth[:LATER_SAMPLE], truth[LATER_SAMPLE + 1 :]])
    basis = weight @ factors.right.T
    complete, _ = torch.linalg.qr(found.T, mode="complete")
    slope = basis @ complete[:, -1:]
    exact = line_pattern_kernels(
        factors.left, slope[:, 0], bias, minimum=SAMPLES, limit=10 * tolerance.absolute, chunk=256
    )
    assert max((abs(float(vector @ truth[LATER_SAMPLE])) for _, vector in exact), default=0.0) < COS_EXACT
    proposals = deepest_row_kernels(
        factors.left, slope, bias, known=found, tolerance=tolerance, min_zeros=SAMPLES
    )
    assert 1 <= proposals.shape[0] <= 8
    assert _best_cos(proposals, truth[LATER_SAMPLE]) > COS_EXACT
    assert _best_cos(proposals, truth[1]) < 0.999  # a known sample is not proposed again
    late = deepest_row_kernels(
        factors.left, slope, bias, known=found, tolerance=tolerance, min_zeros=SAMPLES, deadline=Deadline(0.0)
    )
    assert late.shape == (0, SAMPLES)


def test_a_one_epoch_batch_whose_search_misses_a_later_sample_is_still_claimed_exact() -> None:
    """The search proposes every direction but the later sample's (as CIFAR-10's seed 1 did):
    the last-direction proposals complete the batch, and it is claimed and exact."""
    inputs, weight_delta, bias_delta, weight, bias = _one_epoch()

    def all_but_one(self: SpearPlusPlus, state: SearchState) -> Iterator[torch.Tensor]:
        truth = _true_directions(inputs, state.factors.right)
        yield torch.cat([truth[:LATER_SAMPLE], truth[LATER_SAMPLE + 1 :]])

    with mock.patch.object(SpearPlusPlus, "_proposals", all_but_one):
        rec = SpearPlusPlus(seed=0, time_budget=120, progress=False).invert(
            weight_delta, bias_delta, weight=weight, bias=bias
        )
    assert rec.complete and rec.self_check is not None and rec.self_check.exact
    assert rec.stats["local_epoch"].startswith("fits one local epoch")
    errors = torch.cdist(rec.inputs.double(), inputs).min(dim=1).values / inputs.norm(dim=1).min()
    assert float(errors.max()) < 1e-8
    assert torch.cdist(rec.inputs.double(), inputs).argmin(dim=1).unique().numel() == SAMPLES


class _Captured(Exception):
    """Raised by a stand-in for the attack's search once its state and scorer are captured."""


def _search_state(
    weight_delta: torch.Tensor, bias_delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[SearchState, SparsityMatchingScorer]:
    """The attack's search state and scorer for this update, before any search."""
    captured: list[tuple[SearchState, SparsityMatchingScorer]] = []

    def capture(self: SpearPlusPlus, state: SearchState, scorer: SparsityMatchingScorer) -> Selection:
        captured.append((state, scorer))
        raise _Captured

    with mock.patch.object(SpearPlusPlus, "_run", capture), pytest.raises(_Captured):
        SpearPlusPlus(seed=0, time_budget=60, progress=False).invert(
            weight_delta, bias_delta, weight=weight, bias=bias
        )
    return captured[0]


def _with_missing(state: SearchState, scorer: SparsityMatchingScorer, known: torch.Tensor) -> Selection:
    """A selection of the ``known`` directions (added to the pool) completed by placeholders."""
    b = state.factors.batch_size
    state.pool.add(known)
    directions = torch.cat([known, orthonormal_completion(known, b)], dim=0)
    per_sample, q_inv = scorer.score(directions)
    found = torch.arange(b) < known.shape[0]
    return Selection(directions, found, q_inv @ state.factors.right, per_sample, float(per_sample.mean()))


def test_two_later_samples_of_a_momentum_epoch_are_proposed_and_complete_an_accepted_batch() -> None:
    inputs, weight_delta, bias_delta, weight, bias = _one_epoch(momentum=0.9)
    state, scorer = _search_state(weight_delta, bias_delta, weight, bias)
    truth = _true_directions(inputs, state.factors.right)
    missing = [0, 1]
    known = truth[[i for i in range(SAMPLES) if i not in missing]]
    selection = _with_missing(state, scorer, known)
    proposals = epoch_last_directions(state, scorer, selection, accept_matching=0.99)
    assert proposals.shape[0] == 2
    for sample in missing:
        assert _best_cos(proposals, truth[sample]) > COS_EXACT
    # the same known columns are not scanned twice
    assert epoch_last_directions(state, scorer, selection, accept_matching=0.99).shape[0] == 0


def test_known_columns_holding_a_wrong_one_get_no_proposal() -> None:
    inputs, weight_delta, bias_delta, weight, bias = _one_epoch(momentum=0.9)
    state, scorer = _search_state(weight_delta, bias_delta, weight, bias)
    truth = _true_directions(inputs, state.factors.right)
    blend = truth[2] + truth[3]
    known = torch.cat([truth[4:], (blend / blend.norm())[None]], dim=0)  # 17 samples and a blend
    selection = _with_missing(state, scorer, known)
    assert epoch_last_directions(state, scorer, selection, accept_matching=0.99).shape[0] == 0
