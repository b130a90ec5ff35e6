"""Every reproducible table of the SPEAR and SPEAR++ papers, read from ``tables.toml``.

A :class:`TableConfig` names its family (how its options become settings, how it is
reported), the options of a full run and what ``--quick`` changes. The published numbers are
records in the same file, matched to our rows by :func:`published`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from experiments.config import OPTION_PARSERS, Cell, Setting

DATA: dict[str, Any] = tomllib.loads((Path(__file__).with_name("tables.toml")).read_text(encoding="utf-8"))
"""The parsed ``tables.toml``: tables, published numbers, columns, notes."""

QUICK_NOTE = "a smoke test of the pipeline; its numbers are not the paper comparison"
"""How every quick run describes itself (first output line and markdown header)."""

_SHOWN = frozenset("accuracy psnr source lpips minutes mae label discrete_accuracy continuous_mae".split())
"""The keys of a published record that are shown; the others say which rows it stands beside."""


def parsed(options: Mapping[str, Any]) -> dict[str, Any]:
    """Option values from the file, read as ``--set`` reads them."""
    return {
        key: OPTION_PARSERS[key](str(value).lower() if isinstance(value, bool) else str(value))
        for key, value in options.items()
    }


def published(family: str, **fields: Any) -> dict[str, Any]:
    """The published numbers of the first record of ``family`` whose match keys equal ``fields``."""
    for record in DATA["paper"].get(family, []):
        if all(fields.get(key) == value for key, value in record.items() if key not in _SHOWN):
            return {key: value for key, value in record.items() if key in _SHOWN}
    return {}


@dataclass(frozen=True)
class TableConfig:
    """A reproducible table.

    Attributes
    ----------
    name
        Name on the command line, e.g. ``spearpp-t1``.
    source, title
        The paper table and what it measures.
    family
        Key of :data:`FAMILIES` (settings), of the columns and of the notes.
    options
        Options of a full run.
    quick
        What ``--quick`` changes: small enough to finish within a minute on 2 CPUs.
    """

    name: str
    source: str
    title: str
    family: str
    options: Mapping[str, Any]
    quick: Mapping[str, Any]

    def resolve(self, *, quick: bool, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The options of one run: full, then ``--quick``, then the user's overrides."""
        unknown = sorted(set(overrides) - set(self.options))
        if unknown:
            raise ValueError(f"{self.name} has no option {unknown}; its options: {', '.join(self.options)}")
        return {**self.options, **(self.quick if quick else {}), **overrides}

    def settings(self, options: Mapping[str, Any]) -> list[Setting]:
        """The settings of a run with ``options``.

        Raises
        ------
        ValueError
            When they select nothing to run, or name an unknown section.
        """
        settings = FAMILIES[self.family](options)
        if not settings:
            raise ValueError(f"nothing to run: the options of {self.name} select no setting")
        return settings


def _data(o: Mapping[str, Any]) -> dict[str, Any]:
    return {"dataset": o["dataset"], "data_root": o["data_root"]}


# --------------------------------------------------------------------------- families


def _fedsgd(o: Mapping[str, Any]) -> list[Setting]:
    """SPEAR++ Tables 1-2: cells x methods on FedSGD gradients; ``spear`` beside them on its cells."""
    pp_methods = tuple(m for m in o["methods"] if m != "spear")
    spear_cells = o["spear_cells"] if "spear" in o["methods"] else ()
    spear_methods, spear_trials = ("spear", *(pp_methods or ("l1",))), o["spear_trials"] or o["trials"]
    settings = [Setting("fedsgd", cell, spear_methods, spear_trials, **_data(o)) for cell in spear_cells]
    others = [cell for cell in o["cells"] if cell not in spear_cells] if pp_methods else []
    return settings + [Setting("fedsgd", cell, pp_methods, o["trials"], **_data(o)) for cell in others]


_Built = list[tuple[Cell, dict[str, Any]]]


def _dp(o: Mapping[str, Any]) -> _Built:
    return [(cell, {"noise_factor": factor}) for cell in o["cells"] for factor in o["noise_factors"]]


def _fedavg(o: Mapping[str, Any]) -> _Built:
    published_cells = {(r["b"], r["m"]): r for r in DATA["paper"]["defended"] if r["section"] == "fedavg"}
    built = []
    for cell in o["cells"]:  # the paper's (epochs, mini-batch size) at its cells unless given
        paper = published_cells.get((cell.batch_size, cell.width), {})
        epochs, mini_batch = (
            o["epochs"] or paper.get("epochs", 3),
            o["mini_batch_size"] or paper.get("mini_batch_size", 5),
        )
        built.append((cell, {"epochs": epochs, "mini_batch_size": mini_batch, "lr": o["lr"]}))
    return built


def _dpsgd(o: Mapping[str, Any]) -> _Built:
    return [
        (o["grid_cell"], {"clip_norm": clip, "noise_factor": factor})
        for clip in o["clip_norms"]
        for factor in o["dp_noise_factors"]
    ]


def _fedavg_grid(o: Mapping[str, Any]) -> _Built:
    b = o["grid_cell"].batch_size
    return [
        (o["grid_cell"], {"epochs": epochs, "mini_batch_size": mini_batch, "lr": o["lr"]})
        for mini_batch in dict.fromkeys(min(size, b) for size in o["grid_mini_batch_sizes"])
        for epochs in o["grid_epochs"]
    ]


def _lr_grid(o: Mapping[str, Any]) -> _Built:
    cell = o["grid_cell"]
    return [
        (cell, {"epochs": o["lr_grid_epochs"], "mini_batch_size": cell.batch_size, "lr": lr})
        for lr in o["grid_lrs"]
    ]


def _secagg(o: Mapping[str, Any]) -> _Built:
    b, width = o["secagg_batch_size"], o["secagg_width"] or o["grid_cell"].width
    return [(Cell(k * b, width), {"clients": k, "client_batch": b}) for k in o["secagg_clients"]]


SECTIONS: dict[str, Callable[[Mapping[str, Any]], _Built]] = {
    "dp": _dp,
    "fedavg": _fedavg,
    "dpsgd": _dpsgd,
    "fedavg-grid": _fedavg_grid,
    "lr-grid": _lr_grid,
    "secagg": _secagg,
}
"""The defended-update sections: what the server observes at which cells and parameters."""


def _defended(o: Mapping[str, Any]) -> list[Setting]:
    """DP noise, FedAvg, DP-SGD, local lr and secure aggregation (SPEAR++ Tab. 3-4, SPEAR Tab. 9-11)."""
    unknown = [s for s in o["sections"] if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; available: {', '.join(SECTIONS)}")
    settings: list[Setting] = []
    for section in o["sections"]:
        threshold = o["secagg_threshold_db"] if section == "secagg" else o["threshold_db"]
        for cell, params in SECTIONS[section](o):
            setting = Setting(section, cell, ("l1",), o["trials"], params, threshold_db=threshold, **_data(o))
            if setting not in settings:
                settings.append(setting)
    return settings


def _baseline(o: Mapping[str, Any]) -> list[Setting]:
    """SPEAR Table 1: exact attacks and Inverting Gradients on SPEAR's 6-layer victim."""
    return [
        Setting("full", cell, o["methods"], o["trials"], architecture="spear", **_data(o))
        for cell in o["cells"]
    ]


def _tabular(o: Mapping[str, Any]) -> list[Setting]:
    """SPEAR Table 2: UCI Adult through SPEAR's victim of ``depth`` layers."""
    return [
        Setting("fedsgd", cell, o["methods"], o["trials"], architecture="spear", depth=o["depth"], **_data(o))
        for cell in o["cells"]
    ]


def _by_method(o: Mapping[str, Any], **common: Any) -> list[Setting]:
    """One setting per method: SPEAR attacks the first ``spear_trials`` trials only."""
    spear_trials = min(o["spear_trials"] or o["trials"], o["trials"])
    trials = {m: spear_trials if m == "spear" else o["trials"] for m in o["methods"]}
    return [Setting(methods=(m,), trials=trials[m], architecture="spear", **common) for m in o["methods"]]


def _datasets(o: Mapping[str, Any]) -> list[Setting]:
    """SPEAR Table 3: MNIST, CIFAR-10 and image folders (``LABEL=DIR``)."""
    sources = [(name, name, o["data_root"]) for name in o["datasets"]]
    for item in o["folders"]:
        label, _, directory = item.partition("=")
        key = label.strip().lower() if directory else Path(item).expanduser().name or "folder"
        sources.append((key, "folder", directory or item))
    return [
        setting
        for key, dataset, root in sources
        for cell in o["cells"]
        for setting in _by_method(o, section="fedsgd", cell=cell, dataset=dataset, data_root=root, label=key)
    ]


def _depth(o: Mapping[str, Any]) -> list[Setting]:
    """SPEAR Table 4: the gradient of linear layer l, scored on that layer's inputs."""
    return [
        setting
        for layer in o["layers"]
        for cell in o["cells"]
        for setting in _by_method(o, section="layer", cell=cell, params={"layer": layer}, **_data(o))
    ]


FAMILIES: dict[str, Callable[[Mapping[str, Any]], list[Setting]]] = {
    "fedsgd": _fedsgd,
    "defended": _defended,
    "baseline": _baseline,
    "tabular": _tabular,
    "datasets": _datasets,
    "depth": _depth,
}
"""How each family turns options into settings."""


def _table(name: str, entry: Mapping[str, Any]) -> TableConfig:
    options = {**DATA["common"]["options"], **entry["options"]}
    quick = {**DATA["common"]["quick"], **entry.get("quick", {})}
    if entry["family"] == "defended":
        keys = [
            key
            for section in entry["options"]["sections"].split(",")
            for key in DATA["defended"]["sections"][section]
        ]
        options = {**options, **{key: DATA["defended"]["options"][key] for key in keys}}
        quick = {**{k: v for k, v in DATA["defended"]["quick"].items() if k in options}, **quick}
    for key in entry.get("drop", ()):
        options.pop(key)
    return TableConfig(name, entry["source"], entry["title"], entry["family"], parsed(options), parsed(quick))


TABLES: dict[str, TableConfig] = {name: _table(name, entry) for name, entry in DATA["tables"].items()}
"""The tables by name."""


def get_table(name: str) -> TableConfig:
    """The table called ``name``.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the tables.
    """
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; available: {', '.join(TABLES)}")
    return TABLES[name]
