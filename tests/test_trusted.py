"""Own-matching selection of directions on noisy wide layers (fl_attack.pipeline.noise.one_at_a_time)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.noise.one_at_a_time import (
    AIMED_PER_MISSING,
    FIRST_ROUND_SHARE,
    MIN_AIMED,
    TRUSTED_MIN_WIDTH,
    _seed,
    complement_of_trusted,
    own_matching,
    round_plan,
    trusted_selection,
    uses_trusted_selection,
)
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, orthonormal_completion
from fl_attack.pipeline.spectrum.decompose import decompose, noise_std
from fl_attack.types import ObservedUpdate


@dataclass(frozen=True)
class NoisyLayer:
    scorer: SparsityMatchingScorer
    directions: torch.Tensor  # (b, b) true unit directions in the noisy factor's coordinates
    inputs: torch.Tensor  # (b, n)


@functools.cache
def _layer(batch: int = 6, width: int = 600, features: int = 200, noise: float = 0.02) -> NoisyLayer:
    """A linear+ReLU layer's gradient ``D^T X`` plus Gaussian noise, with the truth kept."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(width, features, generator=generator, dtype=torch.float64) / features**0.5
    bias = 0.01 * torch.randn(width, generator=generator, dtype=torch.float64)
    inputs = torch.randn(batch, features, generator=generator, dtype=torch.float64)
    active = (inputs @ weight.T + bias) > 0  # (b, m)
    upstream = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    columns = upstream * active  # (b, m) dL/dZ
    weight_grad = columns.T @ inputs
    bias_grad = columns.sum(dim=0)
    sigma = noise * float(weight_grad.abs().median())
    weight_grad = weight_grad + sigma * torch.randn(width, features, generator=generator, dtype=torch.float64)
    bias_grad = bias_grad + sigma * torch.randn(width, generator=generator, dtype=torch.float64)
    update = ObservedUpdate.from_arrays(
        weight_grad, bias_grad, weight=weight, bias=bias, device=torch.device("cpu")
    )
    factors = decompose(update.weight_update, batch_size=batch)
    spectrum = factors.spectrum
    tolerance = ZeroTolerance.from_noise(spectrum.relative_noise, width=width).with_entry_noise(
        noise_std(factors.singular_values, batch_size=batch, shape=(width, features)),
        factors.singular_values[:batch],
    )
    truth = columns @ factors.left
    truth = truth / truth.norm(dim=1, keepdim=True)
    return NoisyLayer(SparsityMatchingScorer(update, factors, tolerance), truth, inputs)


def _junk(count: int, size: int) -> torch.Tensor:
    junk = torch.randn(count, size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return junk / junk.norm(dim=1, keepdim=True)


def test_own_matching_equals_the_scorer_beside_a_completion() -> None:
    layer = _layer()
    members = layer.directions[:4]
    duals = torch.linalg.solve(members @ members.T, members)
    own = own_matching(layer.scorer, torch.stack([members, duals], dim=1))
    completed = torch.cat([members, orthonormal_completion(members, 6)], dim=0)
    per_sample, _ = layer.scorer.score(completed)
    assert torch.equal(own, per_sample[:4])


def test_true_directions_match_and_random_ones_sit_near_chance() -> None:
    layer = _layer()
    duals = torch.linalg.solve(layer.directions @ layer.directions.T, layer.directions)
    true_own = own_matching(layer.scorer, torch.stack([layer.directions, duals], dim=1))
    junk = _junk(50, 6)
    junk_own = own_matching(layer.scorer, torch.stack([junk, junk], dim=1))
    assert float(true_own.min()) > 0.85
    assert float(junk_own.max()) < 0.6  # chance is 0.5


def test_trusted_selection_rejects_junk_tried_first() -> None:
    layer = _layer()
    junk = _junk(40, 6)
    candidates = torch.cat([junk, layer.directions], dim=0)
    excess = torch.cat([torch.full((40,), 50.0), torch.full((6,), 10.0)]).double()  # junk ranks first
    selection = trusted_selection(layer.scorer, candidates, excess)
    assert selection.complete
    cos = (selection.directions @ layer.directions.T).abs()
    assert torch.equal(cos.argmax(dim=1).sort().values, torch.arange(6))
    assert float(cos.max(dim=1).values.min()) == pytest.approx(1.0, abs=1e-12)
    assert selection.sparsity_matching > 0.85


def test_a_missing_direction_stays_unclaimed_and_is_aimed_at() -> None:
    layer = _layer()
    candidates = torch.cat([_junk(10, 6), layer.directions[:5]], dim=0)
    selection = trusted_selection(layer.scorer, candidates, torch.arange(15, 0, -1).double())
    assert selection.found.tolist() == [True] * 5 + [False]
    assert float(selection.per_sample[5]) == 0.0
    aim = complement_of_trusted(selection)
    assert aim is not None and aim.shape == (5, 6)
    assert float((aim @ layer.directions[5]).abs().max()) < 0.9  # the missing one is not among them
    count, aimed_past = round_plan(4000, rounds_done=1, latest=selection)
    assert count == max(MIN_AIMED, AIMED_PER_MISSING)
    assert aimed_past is not None and torch.equal(aimed_past, aim)
    assert round_plan(100, rounds_done=1, latest=selection)[0] == 100


def test_twins_are_never_trusted_together() -> None:
    layer = _layer()
    twin = layer.directions[0] + 0.05 * layer.directions[1]
    candidates = torch.cat([layer.directions, (twin / twin.norm())[None]], dim=0)
    excess = torch.tensor([1.0, 1, 1, 1, 1, 1, 9], dtype=torch.float64)
    selection = trusted_selection(layer.scorer, candidates, excess)
    found = selection.directions[selection.found]
    gram = (found @ found.T).abs() - torch.eye(found.shape[0], dtype=torch.float64)
    assert float(gram.max()) <= 0.9


def test_round_plan_and_gate() -> None:
    assert round_plan(2500, rounds_done=0, latest=None) == (int(FIRST_ROUND_SHARE * 2500), None)
    assert round_plan(2500, rounds_done=2, latest=None) == (2500, None)
    layer = _layer()
    complete = Selection(layer.directions, torch.ones(6, dtype=torch.bool), layer.inputs, torch.ones(6), 1.0)
    assert round_plan(2500, rounds_done=1, latest=complete) == (2500, None)
    assert complement_of_trusted(complete) is None
    assert uses_trusted_selection(noisy=True, width=TRUSTED_MIN_WIDTH, batch_size=2)
    assert not uses_trusted_selection(noisy=True, width=TRUSTED_MIN_WIDTH - 1, batch_size=2)
    assert not uses_trusted_selection(noisy=False, width=4000, batch_size=150)
    assert not uses_trusted_selection(noisy=True, width=4000, batch_size=1)


def test_bad_input_is_named() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match=r"candidates must have shape \(c, 6\), got \(3, 5\)"):
        trusted_selection(layer.scorer, torch.ones(3, 5, dtype=torch.float64), torch.ones(3))
    with pytest.raises(ValueError, match=r"excess must have shape \(3,\), got \(2,\)"):
        trusted_selection(layer.scorer, torch.ones(3, 6, dtype=torch.float64), torch.ones(2))
    with pytest.raises(ValueError, match=r"min_matching must be in \(0, 1\], got 1.5"):
        trusted_selection(layer.scorer, layer.directions, torch.ones(6), min_matching=1.5)
    with pytest.raises(ValueError, match="need per_round >= 1 and rounds_done >= 0, got 0 and 0"):
        round_plan(0, rounds_done=0, latest=None)


def test_the_sparsest_few_are_judged_together() -> None:
    layer = _layer()
    candidates = torch.cat([layer.directions, _junk(6, 6)], dim=0)
    assert _seed(layer.scorer, candidates, list(range(12)), min_matching=0.6) == list(range(6))
    assert _seed(layer.scorer, candidates, list(range(6, 12)), min_matching=0.6) == []
    assert _seed(layer.scorer, candidates, [0], min_matching=0.6) == []  # one alone is not judged


def test_past_its_deadline_only_the_seed_is_judged() -> None:
    layer = _layer()
    selection = trusted_selection(
        layer.scorer, layer.directions, torch.ones(6, dtype=torch.float64), deadline=Deadline(0.0)
    )
    assert selection.found.tolist() == [True] * 6  # the six are the seed: judged together
    late = trusted_selection(
        layer.scorer,
        torch.cat([_junk(6, 6), layer.directions]),
        torch.arange(12, 0, -1).double(),
        deadline=Deadline(0.0),
    )
    assert not bool(late.found.any())  # the junk seed fails and nothing else is tried
