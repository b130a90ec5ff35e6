"""fl_attack: exact gradient inversion (SPEAR, SPEAR++) for auditing federated learning.

No Flower import lives in this package: it only sees arrays, so it serves a Flower server
strategy, an offline experiment, or any other framework alike.
"""

from fl_attack.attacks import GradientInversionAttack, Spear, SpearPlusPlus
from fl_attack.baselines import InvertingGradients
from fl_attack.reconstruction import Reconstruction
from fl_attack.sphere_search import SURROGATES, SphereSchedule

__all__ = [
    "GradientInversionAttack",
    "InvertingGradients",
    "Reconstruction",
    "SURROGATES",
    "Spear",
    "SpearPlusPlus",
    "SphereSchedule",
]
