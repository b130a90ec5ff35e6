"""Private, crash-safe storage of gradient-inversion reconstructions.

A :class:`ReconstructionStore` owns one directory per federated run::

    <run>/
        run_config.json
        attacks.csv                         one row per stored attack
        history.json                        training and test metrics per round
        round-001/
            partition-0/
                reconstruction.npy          recovered layer inputs, (b, n) float64
                reconstruction.png          ground truth above reconstruction (matched)
                metrics.json                quality, timing, verdict and error of the attack;
                                            its ``grid`` entry locates every sample's
                                            tiles in reconstruction.png (see grid_layout)

Guarantees:

- **Private.** Directories the store creates get mode ``0o700``, files ``0o600``
  (reconstructions are private client data). A directory it did not create is never chmodded.
- **Complete or absent.** Every file is serialised to bytes, written to a temporary file,
  fsynced, checked for its size on disk and renamed into place, and the directory is fsynced
  (:mod:`fl_attack.results.files`). A failed write (disk full, file-size limit, ...) raises
  :class:`StoreWriteError` naming the file, leaves the previous version intact and leaves no
  temporary file. :meth:`ReconstructionStore.save` either stores an attack completely (its
  files and its table row) or raises and removes what it had written for it.
- **Never reset, never overwritten.** Opening an existing run directory is refused unless
  ``resume=True``, which appends to its table and keeps the rows already there byte for byte.
  An existing directory that is not a run directory (e.g. ``/tmp``) is left as it is and the
  run goes into a new private subdirectory ``<dir>/audit-<timestamp>[-N]``;
  :attr:`ReconstructionStore.directory` says where. A second attack saved for the same
  (round, client), e.g. two clients claiming one partition id, gets its own directory
  ``<name>-dup2`` (``-dup3``, ...) and its ``metrics.json`` names the directory it duplicates.
  A fallback attack's record (:mod:`fl_attack.audit.fallback`) goes to ``<name>-<attack>``
  (``partition-0-cocktail-party``) and its row's ``fallback_after`` holds the exact verdict.
- **Any name length.** A client name longer than 80 characters (a secure-aggregation group
  of many clients) is stored under a short readable directory name plus a hash
  (:mod:`fl_attack.results.naming`); the table's ``client`` column and ``metrics.json``
  keep the full name, the ``directory`` column the short one.
- **No records kept in memory.** :meth:`ReconstructionStore.save` returns the attack's
  directory and :meth:`ReconstructionStore.rows` reads the table back, so a caller can drop
  a record's arrays once it is saved.

Arrays are stored as ``.npy`` with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack.results.files import (
    DIRECTORY_MODE,
    FILE_MODE,
    StoreWriteError,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_npy,
    claim_fresh_directory,
    jsonable,
    make_private_directory,
)
from fl_attack.results.images import GRID_FILE, encode_png, grid_document, grid_layout, image_grid
from fl_attack.results.naming import DUPLICATE_SEPARATOR, unit_directory_name
from fl_attack.results.record import TABLE_COLUMNS, AttackRecord, fallback_after
from fl_attack.results.rundir import (
    RUN_CONFIG_FILE,
    TABLE_FILE,
    RunDirectoryExistsError,
    is_run_directory,
    open_run_directory,
    timestamp,
)
from fl_attack.results.table import (
    TableFormatError,
    header_bytes,
    load_table,
    parse_header,
    parse_rows,
    rows_bytes,
)

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "GRID_FILE",
    "HISTORY_FILE",
    "INPUTS_FILE",
    "METRICS_FILE",
    "RUN_CONFIG_FILE",
    "TABLE_COLUMNS",
    "TABLE_FILE",
    "AttackRecord",
    "ReconstructionStore",
    "RunDirectoryExistsError",
    "StoreClosedError",
    "StoreWriteError",
    "TableFormatError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_npy",
    "encode_png",
    "grid_layout",
    "image_grid",
    "is_run_directory",
    "load_table",
    "make_private_directory",
]

INPUTS_FILE = "reconstruction.npy"
METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.json"


class StoreClosedError(RuntimeError):
    """The store was closed (the run was stopped): it writes nothing more."""


class ReconstructionStore:
    """Directory of one run's reconstructions, their quality and the run's config.

    Parameters
    ----------
    directory : str or os.PathLike
        Output directory. Created (mode ``0o700``) when missing; an existing run directory
        is refused unless ``resume``; any other existing directory gets a new private
        subdirectory ``audit-<timestamp>[-N]`` for the run (see :attr:`directory`).
    run_config : Mapping[str, Any] or None (default: None)
        Configuration of the run, written to ``run_config.json``. When resuming, it must
        equal the stored one (when there is one).
    resume : bool (default: False)
        Append to the existing run directory ``directory``.

    Attributes
    ----------
    directory : Path
        The absolute run directory actually written.

    Raises
    ------
    RunDirectoryExistsError
        ``directory`` already holds a run and ``resume`` is False.
    FileNotFoundError
        ``resume`` is True and ``directory`` is not a run directory.
    ValueError
        When resuming with a ``run_config`` other than the stored one, or a table that
        cannot be read (:class:`TableFormatError`).
    StoreWriteError
        A directory or file could not be written.

    Examples
    --------
    ::

        store = ReconstructionStore.create(None, run_config={"width": 200})
        store.save(AttackRecord(server_round=1, client="partition-0", status="ok", ...))
        rows = store.rows()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run_config: Mapping[str, Any] | None = None,
        resume: bool = False,
    ) -> None:
        run_directory, created = open_run_directory(directory, resume=resume)
        self._open(run_directory, run_config=run_config, created=created)

    @classmethod
    def create(
        cls,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        run_config: Mapping[str, Any] | None = None,
        base: str | os.PathLike[str] = "outputs",
        resume: bool = False,
    ) -> ReconstructionStore:
        """Open ``output_dir`` as the constructor does, or a fresh ``<base>/<timestamp>[-N]`` when None.

        Parameters
        ----------
        output_dir : str or os.PathLike or None (default: None)
            Output directory; None or ``""`` claims a new directory under ``base``.
        run_config : Mapping[str, Any] or None (default: None)
            Configuration of the run, written to ``run_config.json``.
        base : str or os.PathLike (default: "outputs")
            Parent of new run directories when ``output_dir`` is None (created when missing;
            an existing one is not modified).
        resume : bool (default: False)
            Append to the existing run directory ``output_dir``.

        Returns
        -------
        ReconstructionStore
        """
        if output_dir is not None and os.fspath(output_dir) != "":
            return cls(output_dir, run_config=run_config, resume=resume)
        if resume:
            raise ValueError("resume=True needs the run directory to resume as output_dir")
        parent = make_private_directory(Path(base).expanduser().resolve())
        store = cls.__new__(cls)
        store._open(claim_fresh_directory(parent, timestamp()), run_config=run_config, created=True)
        return store

    def _open(self, directory: Path, *, run_config: Mapping[str, Any] | None, created: bool) -> None:
        self.directory = directory
        #: Held while a record or the history is written; :meth:`close` takes it to wait for them.
        self._writing = threading.Lock()
        self._closed = False
        #: First directory (relative to the run) stored for each (round, client).
        self._first_directory: dict[tuple[int, str], str] = {}
        try:
            if self.table_path.exists():
                self._load_table()
            else:
                self._columns = TABLE_COLUMNS
                self._table = header_bytes()
            self._store_run_config(run_config)
            if not self.table_path.exists():
                atomic_write_bytes(self.table_path, self._table)
        except BaseException:
            if created:
                shutil.rmtree(directory, ignore_errors=True)
            raise

    def _load_table(self) -> None:
        content = self.table_path.read_bytes()
        self._columns = parse_header(content, source=self.table_path)
        if not content.endswith(b"\n"):
            content += b"\n"
        for line, row in enumerate(parse_rows(content), start=2):
            try:
                key = (int(row["round"]), row["client"])
            except ValueError as error:
                raise TableFormatError(
                    f"{self.table_path}, row {line}: round {row['round']!r} is not an integer"
                ) from error
            self._first_directory.setdefault(key, row["directory"])
        self._table = content

    def _store_run_config(self, run_config: Mapping[str, Any] | None) -> None:
        if run_config is None:
            return
        path = self.directory / RUN_CONFIG_FILE
        document = jsonable(dict(run_config))
        if path.exists():
            try:
                stored = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as error:
                raise ValueError(
                    f"cannot resume {self.directory}: {path.name} is not valid JSON ({error})"
                ) from error
            if not isinstance(stored, dict):
                raise ValueError(f"cannot resume {self.directory}: {path.name} does not hold a JSON object")
            if stored != document:
                differing = sorted(
                    key for key in set(stored) | set(document) if stored.get(key) != document.get(key)
                )
                raise ValueError(
                    f"cannot resume {self.directory} with another run config: "
                    f"{', '.join(differing)} differ from {RUN_CONFIG_FILE}"
                )
            return
        atomic_write_json(path, document)

    @property
    def table_path(self) -> Path:
        """Path of the run table (``attacks.csv``)."""
        return self.directory / TABLE_FILE

    def attack_directory(self, server_round: int, client: str) -> Path:
        """Directory of the first attack stored for (``server_round``, ``client``).

        The name is ``client``'s own, or a short name plus a hash for a long one; a later
        duplicate of the same (round, client) is stored beside it with a ``-dupN`` suffix.
        """
        first = self._first_directory.get((server_round, client))
        if first is not None:
            return self.directory / first
        return self.directory / f"round-{server_round:03d}" / unit_directory_name(client)

    def save(self, record: AttackRecord) -> Path:
        """Write one attack's files and its table row; return its directory.

        Either everything is written (files complete on disk, row in ``attacks.csv``) or
        this raises and removes the files it had written for the record. Earlier attacks are
        never changed: a second record for the same (round, client) gets its own directory.

        Parameters
        ----------
        record : AttackRecord
            The attack; the store keeps no reference to it.

        Returns
        -------
        Path
            The attack's directory.

        Raises
        ------
        StoreWriteError
            A file could not be written completely (disk full, file too large, ...).
        StoreClosedError
            The store was closed (:meth:`close`).
        """
        with self._writing:
            self._refuse_when_closed(f"the attack on {record.client} in round {record.server_round}")
            return self._save(record)

    def _save(self, record: AttackRecord) -> Path:
        round_directory = make_private_directory(self.directory / f"round-{record.server_round:03d}")
        key = (record.server_round, record.client)
        fallback = fallback_after(record.details) is not None
        # a fallback attack's files sit beside the exact attack's, named after the fallback
        name = f"{record.client}-{record.attack.get('attack') or 'fallback'}" if fallback else record.client
        directory = claim_fresh_directory(
            round_directory, unit_directory_name(name), separator=DUPLICATE_SEPARATOR
        )
        relative = directory.relative_to(self.directory).as_posix()
        try:
            self._write_files(
                record,
                directory,
                relative=relative,
                duplicate_of=None if fallback else self._first_directory.get(key),
            )
            table = self._table + rows_bytes([record.table_row(relative)], columns=self._columns)
            atomic_write_bytes(self.table_path, table)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._table = table
        if not fallback:
            self._first_directory.setdefault(key, relative)
        return directory

    @staticmethod
    def _write_files(
        record: AttackRecord, directory: Path, *, relative: str, duplicate_of: str | None
    ) -> None:
        if record.inputs is not None:
            atomic_write_npy(directory / INPUTS_FILE, np.asarray(record.inputs, dtype=np.float64))
        document = record.metrics()
        document["directory"] = relative
        document["duplicate_of"] = duplicate_of
        if record.reconstructed_images is not None and len(record.reconstructed_images):
            reconstructed = np.asarray(record.reconstructed_images, dtype=np.float64)
            reference = (
                None
                if record.reference_images is None
                else np.asarray(record.reference_images, dtype=np.float64)
            )
            atomic_write_bytes(directory / GRID_FILE, encode_png(image_grid(reconstructed, reference)))
            document["grid"] = grid_document(reconstructed, reference=reference, psnr=record.psnr)
        atomic_write_json(directory / METRICS_FILE, document)

    def rows(self) -> list[dict[str, str]]:
        """The run table read back from disk, one dict per stored attack (see :func:`load_table`)."""
        return load_table(self.table_path)

    def save_history(self, history: Mapping[str, Any]) -> Path:
        """Write the run's per-round training/evaluation metrics to ``history.json``.

        Raises
        ------
        StoreClosedError
            The store was closed (:meth:`close`).
        """
        with self._writing:
            self._refuse_when_closed("the history")
            return atomic_write_json(self.directory / HISTORY_FILE, jsonable(dict(history)))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the store then writes nothing more."""
        return self._closed

    def close(self, *, timeout: float | None = None) -> bool:
        """Stop writing: wait for a record being written to be complete, then refuse every later write.

        A run that is stopped (a signal, a crashed runtime) closes its store so that leaving
        the process at once loses no file half-written: what was stored stays complete.

        Parameters
        ----------
        timeout : float or None (default: None)
            Seconds to wait for a write in progress; None waits for it.

        Returns
        -------
        bool
            True when no write is in progress any more; False when one still was after
            ``timeout`` (the store is closed all the same: it accepts no new write).
        """
        self._closed = True
        acquired = self._writing.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        if acquired:
            self._writing.release()
        return acquired

    def _refuse_when_closed(self, what: str) -> None:
        if self._closed:
            raise StoreClosedError(f"{what} was not stored: the store of {self.directory} was closed")
