"""The Cocktail Party Attack: ICA unmixes independent non-Gaussian inputs; it never claims exactness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_attack import CocktailPartyAttack, Reconstruction, get_attack
from fl_attack.attacks import cocktail_party
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.progress import reporting_to


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


def _sparse_gradient_update(b: int, n: int, m: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Gaussian inputs (no side of them is non-Gaussian) behind ReLU-sparse output gradients."""
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((b, n)) + 0.5
    weight = rng.standard_normal((m, n)) / np.sqrt(n)
    bias = 0.1 * rng.standard_normal(m)
    output_grad = ((inputs @ weight.T + bias) > 0) * rng.standard_normal((b, m))
    return output_grad.T @ inputs, output_grad.sum(0), weight, bias, inputs


def _worst_relative_error(recovered: np.ndarray, inputs: np.ndarray) -> float:
    return max(
        float((np.linalg.norm(recovered - sample, axis=1) / np.linalg.norm(sample)).min())
        for sample in inputs
    )


def test_the_gradient_side_unmixes_gaussian_inputs_that_the_input_side_cannot() -> None:
    dw, db, weight, bias, inputs = _sparse_gradient_update(5, 400, 1000)  # m = 200 b neurons
    auto = CocktailPartyAttack().invert(dw, db, weight=weight, bias=bias, batch_size=5)
    assert auto.stats["unmixed"] == "gradients" and auto.stats["stopped_by"] == "converged"
    assert _worst_relative_error(auto.inputs.numpy(), inputs) < 0.1  # measured 0.072
    paper = CocktailPartyAttack(unmix="inputs").invert(dw, db, weight=weight, bias=bias, batch_size=5)
    assert paper.stats["unmixed"] == "inputs"
    assert _worst_relative_error(paper.inputs.numpy(), inputs) > 0.5  # Gaussian sources: ICA cannot (0.77)


def test_auto_takes_the_input_side_with_few_neurons_per_source() -> None:
    dw, db, weight, bias, _ = _mixed_update(10, 3000, 200)  # m = 20 b < 40 b
    rec = CocktailPartyAttack().invert(dw, db, weight=weight, bias=bias, batch_size=10)
    assert rec.stats["unmixed"] == "inputs" and rec.stats["sides_tried"] == "inputs"


def test_the_time_budget_stops_the_iterations_with_what_they_have() -> None:
    dw, db, weight, bias, _ = _mixed_update(40, 3000, 400, seed=2)
    attack = CocktailPartyAttack(max_iter=10**6, tolerance=1e-300, unmix="inputs")  # never converges
    rec = attack.invert(dw, db, weight=weight, bias=bias, batch_size=40, budget=Budget.start(1.5))
    assert rec.stats["stopped_by"] == "time_budget" and rec.stats["budget_exhausted"] is True
    assert rec.stats["ica_iterations"] > 0 and rec.stats["time_budget"] == 1.5
    assert rec.seconds <= 1.5 * 1.1
    assert rec.inputs.shape == (40, 3000) and bool(torch.isfinite(rec.inputs).all())


def test_without_a_budget_the_iterations_stop_at_max_iter() -> None:
    dw, db, weight, bias, _ = _mixed_update(10, 500, 100, seed=3)
    rec = CocktailPartyAttack(max_iter=3, tolerance=1e-300, unmix="inputs").invert(
        dw, db, weight=weight, bias=bias, batch_size=10
    )
    assert rec.stats["stopped_by"] == "max_iter" and rec.stats["ica_iterations"] == 3
    assert rec.stats["budget_exhausted"] is False and "time_budget" not in rec.stats


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="unmix must be one of auto, inputs, gradients, got 'rows'"):
        CocktailPartyAttack(unmix="rows")
    with pytest.raises(ValueError, match="nonlinearity must be one of logcosh, cube, got 'tanh'"):
        CocktailPartyAttack(nonlinearity="tanh")
    with pytest.raises(ValueError, match="time_budget must be a positive, finite number of seconds"):
        CocktailPartyAttack(time_budget=0.0)


class Collected:
    """A progress sink that keeps every partial result."""

    def __init__(self) -> None:
        self.partials: list[Reconstruction] = []

    def report(self, partial: Reconstruction) -> None:
        self.partials.append(partial)


@pytest.mark.parametrize(("unmix", "shape"), [("inputs", (10, 500, 100)), ("gradients", (4, 300, 400))])
def test_each_reported_estimate_is_what_the_attack_returns_when_stopped_there(
    unmix: str, shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cocktail_party, "PROGRESS_EVERY_SECONDS", 0.0)  # report after every iteration
    monkeypatch.setattr(cocktail_party, "PROGRESS_COST_FACTOR", 0.0)
    dw, db, weight, bias, _ = _mixed_update(*shape, seed=4)
    b = shape[0]
    attack = CocktailPartyAttack(max_iter=6, tolerance=1e-300, unmix=unmix)
    collected = Collected()
    with reporting_to(collected):
        watched = attack.invert(dw, db, weight=weight, bias=bias, batch_size=b)
    plain = attack.invert(dw, db, weight=weight, bias=bias, batch_size=b)
    assert torch.equal(watched.inputs, plain.inputs) and torch.equal(watched.confidence, plain.confidence)

    assert [partial.stats["ica_iterations"] for partial in collected.partials] == [1, 2, 3, 4, 5]
    for partial in collected.partials:
        iterations = partial.stats["ica_iterations"]
        stopped = CocktailPartyAttack(max_iter=iterations, tolerance=1e-300, unmix=unmix).invert(
            dw, db, weight=weight, bias=bias, batch_size=b
        )
        assert stopped.stats["stopped_by"] == "max_iter"
        assert torch.equal(partial.inputs, stopped.inputs)  # only rows the attack returns anyway
        assert torch.equal(partial.confidence, stopped.confidence)
        assert partial.complete is False and partial.self_check is None and partial.batch_size == b
        assert partial.stats["partial"] is True and partial.stats["unmixed"] == unmix
        assert partial.stats["approximate"] is True and partial.found == 0  # never rows found one by one
        assert "stopped_by" not in partial.stats  # it had not stopped


def test_reports_are_spaced_by_the_reporting_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cocktail_party, "PROGRESS_EVERY_SECONDS", 60.0)
    dw, db, weight, bias, _ = _mixed_update(10, 500, 100, seed=4)
    collected = Collected()
    with reporting_to(collected):
        CocktailPartyAttack(max_iter=6, tolerance=1e-300, unmix="inputs").invert(
            dw, db, weight=weight, bias=bias, batch_size=10
        )
    assert [partial.stats["ica_iterations"] for partial in collected.partials] == [1]
