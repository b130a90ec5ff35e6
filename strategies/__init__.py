"""Server side of fl-attack: an honest-but-curious strategy wrapper and the ServerApp."""

from .attack_runner import (
    AttackResult,
    AttackRunner,
    Attacker,
    ProcessAttackRunner,
    ThreadAttackRunner,
    make_runner,
    run_attack,
)
from .audit import HonestButCuriousStrategy
from .config import CLIENT_KEYS, DEFAULT_RUN_CONFIG, resolve_run_config
from .ground_truth import ReconstructionScorer
from .layer import LayerKeys, LayerNotFoundError, LayerUpdate, layer_update, select_layer

__all__ = [
    "AttackResult",
    "AttackRunner",
    "Attacker",
    "CLIENT_KEYS",
    "DEFAULT_RUN_CONFIG",
    "HonestButCuriousStrategy",
    "LayerKeys",
    "LayerNotFoundError",
    "LayerUpdate",
    "ProcessAttackRunner",
    "ReconstructionScorer",
    "ThreadAttackRunner",
    "layer_update",
    "make_runner",
    "resolve_run_config",
    "run_attack",
    "select_layer",
]
