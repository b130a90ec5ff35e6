"""The next-layer route recovers fc1's inputs of a real batch of 32 (``fl_attack.attacks.next_layer``).

The quickstart CNN takes one float32 SGD step at lr 0.1 on 32 bundled photo patches (seed 0);
one seeded round of 100 starts recovers samples exactly that plain SPEAR++ does not reach.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"
sys.path.insert(0, str(EXAMPLE))

from next_layer_route import observe  # noqa: E402

from fl_attack import LayerUpdate  # noqa: E402
from fl_attack.attacks.next_layer import (  # noqa: E402
    complement,
    exact_from_zeros,
    recover_from_next_layer,
)
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402


def _errors(recovered: np.ndarray, truth: np.ndarray) -> np.ndarray:
    errors: np.ndarray = np.linalg.norm(truth - recovered, axis=1) / np.linalg.norm(truth, axis=1)
    return errors


def test_one_round_recovers_real_batch_32_samples_exactly() -> None:
    torch.set_num_threads(1)
    observed, truth = observe(32, 0, 0.1)
    result = recover_from_next_layer(
        observed, batch_size=32, time_budget=math.inf, starts=100, seed=0, max_rounds=1
    )
    assert result.rounds == 1
    nearest = [int(_errors(x, truth).argmin()) for x in result.inputs]
    errors = np.array([float(_errors(x, truth).min()) for x in result.inputs])
    exact = {index for index, error in zip(nearest, errors, strict=True) if error < EXACT_RELATIVE_ERROR}
    assert len(exact) >= 3
    assert len(set(nearest)) == len(nearest)  # no sample reported twice
    # every accepted pattern is a real sample's: the approximate input is within 1% of one
    assert all(float(_errors(s.approximate, truth).min()) < 1e-2 for s in result.samples)
    assert (errors[result.verified] < 1e-3).all()


def test_exact_from_zeros_recovers_the_scaled_input_from_its_zeros() -> None:
    rng = np.random.default_rng(1)
    inputs = np.maximum(rng.standard_normal((4, 30)), 0.0)
    outputs = rng.standard_normal((4, 12))
    update = outputs.T @ inputs
    bias_update = outputs.T @ np.ones(4)
    basis = np.linalg.svd(np.hstack([update, bias_update[:, None]]), full_matrices=False)[2][:4].T
    noisy = inputs[2] + 1e-5 * rng.standard_normal(30)
    recovered, kernel, gap = exact_from_zeros(basis, noisy)
    assert np.allclose(recovered, inputs[2], atol=1e-10)
    assert kernel < 1e-12 < gap


def test_complement_is_orthogonal_to_the_directions() -> None:
    directions = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 1.0]) / np.sqrt(2.0)]
    basis = complement(directions, 3)
    assert basis.shape == (3, 1)
    assert np.allclose(np.array(directions) @ basis, 0.0)
    assert np.allclose(complement([], 2), np.eye(2))


def _observation(width: int = 6, inputs: int = 5, next_width: int = 4) -> LayerUpdate[np.ndarray]:
    rng = np.random.default_rng(0)
    return LayerUpdate(
        weight=rng.standard_normal((width, inputs)),
        bias=rng.standard_normal(width),
        weight_update=rng.standard_normal((width, inputs)),
        bias_update=rng.standard_normal(width),
        next_weight_update=rng.standard_normal((next_width, width)),
    )


def test_bad_arguments_are_named() -> None:
    observed = _observation()
    with pytest.raises(ValueError, match="must be positive"):
        recover_from_next_layer(observed, batch_size=2, time_budget=0.0)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, 5\]"):
        recover_from_next_layer(observed, batch_size=6, time_budget=1.0)
    with pytest.raises(ValueError, match="batch_size 4 is not below the next layer's 4 outputs"):
        recover_from_next_layer(observed, batch_size=4, time_budget=1.0)
    with pytest.raises(ValueError, match=r"next_weight_update has shape \(4, 5\), expected \(k, 6\)"):
        recover_from_next_layer(
            dataclasses.replace(observed, next_weight_update=np.zeros((4, 5))), batch_size=2, time_budget=1.0
        )
    with pytest.raises(ValueError, match="bias_update contains NaN"):
        recover_from_next_layer(
            dataclasses.replace(observed, bias_update=np.full(6, np.nan)), batch_size=2, time_budget=1.0
        )
    with pytest.raises(ValueError, match="the route needs the next layer's update"):
        recover_from_next_layer(
            dataclasses.replace(observed, next_weight_update=None), batch_size=2, time_budget=1.0
        )
