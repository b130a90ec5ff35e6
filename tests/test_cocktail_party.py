"""The Cocktail Party Attack: ICA unmixes independent non-Gaussian inputs; it never claims exactness."""

from __future__ import annotations

import numpy as np
import pytest

from fl_attack import CocktailPartyAttack, get_attack


def _mixed_update(b: int, n: int, m: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    inputs = rng.laplace(size=(b, n)) + 0.3
    weight = rng.standard_normal((m, n)) / np.sqrt(n)
    bias = 0.1 * rng.standard_normal(m)
    output_grad = ((inputs @ weight.T + bias) > 0) * rng.standard_normal((b, m))
    return output_grad.T @ inputs, output_grad.sum(0), weight, bias, inputs


def test_ica_recovers_independent_inputs_with_scale_and_sign_from_the_bias() -> None:
    dw, db, weight, bias, inputs = _mixed_update(10, 3000, 200)
    rec = get_attack("cocktail-party").invert(dw, db, weight=weight, bias=bias, batch_size=10)
    recovered = rec.inputs.numpy()
    assert recovered.shape == (10, 3000) and not rec.complete  # approximate, by design
    for sample in inputs:
        errors = np.linalg.norm(recovered - sample, axis=1) / np.linalg.norm(sample)
        assert errors.min() < 0.25  # the right sign and about the right scale
    with np.errstate(invalid="ignore"):
        assert np.isnan(rec.sparsity_matching)


def test_batch_size_is_estimated_and_checked() -> None:
    dw, db, weight, bias, _ = _mixed_update(6, 800, 100, seed=1)
    assert CocktailPartyAttack().invert(dw, db, weight=weight, bias=bias).batch_size == 6
    with pytest.raises(ValueError, match="batch size 101"):
        CocktailPartyAttack().invert(dw, db, weight=weight, bias=bias, batch_size=101)
    with pytest.raises(ValueError, match="max_iter"):
        CocktailPartyAttack(max_iter=0)
