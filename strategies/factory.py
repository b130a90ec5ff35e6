"""Build the auditor, its attacker and its store from a run config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import UserConfigValue

from fl_attack import LayerAttack, get_attack
from fl_attack.audit import (
    AttackSettings,
    Auditor,
    ExecutionSettings,
    SamplingSettings,
    SecAggSettings,
)
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.results.store import ReconstructionStore
from fl_attack.simulate.secagg import FLOWER_DEFAULTS

from .run_config import RunConfigError, attack_timeout, parse_partitions, resolve_audit_config


def build_attacker(config: Mapping[str, UserConfigValue]) -> LayerAttack:
    """The registered attack ``attack-name`` (default SPEAR++) on ``attack-device``.

    ``attack-local-steps`` above 1 is given to the attack (SPEAR and SPEAR++ take it); it needs
    each attacked update to be one client's (``secagg-group-size = 1``); 0 (unknown) means 1.
    """
    options: dict[str, Any] = {}
    local_steps = int(config["attack-local-steps"]) or 1
    if local_steps > 1:
        if int(config["secagg-group-size"]) > 1:
            raise RunConfigError(
                f"attack-local-steps={local_steps} needs one client's update per attack, but "
                f"secagg-group-size={config['secagg-group-size']} sums several clients' updates: "
                "set attack-local-steps=1"
            )
        options["local_steps"] = local_steps
    name = str(config["attack-name"])
    attacker = get_attack(
        name,
        device=str(config["attack-device"]),
        seed=int(config["attack-seed"]),
        time_budget=float(config["attack-time-budget"]),
        progress=False,
        **options,
    )
    if getattr(attacker, "local_steps", 1) != local_steps:
        raise RunConfigError(
            f"attack-local-steps={local_steps}: the attack {name!r} does not take local steps "
            "(spear and spear++ do): set attack-local-steps=1"
        )
    return attacker


def build_store(config: Mapping[str, UserConfigValue]) -> ReconstructionStore:
    """Open the run directory (``output-dir`` or ``outputs/<timestamp>``) with the config."""
    output_dir = str(config["output-dir"]) or None
    return ReconstructionStore.create(output_dir, run_config=dict(config))


def build_auditor(
    run_config: Mapping[str, UserConfigValue],
    overrides: Mapping[str, UserConfigValue] | None = None,
    *,
    scorer: ReconstructionScorer | None = None,
    attacker: LayerAttack | None = None,
    store: ReconstructionStore | None | Any = ...,
) -> Auditor:
    """An :class:`Auditor` from the audit keys of a run config (other keys are ignored).

    Parameters
    ----------
    run_config : Mapping[str, UserConfigValue]
        The app's run config.
    overrides : Mapping[str, UserConfigValue] or None (default: None)
        Audit keys taking precedence.
    scorer : ReconstructionScorer or None (default: None)
        Scores reconstructions against ground truth clients send.
    attacker : LayerAttack or None (default: None)
        The attack; None builds ``attack-name`` from the registry.
    store : ReconstructionStore or None (default: opened from ``output-dir``)
        Where to write; None keeps records in memory only.
    """
    config = resolve_audit_config(run_config, overrides)
    batch_size = int(config["attack-batch-size"])
    return Auditor(
        attacker if attacker is not None else build_attacker(config),
        store=build_store(config) if store is ... else store,
        scorer=scorer,
        attack=AttackSettings(
            weight_key=str(config["attack-weight-key"]) or None,
            bias_key=str(config["attack-bias-key"]) or None,
            batch_size=batch_size or None,
            time_budget=float(config["attack-time-budget"]),
            timeout=attack_timeout(config),
            fallback=str(config["attack-fallback"]),
        ),
        execution=ExecutionSettings(
            isolation=str(config["attack-isolation"]),
            priority=str(config["attack-priority"]),
            workers=int(config["attack-workers"]),
            queue_size=int(config["attack-queue-size"]) or None,
            queue_policy=str(config["attack-queue"]),
            backend=str(config["attack-backend"]),
            ray_address=str(config["ray-address"]) or None,
            attack_cpus=float(config["attack-cpus"]),
            attack_gpus=float(config["attack-gpus"]),
            attack_gpu_memory=float(config["attack-gpu-memory"]) or None,
            progress=True,
        ),
        sampling=SamplingSettings(
            attack_fraction=float(config["attack-fraction"]),
            attack_partitions=parse_partitions(str(config["attack-partitions"])),
        ),
        secagg=SecAggSettings(
            group_size=int(config["secagg-group-size"]),
            quantization=FLOWER_DEFAULTS if config["secagg-quantization"] else None,
        ),
        seed=int(config["attack-seed"]),
    )
