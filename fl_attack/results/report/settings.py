"""What a run's configuration means for the report: its defenses and the settings that mattered.

The DP epsilon is read where a run records it (nothing is recomputed here): the keys
``epsilon`` or ``dp-epsilon`` (with ``delta`` / ``dp-delta``) in ``run_config.json``, at the
top level of ``history.json`` or in its ``dp`` object, or in the last round's ``train``
metrics of ``history.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fl_attack.results.report.loading import number

__all__ = [
    "Defense",
    "DpBudget",
    "active_defenses",
    "dp_budget",
    "local_steps",
    "relevant_settings",
    "secagg_group_size",
    "train_mode",
]

#: Settings that never change what the server saw or recovered (where files went).
_NEVER_SHOWN = ("output-dir",)
#: Settings used only by one training mode.
_MODE_KEYS: dict[str, tuple[str, ...]] = {
    "batch-size": ("fedsgd",),
    "local-epochs": ("fedavg", "dpsgd"),
    "mini-batch-size": ("fedavg", "dpsgd"),
    "noise-multiplier": ("dpsgd",),
    "max-grad-norm": ("dpsgd",),
    "poisson-sampling": ("dpsgd",),
}
_EPSILON_KEYS = ("epsilon", "dp-epsilon")
_DELTA_KEYS = ("delta", "dp-delta")


@dataclass(frozen=True)
class Defense:
    """One defense that was on in a run.

    Attributes
    ----------
    name : str
        ``dpsgd``, ``secagg`` or ``fedavg``.
    text : str
        A phrase for a sentence, e.g. ``"secure aggregation over groups of 3 clients"``.
    """

    name: str
    text: str


@dataclass(frozen=True)
class DpBudget:
    """A DP guarantee the run recorded.

    Attributes
    ----------
    epsilon : float
        Epsilon (``inf`` without noise).
    delta : float or None
        Its delta, when recorded.
    source : str
        The file and key it was read from.
    """

    epsilon: float
    delta: float | None
    source: str

    def text(self) -> str:
        """``"ε = 16.5 (δ = 1e-05)"``."""
        value = "∞" if math.isinf(self.epsilon) else f"{self.epsilon:.3g}"
        return f"ε = {value}" + ("" if self.delta is None else f" (δ = {self.delta:g})")


def _get(config: Mapping[str, Any] | None, key: str) -> Any:
    return None if config is None else config.get(key)


def train_mode(config: Mapping[str, Any] | None) -> str | None:
    """The run's ``train-mode`` (``fedsgd``, ``fedavg``, ``dpsgd``), None when not recorded."""
    mode = _get(config, "train-mode")
    return mode if isinstance(mode, str) else None


def secagg_group_size(config: Mapping[str, Any] | None) -> int:
    """Clients summed per secure-aggregation group (1: no secure aggregation)."""
    value = number(_get(config, "secagg-group-size"))
    return 1 if value is None or value < 1 else int(value)


def local_steps(config: Mapping[str, Any] | None) -> int | None:
    """Optimizer steps per round of a ``fedavg`` / ``dpsgd`` client, None when unknown.

    ``local-epochs x ceil(samples-per-client / mini-batch-size)``; FedSGD takes one step.
    """
    mode = train_mode(config)
    if mode == "fedsgd":
        return 1
    epochs = number(_get(config, "local-epochs"))
    samples = number(_get(config, "samples-per-client"))
    mini_batch = number(_get(config, "mini-batch-size"))
    if mode not in ("fedavg", "dpsgd") or epochs is None or samples is None or not mini_batch:
        return None
    return int(epochs) * math.ceil(samples / mini_batch)


def _first_number(
    sources: list[tuple[str, Mapping[str, Any] | None]], keys: tuple[str, ...]
) -> tuple[float, str] | None:
    """The first of ``keys`` holding a number (or ``"inf"``) in ``sources``, with where it was found."""
    for name, source in sources:
        if not isinstance(source, Mapping):
            continue
        for key in keys:
            value = source.get(key)
            if value == "inf" or (isinstance(value, float) and math.isinf(value)):
                return math.inf, f"{name}: {key}"
            found = number(value)
            if found is not None:
                return found, f"{name}: {key}"
    return None


def dp_budget(config: Mapping[str, Any] | None, history: Mapping[str, Any] | None) -> DpBudget | None:
    """The DP epsilon (and delta) the run recorded, None when it recorded none."""
    sources: list[tuple[str, Mapping[str, Any] | None]] = [("run_config.json", config)]
    if isinstance(history, Mapping):
        sources.append(("history.json", history))
        dp = history.get("dp")
        sources.append(("history.json dp", dp if isinstance(dp, Mapping) else None))
        rounds = history.get("rounds")
        if isinstance(rounds, list):
            trained = [
                item
                for item in rounds
                if isinstance(item, Mapping) and isinstance(item.get("train"), Mapping)
            ]
            if trained:
                sources.append((f"history.json round {trained[-1].get('round')} train", trained[-1]["train"]))
    epsilon = _first_number(sources, _EPSILON_KEYS)
    if epsilon is None:
        return None
    delta = _first_number(sources, _DELTA_KEYS)
    return DpBudget(epsilon=epsilon[0], delta=None if delta is None else delta[0], source=epsilon[1])


def active_defenses(config: Mapping[str, Any] | None, history: Mapping[str, Any] | None) -> list[Defense]:
    """The defenses a run had on: DP-SGD, secure aggregation, FedAvg with several local steps."""
    defenses: list[Defense] = []
    mode = train_mode(config)
    if mode == "dpsgd":
        noise = number(_get(config, "noise-multiplier"))
        clip = number(_get(config, "max-grad-norm"))
        clip_text = "" if clip is None else f"clipping norm {clip:g}"
        budget = dp_budget(config, history)
        if noise == 0:
            text = "DP-SGD clipping without noise" + (f" ({clip_text})" if clip_text else "")
        else:
            parts = [] if noise is None else [f"noise multiplier {noise:g}"]
            parts += [clip_text] if clip_text else []
            parts += [budget.text()] if budget is not None else []
            text = "DP-SGD" + (f" ({', '.join(parts)})" if parts else "")
        defenses.append(Defense("dpsgd", text))
    group = secagg_group_size(config)
    if group > 1:
        defenses.append(Defense("secagg", f"secure aggregation over groups of {group} clients"))
    if mode == "fedavg":
        steps = local_steps(config)
        epochs = number(_get(config, "local-epochs"))
        mini_batch = number(_get(config, "mini-batch-size"))
        shape = (
            f"{epochs:g} epoch(s) over mini-batches of {mini_batch:g}"
            if epochs is not None and mini_batch is not None
            else "several local epochs"
        )
        if steps is None:
            defenses.append(Defense("fedavg", f"FedAvg local training ({shape})"))
        elif steps > 1:
            defenses.append(Defense("fedavg", f"FedAvg with {steps} local steps per round ({shape})"))
    return defenses


def relevant_settings(config: Mapping[str, Any] | None) -> tuple[list[tuple[str, Any]], list[str]]:
    """The settings that played a part in the run, and the keys left out.

    A key is left out when it cannot have changed what the server saw or recovered: the
    other training modes' keys, ``secagg-group-size`` at 1, ``labels-per-client`` without
    label skew, ``test-limit`` without server evaluation, empty layer keys, ``attack-fraction``
    when partitions are named, a zero ``attack-batch-size`` / ``attack-local-steps`` /
    ``dataset-limit`` / ``depth``,
    an empty ``data-root``, ``attack-enabled`` when true, and ``output-dir``.

    Returns
    -------
    tuple[list[tuple[str, Any]], list[str]]
        ``[(key, value), ...]`` in the config's order, and the omitted keys.
    """
    if config is None:
        return [], []
    mode = train_mode(config)
    shown: list[tuple[str, Any]] = []
    omitted: list[str] = []
    for key, value in config.items():
        if _plays_a_part(key, value, config, mode):
            shown.append((key, value))
        else:
            omitted.append(key)
    return shown, omitted


def _plays_a_part(key: str, value: Any, config: Mapping[str, Any], mode: str | None) -> bool:
    if key in _NEVER_SHOWN:
        return False
    if key in _MODE_KEYS:
        return mode is None or mode in _MODE_KEYS[key]
    if key == "secagg-group-size":
        return secagg_group_size(config) > 1
    if key == "labels-per-client":
        return config.get("partitioning") == "label-skew"
    if key == "test-limit":
        return config.get("server-evaluation") is not False
    if key == "attack-fraction":
        return not config.get("attack-partitions")
    if key in ("attack-partitions", "attack-weight-key", "attack-bias-key", "data-root"):
        return bool(value)
    if key in ("attack-batch-size", "attack-local-steps", "dataset-limit", "depth"):
        return bool(number(value))
    if key == "attack-enabled":
        return value is False
    return True
