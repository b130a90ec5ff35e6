"""Every run-config key of the auditing app, defined once: default, type, range and meaning.

``pyproject.toml``'s ``[tool.flwr.app.config]`` repeats the defaults for ``flwr run`` (a test
checks that it agrees with :data:`SETTINGS`). :func:`resolve_run_config` completes, types and
validates a run config for this project's own app; :func:`resolve_audit_config` reads only
the audit keys from the run config of *any* Flower app (other keys belong to the user).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from flwr.app import ConfigRecord, UserConfigValue

from fl_attack.pipeline.budget.budget import hard_limit


class RunConfigError(ValueError):
    """A run-config key or value is wrong; the message names the key and what is expected."""


class AuditConfigError(RunConfigError):
    """A :class:`RunConfigError` that Flower's log shows as one line, without a traceback.

    Flower logs an exception that ends a ServerApp with the traceback read from its
    ``__traceback__``; for a wrong key in the user's own configuration that is noise around the
    one line that matters, so this error reads as having none (the interpreter still keeps it,
    and Python's own uncaught-exception printer still shows it).
    """

    @property
    def __traceback__(self) -> TracebackType | None:
        """None: the message is the whole story."""
        return None

    @__traceback__.setter
    def __traceback__(self, value: TracebackType | None) -> None:
        """Ignored (see the class docstring)."""


def one_line(error: Exception) -> AuditConfigError:
    """``error`` (a wrong key or value) as an :class:`AuditConfigError` naming the audit configuration."""
    return AuditConfigError(f"fl-attack audit configuration: {error}")


@dataclass(frozen=True)
class Setting:
    """One run-config key.

    Attributes
    ----------
    key : str
        The key as written in ``-c "key=value"``.
    default : UserConfigValue
        Its default; the value's type is the key's type.
    doc : str
        What it means, in one line.
    group : str
        ``federation``, ``data``, ``model``, ``training``, ``utility``, ``threat-model`` or ``audit``.
    for_clients : bool
        Sent to this project's clients with every message.
    choices : tuple[str, ...] or None
        The allowed values of a text key.
    minimum : float or None
        Smallest allowed value of a number (inclusive unless ``positive``).
    positive : bool
        The number must be > 0 (and finite).
    maximum : float or None
        Largest allowed value of a number (inclusive).
    """

    key: str
    default: UserConfigValue
    doc: str
    group: str
    for_clients: bool = False
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    positive: bool = False
    maximum: float | None = None

    @property
    def is_audit(self) -> bool:
        """Whether the key configures the audit (read by the wrapper in any app)."""
        return self.group in ("audit", "threat-model")


TRAIN_MODES = ("fedsgd", "fedavg", "dpsgd")

SETTINGS: tuple[Setting, ...] = (
    Setting("num-server-rounds", 2, "federated rounds", "federation", positive=True),
    Setting(
        "fraction-train", 1.0, "fraction of nodes trained each round", "federation", minimum=0, maximum=1
    ),
    Setting(
        "fraction-evaluate", 1.0, "fraction of nodes evaluated each round", "federation", minimum=0, maximum=1
    ),
    Setting("min-nodes", 2, "nodes needed before a round starts", "federation", positive=True),
    Setting(
        "dataset",
        "photo-patches",
        "photo-patches, digits, faces (bundled offline), cifar10, mnist, folder",
        "data",
        for_clients=True,
    ),
    Setting("data-root", "", "root of cifar10/mnist or the image folder (server side only)", "data"),
    Setting(
        "dataset-limit", 0, "load at most this many samples (0: all)", "data", for_clients=True, minimum=0
    ),
    Setting("partitioning", "iid", "iid or label-skew", "data", True, choices=("iid", "label-skew")),
    Setting("labels-per-client", 2, "labels per client with label-skew", "data", True, positive=True),
    Setting("samples-per-client", 64, "local data per client", "data", True, positive=True),
    Setting("partition-seed", 0, "seed of the partitioning", "data", True),
    Setting(
        "architecture",
        "spear++",
        "victim network: spear++ or spear",
        "model",
        True,
        choices=("spear++", "spear"),
    ),
    Setting("width", 200, "neurons of the hidden layers", "model", True, positive=True),
    Setting("depth", 0, "hidden layers (0: the architecture's default)", "model", True, minimum=0),
    Setting("model-seed", 0, "seed of the initial model", "model"),
    Setting(
        "train-mode", "fedsgd", "fedsgd, fedavg or dpsgd (Opacus)", "training", True, choices=TRAIN_MODES
    ),
    Setting("batch-size", 8, "FedSGD batch size", "training", True, positive=True),
    Setting("local-lr", 0.1, "client learning rate", "training", True, positive=True),
    Setting("local-epochs", 1, "FedAvg / DP-SGD local epochs", "training", True, positive=True),
    Setting("mini-batch-size", 8, "FedAvg / DP-SGD mini-batch size", "training", True, positive=True),
    Setting("noise-multiplier", 1.0, "DP-SGD noise multiplier", "training", True, minimum=0),
    Setting("max-grad-norm", 1.0, "DP-SGD per-sample clipping norm", "training", True, positive=True),
    Setting("poisson-sampling", True, "DP-SGD Poisson sampling", "training", True),
    Setting("client-seed", 0, "seed of the clients' batch draws", "training", True),
    Setting(
        "server-evaluation", True, "score the global model on the test split after every round", "utility"
    ),
    Setting("test-limit", 0, "test samples scored (0: the whole split)", "utility", minimum=0),
    Setting(
        "secagg-group-size",
        1,
        "simulated secure aggregation: the server sees sums of this many updates",
        "threat-model",
        positive=True,
    ),
    Setting(
        "secagg-quantization",
        False,
        "with secagg-group-size > 1: model Flower's SecAgg+ (clip, quantize, modular sum; its defaults)",
        "threat-model",
    ),
    Setting(
        "audit-ground-truth",
        True,
        "simulation only: this project's clients report the samples they used, for scoring",
        "audit",
        for_clients=True,
    ),
    Setting("attack-enabled", True, "run the audit at all", "audit"),
    Setting("attack-name", "spear++", "registered attack (fl_attack.available_attacks())", "audit"),
    Setting(
        "attack-fallback",
        "cocktail-party",
        'approximate attack run on updates not recovered exactly ("" or "none": off)',
        "audit",
    ),
    Setting("attack-fraction", 1.0, "fraction of updates attacked each round", "audit", minimum=0, maximum=1),
    Setting("attack-partitions", "", 'attack only these partition ids, e.g. "0,2"', "audit"),
    Setting("attack-time-budget", 30.0, "seconds each attack may spend", "audit", positive=True),
    Setting("attack-timeout", 0.0, "hard limit per attack (0: 1.5 x budget + 15 s)", "audit", minimum=0),
    Setting("attack-isolation", "process", "process or thread", "audit", choices=("process", "thread")),
    Setting(
        "attack-priority",
        "idle",
        "local worker processes' CPU priority: idle (only CPU the federation leaves) or low (nice 19)",
        "audit",
        choices=("idle", "low"),
    ),
    Setting("attack-weight-key", "", "attacked layer's weight (default: first linear layer)", "audit"),
    Setting("attack-bias-key", "", "attacked layer's bias (default: derived from the weight key)", "audit"),
    Setting("attack-batch-size", 0, "batch size told to the attacker (0: estimated)", "audit", minimum=0),
    Setting(
        "attack-local-steps",
        0,
        "full-batch local SGD steps of every client (FedAvg), matched at both ends "
        "(0: this app's own full-batch local-epochs, else 1)",
        "audit",
        minimum=0,
    ),
    Setting("attack-device", "auto", "auto, cpu or cuda[:N]", "audit"),
    Setting("attack-seed", 0, "seed of the attack and of the attacked-update draw", "audit"),
    Setting(
        "output-dir",
        "",
        "where the run is stored (default outputs/<timestamp>; fl-attack-audit: outputs/audit-<timestamp>)",
        "audit",
    ),
    Setting(
        "attack-workers",
        1,
        "attacks run at once off the round's critical path (0: inside the round)",
        "audit",
        minimum=0,
    ),
    Setting("attack-backend", "local", "local (worker processes) or ray", "audit", choices=("local", "ray")),
    Setting("ray-address", "", "Ray cluster for attack-backend=ray when Ray is not running yet", "audit"),
    Setting("attack-cpus", 1.0, "Ray CPUs per attack", "audit", minimum=0),
    Setting("attack-gpus", 0.0, "Ray GPUs per attack", "audit", minimum=0),
    Setting(
        "attack-gpu-memory",
        0.0,
        "share of the GPU's memory each process running CUDA attacks may use, in (0, 1] "
        "(0: no cap; on Ray with 0 < attack-gpus < 1, the attack-gpus share)",
        "audit",
        minimum=0,
        maximum=1,
    ),
    Setting(
        "attack-queue",
        "block",
        "when the queue is full: block, drop-oldest or sample",
        "audit",
        choices=("block", "drop-oldest", "sample"),
    ),
    Setting("attack-queue-size", 0, "attacks that may wait for a worker (0: unbounded)", "audit", minimum=0),
)

SETTINGS_BY_KEY: dict[str, Setting] = {setting.key: setting for setting in SETTINGS}
#: Every key the app understands, with its default.
DEFAULT_RUN_CONFIG: dict[str, UserConfigValue] = {setting.key: setting.default for setting in SETTINGS}
#: Keys this project's clients need; sent in the ConfigRecord of every message.
CLIENT_KEYS: tuple[str, ...] = tuple(setting.key for setting in SETTINGS if setting.for_clients)
#: Keys the audit wrapper reads from any app's run config.
AUDIT_KEYS: tuple[str, ...] = tuple(setting.key for setting in SETTINGS if setting.is_audit)
#: A run-config key of any app that starts like this belongs to the audit: a typo is an error.
AUDIT_PREFIXES: tuple[str, ...] = ("attack-", "audit-", "secagg-", "output-dir", "ray-")


def closest_key(key: str, keys: tuple[str, ...] = tuple(DEFAULT_RUN_CONFIG)) -> str | None:
    """The valid key most like ``key``, or None when nothing is close."""
    found = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return found[0] if found else None


def _unknown(key: str, keys: tuple[str, ...]) -> RunConfigError:
    nearest = closest_key(key, keys)
    hint = f"; did you mean '{nearest}'?" if nearest else f"; valid keys: {', '.join(keys)}"
    return RunConfigError(f"unknown run-config key '{key}'{hint}")


def _coerce(setting: Setting, value: UserConfigValue) -> UserConfigValue:
    """Convert ``value`` to the type of the setting's default (e.g. ``width=200.0`` to 200)."""
    default = setting.default
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
    raise RunConfigError(
        f"run config '{setting.key}' must be a {type(default).__name__} like {default!r}, got {value!r}"
    )


def _check(setting: Setting, value: UserConfigValue) -> None:
    key = setting.key
    if setting.choices is not None and value not in setting.choices:
        raise RunConfigError(f"{key} must be one of {', '.join(setting.choices)}; got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise RunConfigError(f"{key} must be a finite number, got {value!r}")
    if setting.positive and not value > 0:
        raise RunConfigError(f"{key} must be positive, got {value!r}")
    if setting.minimum is not None and value < setting.minimum:
        raise RunConfigError(f"{key} must be at least {setting.minimum:g}, got {value!r}")
    if setting.maximum is not None and value > setting.maximum:
        raise RunConfigError(f"{key} must be at most {setting.maximum:g}, got {value!r}")


#: A run-config key naming a TOML file of audit keys (one line in an app's pyproject instead of many).
CONFIG_FILE_KEY = "attack-config"


def audit_config_file(path: str) -> dict[str, UserConfigValue]:
    """The audit keys of the TOML file ``path`` (top-level ``key = value`` lines).

    Raises
    ------
    RunConfigError
        When the file cannot be read or parsed, or holds a table or an unknown key (the
        message names the file, the key and the closest valid one).
    """
    import tomllib  # pylint: disable=import-outside-toplevel

    try:
        document = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise RunConfigError(
            f"{CONFIG_FILE_KEY} '{path}' cannot be read: {error.strerror or error}"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise RunConfigError(f"{CONFIG_FILE_KEY} '{path}' is not valid TOML: {error}") from None
    values: dict[str, UserConfigValue] = {}
    for key, value in document.items():
        if key not in AUDIT_KEYS:
            raise RunConfigError(f"in {CONFIG_FILE_KEY} '{path}': {_unknown(key, AUDIT_KEYS)}")
        if not isinstance(value, (bool, int, float, str)):
            raise RunConfigError(
                f"in {CONFIG_FILE_KEY} '{path}': {key} must be a number, a boolean or a string"
            )
        values[key] = value
    return values


def _expand_config_file(
    sources: tuple[Mapping[str, UserConfigValue], ...],
) -> tuple[Mapping[str, UserConfigValue], ...]:
    """The sources with each ``attack-config`` file's keys just after the source that names it.

    The file wins over the run config that names it: Flower's run config holds every key the app
    declares, with its default, so it cannot tell a key set on purpose from a default.
    """
    expanded: list[Mapping[str, UserConfigValue]] = []
    for source in sources:
        path = source.get(CONFIG_FILE_KEY)
        if path is not None and not isinstance(path, str):
            raise RunConfigError(f"{CONFIG_FILE_KEY} must be the path of a TOML file, got {path!r}")
        expanded.append({key: value for key, value in source.items() if key != CONFIG_FILE_KEY})
        if path:
            expanded.append(audit_config_file(path))
    return tuple(expanded)


def _merge(
    sources: tuple[Mapping[str, UserConfigValue], ...], keys: tuple[str, ...], *, strict_prefixes: bool
) -> dict[str, UserConfigValue]:
    merged = {key: DEFAULT_RUN_CONFIG[key] for key in keys}
    for source in _expand_config_file(sources):
        for key, value in source.items():
            if key in merged:
                merged[key] = _coerce(SETTINGS_BY_KEY[key], value)
            elif not strict_prefixes or key.startswith(AUDIT_PREFIXES):
                raise _unknown(key, keys)
    for key, value in merged.items():
        _check(SETTINGS_BY_KEY[key], value)
    parse_partitions(str(merged.get("attack-partitions", "")))
    return merged


def resolve_run_config(
    run_config: Mapping[str, UserConfigValue],
    overrides: Mapping[str, UserConfigValue] | None = None,
) -> dict[str, UserConfigValue]:
    """Complete this project's run config with the defaults, apply overrides and validate.

    Raises
    ------
    RunConfigError
        On an unknown key (naming the closest valid one), a value of the wrong type or
        out of range.
    """
    return _merge((run_config, overrides or {}), tuple(DEFAULT_RUN_CONFIG), strict_prefixes=False)


def resolve_audit_config(
    run_config: Mapping[str, UserConfigValue],
    overrides: Mapping[str, UserConfigValue] | None = None,
) -> dict[str, UserConfigValue]:
    """The audit keys of any Flower app's run config, with defaults and ``overrides`` on top.

    The user's own keys are ignored, but a key that starts like an audit key
    (:data:`AUDIT_PREFIXES`) and is not one is an error naming the closest key. ``attack-config``
    names a TOML file of audit keys, which win over the same keys in the run config
    (``overrides`` win over both).
    """
    return _merge((run_config, overrides or {}), AUDIT_KEYS, strict_prefixes=True)


def parse_partitions(text: str) -> list[int] | None:
    """Parse ``attack-partitions`` (``"0,2,5"``); an empty string means all partitions."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        return None
    try:
        return sorted({int(item) for item in items})
    except ValueError as error:
        raise RunConfigError(f"attack-partitions must be comma-separated integers, got {text!r}") from error


def client_config(config: Mapping[str, UserConfigValue]) -> ConfigRecord:
    """The part of the run config that this project's clients need, as a ConfigRecord."""
    return ConfigRecord({key: config[key] for key in CLIENT_KEYS})


def attack_timeout(config: Mapping[str, UserConfigValue]) -> float:
    """Hard per-attack limit: ``attack-timeout``, or the budget's
    :func:`fl_attack.pipeline.budget.budget.hard_limit` (``1.5 * attack-time-budget + 15`` s)."""
    explicit = float(config["attack-timeout"])
    if explicit > 0:
        return explicit
    return hard_limit(float(config["attack-time-budget"]))
