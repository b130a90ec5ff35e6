"""The markdown of a run: ours beside the paper's numbers, and how to read them.

Each family's columns and notes are data (``[columns]`` and ``[notes]`` of ``tables.toml``);
a column renders one key of a summary row (:func:`experiments.runner.summary_rows`) with a
format of :data:`FORMATS`. A row that was not run (a dataset not requested, a layer that cannot
be attacked) shows its reason in place of our numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from experiments.config import show_option
from experiments.tables import DATA, QUICK_NOTE, TableConfig

Row = Mapping[str, Any]


def _missing(value: Any) -> bool:
    return value is None or value == ""


def number(value: Any, digits: int) -> str:
    """A float with ``digits`` decimals, or an em dash for a missing value."""
    return (
        "—" if _missing(value) or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"
    )


def compact(value: Any) -> str:
    """Three significant digits for floats, as is for the rest, a dash for a missing value."""
    return "—" if _missing(value) else (f"{value:.3g}" if isinstance(value, float) else str(value))


def _scientific(value: Any) -> str:
    if _missing(value):
        return "—"
    return "NaN" if math.isnan(value) else f"{value:.2e}"


def _small(value: Any) -> str:
    if _missing(value) or math.isnan(value):
        return "—"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}" if value >= 0.01 or value == 0 else f"{value:.1e}"


def _value(fmt: Callable[[Any], str]) -> Callable[[Row, str], str]:
    return lambda row, key: fmt(row.get(key))


FORMATS: dict[str, Callable[[Row, str], str]] = {
    "text": _value(lambda v: "—" if _missing(v) else str(v)),
    "g3": _value(compact),
    "num1": _value(lambda v: number(v, 1)),
    "num2": _value(lambda v: number(v, 2)),
    "num3": _value(lambda v: number(v, 3)),
    "pct": _value(lambda v: "—" if _missing(v) else f"{v:.0f}%"),
    "share": _value(lambda v: "—" if _missing(v) else f"{100 * v:.0f}%"),
    "x100": _value(lambda v: compact(None if _missing(v) else 100 * v)),
    "sci": _value(_scientific),
    "small": _value(_small),
    "minutes": _value(lambda v: "—" if _missing(v) else f"{v:g} min"),
    "min2": _value(lambda v: "—" if _missing(v) else f"{v:.2f} min"),
    "duration": _value(lambda v: f"{v:.1f} s" if v < 120 else f"{v / 60:.1f} min"),
    "acc": lambda row, key: f"{row[key]:.0f}% ({row['successes']}/{row['trials']})",
    "count": lambda row, key: f"{row[key]}/{row['trials']}" if key in row else "—",
    "mae": lambda row, key: f"{_scientific(row.get(key))} / {_scientific(row.get(f'median_{key}'))}",
}
"""Cell formats by name: a function of the summary row and the column's key."""


@dataclass(frozen=True)
class Column:
    """A markdown column: ``kind`` is ``id`` (names the row), ``ours`` or ``paper``."""

    header: str
    render: Callable[[Row], str]
    kind: str = "ours"


def _cell(render: Callable[[Row, str], str], key: str, row: Row) -> str:
    return render(row, key)


def columns_of(name: str) -> list[Column]:
    """The columns of a family (or of a defended section) in ``tables.toml``, groups expanded."""
    columns = []
    for entry in DATA["columns"][name]:
        if isinstance(entry, str):  # "@group"
            columns += columns_of(entry.removeprefix("@"))
            continue
        header, key, fmt, *kind = entry
        default = "paper" if key.startswith("paper_") else "ours"
        columns.append(
            Column(header, functools.partial(_cell, FORMATS[fmt], key), kind[0] if kind else default)
        )
    return columns


def markdown_table(columns: Sequence[Column], rows: Sequence[Row], *, status: str | None = "status") -> str:
    """A GitHub-flavoured markdown table; a row whose ``status`` key is not ``"run"`` shows it in
    place of our numbers."""
    header = "| " + " | ".join(c.header for c in columns) + " |"
    lines = [header, "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        if status is None or row.get(status, "run") == "run":
            cells = [c.render(row) for c in columns]
        else:
            first = next(i for i, c in enumerate(columns) if c.kind == "ours")
            cells = [
                c.render(row) if c.kind != "ours" else (row[status] if i == first else "")
                for i, c in enumerate(columns)
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spear_hit_probability(batch_size: int, width: int) -> float:
    """Chance that a random ``(b-1)``-row submatrix lies in one sample's inactive half."""
    return math.comb(width // 2, batch_size - 1) / math.comb(width, batch_size - 1)


def spear_expected_samples(batch_size: int, width: int) -> float:
    """Expected submatrices until SPEAR has hit all ``b`` directions (coupon collector)."""
    p = spear_hit_probability(batch_size, width)
    return sum(1.0 / (k * p) for k in range(1, batch_size + 1))


def _sampling_note(rows: Sequence[Row]) -> list[str]:
    """How far SPEAR's sampling is from finding every direction at the rate measured here."""
    sampled = [r for r in rows if r.get("method") == "spear" and r.get("median_proposals")]
    if not sampled:
        return []
    b, m = sampled[0]["b"], sampled[0]["m"]
    rate = sum(r["median_proposals"] / max(r["median_seconds"], 1e-9) for r in sampled) / len(sampled)
    counts = "; ".join(
        f"{r['label']}: {r['median_proposals']:.3g} in {r['median_seconds']:.0f} s" for r in sampled
    )
    expected = spear_expected_samples(b, m)
    probability = spear_hit_probability(b, m)
    return [
        f"SPEAR's submatrices sampled per batch (median): {counts}. A random (b-1)-row submatrix yields a "
        f"given sample's direction with probability C(m/2, b-1) / C(m, b-1) = {probability:.1e}, so all "
        f"b = {b} directions take ~{expected:.1e} samples: ~{expected / rate / 3600:.1f} h at this rate."
    ]


def _parts(family: str, rows: Sequence[Row], options: Mapping[str, Any]) -> list[str]:
    """The family's tables: one per defended section, extra rows and tables where it has them."""
    if family == "defended":
        parts = []
        for section in options["sections"]:
            chosen = [r for r in rows if r["section"] == section]
            if chosen:
                threshold = f"Accuracy at mean PSNR > {chosen[0]['threshold_db']:g} dB."
                table = markdown_table(columns_of(section), chosen)
                parts.append(f"## {DATA['sections'][section]}\n\n{threshold}\n\n{table}")
        return parts
    if family == "tabular":  # the paper's rows first; the continuous MAE per feature below
        published = [
            {**r, "method_label": r["label"], "source": "SPEAR Tab. 2 (paper, GPU)"}
            for r in DATA["paper"]["tabular"]
        ]
        ours = [
            {**r, "source": f"ours ({r['trials']} batches, CPU)", "minutes": r["median_seconds"] / 60}
            for r in rows
        ]
        features = [key.removeprefix("mae_") for key in (rows[0] if rows else {}) if key.startswith("mae_")]
        per_feature = [Column("method", functools.partial(_cell, FORMATS["text"], "method_label"), "id")]
        per_feature += [Column(f, functools.partial(_cell, FORMATS["small"], f"mae_{f}")) for f in features]
        return [
            markdown_table(columns_of(family), [*published, *ours]),
            "Continuous MAE per feature (original units, mean over batches):\n\n"
            + markdown_table(per_feature, rows),
        ]
    if family == "datasets":  # the paper's datasets we did not run
        given = {r["label"] for r in rows}
        missing = [
            {
                "label": r["label"],
                **{f"paper_{k}": v for k, v in r.items()},
                "status": "not requested (--set datasets=...)"
                if r["dataset"] in ("mnist", "cifar10")
                else "no image folder offline (--set folders=LABEL=DIR)",
            }
            for r in DATA["paper"]["datasets"]
            if r["label"] not in given
        ]
        rows = [*rows, *missing]
    return [markdown_table(columns_of(family), rows)]


def quick_banner(table: TableConfig, options: Mapping[str, Any]) -> str:
    """The line that opens a quick run's output and its markdown."""
    size = f"{options['trials']} trial(s), {options['time_budget']:g} s budgets"
    return f"QUICK RUN of {table.name} ({size}): {QUICK_NOTE}."


def render(table: TableConfig, options: Mapping[str, Any], rows: Sequence[Row], *, quick: bool) -> str:
    """The whole markdown report of a run."""
    spear_budget = options.get("spear_time_budget") or options["time_budget"]
    spear_runs = min(options.get("spear_trials") or options["trials"], options["trials"])
    given = "given to" if options["known_batch_size"] else "estimated by"
    context = {**options, "given": given, "spear_budget": spear_budget, "spear_runs": spear_runs}
    notes = [note.format(**context) for note in [*DATA["notes"][table.family], *DATA["notes"]["common"]]]
    if table.family == "datasets":
        notes += _sampling_note(rows)
    changed = {key: value for key, value in options.items() if table.options.get(key) != value}
    if changed:
        notes.append(
            "Options changed from the full run: "
            + ", ".join(f"`{k}={show_option(v)}`" for k, v in changed.items())
        )
    title = f"# {table.source}: {table.title}" + (" (quick run, not the paper comparison)" if quick else "")
    header = [title, f"> {quick_banner(table, options)}"] if quick else [title]
    return "\n\n".join(
        [*header, *_parts(table.family, rows, options), "\n".join(f"- {note}" for note in notes)]
    )
