"""Run configuration of the auditing app: defaults, validation and the clients' share.

The same keys live in ``[tool.flwr.app.config]`` of ``pyproject.toml`` (what ``flwr run``
reads); :data:`DEFAULT_RUN_CONFIG` repeats them so that an app started without a
``pyproject.toml`` (e.g. ``flwr.simulation.run_simulation``) behaves identically.
The ServerApp forwards :data:`CLIENT_KEYS` to the clients in every train and evaluate
message, so clients never need their own copy of the configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING

from flwr.app import ConfigRecord, UserConfigValue
from flwr.supercore import log

#: Every key the app understands, with its default.
DEFAULT_RUN_CONFIG: dict[str, UserConfigValue] = {
    # Federation
    "num-server-rounds": 2,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-nodes": 2,
    # Data
    "dataset": "photo-patches",
    "data-root": "",
    "dataset-limit": 0,
    "partitioning": "iid",
    "labels-per-client": 2,
    "samples-per-client": 64,
    "partition-seed": 0,
    # Model
    "architecture": "spear++",
    "width": 200,
    "depth": 0,
    "model-seed": 0,
    # Client training
    "train-mode": "fedsgd",
    "batch-size": 8,
    "local-lr": 0.1,
    "local-epochs": 1,
    "mini-batch-size": 8,
    "noise-multiplier": 1.0,
    "max-grad-norm": 1.0,
    "poisson-sampling": True,
    "client-seed": 0,
    # Utility: the global model scored on the dataset's test split after every round
    "server-evaluation": True,
    "test-limit": 0,
    # Threat model: with secure aggregation the server sees sums of this many updates
    "secagg-group-size": 1,
    # Audit
    "audit-ground-truth": True,
    "attack-enabled": True,
    "attack-fraction": 1.0,
    "attack-partitions": "",
    "attack-time-budget": 30.0,
    "attack-timeout": 0.0,
    "attack-isolation": "process",
    "attack-weight-key": "",
    "attack-bias-key": "",
    "attack-batch-size": 0,
    "attack-device": "auto",
    "attack-seed": 0,
    "output-dir": "",
}

#: Keys the clients need; sent in the ConfigRecord of every message.
CLIENT_KEYS: tuple[str, ...] = (
    "dataset",
    "data-root",
    "dataset-limit",
    "partitioning",
    "labels-per-client",
    "samples-per-client",
    "partition-seed",
    "architecture",
    "width",
    "depth",
    "train-mode",
    "batch-size",
    "local-lr",
    "local-epochs",
    "mini-batch-size",
    "noise-multiplier",
    "max-grad-norm",
    "poisson-sampling",
    "client-seed",
    "audit-ground-truth",
)

TRAIN_MODES = ("fedsgd", "fedavg", "dpsgd")
PARTITIONINGS = ("iid", "label-skew")
ISOLATIONS = ("process", "thread")


def _coerce(key: str, value: UserConfigValue, default: UserConfigValue) -> UserConfigValue:
    """Convert ``value`` to the type of ``default`` (e.g. ``width=200.0`` to 200)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ValueError(
        f"run config '{key}' must be a {type(default).__name__} like {default!r}, got {value!r}"
    )


def resolve_run_config(
    run_config: Mapping[str, UserConfigValue],
    overrides: Mapping[str, UserConfigValue] | None = None,
) -> dict[str, UserConfigValue]:
    """Complete a run config with the defaults, apply overrides and validate it.

    Parameters
    ----------
    run_config : Mapping[str, UserConfigValue]
        ``context.run_config`` (may be empty); unknown keys are kept with a warning.
    overrides : Mapping[str, UserConfigValue] or None (default: None)
        Values taking precedence over ``run_config``.

    Returns
    -------
    dict[str, UserConfigValue]
        Every key of :data:`DEFAULT_RUN_CONFIG`, typed like its default.

    Raises
    ------
    ValueError
        On a value of the wrong type or out of range.
    """
    merged: dict[str, UserConfigValue] = dict(DEFAULT_RUN_CONFIG)
    for source in (run_config, overrides or {}):
        for key, value in source.items():
            if key in DEFAULT_RUN_CONFIG:
                merged[key] = _coerce(key, value, DEFAULT_RUN_CONFIG[key])
            else:
                log(WARNING, "Unknown run config key '%s' is ignored", key)
                merged[key] = value
    _validate(merged)
    return merged


def _validate(config: Mapping[str, UserConfigValue]) -> None:
    if config["train-mode"] not in TRAIN_MODES:
        raise ValueError(f"train-mode must be one of {TRAIN_MODES}, got {config['train-mode']!r}")
    if config["partitioning"] not in PARTITIONINGS:
        raise ValueError(
            f"partitioning must be one of {PARTITIONINGS}, got {config['partitioning']!r}"
        )
    positive = (
        "num-server-rounds",
        "width",
        "batch-size",
        "local-epochs",
        "mini-batch-size",
        "samples-per-client",
        "labels-per-client",
        "min-nodes",
        "secagg-group-size",
    )
    for key in positive:
        if not config[key] > 0:  # type: ignore[operator]
            raise ValueError(f"{key} must be positive, got {config[key]!r}")
    for key in ("local-lr", "max-grad-norm", "attack-time-budget"):
        if not config[key] > 0:  # type: ignore[operator]
            raise ValueError(f"{key} must be positive, got {config[key]!r}")
    for key in ("fraction-train", "fraction-evaluate", "attack-fraction"):
        if not 0.0 <= config[key] <= 1.0:  # type: ignore[operator]
            raise ValueError(f"{key} must be in [0, 1], got {config[key]!r}")
    for key in ("dataset-limit", "test-limit", "depth", "attack-batch-size", "noise-multiplier", "attack-timeout"):
        if config[key] < 0:  # type: ignore[operator]
            raise ValueError(f"{key} must be non-negative, got {config[key]!r}")
    if config["attack-isolation"] not in ISOLATIONS:
        raise ValueError(
            f"attack-isolation must be one of {ISOLATIONS}, got {config['attack-isolation']!r}"
        )
    parse_partitions(str(config["attack-partitions"]))


def parse_partitions(text: str) -> list[int] | None:
    """Parse ``attack-partitions`` (``"0,2,5"``); an empty string means all partitions."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        return None
    try:
        return sorted({int(item) for item in items})
    except ValueError as error:
        raise ValueError(
            f"attack-partitions must be comma-separated integers, got {text!r}"
        ) from error


def client_config(config: Mapping[str, UserConfigValue]) -> ConfigRecord:
    """The part of the run config that clients need, as a ConfigRecord."""
    return ConfigRecord({key: config[key] for key in CLIENT_KEYS})
