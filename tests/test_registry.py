"""The attack registry: names, errors, and that registered attacks recover a batch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import fl_attack
from fl_attack import LayerAttack, SpearPlusPlus, available_attacks, get_attack, register_attack
from fl_attack.attacks import registry


def test_builtin_attacks_are_registered_by_name() -> None:
    assert available_attacks() == ("cocktail-party", "spear", "spear++")
    attack = get_attack("spear++", time_budget=12.0, seed=3)
    assert isinstance(attack, SpearPlusPlus)
    assert attack.time_budget == 12.0 and attack.seed == 3
    assert isinstance(attack, LayerAttack)


def test_unknown_name_lists_the_registered_attacks() -> None:
    expected = re.escape("unknown attack 'spear+++'; available: cocktail-party, spear, spear++")
    with pytest.raises(ValueError, match=expected):
        get_attack("spear+++")


def test_a_name_cannot_be_registered_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ATTACKS", dict(registry._ATTACKS))
    with pytest.raises(ValueError, match="already registered"):
        register_attack("spear++", SpearPlusPlus)


def test_a_registered_attack_is_built_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ATTACKS", dict(registry._ATTACKS))
    register_attack("quick-spear++", lambda **options: SpearPlusPlus(time_budget=30.0, **options))
    assert "quick-spear++" in available_attacks()
    generator = torch.Generator().manual_seed(0)
    batch, width, features = 4, 50, 30
    inputs = torch.randn(batch, features, generator=generator, dtype=torch.float64)
    weight = torch.randn(width, features, generator=generator, dtype=torch.float64)
    bias = torch.randn(width, generator=generator, dtype=torch.float64)
    pre = inputs @ weight.T + bias
    # dL/dZ of a ReLU layer: zero where the unit is off, a dense random value where it is on.
    out_grad = torch.randn(batch, width, generator=generator, dtype=torch.float64) * (pre > 0)
    weight_grad, bias_grad = out_grad.T @ inputs, out_grad.sum(0)
    attack = fl_attack.get_attack("quick-spear++", seed=0)
    rec = attack.invert(weight_grad, bias_grad, weight=weight, bias=bias)
    assert rec.complete
    recovered = np.asarray(rec.inputs)
    # Rows come back in any order: match each true row to its nearest recovered row.
    distance = np.abs(recovered[:, None, :] - inputs.numpy()[None, :, :]).max(-1)
    assert distance.min(0).max() < 1e-6
