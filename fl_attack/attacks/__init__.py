"""Gradient-inversion attacks, registered by name.

``spear++`` and ``spear`` are the exact attacks (decompose -> search -> select -> scale, in
:mod:`fl_attack.pipeline`); :class:`InvertingGradients` is the optimisation baseline of
Geiping et al., which needs the whole model and is therefore not a layer attack;
``cocktail-party`` is the approximate ICA attack of Kariyappa et al. (never exact).
"""

from fl_attack.attacks.base import LayerAttackBase
from fl_attack.attacks.cocktail_party import CocktailPartyAttack
from fl_attack.attacks.inverting_gradients import InvertingGradients
from fl_attack.attacks.registry import available_attacks, get_attack, register_attack
from fl_attack.attacks.spear import GradientInversionAttack
from fl_attack.attacks.spear_variants import Spear, SpearPlusPlus

register_attack("spear++", SpearPlusPlus)
register_attack("spear", Spear)
register_attack("cocktail-party", CocktailPartyAttack)

__all__ = [
    "CocktailPartyAttack",
    "GradientInversionAttack",
    "InvertingGradients",
    "LayerAttackBase",
    "Spear",
    "SpearPlusPlus",
    "available_attacks",
    "get_attack",
    "register_attack",
]
