"""Read a run directory into :class:`RunData`: the table, every attack's files, config and history.

Nothing here fails on a damaged file: what cannot be read is listed in
:attr:`RunData.problems` and the report says so. Only a directory without ``attacks.csv``
is refused (:class:`NotARunDirectoryError`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from fl_attack.results.record import is_fallback_row
from fl_attack.results.recovery import KIND_IMAGES, SampleRecovery, sample_recovery
from fl_attack.results.report.verdicts import derive_verdict
from fl_attack.results.store import (
    GRID_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    RUN_CONFIG_FILE,
    TABLE_FILE,
    load_table,
)
from fl_attack.vocabulary import (
    INPUT_SPACES,
    STATUS_OK,
    VERDICTS,
)

__all__ = ["AttackEntry", "NotARunDirectoryError", "RunData", "load_run", "number"]


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
        Client (or ``secagg-...`` group) name, as the table gives it.
    status : str
        One of :data:`fl_attack.vocabulary.STATUSES` (or what an unknown run wrote).
    seconds : float or None
        Attack wall-clock time.
    error : str
        Error message (empty when none).
    row : dict[str, str]
        The raw table row.
    verdict : str
        One of :data:`fl_attack.vocabulary.VERDICTS`: recorded by the run, or derived.
    verdict_reason : str
        One sentence saying why.
    verdict_derived : bool
        True when the run recorded no verdict and the report derived it from status and PSNR.
    input_space : str or None
        ``inputs`` or ``features`` when the run recorded it.
    queued_at, started_at, finished_at : float or None
        Unix times of the attack job, when recorded.
    psnr : list[float] or None
        Per ground-truth sample PSNR (None: not scored by PSNR).
    recovery : SampleRecovery or None
        Scored and recovered samples counted from ``metrics.json`` by the scorer's own
        criterion (images, features or tabular); None without one (the table's fractions serve).
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
    verdict: str = ""
    verdict_reason: str = ""
    verdict_derived: bool = False
    input_space: str | None = None
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    psnr: list[float] | None = None
    recovery: SampleRecovery | None = None
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
        if self.recovery is not None:
            return self.recovery.scored
        count = number(self.row.get("num_references"))
        return 0 if count is None or number(self.row.get("exact_fraction")) is None else int(count)

    def _table_count(self, column: str) -> int:
        """Samples flagged by a fraction column of the table (no ``metrics.json`` to count from)."""
        fraction = number(self.row.get(column))
        return 0 if fraction is None else int(round(fraction * self.scored_count))

    @property
    def exact_count(self) -> int:
        """Scored samples recovered exactly, by the criterion of the scorer that scored them."""
        if self.recovery is not None:
            return self.recovery.exact
        return self._table_count("exact_fraction")

    @property
    def approximate_count(self) -> int:
        """Scored samples recovered at least approximately (exact ones included)."""
        if self.recovery is not None:
            return self.recovery.approximate
        return self._table_count("approx_fraction")

    @property
    def queue_seconds(self) -> float | None:
        """Seconds the job waited before it started, when both times were recorded."""
        if self.queued_at is None or self.started_at is None:
            return None
        return max(0.0, self.started_at - self.queued_at)


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
        One per attacked update (the exact attack's), sorted by round and client.
    history : dict[str, Any] or None
        ``history.json`` (None when missing or unreadable).
    problems : list[str]
        Files that could not be read (reported, never fatal).
    fallbacks : list[AttackEntry]
        The fallback attack's rows (approximate second attacks on updates the exact attack did
        not recover exactly), kept apart so that they never count as attacked updates.
    """

    directory: Path
    config: dict[str, Any] | None
    entries: list[AttackEntry]
    history: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    fallbacks: list[AttackEntry] = field(default_factory=list)


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
        entries=[entry for entry in entries if not is_fallback_row(entry.row)],
        history=history if isinstance(history, dict) else None,
        problems=problems,
        fallbacks=[entry for entry in entries if is_fallback_row(entry.row)],
    )


def number(text: Any) -> float | None:
    """A finite float from a table cell or JSON value, else None."""
    if text is None or text == "" or isinstance(text, bool):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _read_json(path: Path, problems: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        problems.append(f"{path.name}: {error}")
        return None


def _text(row: dict[str, str], metrics: dict[str, Any], key: str) -> str:
    """A text field from the table row, else from metrics.json, else empty."""
    value = row.get(key) or metrics.get(key)
    return value if isinstance(value, str) else ""


def _time(row: dict[str, str], metrics: dict[str, Any], key: str) -> float | None:
    value = number(row.get(key))
    return value if value is not None else number(metrics.get(key))


def _entry(row: dict[str, str], run: Path, problems: list[str]) -> AttackEntry:
    round_number = number(row.get("round"))
    entry = AttackEntry(
        server_round=0 if round_number is None else int(round_number),
        client=row.get("client") or "?",
        status=row.get("status") or "?",
        seconds=number(row.get("seconds")),
        error=row.get("error") or "",
        row=row,
    )
    metrics: dict[str, Any] = {}
    folder = _inside(run, row.get("directory") or "")
    if folder is not None:
        document = _read_json(folder / METRICS_FILE, problems)
        if isinstance(document, dict):
            metrics = document
        psnr = metrics.get("psnr")
        if isinstance(psnr, list):
            entry.psnr = [float(value) for value in psnr if isinstance(value, (int, float))]
        quality = metrics.get("quality")
        entry.recovery = sample_recovery(
            quality=quality if isinstance(quality, dict) else {},
            psnr=psnr if isinstance(psnr, list) else None,
        )
        if isinstance(metrics.get("details"), dict):
            entry.details = metrics["details"]
        if isinstance(metrics.get("grid"), dict):
            entry.grid = metrics["grid"]
        if (folder / GRID_FILE).is_file():
            entry.grid_png = folder / GRID_FILE
            if entry.grid is None:
                entry.grid = _inferred_grid(entry.grid_png, entry.psnr)

    space = _text(row, metrics, "input_space")
    layer = entry.details.get("layer")
    if not space and isinstance(layer, dict) and isinstance(layer.get("input_space"), str):
        space = layer["input_space"]
    entry.input_space = space if space in INPUT_SPACES else None
    entry.queued_at = _time(row, metrics, "queued_at")
    entry.started_at = _time(row, metrics, "started_at")
    entry.finished_at = _time(row, metrics, "finished_at")

    verdict = _text(row, metrics, "verdict")
    if verdict in VERDICTS:
        entry.verdict = verdict
        entry.verdict_reason = _text(row, metrics, "verdict_reason")
    else:
        if verdict:
            problems.append(f"{entry.client}, round {entry.server_round}: unknown verdict {verdict!r}")
        entry.verdict, entry.verdict_reason = derive_verdict(
            status=entry.status,
            error=entry.error,
            scored=entry.scored_count,
            exact=entry.exact_count,
            approximate=entry.approximate_count,
            complete=row.get("complete") == "True" if entry.status == STATUS_OK else None,
            criteria=_criteria(entry.recovery),
        )
        entry.verdict_derived = True
    return entry


def _criteria(recovery: SampleRecovery | None) -> tuple[str, str] | None:
    """The criteria a derived verdict names: None (PSNR) for images or without scores."""
    if recovery is None or recovery.kind == KIND_IMAGES:
        return None
    return recovery.exact_rule, recovery.approximate_rule


def _inside(run: Path, relative: str) -> Path | None:
    """``run / relative`` when it stays inside the run directory and exists, else None."""
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
