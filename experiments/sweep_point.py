"""One point of a defense sweep: its Flower simulation, and the CSV row that summarises it (leakage
from ``attacks.csv``, utility from ``history.json``, the DP-SGD epsilon)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from fl_attack.results.record import is_fallback_row
from fl_attack.vocabulary import EXACT_PSNR_DB

SWEEP_DATA: dict[str, Any] = tomllib.loads(
    Path(__file__).with_name("defenses.toml").read_text(encoding="utf-8")
)
"""The parsed ``defenses.toml``: the sweepable defenses and the CSV columns."""

COLUMN_DOCS: dict[str, str] = SWEEP_DATA["columns"]
"""What every column of ``<name>.csv`` holds (blank = not available)."""

SWEEP_COLUMNS: tuple[str, ...] = tuple(COLUMN_DOCS)
"""Columns of ``<name>.csv``, in order."""


def _number(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def leakage_of(rows: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """Leakage of one run from its ``attacks.csv`` rows (see :data:`COLUMN_DOCS`).

    Sample fractions are weighted by each update's ``num_references``; a failed attack has no
    scored samples and counts in ``attack_failures`` and against ``updates_exact_fraction``.

    Returns
    -------
    dict[str, Any]
        ``attacked_updates``, ``attack_failures``, ``scored_samples``, ``exact_fraction``,
        ``approx_fraction``, ``updates_exact_fraction``, ``mean_psnr``,
        ``median_attack_seconds`` (None where undefined).
    """
    rows = [row for row in rows if not is_fallback_row(row)]  # the exact attack's rows only
    samples = exact = approx = psnr_sum = 0.0
    exact_updates = 0
    for row in rows:
        count = _number(row.get("num_references")) if row.get("status") == "ok" else None
        if not count:
            continue
        samples += count
        exact += count * (_number(row.get("exact_fraction")) or 0.0)
        approx += count * (_number(row.get("approx_fraction")) or 0.0)
        psnr_sum += count * (_number(row.get("mean_psnr")) or 0.0)
        exact_updates += (_number(row.get("min_psnr")) or -math.inf) > EXACT_PSNR_DB
    seconds = [value for value in (_number(row.get("seconds")) for row in rows) if value is not None]
    attacked = len(rows)
    fractions: tuple[float | None, float | None] = (None, None)
    if samples > 0:
        fractions = (exact / samples, approx / samples)
    elif attacked:
        fractions = (0.0, 0.0)  # every attack failed: nothing recovered
    return {
        "attacked_updates": attacked,
        "attack_failures": sum(1 for row in rows if row.get("status") != "ok"),
        "scored_samples": int(samples),
        "exact_fraction": fractions[0],
        "approx_fraction": fractions[1],
        "updates_exact_fraction": exact_updates / attacked if attacked else None,
        "mean_psnr": psnr_sum / samples if samples > 0 else None,
        "median_attack_seconds": statistics.median(seconds) if seconds else None,
    }


def utility_of(history: Mapping[str, Any] | None) -> dict[str, Any]:
    """Initial and final test metrics from a run's ``history.json`` (None where missing)."""
    history = history or {}
    tested = [entry for entry in history.get("rounds", []) if entry.get("test")]
    initial = next((entry["test"] for entry in tested if entry.get("round") == 0), None)
    final = history.get("final_test") or (tested[-1]["test"] if tested else None)
    return {
        "initial_test_acc": None if initial is None else initial.get("test-acc"),
        "final_test_acc": None if final is None else final.get("test-acc"),
        "final_test_loss": None if final is None else final.get("test-loss"),
        "test_examples": None if final is None else final.get("test-examples"),
    }


def dpsgd_epsilon(config: Mapping[str, Any], *, delta: float = 1e-5) -> float | None:
    """Per-client DP-SGD epsilon after all rounds, as Opacus' RDP accountant counts it.

    Every client trains in every round on ``samples-per-client`` samples; Opacus samples each
    step with rate ``1 / ceil(samples / mini-batch-size)`` and takes that many steps per epoch.
    Returns ``inf`` without noise, None when the point does not train with DP-SGD.
    """
    if config.get("train-mode") != "dpsgd":
        return None
    noise = float(config["noise-multiplier"])
    if noise <= 0.0:
        return math.inf
    from opacus.accountants import RDPAccountant  # pylint: disable=import-outside-toplevel

    steps_per_epoch = math.ceil(int(config["samples-per-client"]) / int(config["mini-batch-size"]))
    steps = int(config["num-server-rounds"]) * int(config["local-epochs"]) * steps_per_epoch
    accountant = RDPAccountant()
    accountant.history = [(noise, 1.0 / steps_per_epoch, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(accountant.get_epsilon(delta))


@dataclass
class PointResult:
    """One point of the sweep: its CSV row, keyed by :data:`SWEEP_COLUMNS`."""

    row: dict[str, Any]

    @property
    def ok(self) -> bool:
        """Whether the point's simulation finished."""
        return self.row.get("status") == "ok"


def _clear_run_dir(directory: Path) -> None:
    """Remove a previous run of the same point (only a directory that is a run directory)."""
    from fl_attack.results.store import RUN_CONFIG_FILE, TABLE_FILE  # pylint: disable=import-outside-toplevel

    if directory.exists():
        if not ((directory / RUN_CONFIG_FILE).exists() or (directory / TABLE_FILE).exists()):
            raise ValueError(f"{directory} exists and is not a run directory; not overwriting it")
        shutil.rmtree(directory)


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else ""
    return "" if value is None else value


def run_point(
    parameter: str,
    value: float,
    *,
    overrides: Mapping[str, Any],
    clients: int,
    cpus: int,
    delta: float,
    csv_dir: Path,
) -> PointResult:
    """Run one point's simulation and summarise it; never raises for a failed simulation."""
    from fl_attack.results.store import HISTORY_FILE, TABLE_FILE, load_table  # pylint: disable=import-outside-toplevel
    from strategies import cli, resolve_run_config  # pylint: disable=import-outside-toplevel

    config = resolve_run_config({}, overrides)
    run_dir = Path(str(config["output-dir"]))
    epsilon = dpsgd_epsilon(config, delta=delta)
    try:
        shown_dir = str(run_dir.resolve().relative_to(csv_dir.resolve()))
    except ValueError:
        shown_dir = str(run_dir.resolve())
    row: dict[str, Any] = {
        "parameter": parameter,
        "value": value,
        "status": "ok",
        "error": "",
        "clients": clients,
    }
    row |= {"train_mode": config["train-mode"], "rounds": config["num-server-rounds"], "run_dir": shown_dir}
    if epsilon is not None:  # a DP-SGD point
        row |= {"epsilon": "inf" if math.isinf(epsilon) else round(epsilon, 4), "delta": delta}
    start = time.perf_counter()
    try:
        _clear_run_dir(run_dir)
        cli.run_audit_simulation(overrides, num_supernodes=clients, cpus=cpus)
    except (Exception, SystemExit) as error:  # pylint: disable=broad-exception-caught
        row["status"], row["error"] = "error", f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
        logging.getLogger(__name__).debug("point failed", exc_info=True)
    row["seconds"] = round(time.perf_counter() - start, 1)
    if (run_dir / TABLE_FILE).exists():
        row.update(leakage_of(load_table(run_dir / TABLE_FILE)))
    if (run_dir / HISTORY_FILE).exists() and row["status"] == "ok":
        row.update(utility_of(json.loads((run_dir / HISTORY_FILE).read_text(encoding="utf-8"))))
    return PointResult({key: _cell(row.get(key)) for key in SWEEP_COLUMNS})
