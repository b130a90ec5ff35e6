"""Atomic, durable writes of the store: a failed write raises StoreWriteError and changes nothing."""

from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fl_attack.results.files import (
    StoreWriteError,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_npy,
    make_private_directory,
)

_real_write = os.write


def _failing_write(code: int, *, after: int) -> Callable[[int, object], int]:
    """An ``os.write`` that accepts ``after`` bytes in total, then fails with ``code``."""
    accepted = [0]

    def write(descriptor: int, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        room = after - accepted[0]
        if room <= 0:
            raise OSError(code, os.strerror(code))
        written = _real_write(descriptor, view[:room])
        accepted[0] += written
        return written

    return write


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "disk full (no space left on the device)"),
        (errno.EDQUOT, "disk full (disk quota exceeded)"),
        (
            errno.EFBIG,
            "file too large (the process's file-size limit or the file system's maximum was reached)",
        ),
    ],
)
def test_failed_write_raises_names_the_file_and_keeps_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    target = tmp_path / "reconstruction.npy"
    before = np.arange(10.0)
    atomic_write_npy(target, before)
    previous = target.read_bytes()

    monkeypatch.setattr(os, "write", _failing_write(code, after=100))
    with pytest.raises(StoreWriteError) as caught:
        atomic_write_npy(target, np.arange(1000.0))

    error = caught.value
    assert isinstance(error, OSError)
    assert error.errno == code
    assert error.filename == str(target)
    assert (
        str(error)
        == f"could not write {target}: {words}; a previous version of the file, if any, is unchanged"
    )
    assert target.read_bytes() == previous
    np.testing.assert_array_equal(np.load(target), before)
    assert _names(tmp_path) == ["reconstruction.npy"]  # no temporary file left


def test_failed_first_write_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "write", _failing_write(errno.ENOSPC, after=0))
    with pytest.raises(StoreWriteError, match="disk full"):
        atomic_write_json(tmp_path / "metrics.json", {"a": 1})
    assert _names(tmp_path) == []


def test_partial_writes_are_continued_until_every_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def dribble(descriptor: int, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        calls.append(len(view))
        return _real_write(descriptor, view[:7])

    monkeypatch.setattr(os, "write", dribble)
    payload = bytes(range(256)) * 3
    atomic_write_bytes(tmp_path / "data.bin", payload)
    assert (tmp_path / "data.bin").read_bytes() == payload
    assert len(calls) == -(-len(payload) // 7)


def test_write_that_accepts_nothing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "write", lambda descriptor, data: 0)
    with pytest.raises(
        StoreWriteError, match=r"the device accepted no more bytes \(0 of 5 written\)"
    ) as caught:
        atomic_write_bytes(tmp_path / "data.bin", b"hello")
    assert caught.value.errno == errno.EIO
    assert _names(tmp_path) == []


def test_bytes_lost_before_the_disk_are_detected_by_the_size_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that claims success but loses bytes (like a lost flush error) never installs the file."""
    target = tmp_path / "data.bin"
    atomic_write_bytes(target, b"old content")

    def lossy(descriptor: int, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        _real_write(descriptor, view[: len(view) // 2])
        return len(view)

    monkeypatch.setattr(os, "write", lossy)
    with pytest.raises(StoreWriteError, match=r"only 500 of 1000 bytes reached the disk") as caught:
        atomic_write_bytes(target, b"x" * 1000)
    assert caught.value.errno == errno.EIO
    assert target.read_bytes() == b"old content"
    assert _names(tmp_path) == ["data.bin"]


def test_failing_fsync_keeps_the_previous_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "attacks.csv"
    atomic_write_bytes(target, b"round,client\n")

    def fsync(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreWriteError, match="disk full"):
        atomic_write_bytes(target, b"round,client\n1,partition-0\n")
    assert target.read_bytes() == b"round,client\n"
    assert _names(tmp_path) == ["attacks.csv"]


def test_the_directory_is_fsynced_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name file descriptors")
    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_bytes(tmp_path / "data.bin", b"abc")
    assert len(synced) == 2
    assert Path(synced[0]).name.startswith(".data.bin.") and synced[0].endswith(".tmp")
    assert synced[1] == str(tmp_path)


def test_failing_writer_leaves_no_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"

    def crash(handle: object) -> None:
        handle.write(b"half of it")  # type: ignore[attr-defined]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, crash)
    assert _names(tmp_path) == []

    atomic_write_bytes(target, b"complete")
    with pytest.raises(RuntimeError):
        atomic_write(target, crash)
    assert target.read_bytes() == b"complete"
    assert _names(tmp_path) == ["data.bin"]


def test_npy_refuses_pickle_and_round_trips(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="object arrays cannot be stored without pickle"):
        atomic_write_npy(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object))
    assert _names(tmp_path) == []
    values = np.random.default_rng(0).standard_normal((3, 5))
    atomic_write_npy(tmp_path / "x.npy", values)
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy", allow_pickle=False), values)


def test_long_target_names_get_a_valid_temporary_name(tmp_path: Path) -> None:
    target = tmp_path / ("n" * 250)
    atomic_write_bytes(target, b"ok")
    assert target.read_bytes() == b"ok"


def test_store_write_error_survives_pickling() -> None:
    error = StoreWriteError(errno.ENOSPC, "could not write /x: disk full", "/x")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.errno, str(copy), copy.filename) == (
        StoreWriteError,
        errno.ENOSPC,
        str(error),
        "/x",
    )


def test_make_private_directory_never_changes_an_existing_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert make_private_directory(shared) == shared
    assert shared.stat().st_mode & 0o7777 == 0o1777

    created = make_private_directory(tmp_path / "a" / "b")
    assert created.stat().st_mode & 0o7777 == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreWriteError, match=r"could not create directory .*file"):
        make_private_directory(tmp_path / "file")
