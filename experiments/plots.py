"""Plots of the defended-update tables: accuracy and mean PSNR against noise and local steps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Lines = dict[str, list[tuple[float, Mapping[str, Any]]]]


def _figure(lines: Lines, *, xlabel: str, title: str, path: Path, log_x: bool) -> Path | None:
    if not lines:
        return None
    figure = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2)
    for label, points in lines.items():
        points = sorted(points, key=lambda point: point[0])
        xs = [x for x, _ in points]
        axes[0].plot(xs, [row["accuracy"] for _, row in points], marker="o", label=label)
        psnr = [math.nan if row.get("mean_psnr") is None else row["mean_psnr"] for _, row in points]
        axes[1].plot(xs, psnr, marker="o", label=label)
    for axis, ylabel in zip(axes, ("batch accuracy (%)", "mean PSNR (dB)"), strict=True):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        if log_x:
            axis.set_xscale("log")
    axes[0].set_ylim(-5, 105)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    return path


def defended_plots(rows: Sequence[Mapping[str, Any]], *, directory: Path, name: str) -> list[Path]:
    """``<name>_noise.png`` (DP noise, DP-SGD) and ``<name>_local_steps.png`` (FedAvg); the ones drawn."""
    noise: Lines = {}
    steps: Lines = {}
    for row in rows:
        if row.get("status") != "run":
            continue
        cell = f"{row['b']}x{row['m']}"
        if row["section"] == "dp":
            noise.setdefault(f"DP noise {cell}", []).append((row["noise_factor"], row))
        elif row["section"] == "dpsgd":
            noise.setdefault(f"DP-SGD {cell} C={row['clip_norm']:g}", []).append((row["noise_factor"], row))
        elif row["section"] in ("fedavg", "fedavg-grid") and row.get("local_steps") is not None:
            label = f"FedAvg {cell} mini-batch {row['mini_batch_size']} lr {row['lr']:g}"
            steps.setdefault(label, []).append((row["local_steps"], row))
    plotted = [row for row in rows if row.get("section") != "secagg" and "threshold_db" in row]
    threshold = f"> {plotted[0]['threshold_db']:g} dB" if plotted else ""
    drawn = [
        _figure(
            noise,
            xlabel="noise std / median |gradient entry|",
            log_x=False,
            path=directory / f"{name}_noise.png",
            title=f"SPEAR++ under noise (accuracy: mean PSNR {threshold})",
        ),
        _figure(
            steps,
            xlabel="local SGD steps",
            log_x=True,
            path=directory / f"{name}_local_steps.png",
            title=f"SPEAR++ under FedAvg (accuracy: mean PSNR {threshold})",
        ),
    ]
    return [path for path in drawn if path is not None]
