"""The threat-model card: what the server saw, what it knew, and how the run was scored.

Each card item is a label and a value made of segments (``("text", ...)`` or ``("code", ...)``)
so that the template marks up code without any pre-built HTML.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fl_attack.results.report.loading import RunData, number
from fl_attack.results.report.settings import dp_budget, local_steps, secagg_group_size, train_mode
from fl_attack.vocabulary import INPUT_SPACE_FEATURES, INPUT_SPACE_INPUTS

__all__ = ["CardItem", "Segment", "threat_model_card"]

#: ``(kind, text)`` with kind ``"text"`` or ``"code"``.
Segment = tuple[str, str]
#: ``{"label": str, "value": list[Segment], "key": str}``.
CardItem = dict[str, Any]

_INPUT_SPACE_TEXT = {
    INPUT_SPACE_INPUTS: (
        "inputs: the attacked layer is the model's first, so what it recovers is the client's data"
    ),
    INPUT_SPACE_FEATURES: (
        "features: the attacked layer follows other layers, so what it recovers are the "
        "client samples' features at that layer, not the raw data"
    ),
}


def _item(key: str, label: str, *segments: Segment) -> CardItem:
    return {"key": key, "label": label, "value": list(segments)}


def _text(value: str) -> Segment:
    return ("text", value)


def _code(value: Any) -> Segment:
    return ("code", str(value))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def threat_model_card(data: RunData) -> list[CardItem]:
    """The card's items for one run (see the module docstring for their shape)."""
    config = data.config
    get = (lambda key: None) if config is None else config.get
    items = [
        _item(
            "server",
            "Server",
            _text(
                "honest-but-curious: it runs the federated protocol and aggregates exactly as the inner "
                "strategy would, and it runs an exact gradient-inversion attack on the updates it receives"
            ),
        ),
        _layer_item(data, get("attack-weight-key")),
        _input_space_item(data),
    ]
    group = secagg_group_size(config)
    if group > 1:
        seen = (
            f"the sum of each group of {group} clients' updates (secure aggregation), attacked as one batch"
        )
    else:
        seen = "every client's individual update (no secure aggregation)"
    items.append(_item("observed", "What the server saw", _text(seen)))
    items.append(_item("training", "Client training", *_training(config)))
    if train_mode(config) == "dpsgd":
        budget = dp_budget(config, data.history)
        items.append(
            _item(
                "dp-epsilon",
                "DP guarantee",
                _text(
                    f"{budget.text()}, as recorded in {budget.source}"
                    if budget is not None
                    else "epsilon not recorded by this run (run_config.json and history.json give none)"
                ),
            )
        )
    items.append(
        _item(
            "secagg",
            "Secure aggregation",
            _text(
                f"groups of {group} clients" if group > 1 else "none (the server sees each client's update)"
            ),
        )
    )
    told = number(get("attack-batch-size"))
    items.append(
        _item(
            "knowledge",
            "Attacker's knowledge",
            _text(
                "the global parameters of the attacked layer and the client's update of it; "
                + (
                    f"it was told the batch size ({told:g} per client); "
                    if told
                    else "it estimated the batch size itself; "
                )
                + "it never sees the clients' data or labels"
            ),
        )
    )
    items.append(_item("ground-truth", "Ground truth", _text(_scoring(data, get("audit-ground-truth")))))
    targets = _targets(
        get("attack-partitions"), number(get("attack-fraction")), number(get("attack-time-budget"))
    )
    items.append(_item("targets", "Attacked updates", _text(targets)))
    if get("dataset") is not None:
        rest = _known(
            ("{} samples per client", get("samples-per-client")),
            ("{} partitioning", get("partitioning")),
            ("{} round(s)", get("num-server-rounds")),
        )
        items.append(
            _item("data", "Data", _code(get("dataset")), _text("".join(f", {part}" for part in rest)))
        )
    return items


def _layer_item(data: RunData, weight_key: Any) -> CardItem:
    layer = next(
        (entry.details["layer"] for entry in data.entries if isinstance(entry.details.get("layer"), Mapping)),
        None,
    )
    if layer is not None:
        return _item(
            "layer",
            "Attacked layer",
            _text("weight "),
            _code(layer.get("weight")),
            _text(" and bias "),
            _code(layer.get("bias")),
        )
    if weight_key:
        return _item("layer", "Attacked layer", _text("weight "), _code(weight_key))
    return _item(
        "layer", "Attacked layer", _text("the model's first 2-D weight and its bias (default; not recorded)")
    )


def _input_space_item(data: RunData) -> CardItem:
    spaces = sorted({entry.input_space for entry in data.entries if entry.input_space is not None})
    if not spaces:
        text = "not recorded by this run"
    else:
        text = "; ".join(_INPUT_SPACE_TEXT[space] for space in spaces)
    return _item("input-space", "Input space", _text(text))


def _known(*parts: tuple[str, Any]) -> list[str]:
    """``template.format(value)`` for every part whose value was recorded."""
    return [template.format(_show(value)) for template, value in parts if value is not None and value != ""]


def _training(config: Mapping[str, Any] | None) -> list[Segment]:
    mode = train_mode(config)
    get = (lambda key: None) if config is None else config.get
    if mode == "fedsgd":
        parts = _known(("a batch of {} samples", get("batch-size")), ("learning rate {}", get("local-lr")))
        return [
            _text(
                "FedSGD: each client sends one gradient step"
                + (f" ({', '.join(parts)})" if parts else "")
                + ", the setting in which exact recovery is expected"
            )
        ]
    if mode in ("fedavg", "dpsgd"):
        steps = local_steps(config)
        parts = _known(
            ("{} local epoch(s)", get("local-epochs")),
            ("mini-batches of {} samples", get("mini-batch-size")),
            ("learning rate {}", get("local-lr")),
            ("{} optimizer step(s) per round", steps),
        )
        if mode == "dpsgd":
            parts += _known(
                ("per-sample gradients clipped to norm {}", get("max-grad-norm")),
                ("Gaussian noise with multiplier {}", get("noise-multiplier")),
                ("Poisson sampling {}", get("poisson-sampling")),
            )
        name = "FedAvg" if mode == "fedavg" else "DP-SGD (Opacus)"
        return [_text(name + (f": {', '.join(parts)}" if parts else ""))]
    if mode is None:
        return [_text("not recorded (no run_config.json or no train-mode in it)")]
    return [_text("training mode "), _code(mode)]


def _scoring(data: RunData, ground_truth: Any) -> str:
    any_scored = any(entry.scored for entry in data.entries)
    if any_scored:
        return (
            "used only to score the reconstructions afterwards (PSNR of every sample against its "
            "best-matched reconstruction); the attacker never sees it"
        )
    if ground_truth is False:
        return "not collected (audit-ground-truth=false): the reconstructions are not scored"
    return "not used: no reconstruction was scored in this run"


def _targets(partitions: Any, fraction: float | None, budget: float | None) -> str:
    if partitions:
        text = f"the clients of partitions {partitions}"
    elif fraction is None or fraction >= 1.0:
        text = "every client update"
    else:
        text = f"a random {100.0 * fraction:.0f}% of the client updates per round"
    return text + ("" if budget is None else f", with a search budget of {budget:g} s per update")
