"""The vocabulary of the experiments: cells, methods, settings and the options of a table.

A *table* (:mod:`experiments.tables`) is data: a family, its options for a full run and the
overrides of ``--quick``. Its family turns the options into :class:`Setting` objects, each one
configuration the attack meets (victim, what the server observes, how it is scored, how many
trials); the runner (:mod:`experiments.runner`) attacks them all the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Cell:
    """A client batch size b and the width m of the attacked layer."""

    batch_size: int
    width: int

    @property
    def label(self) -> str:
        """``"<b>x<m>"``, the form :func:`parse_cells` reads."""
        return f"{self.batch_size}x{self.width}"


@dataclass(frozen=True)
class Method:
    """An attack configuration: its label in reports and how to build it.

    Attributes
    ----------
    label
        Name in the markdown tables.
    attack
        Name in :func:`fl_attack.get_attack`, or ``"inverting-gradients"`` for the
        optimisation baseline (it needs the whole model, so it is no layer attack).
    options
        Keyword options of the attack.
    """

    label: str
    attack: str
    options: Mapping[str, Any] = field(default_factory=dict)


METHODS: dict[str, Method] = {
    "l1": Method("SPEAR++ l1 (RAdam)", "spear++", {"surrogate": "l1", "optimizer": "radam"}),
    "logcosh": Method("SPEAR++ LogCosh (RAdam)", "spear++", {"surrogate": "logcosh", "optimizer": "radam"}),
    "neg_l4": Method("SPEAR++ -l4 (RAdam)", "spear++", {"surrogate": "neg_l4", "optimizer": "radam"}),
    "pgd": Method("SPEAR++ l1 (PGD)", "spear++", {"surrogate": "l1", "optimizer": "pgd"}),
    "spear": Method("SPEAR (sampling)", "spear"),
    "ig": Method("Geiping et al. (Inverting Gradients, TV prior)", "inverting-gradients", {"tv": True}),
    "ig-notv": Method("Geiping et al. without TV prior (ablation)", "inverting-gradients", {"tv": False}),
}
"""Attack configurations by name: SPEAR++ with the ``l1`` / ``logcosh`` / ``neg_l4`` surrogates
and Riemannian Adam, ``pgd`` (l1 with projected subgradient descent), ``spear`` (SPEAR's
sampling) and the Inverting Gradients baseline of Geiping et al. with and without TV prior."""


@dataclass(frozen=True)
class Setting:
    """One configuration the attack meets; every method of it attacks the same update.

    Attributes
    ----------
    section
        What the server observes (a key of :data:`experiments.observe.OBSERVERS`).
    cell
        Batch size b (summed over clients for ``secagg``) and width m.
    methods
        Keys of :data:`METHODS`.
    trials
        Batches attacked; trial t (of every setting of the same victim and data) uses the
        same batch and victim, drawn from seed ``seed + t``.
    params
        The observation's parameters (noise factor, epochs, layer, ...), reported as columns.
    dataset, data_root, label
        The data, where it lives (None: searched) and its key in reports (an image folder's label).
    architecture, depth
        The victim of :func:`fl_attack.simulate.victims.build_victim`.
    threshold_db
        Mean PSNR above which an image batch counts as recovered.
    """

    section: str
    cell: Cell
    methods: tuple[str, ...]
    trials: int
    params: Mapping[str, Any] = field(default_factory=dict)
    dataset: str = "cifar10"
    data_root: str | None = None
    label: str = ""
    architecture: str = "spear++"
    depth: int | None = None
    threshold_db: float = 90.0

    @property
    def data_key(self) -> tuple[str, str | None]:
        """The dataset and its root."""
        return (self.dataset, self.data_root)

    @property
    def victim_key(self) -> tuple[str, str | None, str, int | None, Cell]:
        """Settings with the same key attack the same batches and victims."""
        return (self.dataset, self.data_root, self.architecture, self.depth, self.cell)

    @property
    def fields(self) -> dict[str, Any]:
        """What names the setting in CSV and summary rows: section, dataset, b, m, parameters."""
        cell = {"b": self.cell.batch_size, "m": self.cell.width}
        return {"section": self.section, "dataset": self.label or self.dataset, **cell, **self.params}


# --------------------------------------------------------------------------- option values


def parse_names(text: str) -> tuple[str, ...]:
    """Split a comma-separated list, dropping blanks."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_cells(text: str) -> tuple[Cell, ...]:
    """``"20x200,25x200"`` as cells; an empty string gives none.

    Raises
    ------
    ValueError
        On an entry not of the form ``<b>x<m>`` with positive sizes.
    """
    cells = []
    for item in parse_names(text):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"cell {item!r} is not of the form <b>x<m>, e.g. 20x200")
        batch_size, width = (int(part) for part in parts)
        if batch_size < 1 or width < 1:
            raise ValueError(f"cell {item!r} needs a positive batch size and width")
        cells.append(Cell(batch_size, width))
    return tuple(cells)


def _number(kind: Callable[[str], Any], *, minimum: float, strict: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text.strip())
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise ValueError(f"{text!r} must be {'>' if strict else '>='} {minimum:g}")
        return value

    return parse


def _list(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    return lambda text: tuple(item(part) for part in parse_names(text))


def _optional(item: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text.strip().lower() in ("", "none") else item(text)


def _methods(text: str) -> tuple[str, ...]:
    names = parse_names(text)
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        raise ValueError(f"unknown or no methods {list(unknown)}; available: {', '.join(METHODS)}")
    return names


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise ValueError(f"{text!r} is not a boolean (true/false)")
    return lowered in ("true", "1")


def _one_cell(text: str) -> Cell:
    cells = parse_cells(text)
    if len(cells) != 1:
        raise ValueError(f"{text!r} must be exactly one cell, e.g. 20x200")
    return cells[0]


_COUNT = _number(int, minimum=1, strict=False)
_SECONDS = _number(float, minimum=0, strict=True)
_NONNEGATIVE = _number(float, minimum=0, strict=False)

OPTION_PARSERS: dict[str, Callable[[str], Any]] = {
    "trials": _COUNT,
    "spear_trials": _optional(_COUNT),
    "seed": int,
    "time_budget": _SECONDS,
    "spear_time_budget": _optional(_SECONDS),
    "hard_limit_slack": _NONNEGATIVE,
    "known_batch_size": _boolean,
    "known_local_steps": _boolean,
    "next_layer": _boolean,
    "warm_up": _boolean,
    "dataset": str.strip,
    "data_root": _optional(str.strip),
    "datasets": parse_names,
    "folders": parse_names,
    "cells": parse_cells,
    "spear_cells": parse_cells,
    "methods": _methods,
    "sections": parse_names,
    "layers": _list(_COUNT),
    "depth": _optional(_number(int, minimum=2, strict=False)),
    "threshold_db": float,
    "secagg_threshold_db": float,
    "noise_factors": _list(_NONNEGATIVE),
    "epochs": _optional(_COUNT),
    "mini_batch_size": _optional(_COUNT),
    "lr": _SECONDS,
    "grid_cell": _one_cell,
    "clip_norms": _list(_SECONDS),
    "dp_noise_factors": _list(_NONNEGATIVE),
    "grid_epochs": _list(_COUNT),
    "grid_mini_batch_sizes": _list(_COUNT),
    "grid_lrs": _list(_SECONDS),
    "lr_grid_epochs": _COUNT,
    "secagg_clients": _list(_COUNT),
    "secagg_batch_size": _COUNT,
    "secagg_width": _optional(_COUNT),
    "ig_iterations": _COUNT,
    "ig_tv_weight": _NONNEGATIVE,
    "ig_restarts": _COUNT,
    "ig_time_budget": _optional(_SECONDS),
}
"""How ``--set KEY=VALUE`` reads each option (lists are comma-separated; ``none`` clears)."""


def parse_option(key: str, text: str, *, allowed: Mapping[str, Any]) -> Any:
    """Read ``KEY=VALUE`` of ``--set`` for a table whose options are ``allowed``.

    Raises
    ------
    ValueError
        For a key the table does not have (the message lists its keys) or a bad value.
    """
    if key not in allowed:
        raise ValueError(f"unknown option {key!r} for this table; its options: {', '.join(allowed)}")
    try:
        return OPTION_PARSERS[key](text)
    except ValueError as error:
        raise ValueError(f"bad value for {key}: {error}") from None


def show_option(value: Any) -> str:
    """An option value in the form ``--set`` reads back."""
    if isinstance(value, Cell):
        return value.label
    if isinstance(value, tuple):
        return ",".join(show_option(item) for item in value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
