"""The report's plots as PNG bytes (matplotlib on its own Agg canvas: no pyplot, no global state)."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fl_attack.results.report.formatting import short_name
from fl_attack.results.report.loading import AttackEntry
from fl_attack.results.report.summary import psnr_bin_edges
from fl_attack.vocabulary import APPROX_PSNR_DB, DISPLAY_PSNR_CAP_DB, EXACT_PSNR_DB

__all__ = ["plot_psnr", "plot_rounds", "plot_seconds"]

#: Attacks drawn as labelled bars in the timing plot; beyond, a strip plot per round.
_MAX_BARS = 48
#: Rounds drawn as separate stacks of the PSNR histogram; beyond, one colour.
_MAX_STACKED_ROUNDS = 8
_STATUS_COLOURS = {
    "ok": "#2a7ab9",
    "error": "#c0392b",
    "timeout": "#e67e22",
    "out-of-memory": "#8e44ad",
    "killed": "#6d214f",
    "dropped": "#7f8c8d",
}


def _new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def plot_rounds(rounds: Sequence[Mapping[str, Any]]) -> bytes | None:
    """Recovered shares per round above the global model's test accuracy; None when neither exists."""
    leak = [item for item in rounds if item["scored_samples"]]
    utility = [item for item in rounds if item["test_acc"] is not None]
    if not leak and not utility:
        return None
    panels = int(bool(leak)) + int(bool(utility))
    figure = _new_figure(7.5, 2.9 * panels)
    axes = list(figure.subplots(panels, 1, squeeze=False)[:, 0])
    if leak:
        axis = axes[0]
        positions = np.array([item["round"] for item in leak], dtype=float)
        axis.bar(
            positions - 0.2,
            [item["approximate_sample_share"] for item in leak],
            width=0.4,
            label=f"approximate (> {APPROX_PSNR_DB:g} dB)",
            color="#9ecae1",
        )
        axis.bar(
            positions + 0.2,
            [item["exact_sample_share"] for item in leak],
            width=0.4,
            label=f"exact (> {EXACT_PSNR_DB:g} dB)",
            color="#08519c",
        )
        axis.set_ylim(0, 1.3)
        axis.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        axis.set_ylabel("share of samples")
        axis.set_title("Client samples recovered per round")
        axis.set_xticks(positions)
        axis.legend(loc="upper center", ncol=2, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    if utility:
        axis = axes[-1]
        axis.plot(
            [item["round"] for item in utility],
            [item["test_acc"] for item in utility],
            marker="o",
            color="#31a354",
        )
        axis.set_ylim(0, 1.05)
        axis.set_ylabel("test accuracy")
        axis.set_title(
            "Global model on the test split"
            + (" (round 0: initial model)" if utility[0]["round"] == 0 else "")
        )
        axis.set_xticks([item["round"] for item in utility])
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("round")
    figure.tight_layout()
    return _png(figure)


def plot_psnr(entries: Sequence[AttackEntry]) -> bytes | None:
    """Histogram of every scored sample's PSNR, values above the display cap in one "> 150 dB" bin."""
    by_round: dict[int, list[float]] = {}
    for entry in entries:
        if entry.psnr:
            by_round.setdefault(entry.server_round, []).extend(entry.psnr)
    if not by_round:
        return None
    everything = [value for values in by_round.values() for value in values]
    edges = psnr_bin_edges(everything)
    width = edges[1] - edges[0]
    overflow_left = edges[-1] + 2 * width  # the "> cap" bar stands apart, right of the last bin
    figure = _new_figure(7.5, 3.2)
    axis: Axes = figure.subplots()
    rounds = sorted(by_round)
    groups = (
        [(f"round {r}", by_round[r]) for r in rounds]
        if len(rounds) <= _MAX_STACKED_ROUNDS
        else [("", everything)]
    )
    bottom = np.zeros(len(edges))  # len(edges) - 1 bins plus the overflow bin
    for label, values in groups:
        counts, _ = np.histogram([v for v in values if v <= DISPLAY_PSNR_CAP_DB], bins=edges)
        heights = np.append(counts, sum(1 for v in values if v > DISPLAY_PSNR_CAP_DB)).astype(float)
        lefts = np.append(np.asarray(edges[:-1]), overflow_left)
        axis.bar(
            lefts,
            heights,
            width=width,
            bottom=bottom,
            align="edge",
            label=label or None,
            edgecolor="white",
            linewidth=0.5,
        )
        bottom += heights
    if len(groups) > 1:
        axis.legend(fontsize=8, loc="upper left")
    for threshold, name in ((APPROX_PSNR_DB, "approximate"), (EXACT_PSNR_DB, "exact")):
        axis.axvline(threshold, color="k", linestyle="--", linewidth=1)
        axis.text(threshold + 1.5, max(bottom) * 1.02, f"{name}\n> {threshold:g} dB", fontsize=8, va="bottom")
    axis.set_ylim(0, max(bottom) * 1.3 + 0.5)
    ticks = [edge for edge in edges if edge % 25 == 0]
    axis.set_xticks([*ticks, overflow_left + width / 2])
    axis.set_xticklabels([f"{tick:g}" for tick in ticks] + [f"> {DISPLAY_PSNR_CAP_DB:g}"])
    axis.set_xlim(edges[0], overflow_left + width)
    axis.set_xlabel("PSNR of a sample against its ground truth (dB)")
    axis.set_ylabel("samples")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_title(f"PSNR distribution ({len(everything)} scored samples)")
    figure.tight_layout()
    return _png(figure)


def plot_seconds(entries: Sequence[AttackEntry], budget: float | None, timeout: float | None) -> bytes | None:
    """Wall-clock time of every attack, coloured by status, with the budget and hard limit."""
    timed = [entry for entry in entries if entry.seconds is not None]
    if not timed:
        return None
    colours = [_STATUS_COLOURS.get(entry.status, "#777777") for entry in timed]
    if len(timed) <= _MAX_BARS:
        figure = _new_figure(7.5, 0.9 + 0.26 * len(timed))
        axis: Axes = figure.subplots()
        positions = np.arange(len(timed))
        axis.barh(positions, [entry.seconds or 0.0 for entry in timed], color=colours)
        axis.set_yticks(positions)
        axis.set_yticklabels(
            [f"round {entry.server_round}  {short_name(entry.client)}" for entry in timed], fontsize=8
        )
        axis.invert_yaxis()
        axis.set_xlabel("attack time (s)")
        limit_line: Callable[..., Any] = axis.axvline
    else:
        figure = _new_figure(7.5, 3.4)
        axis = figure.subplots()
        jitter = np.random.default_rng(0).uniform(-0.25, 0.25, len(timed))
        axis.scatter(
            np.array([entry.server_round for entry in timed], dtype=float) + jitter,
            [entry.seconds or 0.0 for entry in timed],
            c=colours,
            s=12,
        )
        axis.set_xlabel("round")
        axis.set_ylabel("attack time (s)")
        limit_line = axis.axhline
    for value, name, style in ((budget, "time budget", ":"), (timeout, "timeout", "--")):
        if value:
            limit_line(value, color="k", linestyle=style, linewidth=1, label=f"{name} ({value:g} s)")
    for status in sorted({entry.status for entry in timed}):
        axis.scatter([], [], color=_STATUS_COLOURS.get(status, "#777777"), marker="s", label=status)
    axis.legend(fontsize=8, loc="best")
    axis.set_title("Attack time per client update")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return _png(figure)
