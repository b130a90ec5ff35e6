"""The run table ``attacks.csv``: one CSV row per stored attack, read back with :func:`load_table`."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fl_attack.results.record import TABLE_COLUMNS

#: Columns a table must have to be read as a run table.
REQUIRED_COLUMNS: tuple[str, ...] = ("round", "client", "status", "directory")


class TableFormatError(ValueError):
    """A file is not a run table the store can read or append to."""


def header_bytes(*, columns: Sequence[str] = TABLE_COLUMNS) -> bytes:
    """The table's header line."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(list(columns))
    return text.getvalue().encode("utf-8")


def rows_bytes(rows: Sequence[Mapping[str, Any]], *, columns: Sequence[str] = TABLE_COLUMNS) -> bytes:
    """``rows`` as CSV lines under ``columns`` (no header).

    Parameters
    ----------
    rows : Sequence[Mapping[str, Any]]
        Rows keyed by column; columns a row lacks are left empty, keys not in ``columns``
        are dropped (an older table keeps its own columns).
    columns : Sequence[str]
        The table's columns, in order.

    Returns
    -------
    bytes
        UTF-8 CSV, one ``\\n``-terminated line per row.
    """
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore")
    writer.writerows(rows)
    return text.getvalue().encode("utf-8")


def parse_header(content: bytes, *, source: str | os.PathLike[str]) -> tuple[str, ...]:
    """The columns named by the first line of a table's ``content``.

    Raises
    ------
    TableFormatError
        When the content is not UTF-8 CSV or lacks a column of :data:`REQUIRED_COLUMNS`.
    """
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TableFormatError(f"{os.fspath(source)} is not a UTF-8 run table: {error}") from error
    first = next(csv.reader(io.StringIO(text)), [])
    missing = [column for column in REQUIRED_COLUMNS if column not in first]
    if missing:
        raise TableFormatError(
            f"{os.fspath(source)} is not a run table: its header lacks the column(s) {', '.join(missing)}"
        )
    return tuple(first)


def parse_rows(content: bytes) -> list[dict[str, str]]:
    """Rows of a table's ``content``; every column of :data:`TABLE_COLUMNS` is present.

    Columns the table does not have (tables written before they existed) read as ``""``;
    columns the store does not know are kept.
    """
    rows = []
    for row in csv.DictReader(io.StringIO(content.decode("utf-8"))):
        complete = {column: "" for column in TABLE_COLUMNS}
        complete.update(
            {key: "" if value is None else value for key, value in row.items() if key is not None}
        )
        rows.append(complete)
    return rows


def load_table(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Read a run table written by the store (values as strings).

    Parameters
    ----------
    path : str or os.PathLike
        The ``attacks.csv`` file.

    Returns
    -------
    list[dict[str, str]]
        One dict per row, with every column of :data:`TABLE_COLUMNS` (``""`` where the
        table has no such column, as in tables written before it was added).
    """
    with open(path, "rb") as handle:
        return parse_rows(handle.read())
