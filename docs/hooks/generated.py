"""MkDocs hook: the pages' generated parts, built from the project's own sources at build time.

A page asks for a generated block with an HTML comment on a line of its own:

- ``<!-- generated: settings -->``: every run-config key of :mod:`strategies.run_config`
  (default, allowed values, meaning), grouped as the module groups them;
- ``<!-- generated: tables -->``: the paper tables of ``experiments/tables.toml``;
- ``<!-- generated: headline -->``: one row per paper cell (``docs/headline.toml``), ours read
  from the result files under ``experiments/results/``;
- ``<!-- generated: result NAME -->``: the markdown table that the experiment runner wrote to
  ``experiments/results/NAME.md`` from its data (its title becomes a caption).

Nothing here holds a result: a result file that is missing, or a headline row that matches
no row of its file, fails the build. ``python docs/hooks/generated.py headline`` prints the
headline table (the README's copy is checked against it by ``tests/test_readme.py``).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
HEADLINE = ROOT / "docs" / "headline.toml"
MARKER = re.compile(r"^<!-- generated: (?P<what>[a-z]+)(?: (?P<argument>[\w.-]+))? -->$", re.MULTILINE)


class GeneratedError(RuntimeError):
    """A generated block cannot be built (missing file, unknown marker, unmatched row)."""


def settings_markdown() -> str:
    """The run-config keys of :data:`strategies.run_config.SETTINGS` as one table per group."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from strategies.run_config import SETTINGS

    groups: dict[str, list[Any]] = {}
    for setting in SETTINGS:
        groups.setdefault(setting.group, []).append(setting)
    parts: list[str] = []
    for group, settings in groups.items():
        parts.append(f"### {group}\n\n| key | default | allowed | meaning |\n|---|---|---|---|")
        for setting in settings:
            parts.append(
                f"| `{setting.key}` | {_value(setting.default)} | {_allowed(setting)} | "
                f"{setting.doc.replace('|', '/')} |"
            )
        parts.append("")
    return "\n".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def _allowed(setting: Any) -> str:
    if setting.choices:
        return ", ".join(f"`{choice}`" for choice in setting.choices)
    bounds = []
    if setting.positive:
        bounds.append("> 0")
    elif setting.minimum is not None:
        bounds.append(f">= {setting.minimum:g}")
    if setting.maximum is not None:
        bounds.append(f"<= {setting.maximum:g}")
    return ", ".join(bounds) or type(setting.default).__name__


def tables_markdown() -> str:
    """The paper tables of ``experiments/tables.toml``: name, what it reproduces, the command."""
    tables = tomllib.loads((ROOT / "experiments" / "tables.toml").read_text())["tables"]
    rows = ["| table | reproduces | command |", "|---|---|---|"]
    for name, table in tables.items():
        rows.append(
            f"| `{name}` | {table['source']}: {table['title']} | `python -m experiments run {name}` |"
        )
    return "\n".join(rows) + "\n"


def result_markdown(name: str) -> str:
    """The table the experiment runner wrote to ``experiments/results/NAME.md``, title as a caption."""
    path = RESULTS / f"{name}.md"
    if not path.is_file():
        raise GeneratedError(f"experiments/results/{name}.md does not exist")
    text = path.read_text()
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines[0] = f"**{lines[0][2:].strip()}** (`experiments/results/{name}.md`)"
    else:
        lines.insert(0, f"From `experiments/results/{name}.md`:\n")
    # the runner's own headings go below the page's
    lines = [f"#{line}" if re.match(r"#{1,5} \S", line) else line for line in lines]
    return "\n".join(lines) + "\n"


def _result_rows(name: str) -> list[dict[str, Any]]:
    """The summary rows of a result file: ``NAME.json``'s ``rows``, or ``NAME.csv``'s trials summed."""
    json_path, csv_path = RESULTS / f"{name}.json", RESULTS / f"{name}.csv"
    if json_path.is_file():
        rows: list[dict[str, Any]] = json.loads(json_path.read_text())["rows"]
        return rows
    if not csv_path.is_file():
        raise GeneratedError(f"experiments/results/{name}.json (or .csv) does not exist")
    with csv_path.open() as handle:
        trials = list(csv.DictReader(handle))
    cells: dict[tuple[int, int, str], list[dict[str, str]]] = {}
    for trial in trials:
        cells.setdefault((int(trial["b"]), int(trial["m"]), trial["method"]), []).append(trial)
    summaries = []
    for (b, m, method), members in cells.items():
        summaries.append(
            {
                "b": b,
                "m": m,
                "method": method,
                "trials": len(members),
                "successes": sum(int(member["ok"]) for member in members),
                "mean_psnr": statistics.fmean(float(member["mean_psnr"]) for member in members),
                "median_seconds": statistics.median(float(member["seconds"]) for member in members),
            }
        )
    return summaries


def _matching(rows: Sequence[Mapping[str, Any]], match: Mapping[str, Any], name: str) -> dict[str, Any]:
    found = [row for row in rows if all(row.get(key) == value for key, value in match.items())]
    if len(found) != 1:
        raise GeneratedError(f"{len(found)} rows of experiments/results/{name} match {dict(match)}")
    return dict(found[0])


def pooled_row(sources: Sequence[str], match: Mapping[str, Any]) -> dict[str, Any]:
    """The row matching ``match`` in each result file, pooled over the files.

    Trials and successes add up, mean PSNRs are weighted by trials; the median seconds of
    several files become their range (``seconds_range``).
    """
    rows = [_matching(_result_rows(source), match, source) for source in sources]
    if len(rows) == 1:
        row = rows[0]
        row["seconds_range"] = f"{row['median_seconds']:.1f} s" if "median_seconds" in row else ""
        return row
    trials = sum(row["trials"] for row in rows)
    pooled = dict(rows[0])
    pooled["trials"] = trials
    pooled["successes"] = sum(row["successes"] for row in rows)
    pooled["accuracy"] = 100.0 * pooled["successes"] / trials
    pooled["mean_psnr"] = sum(row["mean_psnr"] * row["trials"] for row in rows) / trials
    seconds = sorted(row["median_seconds"] for row in rows)
    pooled["seconds_range"] = f"{seconds[0]:.0f}-{seconds[-1]:.0f} s"
    return pooled


def headline_rows() -> list[dict[str, str]]:
    """One dict per paper cell of ``docs/headline.toml``: paper, cell, paper's result, ours, time, data."""
    cells = tomllib.loads(HEADLINE.read_text())["cell"]
    rendered = []
    for cell in cells:
        sources = cell["data"] if isinstance(cell["data"], list) else [cell["data"]]
        row = pooled_row(sources, cell.get("match", {}))
        rendered.append(
            {
                "paper": cell["paper"],
                "cell": cell["cell"],
                "published": cell["published"],
                "ours": cell["ours"].format(**row),
                "time": cell.get("time", "{seconds_range}").format(**row),
                "data": ", ".join(f"`{source}`" for source in sources),
            }
        )
    return rendered


def headline_markdown() -> str:
    """The headline table: one row per paper cell."""
    lines = [
        "| paper | cell | paper's result | ours | time / batch (ours) | data (`experiments/results/`) |",
        "|---|---|---|---|---|---|",
    ]
    for row in headline_rows():
        lines.append(
            f"| {row['paper']} | {row['cell']} | {row['published']} | {row['ours']} | {row['time']} | {row['data']} |"
        )
    return "\n".join(lines) + "\n"


def render(markdown: str) -> str:
    """``markdown`` with every generated block filled in."""

    def fill(found: re.Match[str]) -> str:
        what, argument = found.group("what"), found.group("argument")
        if what == "settings":
            return settings_markdown()
        if what == "tables":
            return tables_markdown()
        if what == "headline":
            return headline_markdown()
        if what == "result" and argument:
            return result_markdown(argument)
        raise GeneratedError(f"unknown generated block {found.group(0)!r}")

    return MARKER.sub(fill, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: fill the page's generated blocks."""
    return render(markdown)


if __name__ == "__main__":
    if sys.argv[1:] != ["headline"]:
        raise SystemExit("usage: python docs/hooks/generated.py headline")
    print(headline_markdown(), end="")
