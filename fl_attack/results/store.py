"""Private, crash-safe storage of gradient-inversion reconstructions.

A :class:`ReconstructionStore` owns one directory per federated run::

    <run>/
        run_config.json
        attacks.csv                         one row per (round, client)
        history.json                        training and test metrics per round
        round-001/
            partition-0/
                reconstruction.npy          recovered layer inputs, (b, n) float64
                reconstruction.png          ground truth above reconstruction (matched)
                metrics.json                quality, timing and error of the attack;
                                            its ``grid`` entry locates every sample's
                                            tiles in reconstruction.png (see grid_layout)

Reconstructions are private client data: directories are created with mode ``0o700``
and files with mode ``0o600``. Every file is written to a temporary file in its target
directory and moved into place with :func:`os.replace`, so a crash never leaves a
half-written file behind. Arrays are stored as ``.npy`` with ``allow_pickle=False``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
from PIL import Image

from fl_attack.vocabulary import INPUT_SPACES, STATUSES, VERDICTS

#: Permission bits of every directory the store creates.
DIRECTORY_MODE = 0o700
#: Permission bits of every file the store writes.
FILE_MODE = 0o600

RUN_CONFIG_FILE = "run_config.json"
TABLE_FILE = "attacks.csv"
INPUTS_FILE = "reconstruction.npy"
GRID_FILE = "reconstruction.png"
METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.json"

#: Columns of the run table, in order.
TABLE_COLUMNS: tuple[str, ...] = (
    "round",
    "client",
    "status",
    "verdict",
    "verdict_reason",
    "input_space",
    "seconds",
    "batch_size",
    "complete",
    "sparsity_matching",
    "num_references",
    "mean_psnr",
    "min_psnr",
    "exact_fraction",
    "approx_fraction",
    "batch_exact",
    "error",
    "directory",
    "queued_at",
    "started_at",
    "finished_at",
)

_STATUSES = STATUSES
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class AttackRecord:
    """Everything stored about one attack on one client's update.

    Attributes
    ----------
    server_round : int
        Federated round (starting at 1) in which the update was sent.
    client : str
        Directory-safe client name, e.g. ``"partition-3"`` or ``"node-81723"``.
    status : str
        ``"ok"``, ``"error"``, ``"timeout"`` or ``"out-of-memory"``.
    seconds : float
        Wall-clock time spent on the attack.
    inputs : numpy.ndarray or None
        ``(b, n)`` reconstructed layer inputs, in the attacker's order.
    reconstructed_images : numpy.ndarray or None
        ``(k, C, H, W)`` reconstructions in ``[0, 1]`` for the PNG grid; when
        ``reference_images`` is given, row ``i`` is matched to reference ``i``.
    reference_images : numpy.ndarray or None
        ``(k, C, H, W)`` ground-truth images in ``[0, 1]`` (only when scored).
    attack : Mapping[str, Any]
        What the attacker itself reports (batch size, sparsity-matching coefficient,
        completeness, ...), computed without the ground truth.
    quality : Mapping[str, Any]
        Scalar quality against the ground truth (mean PSNR, exact fraction, ...).
    psnr : Sequence[float] or None
        PSNR in dB of every ground-truth sample against its matched reconstruction.
    error : str or None
        Why the attack failed, when ``status`` is not ``"ok"``.
    details : Mapping[str, Any]
        Further JSON-serialisable facts (node id, partition id, training mode, ...).
    """

    server_round: int
    client: str
    status: str
    seconds: float
    inputs: np.ndarray | None = None
    reconstructed_images: np.ndarray | None = None
    reference_images: np.ndarray | None = None
    attack: Mapping[str, Any] = field(default_factory=dict)
    quality: Mapping[str, Any] = field(default_factory=dict)
    psnr: Sequence[float] | None = None
    error: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    verdict: str | None = None
    verdict_reason: str | None = None
    input_space: str | None = None
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        """Validate the fields that end up in paths and tables."""
        if self.server_round < 0:
            raise ValueError(f"server_round must be non-negative, got {self.server_round}")
        if not _SAFE_NAME.match(self.client):
            raise ValueError(
                f"client name {self.client!r} is not directory-safe "
                "(letters, digits, '_', '.', '-'; not starting with '.' or '-')"
            )
        if self.status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, got {self.status!r}")
        if self.verdict is not None and self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.input_space is not None and self.input_space not in INPUT_SPACES:
            raise ValueError(f"input_space must be one of {INPUT_SPACES}, got {self.input_space!r}")

    def metrics(self) -> dict[str, Any]:
        """The JSON document stored as ``metrics.json`` (no arrays)."""
        return _jsonable(
            {
                "round": self.server_round,
                "client": self.client,
                "status": self.status,
                "verdict": self.verdict,
                "verdict_reason": self.verdict_reason,
                "input_space": self.input_space,
                "seconds": self.seconds,
                "queued_at": self.queued_at,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "error": self.error,
                "complete": self.attack.get("complete"),
                "sparsity_matching": self.attack.get("sparsity_matching"),
                "batch_size": self.attack.get("batch_size"),
                "attack": dict(self.attack),
                "quality": dict(self.quality),
                "psnr": None if self.psnr is None else [float(v) for v in self.psnr],
                "details": dict(self.details),
            }
        )

    def table_row(self, directory: str) -> dict[str, Any]:
        """One row of the run table."""
        psnr = None if self.psnr is None else [float(v) for v in self.psnr]
        row = {
            "round": self.server_round,
            "client": self.client,
            "status": self.status,
            "verdict": self.verdict,
            "verdict_reason": self.verdict_reason,
            "input_space": self.input_space,
            "seconds": round(float(self.seconds), 4),
            "batch_size": self.attack.get("batch_size"),
            "complete": self.attack.get("complete"),
            "sparsity_matching": self.attack.get("sparsity_matching"),
            "num_references": None if psnr is None else len(psnr),
            "mean_psnr": self.quality.get("mean_psnr"),
            "min_psnr": min(psnr) if psnr else None,
            "exact_fraction": self.quality.get("exact_fraction"),
            "approx_fraction": self.quality.get("approx_fraction"),
            "batch_exact": self.quality.get("batch_exact"),
            "error": self.error,
            "directory": directory,
            "queued_at": self.queued_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }
        return {key: "" if value is None else value for key, value in row.items()}


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file so that it either appears complete or not at all.

    ``write`` receives a binary file object opened on a temporary file in the target
    directory (mode ``0o600``). Once it returns, the data is flushed to disk and the
    temporary file is renamed over ``path``. If ``write`` raises, the temporary file is
    removed, an existing ``path`` is left untouched, and the exception propagates.

    Parameters
    ----------
    path : str or os.PathLike
        Final location of the file.
    write : Callable[[IO[bytes]], None]
        Writes the whole content to the given file object.

    Returns
    -------
    Path
        The path written.
    """
    target = Path(path)
    descriptor, temporary = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        os.fchmod(descriptor, FILE_MODE)
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Atomically write ``data`` to ``path`` (see :func:`atomic_write`)."""
    return atomic_write(path, lambda handle: handle.write(data))


def atomic_write_json(path: str | os.PathLike[str], document: Any) -> Path:
    """Atomically write ``document`` as indented JSON (NaN/Inf become ``null``)."""
    text = json.dumps(_jsonable(document), indent=2, sort_keys=False, allow_nan=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def atomic_write_npy(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Atomically write ``array`` in ``.npy`` format, refusing object arrays."""
    values = np.asarray(array)
    if values.dtype == object:
        raise TypeError("object arrays cannot be stored without pickle")
    return atomic_write(path, lambda handle: np.save(handle, values, allow_pickle=False))


def make_private_directory(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents, giving the leaf mode ``0o700``.

    Existing directories are kept, but the leaf's mode is tightened to ``0o700``.
    """
    directory = Path(path)
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    os.chmod(directory, DIRECTORY_MODE)
    return directory


#: Upper bound of a per-tile PSNR (mirrors ``fl_attack.evaluation.metrics.PSNR_CAP_DB``).
_PSNR_CAP_DB = 300.0


def grid_layout(
    image_shape: Sequence[int],
    *,
    rows: int,
    columns: int,
    min_tile: int = 64,
    padding: int = 2,
) -> dict[str, int]:
    """Pixel geometry of a picture drawn by :func:`image_grid`.

    Tile ``(row, column)`` of the picture occupies the box
    ``left = padding + column * (tile_width + padding)``,
    ``top = padding + row * (tile_height + padding)``, of size
    ``tile_width x tile_height``.

    Parameters
    ----------
    image_shape : Sequence[int]
        ``(C, H, W)`` or ``(H, W)`` of one image.
    rows : int
        Rows of tiles (2 with ground truth, else 1).
    columns : int
        Columns of tiles.
    min_tile : int (default: 64)
        As in :func:`image_grid`.
    padding : int (default: 2)
        As in :func:`image_grid`.

    Returns
    -------
    dict[str, int]
        ``rows``, ``columns``, ``tile_height``, ``tile_width``, ``padding``, ``scale``,
        ``height`` and ``width`` (of the whole picture).
    """
    height, width = (int(size) for size in tuple(image_shape)[-2:])
    scale = max(1, math.ceil(min_tile / max(height, width)))
    tile_h, tile_w = height * scale, width * scale
    return {
        "rows": int(rows),
        "columns": int(columns),
        "tile_height": tile_h,
        "tile_width": tile_w,
        "padding": int(padding),
        "scale": scale,
        "height": rows * tile_h + (rows + 1) * padding,
        "width": columns * tile_w + (columns + 1) * padding,
    }


def image_grid(
    reconstructed: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    min_tile: int = 64,
    padding: int = 2,
) -> np.ndarray:
    """Tile images into one ``uint8`` RGB picture: ground truth on top, reconstructions below.

    Parameters
    ----------
    reconstructed : numpy.ndarray
        ``(k, C, H, W)`` images in ``[0, 1]`` with ``C`` in ``{1, 3}``.
    reference : numpy.ndarray or None
        ``(k', C, H, W)`` ground truth drawn in a first row; column ``i`` pairs
        ``reference[i]`` with ``reconstructed[i]``.
    min_tile : int (default: 64)
        Images are enlarged by an integer factor (nearest neighbour) to at least
        this many pixels per side.
    padding : int (default: 2)
        White pixels between tiles.

    Returns
    -------
    numpy.ndarray
        ``(height, width, 3)`` ``uint8`` array.
    """
    rows = [reconstructed] if reference is None else [reference, reconstructed]
    for images in rows:
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"expected (k, C, H, W) images with C in {{1, 3}}, got {images.shape}")
    height, width = rows[0].shape[2:]
    if any(images.shape[2:] != (height, width) for images in rows):
        raise ValueError("all images of a grid must share their height and width")
    columns = max(1, max(len(images) for images in rows))
    layout = grid_layout(
        rows[0].shape, rows=len(rows), columns=columns, min_tile=min_tile, padding=padding
    )
    scale, tile_h, tile_w = layout["scale"], layout["tile_height"], layout["tile_width"]
    canvas = np.full((layout["height"], layout["width"], 3), 255, dtype=np.uint8)
    for row_index, images in enumerate(rows):
        for column, image in enumerate(images):
            rgb = np.repeat(image, 3, axis=0) if image.shape[0] == 1 else image
            pixels = np.clip(np.nan_to_num(rgb.transpose(1, 2, 0), nan=0.0), 0.0, 1.0)
            pixels = np.kron(pixels, np.ones((scale, scale, 1)))
            top = padding + row_index * (tile_h + padding)
            left = padding + column * (tile_w + padding)
            canvas[top : top + tile_h, left : left + tile_w] = np.round(pixels * 255).astype(np.uint8)
    return canvas


def encode_png(picture: np.ndarray) -> bytes:
    """Encode a ``(height, width, 3)`` ``uint8`` array as PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(picture, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def default_run_directory(base: str | os.PathLike[str] = "outputs") -> Path:
    """A fresh ``<base>/<YYYYmmdd-HHMMSS>[-k]`` path that does not exist yet."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = Path(base) / stamp
    suffix = 1
    while candidate.exists():
        candidate = Path(base) / f"{stamp}-{suffix}"
        suffix += 1
    return candidate


class ReconstructionStore:
    """Directory of one run's reconstructions, their quality and the run's config.

    Parameters
    ----------
    directory : str or os.PathLike
        Run directory; created (mode ``0o700``) when missing.
    run_config : Mapping[str, Any] or None (default: None)
        Configuration of the run, written to ``run_config.json``.

    Examples
    --------
    ::

        store = ReconstructionStore.create(None, run_config={"width": 200})
        store.save(AttackRecord(server_round=1, client="partition-0", status="ok", ...))
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory = make_private_directory(Path(directory).resolve())
        self._rows: list[dict[str, Any]] = []
        self.records: list[AttackRecord] = []
        if run_config is not None:
            atomic_write_json(self.directory / RUN_CONFIG_FILE, dict(run_config))
        atomic_write(self.table_path, self._write_table)

    @classmethod
    def create(
        cls,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        run_config: Mapping[str, Any] | None = None,
        base: str | os.PathLike[str] = "outputs",
    ) -> ReconstructionStore:
        """Open ``output_dir``, or a fresh ``<base>/<timestamp>`` directory when it is None."""
        directory = default_run_directory(base) if output_dir in (None, "") else Path(output_dir)
        if output_dir in (None, ""):
            make_private_directory(Path(base))
        return cls(directory, run_config=run_config)

    @property
    def table_path(self) -> Path:
        """Path of the run table (``attacks.csv``)."""
        return self.directory / TABLE_FILE

    def attack_directory(self, server_round: int, client: str) -> Path:
        """Directory holding the files of one (round, client) attack."""
        return self.directory / f"round-{server_round:03d}" / client

    def save(self, record: AttackRecord) -> Path:
        """Write one attack's files and its table row; return its directory.

        Saving the same (round, client) twice replaces the earlier files and row.
        """
        round_directory = make_private_directory(self.directory / f"round-{record.server_round:03d}")
        directory = make_private_directory(round_directory / record.client)
        if record.inputs is not None:
            atomic_write_npy(directory / INPUTS_FILE, np.asarray(record.inputs, dtype=np.float64))
        document = record.metrics()
        if record.reconstructed_images is not None and len(record.reconstructed_images):
            reconstructed = np.asarray(record.reconstructed_images, dtype=np.float64)
            reference = (
                None if record.reference_images is None else np.asarray(record.reference_images, dtype=np.float64)
            )
            picture = image_grid(reconstructed, reference)
            atomic_write_bytes(directory / GRID_FILE, encode_png(picture))
            document["grid"] = _grid_document(reconstructed, reference, record.psnr)
        atomic_write_json(directory / METRICS_FILE, document)

        relative = str(directory.relative_to(self.directory))
        self._rows = [
            row
            for row in self._rows
            if (row["round"], row["client"]) != (record.server_round, record.client)
        ]
        self.records = [
            kept
            for kept in self.records
            if (kept.server_round, kept.client) != (record.server_round, record.client)
        ]
        self._rows.append(record.table_row(relative))
        self.records.append(record)
        atomic_write(self.table_path, self._write_table)
        return directory

    def save_history(self, history: Mapping[str, Any]) -> Path:
        """Write the run's per-round training/evaluation metrics to ``history.json``."""
        return atomic_write_json(self.directory / HISTORY_FILE, _jsonable(dict(history)))

    def _write_table(self, handle: IO[bytes]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=TABLE_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self._rows)
        handle.write(text.getvalue().encode("utf-8"))


def _grid_document(
    reconstructed: np.ndarray, reference: np.ndarray | None, psnr: Sequence[float] | None
) -> dict[str, Any]:
    """Where each sample lies in ``reconstruction.png``, and its PSNR per column.

    ``column_psnr[i]`` scores column ``i`` (ground truth above its matched
    reconstruction). When every ground-truth sample has a column, these are the scores
    in ``psnr`` (``column_psnr_source = "scores"``); otherwise (some samples were not
    matched) they are recomputed from the drawn images (``"images"``).
    """
    rows = 1 if reference is None else 2
    columns = max(len(reconstructed), 0 if reference is None else len(reference))
    document: dict[str, Any] = {
        "file": GRID_FILE,
        "row_names": ["reconstruction"] if reference is None else ["reference", "reconstruction"],
        "image_shape": [int(size) for size in reconstructed.shape[1:]],
        **grid_layout(reconstructed.shape, rows=rows, columns=columns),
        "column_psnr": None,
        "column_psnr_source": None,
    }
    if reference is None:
        return document
    paired = min(len(reference), len(reconstructed))
    if psnr is not None and len(psnr) == paired == len(reference):
        document["column_psnr"] = [float(value) for value in psnr]
        document["column_psnr_source"] = "scores"
    else:
        difference = np.clip(reconstructed[:paired], 0.0, 1.0) - np.clip(reference[:paired], 0.0, 1.0)
        mse = np.mean(np.square(difference).reshape(paired, -1), axis=1)
        with np.errstate(divide="ignore"):
            values = np.minimum(-10.0 * np.log10(mse), _PSNR_CAP_DB)
        document["column_psnr"] = [float(value) for value in values]
        document["column_psnr_source"] = "images"
    return document


def load_table(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Read a run table written by :class:`ReconstructionStore` (values as strings)."""
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _jsonable(value: Any) -> Any:
    """Convert numpy/torch scalars and arrays to plain JSON values; NaN/Inf to None."""
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if hasattr(value, "tolist") and callable(value.tolist):
        return _jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)
