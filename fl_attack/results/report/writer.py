"""Write a run's report: ``report.html``, ``report.json`` beside it, and the plots as PNG files.

The report shows private data (ground-truth samples), so like the rest of the store it is
written atomically with mode ``0o600`` in directories of mode ``0o700``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fl_attack.pipeline.budget.budget import hard_limit
from fl_attack.results.report.figures import plot_psnr, plot_rounds, plot_seconds
from fl_attack.results.report.gallery import best_and_worst, gallery_png, sample_tiles, scored_samples
from fl_attack.results.report.loading import load_run, number
from fl_attack.results.report.page import render_page
from fl_attack.results.report.summary import build_summary
from fl_attack.results.store import atomic_write_bytes, make_private_directory

__all__ = ["REPORT_DIRECTORY", "REPORT_FILE", "SUMMARY_FILE", "write_report"]

#: Name of the report inside the run directory.
REPORT_FILE = "report.html"
#: Name of the machine-readable summary written beside the report.
SUMMARY_FILE = "report.json"
#: Folder (inside the run directory) of the report's plots as PNG files.
REPORT_DIRECTORY = "report"
#: Samples shown among the best and among the worst reconstructions.
GALLERY_SIZE = 8
#: Unscored reconstruction grids shown when no sample has a score.
UNSCORED_GRIDS = 6


def write_report(run_dir: str | Path, *, output: str | Path | None = None) -> Path:
    """Write the HTML report of a run directory, its JSON summary and its plots as PNG files.

    Parameters
    ----------
    run_dir : str or Path
        A run directory written by :class:`~fl_attack.results.store.ReconstructionStore`.
    output : str or Path or None (default: None)
        Where to write the HTML; None writes ``<run_dir>/report.html``. The summary goes
        beside it with the suffix ``.json`` (``report.json``). The plots go to
        ``<run_dir>/report/`` by default, or to ``<output stem>-plots/`` beside ``output``.

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
    budget = number((data.config or {}).get("attack-time-budget"))
    timeout = number((data.config or {}).get("attack-timeout"))
    if budget and not timeout:
        timeout = hard_limit(budget)  # the ServerApp's default hard limit

    summary = build_summary(data)
    best, worst = best_and_worst(scored_samples(data.entries), GALLERY_SIZE)
    pictures = {
        "rounds": plot_rounds(summary["rounds"]),
        "psnr": plot_psnr(data.entries),
        "attack_seconds": plot_seconds(data.entries, budget, timeout),
        "best": gallery_png(best, "Best reconstructions (top: ground truth)"),
        "worst": gallery_png(worst, "Worst reconstructions (top: ground truth)"),
    }
    make_private_directory(plots)
    for name, png in pictures.items():
        if png is not None:
            atomic_write_bytes(plots / f"{name}.png", png)

    grids: list[dict[str, Any]] = []
    if not best:
        for entry in data.entries:
            if entry.grid_png is not None and len(grids) < UNSCORED_GRIDS:
                grids.append(
                    {"round": entry.server_round, "client": entry.client, "png": entry.grid_png.read_bytes()}
                )
    limits = [f"search budget {budget:g} s"] if budget else []
    limits += [f"hard timeout {timeout:g} s"] if timeout else []
    page = render_page(
        data=data,
        summary=summary,
        pictures=pictures,
        best=sample_tiles(best),
        worst=sample_tiles(worst),
        grids=grids,
        limits=limits,
    )
    text = json.dumps(summary, indent=2, allow_nan=False) + "\n"
    atomic_write_bytes(target.with_suffix(".json"), text.encode("utf-8"))
    return atomic_write_bytes(target, page.encode("utf-8"))
