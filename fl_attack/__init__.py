"""fl_attack: exact gradient inversion (SPEAR, SPEAR++) for auditing federated learning.

No Flower import lives in this package: it only sees arrays, so it serves a Flower server
strategy, an offline experiment, or any other framework alike.

Layout: :mod:`fl_attack.types` (what the server observes, what an attack returns),
:mod:`fl_attack.attacks` (the attacks by name), :mod:`fl_attack.pipeline` (their stages),
:mod:`fl_attack.simulate` (victims and client updates), :mod:`fl_attack.data`,
:mod:`fl_attack.evaluation`, :mod:`fl_attack.results` (store and report).
"""

from fl_attack.attacks import (
    CocktailPartyAttack,
    GradientInversionAttack,
    InvertingGradients,
    Spear,
    SpearPlusPlus,
    available_attacks,
    get_attack,
    register_attack,
)
from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.search.sphere import SURROGATES, SphereSchedule
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import LayerAttack, LayerUpdate, ObservedUpdate

__all__ = [
    "Budget",
    "CocktailPartyAttack",
    "GradientInversionAttack",
    "InvertingGradients",
    "LayerAttack",
    "LayerUpdate",
    "ObservedUpdate",
    "Reconstruction",
    "SURROGATES",
    "Spear",
    "SpearPlusPlus",
    "SphereSchedule",
    "available_attacks",
    "get_attack",
    "register_attack",
]
