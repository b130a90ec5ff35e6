"""The floor under the quickstart CNN's fc1: the float64 replay and the zero sets' reach."""

from __future__ import annotations

import numpy as np
import torch

from experiments.cnn_fc1_floor import floor_row, peel_reach, replayed_columns
from experiments.fedavg_training import quickstart_cnn_client
from fl_attack.data.images import load_dataset, sample_batch


def test_the_replay_decomposes_a_float64_clients_update_into_its_samples() -> None:
    # two mini-batch steps with momentum: step 1's gradient reaches the weights 1.9 times
    data = load_dataset("photo-patches", split="train")
    received, trained, _ = quickstart_cnn_client(data, samples=40, seed=2, lr=0.05, dtype=torch.float64)
    images, labels, _ = sample_batch(data, 40, seed=2)
    inputs, columns = replayed_columns(received, images, labels, seed=2, lr=0.05)
    assert inputs.shape == (40, 400) and columns.shape == (40, 120)
    update = trained["fc1.weight"] - received["fc1.weight"]
    replayed = columns.T @ inputs
    assert np.linalg.norm(update - replayed) < 1e-10 * np.linalg.norm(update)
    # a wrong momentum weight (plain sum of the two steps' gradients) does not decompose it
    unweighted = columns.copy()
    unweighted[:32] /= 1.9
    assert np.linalg.norm(update - unweighted.T @ inputs) > 1e-3 * np.linalg.norm(update)


def test_peeling_reaches_samples_only_through_ones_already_found() -> None:
    # b = 4: a sample needs 3 zeros first, then 2, 1, 0 as the others are peeled off
    assert peel_reach(np.array([3, 2, 1, 0])) == 4
    assert peel_reach(np.array([3, 3, 0, 0])) == 2  # the last two would need 1 zero each
    assert peel_reach(np.array([2, 2, 2, 2])) == 0  # nobody can start
    assert peel_reach(np.array([5, 5, 5, 5])) == 4


def test_a_float32_client_reports_its_noise_and_the_oracles_rows() -> None:
    data = load_dataset("photo-patches", split="train")
    row = floor_row(data, samples=16, seed=0, lr=0.1)
    assert 0 < row.relative_noise < 1e-3  # float32 rounding, not a mismatch of the replay
    assert 0 <= row.oracle_exact <= 16 and row.enough_zeros <= 16 and row.peel_reach <= 16
    assert row.oracle_median_error < 1e-3
