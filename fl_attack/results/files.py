"""Private, durable file writes: a file is either completely on disk or not changed at all.

Every write here follows the same steps: the content is serialised to bytes first (so that a
serialiser's own buffered I/O can never lose an error), written to a temporary file in the
target's directory with :func:`os.write` until every byte is accepted, flushed to the device
with :func:`os.fsync`, checked against its expected size on disk, moved over the target with
:func:`os.replace`, and the directory is fsynced so that the rename itself survives a crash.
Any failure removes the temporary file, leaves a previous version of the target unchanged and
raises :class:`StoreWriteError`, whose message names the file and says why ("disk full",
"file too large", ...).
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

#: Permission bits of every directory the store creates.
DIRECTORY_MODE = 0o700
#: Permission bits of every file the store writes.
FILE_MODE = 0o600

#: How a failed write is explained, by ``errno``; other errors use the system's own words.
_REASONS: dict[int, str] = {
    errno.ENOSPC: "disk full (no space left on the device)",
    errno.EDQUOT: "disk full (disk quota exceeded)",
    errno.EFBIG: "file too large (the process's file-size limit or the file system's maximum was reached)",
    errno.ENAMETOOLONG: "file name too long",
}

#: Longest part of the target's name used in a temporary file's name (names are capped at 255 bytes).
_TEMPORARY_NAME_PART = 100


class StoreWriteError(OSError):
    """A file or directory of the store could not be written completely.

    Raised with the ``errno`` of the underlying failure (``ENOSPC``, ``EFBIG``, ``EDQUOT``,
    ...; ``EIO`` when fewer bytes than written reached the disk), the message as
    ``strerror`` and the path as ``filename``. A previous version of the file is unchanged.
    """

    def __str__(self) -> str:
        """The message alone: it already names the file."""
        return self.strerror if isinstance(self.strerror, str) else super().__str__()


def write_error(path: str | os.PathLike[str], cause: OSError, *, action: str = "write") -> StoreWriteError:
    """A :class:`StoreWriteError` explaining why ``action`` on ``path`` failed with ``cause``.

    Parameters
    ----------
    path : str or os.PathLike
        The file or directory being written.
    cause : OSError
        The failure; its ``errno`` selects the explanation ("disk full", "file too large").
    action : str (default: "write")
        What was attempted, e.g. ``"write"`` or ``"create directory"``.

    Returns
    -------
    StoreWriteError
        With ``cause``'s ``errno``.
    """
    if isinstance(cause, StoreWriteError):
        return cause
    code = cause.errno
    reason = _REASONS.get(code) if code is not None else None
    if reason is None:
        reason = cause.strerror or str(cause) or type(cause).__name__
    message = f"could not {action} {os.fspath(path)}: {reason}"
    if action == "write":
        message += "; a previous version of the file, if any, is unchanged"
    return StoreWriteError(code, message, os.fspath(path))


def _write_all(descriptor: int, data: memoryview, target: Path) -> None:
    """Write every byte of ``data`` to ``descriptor`` (``os.write`` may accept only a part)."""
    offset = 0
    while offset < len(data):
        written = os.write(descriptor, data[offset:])
        if written <= 0:
            raise StoreWriteError(
                errno.EIO,
                f"could not write {target}: the device accepted no more bytes "
                f"({offset} of {len(data)} written)",
                os.fspath(target),
            )
        offset += written


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (new names, renames) to the device.

    File systems that cannot fsync a directory (``EINVAL``) are accepted as they are.

    Raises
    ------
    StoreWriteError
        When the directory cannot be opened or the device reports an error.
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as error:
        raise write_error(directory, error, action="sync directory") from error
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise write_error(directory, error, action="sync directory") from error
    finally:
        os.close(descriptor)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> Path:
    """Write ``data`` to ``path`` so that it appears complete or not at all (mode ``0o600``).

    Parameters
    ----------
    path : str or os.PathLike
        Final location of the file; its directory must exist.
    data : bytes-like
        The whole content.

    Returns
    -------
    Path
        The path written.

    Raises
    ------
    StoreWriteError
        When any step fails (disk full, file too large, short write, ...). The temporary
        file is removed and a previous ``path`` is left unchanged.
    """
    target = Path(path)
    content = memoryview(data).cast("B")
    try:
        descriptor, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name[:_TEMPORARY_NAME_PART]}.", suffix=".tmp"
        )
    except OSError as error:
        raise write_error(target, error) from error
    open_descriptor: int | None = descriptor
    try:
        os.fchmod(descriptor, FILE_MODE)
        _write_all(descriptor, content, target)
        os.fsync(descriptor)
        size = os.fstat(descriptor).st_size
        if size != len(content):
            raise StoreWriteError(
                errno.EIO,
                f"could not write {target}: only {size} of {len(content)} bytes reached the disk; "
                "a previous version of the file, if any, is unchanged",
                os.fspath(target),
            )
        open_descriptor = None
        os.close(descriptor)
        os.replace(temporary, target)
    except BaseException as failure:
        if open_descriptor is not None:
            try:
                os.close(open_descriptor)
            except OSError:
                pass
        try:
            os.unlink(temporary)
        except OSError:
            pass
        if isinstance(failure, OSError):
            raise write_error(target, failure) from failure
        raise
    fsync_directory(target.parent)
    return target


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Atomically write what ``write`` produces (see :func:`atomic_write_bytes`).

    ``write`` receives an in-memory binary file; only once it has returned is anything
    written to disk. If it raises, no file is created or changed and the exception propagates.
    """
    buffer = io.BytesIO()
    write(buffer)
    return atomic_write_bytes(path, buffer.getbuffer())


def json_bytes(document: Any) -> bytes:
    """``document`` as indented UTF-8 JSON with a final newline (NaN/Inf become ``null``)."""
    text = json.dumps(jsonable(document), indent=2, sort_keys=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], document: Any) -> Path:
    """Atomically write ``document`` as indented JSON (NaN/Inf become ``null``)."""
    return atomic_write_bytes(path, json_bytes(document))


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` in ``.npy`` format, refusing object arrays (they would need pickle)."""
    values = np.asarray(array)
    if values.dtype.hasobject:
        raise TypeError("object arrays cannot be stored without pickle")
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def atomic_write_npy(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Atomically write ``array`` in ``.npy`` format, refusing object arrays."""
    return atomic_write_bytes(path, npy_bytes(array))


def make_private_directory(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents; a directory created here gets mode ``0o700``.

    An existing directory is returned unchanged: its mode is never touched, since it may be
    shared (``/tmp``) or belong to the user.

    Raises
    ------
    StoreWriteError
        When the directory cannot be created, or ``path`` exists and is not a directory.
    """
    directory = Path(path)
    if directory.is_dir():
        return directory
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError as error:
        if directory.is_dir():
            return directory
        raise write_error(directory, error, action="create directory") from error
    except OSError as error:
        raise write_error(directory, error, action="create directory") from error
    try:
        os.chmod(directory, DIRECTORY_MODE)  # mkdir's mode is reduced by the umask
    except OSError as error:
        raise write_error(directory, error, action="create directory") from error
    return directory


def claim_fresh_directory(parent: str | os.PathLike[str], stem: str, *, separator: str = "-") -> Path:
    """Create and return a new private directory ``<parent>/<stem>``, else ``<stem><separator>N`` (N >= 2).

    The name is claimed with an exclusive ``mkdir``, so two processes never get the same one.

    Parameters
    ----------
    parent : str or os.PathLike
        An existing directory.
    stem : str
        The preferred name.
    separator : str (default: "-")
        Put between ``stem`` and the number of a later candidate.

    Returns
    -------
    Path
        The directory created (mode ``0o700``).

    Raises
    ------
    StoreWriteError
        When ``parent`` is missing or no directory can be created in it.
    """
    base = Path(parent)
    number = 1
    while True:
        candidate = base / (stem if number == 1 else f"{stem}{separator}{number}")
        try:
            candidate.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            number += 1
            continue
        except OSError as error:
            raise write_error(candidate, error, action="create directory") from error
        try:
            os.chmod(candidate, DIRECTORY_MODE)  # mkdir's mode is reduced by the umask
        except OSError as error:
            raise write_error(candidate, error, action="create directory") from error
        return candidate


def jsonable(value: Any) -> Any:
    """Convert numpy/torch scalars and arrays to plain JSON values; NaN/Inf to None."""
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if hasattr(value, "tolist") and callable(value.tolist):
        return jsonable(value.tolist())
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
