"""The markdown and the plot of a defense sweep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.report import Column, markdown_table

Rows = Sequence[Mapping[str, Any]]


def percent(value: Any) -> str:
    """A fraction as a percentage, a dash when blank."""
    return "—" if value in ("", None) else f"{100.0 * float(value):.0f}%"


def fixed(value: Any, digits: int = 3) -> str:
    """A number with ``digits`` decimals, text as it is, a dash when blank."""
    if value in ("", None):
        return "—"
    return value if isinstance(value, str) else f"{float(value):.{digits}f}"


def _epsilon(row: Mapping[str, Any]) -> str:
    value = row.get("epsilon")
    return "—" if value in ("", None) else (value if isinstance(value, str) else f"{value:.3g}")


def sweep_markdown(rows: Rows, *, name: str, description: str, settings: Mapping[str, Any]) -> str:
    """The markdown report: the sweep's settings, then one table row per value."""
    columns = [
        Column(name, lambda r: f"{r['value']:g}" if isinstance(r["value"], (int, float)) else str(r["value"]))
    ]
    if any(row.get("epsilon") not in ("", None) for row in rows):
        columns.append(Column(f"epsilon (delta={rows[0].get('delta') or settings['delta']:g})", _epsilon))
    columns += [
        Column("exact (> 90 dB)", lambda r: percent(r["exact_fraction"])),
        Column("approx (> 25 dB)", lambda r: percent(r["approx_fraction"])),
        Column("updates exact", lambda r: percent(r["updates_exact_fraction"])),
        Column("attacks (failed)", lambda r: f"{r['attacked_updates'] or 0} ({r['attack_failures'] or 0})"),
        Column("median attack s", lambda r: fixed(r["median_attack_seconds"], 1)),
        Column("test acc round 0", lambda r: fixed(r["initial_test_acc"])),
        Column(f"test acc round {settings['rounds']}", lambda r: fixed(r["final_test_acc"])),
        Column("status", lambda r: r["status"] if r["status"] == "ok" else f"error: {r['error']}"),
    ]
    overrides = {**settings["base_overrides"], **settings["user_overrides"]}
    shown = " ".join(f"`{key}={value!r}`" for key, value in overrides.items()) or "none"
    setup = (
        f"{description}. {settings['clients']} clients, {settings['rounds']} rounds, dataset "
        f"`{settings['dataset']}`, train mode `{settings['train_mode']}`, seed {settings['seed']}, "
        f"attack time budget {settings['attack_time_budget']:g} s; overrides: {shown}."
    )
    reading = (
        "Leakage = share of the attacked clients' samples the server recovered (PSNR after matching), over "
        'every round and client; "updates exact" = share of attacked updates recovered completely. '
        "Utility = global model's accuracy on the test split."
    )
    table = markdown_table(columns, rows, status=None)
    return "\n\n".join([f"## Defense sweep: {name}", setup, reading, table])


def plot_sweep(rows: Rows, *, name: str, integer: bool, path: Path) -> Path:
    """Leakage fractions (top) and test accuracy (bottom) against the parameter (Agg PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

    def series(column: str) -> tuple[list[float], list[float]]:
        ok = [row for row in rows if row.get("status") == "ok" and row.get(column) not in ("", None)]
        points = sorted((float(row["value"]), float(row[column])) for row in ok)
        return [x for x, _ in points], [y for _, y in points]

    figure = Figure(figsize=(6.4, 6.0), constrained_layout=True)
    FigureCanvasAgg(figure)
    leak_axis, utility_axis = figure.subplots(2, 1, sharex=True)
    for column, label, marker in (
        ("exact_fraction", "samples exact (> 90 dB)", "o"),
        ("approx_fraction", "samples approx. (> 25 dB)", "s"),
        ("updates_exact_fraction", "updates fully exact", "^"),
    ):
        leak_axis.plot(*series(column), marker=marker, label=label)
    leak_axis.set_ylabel("leakage (fraction recovered)")
    leak_axis.set_ylim(-0.05, 1.05)
    xs, ys = series("final_test_acc")
    xs0, ys0 = series("initial_test_acc")
    rounds = next((row["rounds"] for row in rows if row.get("rounds") not in ("", None)), "?")
    utility_axis.plot(xs, ys, marker="o", color="tab:green", label=f"after round {rounds}")
    utility_axis.plot(xs0, ys0, linestyle="--", color="tab:gray", label="initial model")
    utility_axis.set_ylim(0.0, min(1.0, max(ys + ys0) + 0.1) if ys + ys0 else 1.0)
    utility_axis.set_ylabel("test accuracy")
    utility_axis.set_xlabel(name)
    for axis in (leak_axis, utility_axis):
        axis.legend(loc="best", fontsize="small")
        axis.grid(alpha=0.3)
    if integer:
        utility_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    values = sorted(float(row["value"]) for row in rows)
    positive = [value for value in values if value > 0]
    if positive and values[-1] / positive[0] >= 50:  # a wide range on a log axis (symlog with a 0)
        if values[0] <= 0:
            utility_axis.set_xscale("symlog", linthresh=positive[0])
            utility_axis.set_xlim(-0.2 * positive[0], 1.3 * values[-1])
        else:
            utility_axis.set_xscale("log")
    figure.suptitle(f"Privacy-utility trade-off: {name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
