"""Self-contained HTML report of an audit run directory.

:func:`write_report` reads a run directory written by
:class:`~fl_attack.results.store.ReconstructionStore` (``run_config.json``, ``attacks.csv``,
``history.json`` and every attack's ``metrics.json`` / ``reconstruction.png``) and writes

* ``<run>/report.html``: one HTML file that opens offline in any browser; every picture is
  a base64-embedded PNG and there is no external CSS, JavaScript or font (a
  Content-Security-Policy forbids fetching anything);
* ``<run>/report/*.png``: the same plots as PNG files (matplotlib, Agg canvas).

The report holds the run's configuration and the threat model derived from it, the share
of client samples recovered exactly (> ``fl_attack.evaluation.metrics.EXACT_PSNR_DB`` = 90 dB) and
approximately (> ``APPROX_PSNR_DB`` = 25 dB) overall and per round beside the global model's test
accuracy, the PSNR distribution, the attack's time per client, the best and worst
reconstructions beside their ground truth, per-client recovery inside secure-aggregation
sums, and every failed attack with its error.

The report shows private data (ground-truth samples), so like the rest of the store it is
written atomically with mode ``0o600`` in directories of mode ``0o700``.

``fl-attack-report RUN_DIR [-o FILE]`` runs :func:`write_report` from the command line.
No Flower import lives here.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from PIL import Image, ImageDraw, ImageFont

from fl_attack.evaluation.metrics import APPROX_PSNR_DB, EXACT_PSNR_DB
from fl_attack.results.store import (
    GRID_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    RUN_CONFIG_FILE,
    TABLE_FILE,
    atomic_write_bytes,
    load_table,
    make_private_directory,
)

__all__ = [
    "NotARunDirectoryError",
    "REPORT_DIRECTORY",
    "REPORT_FILE",
    "RunData",
    "entry_point",
    "load_run",
    "main",
    "write_report",
]

#: Name of the report inside the run directory.
REPORT_FILE = "report.html"
#: Folder (inside the run directory) of the report's plots as PNG files.
REPORT_DIRECTORY = "report"

#: Samples shown among the best and among the worst reconstructions.
_GALLERY_SIZE = 8
#: Side in pixels of one sample in the best / worst galleries.
_GALLERY_TILE = 96
#: Unscored reconstruction grids shown when no sample has a score.
_UNSCORED_GRIDS = 6
#: Attacks drawn as labelled bars in the timing plot; beyond, a strip plot per round.
_MAX_BARS = 48
_STATUS_COLOURS = {
    "ok": "#2a7ab9",
    "error": "#c0392b",
    "timeout": "#e67e22",
    "out-of-memory": "#8e44ad",
}
_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "script-src 'none'; font-src 'none'; connect-src 'none'"
)
_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 72em; color: #222;
       line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.headline { font-size: 1.1em; } .headline b { font-size: 1.2em; }
.note { color: #555; font-size: 0.92em; } .warn { color: #a33; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; height: auto; } img.pixels { image-rendering: pixelated; }
code { background: #f4f4f4; padding: 0 0.2em; }
.status-ok { color: #1a6; } .status-error, .status-timeout, .status-out-of-memory { color: #a33; }
"""


class NotARunDirectoryError(ValueError):
    """The directory given is not a run directory (it has no ``attacks.csv``)."""


@dataclass
class AttackEntry:
    """One row of ``attacks.csv`` with what its ``metrics.json`` adds.

    Attributes
    ----------
    server_round : int
        Federated round of the attacked update.
    client : str
        Client (or ``secagg-...`` group) name.
    status : str
        ``ok``, ``error``, ``timeout`` or ``out-of-memory``.
    seconds : float or None
        Attack wall-clock time.
    error : str
        Error message (empty when none).
    row : dict[str, str]
        The raw table row.
    psnr : list[float] or None
        Per ground-truth sample PSNR (None: not scored).
    details : dict[str, Any]
        ``details`` of ``metrics.json`` (node / partition ids, layer, members, ...).
    grid : dict[str, Any] or None
        Geometry of ``reconstruction.png`` and its per-column PSNR.
    grid_png : Path or None
        The attack's ``reconstruction.png`` when present.
    """

    server_round: int
    client: str
    status: str
    seconds: float | None
    error: str
    row: dict[str, str]
    psnr: list[float] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, Any] | None = None
    grid_png: Path | None = None

    @property
    def scored(self) -> bool:
        """Whether ground-truth scores exist for this attack."""
        return self.scored_count > 0

    @property
    def scored_count(self) -> int:
        """Number of scored ground-truth samples."""
        if self.psnr is not None:
            return len(self.psnr)
        count = _number(self.row.get("num_references"))
        return 0 if count is None or _number(self.row.get("exact_fraction")) is None else int(count)

    def recovered(self, threshold: float) -> int:
        """Number of scored samples above ``threshold`` dB."""
        if self.psnr is not None:
            return sum(1 for value in self.psnr if value > threshold)
        # No metrics.json: fall back on the table's fractions.
        column = "exact_fraction" if threshold >= EXACT_PSNR_DB else "approx_fraction"
        fraction = _number(self.row.get(column))
        return 0 if fraction is None else int(round(fraction * self.scored_count))


@dataclass
class RunData:
    """Everything the report is made of.

    Attributes
    ----------
    directory : Path
        The run directory.
    config : dict[str, Any] or None
        ``run_config.json`` (None when missing or unreadable).
    entries : list[AttackEntry]
        One per attacked update, sorted by round and client.
    history : dict[str, Any] or None
        ``history.json`` (None when missing or unreadable).
    problems : list[str]
        Files that could not be read (reported, never fatal).
    """

    directory: Path
    config: dict[str, Any] | None
    entries: list[AttackEntry]
    history: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Sample:
    entry: AttackEntry
    column: int
    psnr: float


# --------------------------------------------------------------------------- loading


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory written by :class:`~fl_attack.results.store.ReconstructionStore`.

    Parameters
    ----------
    run_dir : str or Path
        The run directory.

    Returns
    -------
    RunData

    Raises
    ------
    NotARunDirectoryError
        When ``run_dir`` holds no ``attacks.csv``.
    """
    directory = Path(run_dir).resolve()
    table = directory / TABLE_FILE
    if not table.is_file():
        raise NotARunDirectoryError(f"{run_dir} is not a run directory (no {TABLE_FILE})")
    problems: list[str] = []
    config = _read_json(directory / RUN_CONFIG_FILE, problems)
    history = _read_json(directory / HISTORY_FILE, problems)
    entries = [_entry(row, directory, problems) for row in load_table(table)]
    entries.sort(key=lambda entry: (entry.server_round, entry.client))
    return RunData(
        directory=directory,
        config=config if isinstance(config, dict) else None,
        entries=entries,
        history=history if isinstance(history, dict) else None,
        problems=problems,
    )


def _read_json(path: Path, problems: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        problems.append(f"{path.name}: {error}")
        return None


def _entry(row: dict[str, str], run: Path, problems: list[str]) -> AttackEntry:
    number = _number(row.get("round"))
    entry = AttackEntry(
        server_round=0 if number is None else int(number),
        client=row.get("client") or "?",
        status=row.get("status") or "?",
        seconds=_number(row.get("seconds")),
        error=row.get("error") or "",
        row=row,
    )
    folder = _inside(run, row.get("directory") or "")
    if folder is None:
        return entry
    metrics = _read_json(folder / METRICS_FILE, problems)
    if isinstance(metrics, dict):
        psnr = metrics.get("psnr")
        if isinstance(psnr, list):
            entry.psnr = [float(value) for value in psnr if isinstance(value, (int, float))]
        if isinstance(metrics.get("details"), dict):
            entry.details = metrics["details"]
        if isinstance(metrics.get("grid"), dict):
            entry.grid = metrics["grid"]
    if (folder / GRID_FILE).is_file():
        entry.grid_png = folder / GRID_FILE
        if entry.grid is None:
            entry.grid = _inferred_grid(entry.grid_png, entry.psnr)
    return entry


def _inside(run: Path, relative: str) -> Path | None:
    """``run / relative`` when it stays inside the run directory, else None."""
    if not relative:
        return None
    candidate = (run / relative).resolve()
    try:
        candidate.relative_to(run)
    except ValueError:
        return None
    return candidate if candidate.is_dir() else None


def _inferred_grid(png: Path, psnr: list[float] | None) -> dict[str, Any] | None:
    """Geometry of a ``reconstruction.png`` written before ``metrics.json`` had a ``grid``.

    Assumes every ground-truth sample has a column (true unless the attack returned
    fewer rows than the batch), and checks that the picture's size agrees.
    """
    if not psnr:
        return None
    try:
        with Image.open(png) as picture:
            width, height = picture.size
    except OSError:
        return None
    rows, columns, padding = 2, len(psnr), 2
    tile_w, rest_w = divmod(width - (columns + 1) * padding, columns)
    tile_h, rest_h = divmod(height - (rows + 1) * padding, rows)
    if rest_w or rest_h or tile_w <= 0 or tile_h <= 0:
        return None
    return {
        "rows": rows,
        "columns": columns,
        "tile_height": tile_h,
        "tile_width": tile_w,
        "padding": padding,
        "column_psnr": list(psnr),
        "column_psnr_source": "scores (geometry inferred)",
    }


def _number(text: Any) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------- summaries


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _round_summaries(data: RunData) -> list[dict[str, Any]]:
    """One dict per round: attacks, failures, scored samples, fractions, test metrics."""
    tests = _test_metrics(data.history)
    rounds = sorted({entry.server_round for entry in data.entries} | set(tests))
    summaries = []
    for server_round in rounds:
        entries = [entry for entry in data.entries if entry.server_round == server_round]
        scored = sum(entry.scored_count for entry in entries)
        exact = sum(entry.recovered(EXACT_PSNR_DB) for entry in entries)
        approx = sum(entry.recovered(APPROX_PSNR_DB) for entry in entries)
        values = [value for entry in entries for value in (entry.psnr or [])]
        seconds = [entry.seconds for entry in entries if entry.seconds is not None]
        test = tests.get(server_round, {})
        summaries.append(
            {
                "round": server_round,
                "attacks": len(entries),
                "failed": sum(1 for entry in entries if entry.status != "ok"),
                "scored": scored,
                "exact": exact,
                "approx": approx,
                "exact_fraction": _fraction(exact, scored),
                "approx_fraction": _fraction(approx, scored),
                "mean_psnr": float(np.mean(values)) if values else None,
                "median_seconds": float(np.median(seconds)) if seconds else None,
                "test_acc": _number(test.get("test-acc")),
                "test_loss": _number(test.get("test-loss")),
            }
        )
    return summaries


def _test_metrics(history: Mapping[str, Any] | None) -> dict[int, dict[str, Any]]:
    """``{round: test metrics}`` from ``history.json`` (round 0: the initial model)."""
    result: dict[int, dict[str, Any]] = {}
    rounds = history.get("rounds") if isinstance(history, Mapping) else None
    for item in rounds if isinstance(rounds, list) else []:
        if not isinstance(item, Mapping) or not isinstance(item.get("test"), Mapping):
            continue
        number = _number(item.get("round"))
        if number is not None:
            result[int(number)] = dict(item["test"])
    return result


def _samples(entries: Sequence[AttackEntry]) -> list[_Sample]:
    """Every drawn (ground truth, reconstruction) column with its PSNR."""
    samples = []
    for entry in entries:
        grid = entry.grid or {}
        values = grid.get("column_psnr")
        if entry.grid_png is None or not isinstance(values, list) or int(grid.get("rows", 0)) != 2:
            continue
        for column, value in enumerate(values):
            if isinstance(value, (int, float)) and math.isfinite(value):
                samples.append(_Sample(entry, column, float(value)))
    return samples


def _best_and_worst(samples: list[_Sample], size: int) -> tuple[list[_Sample], list[_Sample]]:
    """The ``size`` best and ``size`` worst samples, without showing one twice."""
    ordered = sorted(
        samples, key=lambda s: (-s.psnr, s.entry.server_round, s.entry.client, s.column)
    )
    best = ordered[: min(size, math.ceil(len(ordered) / 2))]
    worst = ordered[len(best) :][::-1][:size]
    return best, worst


# ----------------------------------------------------------------------------- plots


def _new_figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas (no pyplot, no global backend state)."""
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _plot_rounds(summaries: list[dict[str, Any]]) -> bytes | None:
    leak = [s for s in summaries if s["scored"]]
    utility = [s for s in summaries if s["test_acc"] is not None]
    if not leak and not utility:
        return None
    panels = int(bool(leak)) + int(bool(utility))
    figure = _new_figure(7.5, 2.9 * panels)
    axes = figure.subplots(panels, 1, squeeze=False)[:, 0]
    index = 0
    if leak:
        axis = axes[index]
        index += 1
        rounds = np.array([s["round"] for s in leak], dtype=float)
        axis.bar(rounds - 0.2, [s["approx_fraction"] for s in leak], width=0.4,
                 label=f"approximate (> {APPROX_PSNR_DB:g} dB)", color="#9ecae1")
        axis.bar(rounds + 0.2, [s["exact_fraction"] for s in leak], width=0.4,
                 label=f"exact (> {EXACT_PSNR_DB:g} dB)", color="#08519c")
        axis.set_ylim(0, 1.3)
        axis.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        axis.set_ylabel("fraction of samples")
        axis.set_title("Client samples recovered per round")
        axis.set_xticks(rounds)
        axis.legend(loc="upper center", ncol=2, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    if utility:
        axis = axes[index]
        axis.plot([s["round"] for s in utility], [s["test_acc"] for s in utility],
                  marker="o", color="#31a354")
        axis.set_ylim(0, 1.05)
        axis.set_ylabel("test accuracy")
        axis.set_title("Global model on the test split"
                       + (" (round 0: initial model)" if utility[0]["round"] == 0 else ""))
        axis.set_xticks([s["round"] for s in utility])
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("round")
    figure.tight_layout()
    return _png(figure)


def _plot_psnr(entries: Sequence[AttackEntry]) -> bytes | None:
    by_round: dict[int, list[float]] = {}
    for entry in entries:
        if entry.psnr:
            by_round.setdefault(entry.server_round, []).extend(entry.psnr)
    if not by_round:
        return None
    everything = [value for values in by_round.values() for value in values]
    top = max(300.0, max(everything) + 5.0)
    bins = np.linspace(min(0.0, min(everything)), top, 61)
    figure = _new_figure(7.5, 3.2)
    axis = figure.subplots()
    rounds = sorted(by_round)
    if len(rounds) <= 8:
        axis.hist([by_round[r] for r in rounds], bins=bins, stacked=True, histtype="stepfilled",
                  label=[f"round {r}" for r in rounds])
        axis.legend(fontsize=8)
    else:
        axis.hist(everything, bins=bins, color="#2a7ab9", histtype="stepfilled")
    for threshold, name in ((APPROX_PSNR_DB, "approximate"), (EXACT_PSNR_DB, "exact")):
        axis.axvline(threshold, color="k", linestyle="--", linewidth=1)
        axis.text(threshold + 2, axis.get_ylim()[1] * 0.95, f"{name}\n> {threshold:g} dB",
                  fontsize=8, va="top")
    axis.set_xlabel("PSNR of a sample against its ground truth (dB, capped at 300)")
    axis.set_ylabel("samples")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_title(f"PSNR distribution ({len(everything)} scored samples)")
    figure.tight_layout()
    return _png(figure)


def _plot_seconds(entries: Sequence[AttackEntry], budget: float | None, timeout: float | None) -> bytes | None:
    timed = [entry for entry in entries if entry.seconds is not None]
    if not timed:
        return None
    colours = [_STATUS_COLOURS.get(entry.status, "#777777") for entry in timed]
    if len(timed) <= _MAX_BARS:
        figure = _new_figure(7.5, 0.9 + 0.26 * len(timed))
        axis = figure.subplots()
        positions = np.arange(len(timed))
        axis.barh(positions, [entry.seconds for entry in timed], color=colours)
        axis.set_yticks(positions)
        axis.set_yticklabels([f"round {e.server_round}  {e.client}" for e in timed], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("attack time (s)")
        limit_axis = axis.axvline
    else:
        figure = _new_figure(7.5, 3.4)
        axis = figure.subplots()
        rng = np.random.default_rng(0)
        x = np.array([entry.server_round for entry in timed], dtype=float)
        axis.scatter(x + rng.uniform(-0.25, 0.25, len(x)), [e.seconds for e in timed],
                     c=colours, s=12)
        axis.set_xlabel("round")
        axis.set_ylabel("attack time (s)")
        limit_axis = axis.axhline
    for value, name, style in ((budget, "time budget", ":"), (timeout, "timeout", "--")):
        if value:
            limit_axis(value, color="k", linestyle=style, linewidth=1, label=f"{name} ({value:g} s)")
    statuses = sorted({entry.status for entry in timed})
    for status in statuses:
        axis.scatter([], [], color=_STATUS_COLOURS.get(status, "#777777"), marker="s", label=status)
    axis.legend(fontsize=8, loc="best")
    axis.set_title("Attack time per client update")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return _png(figure)


def _tile(picture: Image.Image, grid: Mapping[str, Any], row: int, column: int) -> Image.Image:
    padding = int(grid.get("padding", 2))
    tile_h, tile_w = int(grid["tile_height"]), int(grid["tile_width"])
    top = padding + row * (tile_h + padding)
    left = padding + column * (tile_w + padding)
    return picture.crop((left, top, left + tile_w, top + tile_h))


def _plot_gallery(samples: list[_Sample], title: str) -> bytes | None:
    """Ground truth (top) above the matched reconstruction (bottom) for each sample.

    Drawn with PIL (crops of the attacks' ``reconstruction.png``, nearest-neighbour
    scaled to :data:`_GALLERY_TILE` pixels) and labelled with round, client, column and
    PSNR.
    """
    if not samples:
        return None
    opened: dict[Path, Image.Image] = {}
    try:
        pairs = []
        for sample in samples:
            path = sample.entry.grid_png
            assert path is not None
            if path not in opened:
                with Image.open(path) as picture:
                    opened[path] = picture.convert("RGB")
            grid = sample.entry.grid or {}
            pairs.append([
                _tile(opened[path], grid, row, sample.column).resize(
                    (_GALLERY_TILE, _GALLERY_TILE), Image.Resampling.NEAREST
                )
                for row in (0, 1)
            ])
    finally:
        for picture in opened.values():
            picture.close()
    try:
        font: Any = ImageFont.load_default(size=12)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        font = ImageFont.load_default()
    gap, label_h, left, title_h = 8, 34, 104, 24
    width = left + len(pairs) * (_GALLERY_TILE + gap)
    height = title_h + label_h + 2 * _GALLERY_TILE + gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), title, fill="black", font=font)
    draw.text((4, title_h + label_h + _GALLERY_TILE // 2), "ground truth", fill="black", font=font)
    draw.text((4, title_h + label_h + gap + _GALLERY_TILE * 3 // 2), "reconstruction", fill="black", font=font)
    for index, (sample, (truth, guess)) in enumerate(zip(samples, pairs)):
        x = left + index * (_GALLERY_TILE + gap)
        draw.text((x, title_h), f"r{sample.entry.server_round} {_short(sample.entry.client, 14)}",
                  fill="black", font=font)
        draw.text((x, title_h + 15), f"#{sample.column} {sample.psnr:.1f} dB", fill="black", font=font)
        canvas.paste(truth, (x, title_h + label_h))
        canvas.paste(guess, (x, title_h + label_h + _GALLERY_TILE + gap))
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return buffer.getvalue()


def _short(name: str, limit: int = 22) -> str:
    """A label of at most ``limit`` characters (``secagg-partition-0_partition-1``: ``sum p0+p1``)."""
    if name.startswith("secagg-"):
        name = "sum " + "+".join(
            member.replace("partition-", "p").replace("node-", "n") for member in name[7:].split("_")
        )
    return name if len(name) <= limit else name[: limit - 1] + "\u2026"


# ------------------------------------------------------------------------------ HTML


def _e(value: Any) -> str:
    """Escape any value for HTML text and attributes."""
    return html.escape(str(value), quote=True)


def _format(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return "&ndash;"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return _e(f"{value:.{digits}f}")
    return _e(value)


def _percent(value: float | None) -> str:
    return "&ndash;" if value is None else _e(f"{100.0 * value:.1f}%")


def _image(png: bytes, alt: str, *, pixels: bool = False) -> str:
    """An ``<img>`` with ``png`` embedded as a base64 data URL."""
    encoded = base64.b64encode(png).decode("ascii")
    extra = ' class="pixels"' if pixels else ""
    return f'<img{extra} src="data:image/png;base64,{encoded}" alt="{_e(alt)}">'


def _figure(png: bytes, alt: str, caption: str, *, pixels: bool = False) -> str:
    """A ``<figure>``; ``caption`` must be escaped HTML already."""
    return f"<figure>{_image(png, alt, pixels=pixels)}<figcaption>{caption}</figcaption></figure>"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], *, numeric: Sequence[int] = ()) -> str:
    """An HTML table; ``header`` is escaped here, ``rows`` must be escaped HTML already."""
    head = "".join(f"<th>{_e(name)}</th>" for name in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if index in numeric else f"<td>{cell}</td>"
            for index, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _config_value(config: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    if not config or key not in config:
        return default
    return config[key]


def _threat_model(data: RunData) -> str:
    """Plain-language threat model derived from the run configuration (escaped HTML)."""
    config = data.config
    get = lambda key, default=None: _config_value(config, key, default)  # noqa: E731
    parts: list[str] = []
    if config is None:
        parts.append(
            "<p class=\"warn\">The run configuration (run_config.json) is missing; the threat "
            "model below is what the stored attacks show.</p>"
        )
    layer = next((entry.details.get("layer") for entry in data.entries
                  if isinstance(entry.details.get("layer"), Mapping)), None)
    if layer:
        layer_text = (f"the layer with weight <code>{_e(layer.get('weight'))}</code> and bias "
                      f"<code>{_e(layer.get('bias'))}</code>")
    elif get("attack-weight-key"):
        layer_text = f"the layer <code>{_e(get('attack-weight-key'))}</code>"
    else:
        layer_text = "the first linear layer (the first 2-D weight and its bias)"
    architecture = get("architecture")
    model = (f" of the <code>{_e(architecture)}</code> victim network (width {_e(get('width'))}"
             f"{'' if not get('depth') else ', depth ' + _e(get('depth'))})") if architecture else ""
    parts.append(
        "<p><b>Honest-but-curious server.</b> The server follows the protocol: it selects "
        "clients, sends them the global model and aggregates their replies exactly as the "
        "inner strategy (FedAvg) would. It is curious: it keeps a copy of every client's "
        f"update of {layer_text}{model} and runs the SPEAR++ exact gradient-inversion attack "
        "on it, trying to recover the inputs the client trained on.</p>"
    )

    mode = get("train-mode")
    batch = get("batch-size")
    if mode == "fedsgd":
        training = (f"<b>FedSGD</b>: each client sends one gradient step computed on a batch of "
                    f"{_e(batch)} samples, so its update is proportional to the batch gradient "
                    "(the setting in which exact recovery is expected).")
    elif mode == "fedavg":
        training = (f"<b>FedAvg</b>: each client trains {_e(get('local-epochs'))} local epoch(s) "
                    f"over mini-batches of {_e(get('mini-batch-size'))} samples (learning rate "
                    f"{_e(get('local-lr'))}) and sends the total change; the attack treats it as "
                    "one gradient, so recovery degrades with more local steps.")
    elif mode == "dpsgd":
        training = (f"<b>DP-SGD</b> (Opacus): per-sample gradients are clipped to norm "
                    f"{_e(get('max-grad-norm'))} and Gaussian noise with multiplier "
                    f"{_e(get('noise-multiplier'))} is added (Poisson sampling: "
                    f"{_format(get('poisson-sampling'))}; batch size {_e(batch)}); the noise is "
                    "the defence, and exact recovery is not expected.")
    elif mode is None:
        training = "The training mode was not recorded."
    else:
        training = f"Training mode <code>{_e(mode)}</code>."
    parts.append(f"<p><b>Client training.</b> {training}</p>")

    group = get("secagg-group-size", 1)
    try:
        group_size = int(group)
    except (TypeError, ValueError):
        group_size = 1
    if group_size > 1:
        secagg = (f"<b>Secure aggregation</b> is simulated with groups of {group_size} clients: "
                  "the server only sees the sum of each group's updates, attacks that sum as one "
                  "larger batch, and the recovered samples are attributed to each member client "
                  "when scoring.")
    else:
        secagg = ("<b>No secure aggregation</b>: the server sees every client's individual "
                  "update.")
    parts.append(f"<p>{secagg}</p>")

    told = get("attack-batch-size")
    budget = get("attack-time-budget")
    fraction = _number(get("attack-fraction"))
    partitions = get("attack-partitions")
    targets = (f"clients of partitions {_e(partitions)}" if partitions else
               ("every client update" if fraction is None or fraction >= 1.0 else
                f"a random {_percent(fraction)} of the client updates per round"))
    parts.append(
        "<p><b>What the attacker sees:</b> the global parameters of the attacked layer that the "
        "server sent, and the client's update of that layer (the server receives the whole "
        "model update; the attack needs only this layer); "
        + ("it is told the batch size, " + _e(told) + " per client. " if told
           else "it estimates the batch size itself. ")
        + "<b>What it does not see:</b> the clients' data and labels. The attack targets "
        + targets
        + (f", with a search budget of {_e(budget)} s per update" if budget is not None else "")
        + ".</p>"
    )
    ground_truth = get("audit-ground-truth")
    any_scored = any(entry.scored for entry in data.entries)
    if ground_truth is False or (not any_scored and ground_truth is None):
        scoring = ("No ground truth was collected, so the reconstructions are <b>not scored</b>; "
                   "only the attacker's own confidence (completeness, sparsity matching) is "
                   "available.")
    else:
        scoring = ("In this simulation clients also report which samples they used. That "
                   "<b>ground truth is used only to score</b> the reconstructions afterwards "
                   "(PSNR of every sample against its best-matched reconstruction, on de-normalized "
                   "images with pixel range 1); the attacker never sees it.")
    data_text = ""
    if get("dataset") is not None:
        data_text = (f" Data: <code>{_e(get('dataset'))}</code>, {_e(get('samples-per-client'))} "
                     f"samples per client, <code>{_e(get('partitioning'))}</code> partitioning, "
                     f"{_e(get('num-server-rounds'))} round(s).")
    parts.append(f"<p>{scoring}{data_text}</p>")
    return "\n".join(parts)


def _headline(data: RunData) -> str:
    entries = data.entries
    statuses = Counter(entry.status for entry in entries)
    scored = sum(entry.scored_count for entry in entries)
    exact = sum(entry.recovered(EXACT_PSNR_DB) for entry in entries)
    approx = sum(entry.recovered(APPROX_PSNR_DB) for entry in entries)
    failed = [entry for entry in entries if entry.status != "ok"]
    unscored_ok = [entry for entry in entries if entry.status == "ok" and not entry.scored]
    lines = [f"<p class=\"headline\"><b>{len(entries)}</b> client update(s) attacked"]
    if entries:
        lines[0] += " (" + ", ".join(f"{_e(count)} {_e(status)}" for status, count in
                                     sorted(statuses.items())) + ")"
    lines[0] += ".</p>"
    if scored:
        batches = [entry for entry in entries if entry.psnr]
        batch_exact = sum(1 for entry in batches if min(entry.psnr or [0.0]) > EXACT_PSNR_DB)
        lines.append(
            f"<p class=\"headline\">Exactly recovered (&gt; {EXACT_PSNR_DB:g} dB): "
            f"<b>{_percent(exact / scored)}</b> of the {scored} scored client samples "
            f"({exact}); approximately (&gt; {APPROX_PSNR_DB:g} dB): "
            f"<b>{_percent(approx / scored)}</b> ({approx}). {batch_exact} of {len(batches)} "
            "scored updates were recovered entirely (every sample exact).</p>"
        )
        if failed:
            lines.append(
                f"<p class=\"note\">{len(failed)} failed attack(s) are not counted in these "
                "fractions (their samples were not scored); see Failures below.</p>"
            )
        if unscored_ok:
            lines.append(
                f"<p class=\"note\">{len(unscored_ok)} successful attack(s) have no score and "
                "are not counted.</p>"
            )
    elif entries:
        complete = sum(1 for entry in entries if entry.row.get("complete") == "True")
        lines.append(
            "<p class=\"headline warn\">Scores are unavailable: no attacked update was scored "
            "against ground truth (the run had no ground truth, e.g. "
            "<code>audit-ground-truth=false</code>, or every attack failed). "
            f"The attacker itself reports {complete} of {statuses.get('ok', 0)} successful "
            "reconstruction(s) as complete.</p>"
        )
    else:
        lines.append("<p class=\"headline warn\">No client update was attacked in this run, so "
                     "there is nothing to score.</p>")
    final = data.history.get("final_test") if data.history else None
    if isinstance(final, Mapping) and _number(final.get("test-acc")) is not None:
        lines.append(
            f"<p>Utility: final test accuracy <b>{_percent(_number(final.get('test-acc')))}</b>"
            f" (test loss {_format(_number(final.get('test-loss')), 3)}, "
            f"{_format(final.get('test-examples'))} examples).</p>"
        )
    return "\n".join(lines)


def _round_table(summaries: list[dict[str, Any]]) -> str:
    rows = [
        [
            _e(s["round"]),
            _e(s["attacks"]),
            _e(s["failed"]),
            _e(s["scored"]),
            f"{_percent(s['exact_fraction'])} ({_e(s['exact'])})" if s["scored"] else "&ndash;",
            f"{_percent(s['approx_fraction'])} ({_e(s['approx'])})" if s["scored"] else "&ndash;",
            _format(s["mean_psnr"]),
            _format(s["median_seconds"]),
            _percent(s["test_acc"]),
            _format(s["test_loss"], 3),
        ]
        for s in summaries
    ]
    return _table(
        ["round", "attacked updates", "failed", "scored samples",
         f"exact (> {EXACT_PSNR_DB:g} dB)", f"approx. (> {APPROX_PSNR_DB:g} dB)",
         "mean PSNR (dB)", "median attack s", "test accuracy", "test loss"],
        rows,
        numeric=range(10),
    )


def _attacks_table(entries: Sequence[AttackEntry]) -> str:
    rows = []
    for entry in entries:
        scored = entry.scored_count
        rows.append([
            _e(entry.server_round),
            _e(entry.client),
            f'<span class="status-{_e(entry.status)}">{_e(entry.status)}</span>',
            _format(entry.seconds),
            _format(entry.row.get("batch_size")),
            _format(entry.row.get("complete")),
            _format(_number(entry.row.get("sparsity_matching")), 4),
            _format(_number(entry.row.get("mean_psnr"))),
            (f"{_e(entry.recovered(EXACT_PSNR_DB))}/{_e(scored)}" if scored else "&ndash;"),
            (f"{_e(entry.recovered(APPROX_PSNR_DB))}/{_e(scored)}" if scored else "&ndash;"),
            _e(entry.error),
        ])
    return _table(
        ["round", "client", "status", "seconds", "batch size (est.)", "complete",
         "sparsity matching", "mean PSNR (dB)", "exact", "approx.", "error"],
        rows,
        numeric=(0, 3, 4, 6, 7, 8, 9),
    )


def _secagg_section(entries: Sequence[AttackEntry]) -> str:
    rows = []
    for entry in entries:
        members = entry.details.get("members")
        if not isinstance(members, Mapping):
            continue
        for member, quality in members.items():
            quality = quality if isinstance(quality, Mapping) else {}
            rows.append([
                _e(entry.server_round),
                _e(entry.client),
                _e(member),
                _format(quality.get("samples")),
                _format(_number(quality.get("mean_psnr"))),
                _percent(_number(quality.get("exact_fraction"))),
                _percent(_number(quality.get("approx_fraction"))),
            ])
    if not rows:
        return ""
    return (
        "<h2>Secure aggregation: recovery per member client</h2>"
        "<p>The server attacked each group's summed update as one batch; every recovered "
        "sample is attributed to the member that trained on it.</p>"
        + _table(["round", "group", "member", "samples", "mean PSNR (dB)",
                  f"exact (> {EXACT_PSNR_DB:g} dB)", f"approx. (> {APPROX_PSNR_DB:g} dB)"],
                 rows, numeric=(0, 3, 4, 5, 6))
    )


def _failures_section(entries: Sequence[AttackEntry]) -> str:
    failed = [entry for entry in entries if entry.status != "ok" or entry.error]
    if not failed:
        return "<h2>Failures</h2><p>No attack failed.</p>"
    rows = [
        [_e(entry.server_round), _e(entry.client), _e(entry.status), _format(entry.seconds),
         _e(entry.error or "(no message)")]
        for entry in failed
    ]
    return (
        "<h2>Failures</h2><p>Attacks that raised, ran out of time or memory, or whose "
        "scoring failed; training went on regardless.</p>"
        + _table(["round", "client", "status", "seconds", "error"], rows, numeric=(0, 3))
    )


def _config_section(config: Mapping[str, Any] | None) -> str:
    if config is None:
        return "<h2>Configuration</h2><p class=\"warn\">No run_config.json in this run.</p>"
    rows = [
        [f"<code>{_e(key)}</code>",
         _e(json.dumps(value) if not isinstance(value, str) else value)]
        for key, value in config.items()
    ]
    return "<h2>Configuration</h2>" + _table(["key", "value"], rows)


# ---------------------------------------------------------------------------- report


def write_report(run_dir: str | Path, *, output: str | Path | None = None) -> Path:
    """Write the HTML report of a run directory, and its plots as PNG files.

    Parameters
    ----------
    run_dir : str or Path
        A run directory written by :class:`~fl_attack.results.store.ReconstructionStore`.
    output : str or Path or None (default: None)
        Where to write the HTML; None writes ``<run_dir>/report.html``. The plots go to
        ``<run_dir>/report/`` by default, or to ``<output stem>-plots/`` beside
        ``output`` when it is given.

    Returns
    -------
    Path
        The HTML file written.

    Raises
    ------
    NotARunDirectoryError
        When ``run_dir`` holds no ``attacks.csv``.
    """
    data = load_run(run_dir)
    if output is None:
        target = data.directory / REPORT_FILE
        plots = data.directory / REPORT_DIRECTORY
    else:
        target = Path(output).resolve()
        plots = target.parent / f"{target.stem}-plots"
    config = data.config
    budget = _number(_config_value(config, "attack-time-budget"))
    timeout = _number(_config_value(config, "attack-timeout"))
    if budget and not timeout:
        timeout = 1.5 * budget + 15.0  # the ServerApp's default hard limit

    summaries = _round_summaries(data)
    samples = _samples(data.entries)
    best, worst = _best_and_worst(samples, _GALLERY_SIZE)
    pictures = {
        "rounds": _plot_rounds(summaries),
        "psnr": _plot_psnr(data.entries),
        "attack_seconds": _plot_seconds(data.entries, budget, timeout),
        "best": _plot_gallery(best, "Best reconstructions (top: ground truth)"),
        "worst": _plot_gallery(worst, "Worst reconstructions (top: ground truth)"),
    }
    make_private_directory(plots)
    for name, png in pictures.items():
        if png is not None:
            atomic_write_bytes(plots / f"{name}.png", png)

    body = [
        f"<h1>Privacy audit report</h1>"
        f"<p class=\"note\">Run directory <code>{_e(data.directory)}</code>; generated "
        f"{_e(datetime.now().isoformat(timespec='seconds'))}. This page contains clients' "
        "private samples (ground truth and reconstructions): share it accordingly.</p>",
        "<h2>Summary</h2>",
        _headline(data),
    ]
    if data.problems:
        body.append("<p class=\"warn\">Unreadable files: "
                    + "; ".join(_e(problem) for problem in data.problems) + "</p>")
    body += ["<h2>Threat model</h2>", _threat_model(data)]

    body.append("<h2>Leakage and utility per round</h2>")
    body.append(
        f"<p>Fraction of the scored client samples recovered exactly (PSNR &gt; "
        f"{EXACT_PSNR_DB:g} dB: identical up to float round-off) and approximately (&gt; "
        f"{APPROX_PSNR_DB:g} dB: recognisable), next to the global model's test accuracy "
        "from history.json.</p>"
    )
    body.append(_round_table(summaries) if summaries else "<p>No rounds recorded.</p>")
    if pictures["rounds"]:
        body.append(_figure(pictures["rounds"], "recovered fractions and test accuracy per round",
                            "Recovered fractions per round and test accuracy."))

    body.append("<h2>PSNR distribution</h2>")
    if pictures["psnr"]:
        body.append(_figure(pictures["psnr"], "PSNR histogram",
                            "Every scored sample's PSNR against its ground truth."))
    else:
        body.append("<p class=\"warn\">Scores are unavailable: no sample was scored.</p>")

    body.append("<h2>Best and worst reconstructions</h2>")
    if best:
        body.append(
            "<p>Each column shows one client sample: the ground truth (top) above the "
            "reconstruction matched to it (bottom), with the round, client, sample column "
            "and PSNR.</p>"
        )
        body.append(_figure(pictures["best"], "best reconstructions",  # type: ignore[arg-type]
                            "Highest PSNR.", pixels=True))
        if worst:
            body.append(_figure(pictures["worst"], "worst reconstructions",  # type: ignore[arg-type]
                                "Lowest PSNR (lowest first).", pixels=True))
        rows = [[_e(label), _e(s.entry.server_round), _e(s.entry.client), _e(s.column),
                 _format(s.psnr)] for label, group in (("best", best), ("worst", worst))
                for s in group]
        body.append(_table(["", "round", "client", "column", "PSNR (dB)"], rows, numeric=(1, 3, 4)))
    else:
        unscored = [entry for entry in data.entries if entry.grid_png is not None][:_UNSCORED_GRIDS]
        if unscored:
            body.append("<p class=\"warn\">Scores are unavailable, so there is no best or worst; "
                        "here are stored reconstructions as the attacker sees them.</p>")
            for entry in unscored:
                png = entry.grid_png.read_bytes()  # type: ignore[union-attr]
                body.append(_figure(png, f"reconstruction round {entry.server_round} {entry.client}",
                                    f"Round {_e(entry.server_round)}, {_e(entry.client)}.",
                                    pixels=True))
        else:
            body.append("<p>No reconstruction was stored.</p>")

    body.append("<h2>Attack time per client</h2>")
    if pictures["attack_seconds"]:
        limits = []
        if budget:
            limits.append(f"search budget {budget:g} s")
        if timeout:
            limits.append(f"hard timeout {timeout:g} s")
        body.append(_figure(pictures["attack_seconds"], "attack seconds per client",
                            "Wall-clock time of every attack"
                            + (f" ({_e(', '.join(limits))})" if limits else "") + "."))
    else:
        body.append("<p>No attack timing recorded.</p>")

    body.append(_secagg_section(data.entries))
    body.append(_failures_section(data.entries))
    body.append("<h2>All attacked updates</h2>")
    body.append(_attacks_table(data.entries) if data.entries else "<p>None.</p>")
    body.append(_config_section(config))

    document = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>fl-attack audit report: {_e(data.directory.name)}</title>"
        f"<style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(part for part in body if part)
        + "\n</body></html>\n"
    )
    return atomic_write_bytes(target, document.encode("utf-8"))


# ------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-attack-report RUN_DIR [-o FILE]``; return the exit code.

    Exit codes: 0 written, 1 could not be written, 2 bad usage or not a run directory.
    """
    parser = argparse.ArgumentParser(
        prog="fl-attack-report",
        description="Write the self-contained HTML report of an fl-attack audit run directory.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds attacks.csv)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="HTML file to write (default: RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / TABLE_FILE).is_file():
        parser.error(f"{run_dir} is not a run directory: it has no {TABLE_FILE}")
    try:
        path = write_report(run_dir, output=args.output)
    except OSError as error:
        print(f"fl-attack-report: could not write the report: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def entry_point() -> None:
    """Console-script entry."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry_point()
