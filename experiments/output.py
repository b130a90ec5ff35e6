"""Where experiments write, and how: CSV rows as they come, then JSON and markdown.

Runs write to ``outputs/experiments/<name>/`` (below the working directory) unless told
otherwise; the committed results under ``experiments/results/`` are written only with
``--update-results``.
"""

from __future__ import annotations

import csv
import json
import math
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from experiments.config import Cell

RESULTS_DIR: Path = Path(__file__).resolve().parent / "results"
"""The committed results (written only with ``--update-results``)."""

OUTPUTS_DIR: Path = Path("outputs") / "experiments"
"""Default parent of a run's folder, relative to the working directory."""


def output_directory(*, name: str, out: Path | None, update_results: bool) -> Path:
    """The folder a run named ``name`` writes to.

    Raises
    ------
    ValueError
        When ``out`` lies in the committed results without ``update_results``, or when both
        are given.
    """
    if update_results:
        if out is not None:
            raise ValueError("--update-results writes to experiments/results: do not combine it with --out")
        return RESULTS_DIR
    directory = out if out is not None else OUTPUTS_DIR / name
    resolved = directory.resolve()
    if resolved == RESULTS_DIR or RESULTS_DIR in resolved.parents:
        raise ValueError(f"{directory} holds the committed results: pass --update-results to write there")
    return directory


def dataset_missing(name: str, error: Exception) -> str:
    """One line naming a dataset that is not on this machine and how to get it."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = first.removesuffix(" Looked in:").rstrip(":")
    if name == "folder" or "fl-attack-data fetch" in first:
        return first
    return f"{first} Run `fl-attack-data fetch {name}` (or pass --data-root DIR)."


def json_safe(value: Any) -> Any:
    """``value`` with NaN/Inf as None, paths and tuples as JSON types."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Cell):
        return value.label
    return value


def environment() -> dict[str, Any]:
    """Versions and thread count, stored with every result."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }


class ResultsWriter:
    """Writes ``<name>.csv`` row by row (an interrupted run keeps its rows), then ``.json`` and ``.md``.

    Parameters
    ----------
    directory
        Output folder, created when missing.
    name
        File stem.
    fields
        CSV columns; a row may leave some blank but not add others.
    """

    def __init__(self, directory: Path, *, name: str, fields: Sequence[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.csv_path = directory / f"{name}.csv"
        self.json_path = directory / f"{name}.json"
        self.markdown_path = directory / f"{name}.md"
        self._handle = self.csv_path.open("w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._handle, fieldnames=list(fields), restval="", extrasaction="raise")
        self._writer.writeheader()
        self._handle.flush()

    def add(self, row: Mapping[str, Any]) -> None:
        """Append one row to the CSV."""
        self._writer.writerow({key: "" if value is None else value for key, value in row.items()})
        self._handle.flush()

    def finish(self, summary: Mapping[str, Any], markdown: str) -> list[Path]:
        """Close the CSV, write the JSON summary and the markdown; return the three paths."""
        self._handle.close()
        payload = json_safe({"environment": environment(), **summary})
        self.json_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        self.markdown_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
        return [self.csv_path, self.json_path, self.markdown_path]

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handle.closed:
            self._handle.close()
