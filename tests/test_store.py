"""Tests of the reconstruction store: layout, content, permissions, names, run directories, duplicates."""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import stat
import weakref
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_attack.results.store import (
    DIRECTORY_MODE,
    FILE_MODE,
    TABLE_COLUMNS,
    AttackRecord,
    ReconstructionStore,
    RunDirectoryExistsError,
    StoreWriteError,
    atomic_write_bytes,
    image_grid,
    load_table,
)
from fl_attack.vocabulary import INPUT_SPACES, STATUSES, VERDICTS


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _record(server_round: int = 1, client: str = "partition-0", **fields: object) -> AttackRecord:
    rng = np.random.default_rng(server_round)
    images = rng.random((3, 3, 4, 4))
    defaults: dict[str, object] = {
        "status": "ok",
        "seconds": 1.5,
        "inputs": rng.standard_normal((3, 48)),
        "reconstructed_images": images,
        "reference_images": images[::-1].copy(),
        "attack": {"batch_size": 3, "complete": True, "sparsity_matching": 0.999},
        "quality": {"mean_psnr": 120.0, "exact_fraction": 1.0, "approx_fraction": 1.0, "batch_exact": True},
        "psnr": [118.0, 121.0, 300.0],
        "details": {"node_id": 7, "partition_id": 0},
    }
    defaults.update(fields)
    return AttackRecord(server_round=server_round, client=client, **defaults)  # type: ignore[arg-type]


def _failed(server_round: int, client: str, error: str = "boom") -> AttackRecord:
    return AttackRecord(server_round=server_round, client=client, status="error", seconds=0.2, error=error)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


def test_layout_content_and_table(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"width": 200, "dataset": "digits"})
    record = _record(
        verdict="exact",
        verdict_reason="self-check passed",
        input_space="inputs",
        queued_at=1700000000.25,
        started_at=1700000001.5,
        finished_at=1700000003.0,
    )
    directory = store.save(record)

    assert directory == store.directory / "round-001" / "partition-0"
    inputs = np.load(directory / "reconstruction.npy", allow_pickle=False)
    np.testing.assert_array_equal(inputs, record.inputs)
    assert inputs.dtype == np.float64

    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["verdict"] == "exact"
    assert metrics["verdict_reason"] == "self-check passed" and metrics["input_space"] == "inputs"
    assert (metrics["queued_at"], metrics["started_at"], metrics["finished_at"]) == (
        1700000000.25,
        1700000001.5,
        1700000003.0,
    )
    assert metrics["psnr"] == [118.0, 121.0, 300.0]
    assert metrics["complete"] is True
    assert metrics["sparsity_matching"] == pytest.approx(0.999)
    assert metrics["quality"]["exact_fraction"] == 1.0
    assert metrics["details"]["node_id"] == 7
    assert metrics["directory"] == "round-001/partition-0" and metrics["duplicate_of"] is None

    with Image.open(directory / "reconstruction.png") as picture:
        assert picture.mode == "RGB"
        width, height = picture.size
    assert width > height > 0  # two rows (truth, reconstruction), three columns

    assert json.loads((store.directory / "run_config.json").read_text()) == {
        "width": 200,
        "dataset": "digits",
    }
    header = store.table_path.read_text().splitlines()[0]
    assert header.split(",") == list(TABLE_COLUMNS)
    assert TABLE_COLUMNS[2:6] == ("status", "verdict", "verdict_reason", "input_space")
    rows = store.rows()
    assert rows == load_table(store.table_path) and len(rows) == 1
    row = rows[0]
    assert (row["round"], row["client"], row["status"], row["verdict"]) == ("1", "partition-0", "ok", "exact")
    assert (row["verdict_reason"], row["input_space"]) == ("self-check passed", "inputs")
    assert (row["queued_at"], row["started_at"], row["finished_at"]) == (
        "1700000000.250000",
        "1700000001.500000",
        "1700000003.000000",
    )
    assert row["min_psnr"] == "118.0"
    assert row["directory"] == "round-001/partition-0"


def test_store_keeps_no_reference_to_saved_records(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    inputs = np.random.default_rng(0).standard_normal((3, 48))
    alive = weakref.ref(inputs)
    record = _record(inputs=inputs)
    saved_to = store.save(record)
    del record, inputs
    gc.collect()
    assert alive() is None  # the caller may drop a record's arrays once it is saved
    assert saved_to == store.directory / "round-001" / "partition-0"
    assert [row["client"] for row in store.rows()] == ["partition-0"]


def test_failed_attack_stores_metrics_only(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(_failed(3, "node-12"))
    assert sorted(path.name for path in directory.iterdir()) == ["metrics.json"]
    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["error"] == "boom" and metrics["psnr"] is None and metrics["verdict"] is None
    row = store.rows()[0]
    assert (row["verdict"], row["input_space"], row["queued_at"], row["error"]) == ("", "", "", "boom")


def test_private_permissions(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        store = ReconstructionStore.create(None, run_config={"a": 1}, base=tmp_path / "outputs")
        directory = store.save(_record())
    finally:
        os.umask(old_umask)
    assert store.directory.parent == (tmp_path / "outputs").resolve()
    for folder in (store.directory, directory.parent, directory):
        assert _mode(folder) == DIRECTORY_MODE
    for file in [*directory.iterdir(), store.table_path, store.directory / "run_config.json"]:
        assert _mode(file) == FILE_MODE, file


def test_default_directories_are_unique_and_the_base_keeps_its_mode(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    first = ReconstructionStore.create(None, base=tmp_path)
    second = ReconstructionStore.create(None, base=tmp_path)
    assert first.directory != second.directory
    assert first.directory.parent == second.directory.parent == tmp_path.resolve()
    assert _mode(tmp_path) == 0o755


def test_crash_while_saving_removes_the_partial_attack_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReconstructionStore(tmp_path / "run")
    store.save(_record())
    before = _snapshot(store.directory)

    def broken_png(picture: np.ndarray) -> bytes:
        raise OSError("crash while encoding")

    monkeypatch.setattr("fl_attack.results.store.encode_png", broken_png)
    with pytest.raises(OSError, match="crash while encoding"):
        store.save(_record(inputs=np.zeros((3, 48))))
    assert _snapshot(store.directory) == before  # no dup directory, no temporary file, same table


def test_disk_full_while_saving_raises_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReconstructionStore(tmp_path / "run")
    store.save(_record())
    before = _snapshot(store.directory)

    def full(descriptor: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(
        StoreWriteError, match=r"could not write .*round-001/partition-1/reconstruction.npy: disk full"
    ):
        store.save(_record(client="partition-1"))
    assert _snapshot(store.directory) == before
    assert not (store.directory / "round-001" / "partition-1").exists()
    monkeypatch.undo()
    store.save(_record(client="partition-1"))  # the store is still usable once space is back
    assert [row["client"] for row in store.rows()] == ["partition-0", "partition-1"]


def test_disk_full_on_the_table_removes_the_attack_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReconstructionStore(tmp_path / "run")
    store.save(_record())
    before = _snapshot(store.directory)
    real = atomic_write_bytes

    def table_full(path: os.PathLike[str], data: bytes) -> Path:
        if Path(path).name == "attacks.csv":
            raise StoreWriteError(errno.ENOSPC, f"could not write {path}: disk full", os.fspath(path))
        return real(path, data)

    monkeypatch.setattr("fl_attack.results.store.atomic_write_bytes", table_full)
    with pytest.raises(StoreWriteError, match="attacks.csv: disk full"):
        store.save(_record(client="partition-1"))
    assert _snapshot(store.directory) == before
    monkeypatch.undo()
    store.save(_record(client="partition-2"))
    assert [row["client"] for row in load_table(store.table_path)] == ["partition-0", "partition-2"]


def test_image_grid_shapes() -> None:
    gray = np.random.default_rng(0).random((4, 1, 8, 8))
    picture = image_grid(gray, gray, min_tile=16, padding=1)
    assert picture.dtype == np.uint8
    assert picture.shape == (2 * 16 + 3, 4 * 16 + 5, 3)
    only = image_grid(gray[:2], None, min_tile=8, padding=0)
    assert only.shape == (8, 16, 3)
    np.testing.assert_array_equal(only[:, :, 0], only[:, :, 2])  # gray stays gray


def test_record_accepts_every_shared_word() -> None:
    for status in STATUSES:
        assert AttackRecord(server_round=1, client="p", status=status, seconds=0.0).status == status
    for verdict in VERDICTS:
        assert (
            AttackRecord(server_round=1, client="p", status="ok", seconds=0, verdict=verdict).verdict
            == verdict
        )
    for space in INPUT_SPACES:
        record = AttackRecord(server_round=1, client="p", status="ok", seconds=0, input_space=space)
        assert record.input_space == space


def test_record_rejects_bad_fields_with_one_line_each() -> None:
    with pytest.raises(ValueError) as caught:
        AttackRecord(
            server_round=-1,
            client="../escape",
            status="finished",
            seconds=float("nan"),
            verdict="great",
            verdict_reason=3,  # type: ignore[arg-type]
            input_space="pixels",
            queued_at=-5.0,
            started_at=float("inf"),
            finished_at="now",  # type: ignore[arg-type]
        )
    lines = str(caught.value).splitlines()
    assert lines[0] == "invalid AttackRecord:"
    assert lines[1:] == [
        "  server_round must be a non-negative integer, got -1",
        "  client name '../escape' is not directory-safe "
        "(letters, digits, '_', '.', '-'; not starting with '.' or '-')",
        f"  status must be one of {STATUSES}, got 'finished'",
        "  seconds must be a finite non-negative number, got nan",
        f"  verdict must be one of {VERDICTS} or None, got 'great'",
        "  verdict_reason must be a string, got int",
        f"  input_space must be one of {INPUT_SPACES} or None, got 'pixels'",
        "  queued_at must be None or unix seconds (finite, >= 0), got -5.0",
        "  started_at must be None or unix seconds (finite, >= 0), got inf",
        "  finished_at must be None or unix seconds (finite, >= 0), got 'now'",
    ]
    with pytest.raises(ValueError, match=r"psnr must be None or a sequence of numbers, got 'high'"):
        AttackRecord(server_round=1, client="p", status="ok", seconds=0.0, psnr="high")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"server_round must be a non-negative integer, got True"):
        AttackRecord(server_round=True, client="p", status="ok", seconds=0.0)


def test_long_secagg_name_is_stored_under_a_short_name_with_a_hash(tmp_path: Path) -> None:
    members = [f"partition-{index}" for index in range(20)]
    client = "secagg-" + "_".join(members)
    assert len(client) > 255
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(_record(client=client, details={"partition_id": list(range(20))}))

    digest = hashlib.sha256(client.encode()).hexdigest()[:10]
    assert directory.name == f"secagg-partition-0-and-19-more-{digest}"
    assert np.load(directory / "reconstruction.npy").shape == (3, 48)
    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["client"] == client and metrics["details"]["partition_id"] == list(range(20))
    row = store.rows()[0]
    assert row["client"] == client
    assert row["directory"] == f"round-001/secagg-partition-0-and-19-more-{digest}"
    assert store.attack_directory(1, client) == directory


def test_any_long_name_gets_a_distinct_short_directory(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    first = store.save(_failed(1, "node-" + "7" * 300))
    second = store.save(_failed(1, "node-" + "7" * 299 + "8"))
    short = store.save(_failed(1, "n" * 80))
    assert first != second
    assert len(first.name) <= 80 and len(second.name) <= 80
    assert first.name.startswith("node-777") and first.parent == second.parent
    assert short.name == "n" * 80
    assert [len(row["client"]) for row in store.rows()] == [305, 305, 80]


def test_same_round_and_client_never_overwrite(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    first = store.save(_record(details={"node_id": 1}))
    first_files = _snapshot(first)
    second = store.save(_record(details={"node_id": 2}, inputs=np.zeros((3, 48))))
    third = store.save(_failed(1, "partition-0"))

    assert [path.name for path in (first, second, third)] == [
        "partition-0",
        "partition-0-dup2",
        "partition-0-dup3",
    ]
    assert _snapshot(first) == first_files
    for duplicate in (second, third):
        metrics = json.loads((duplicate / "metrics.json").read_text())
        assert metrics["duplicate_of"] == "round-001/partition-0"
        assert metrics["directory"] == f"round-001/{duplicate.name}"
    np.testing.assert_array_equal(np.load(second / "reconstruction.npy"), np.zeros((3, 48)))
    rows = store.rows()
    assert [(row["client"], row["directory"], row["status"]) for row in rows] == [
        ("partition-0", "round-001/partition-0", "ok"),
        ("partition-0", "round-001/partition-0-dup2", "ok"),
        ("partition-0", "round-001/partition-0-dup3", "error"),
    ]
    assert store.attack_directory(1, "partition-0") == first


def test_existing_run_directory_is_refused(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"a": 1})
    store.save(_record())
    before = _snapshot(store.directory)
    with pytest.raises(RunDirectoryExistsError, match=r"already holds a run .*pass resume=True to append"):
        ReconstructionStore(store.directory)
    with pytest.raises(RunDirectoryExistsError, match=r"already holds a run .*pass resume=True to append"):
        ReconstructionStore.create(store.directory, run_config={"a": 1})
    assert _snapshot(store.directory) == before

    only_config = tmp_path / "config-only"
    only_config.mkdir()
    (only_config / "run_config.json").write_text("{}")
    with pytest.raises(RunDirectoryExistsError):
        ReconstructionStore(only_config)


def test_resume_appends_and_keeps_existing_rows_byte_identical(tmp_path: Path) -> None:
    first = ReconstructionStore(tmp_path / "run", run_config={"a": 1})
    first.save(_record(verdict_reason='said "no", twice\nthen stopped'))
    first.save(_failed(1, "partition-1"))
    table_before = first.table_path.read_bytes()
    files_before = _snapshot(first.directory)

    resumed = ReconstructionStore.create(first.directory, run_config={"a": 1}, resume=True)
    assert resumed.directory == first.directory
    duplicate = resumed.save(_record(client="partition-1"))
    resumed.save(_record(server_round=2))

    table_after = resumed.table_path.read_bytes()
    assert table_after.startswith(table_before)
    assert duplicate.name == "partition-1-dup2"
    assert json.loads((duplicate / "metrics.json").read_text())["duplicate_of"] == "round-001/partition-1"
    rows = resumed.rows()
    assert [(row["round"], row["client"]) for row in rows] == [
        ("1", "partition-0"),
        ("1", "partition-1"),
        ("1", "partition-1"),
        ("2", "partition-0"),
    ]
    assert rows[0]["verdict_reason"] == 'said "no", twice\nthen stopped'
    after = _snapshot(resumed.directory)
    assert {name: after[name] for name in files_before if name != "attacks.csv"} == {
        name: data for name, data in files_before.items() if name != "attacks.csv"
    }


def test_resume_refuses_what_it_cannot_resume(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(FileNotFoundError, match=r"cannot resume .*plain: it is not a run directory"):
        ReconstructionStore(plain, resume=True)
    with pytest.raises(ValueError, match="resume=True needs the run directory"):
        ReconstructionStore.create(None, base=tmp_path, resume=True)
    run = ReconstructionStore(tmp_path / "run", run_config={"a": 1, "b": 2}).directory
    with pytest.raises(ValueError, match=r"with another run config: b, c differ from run_config.json"):
        ReconstructionStore(run, run_config={"a": 1, "b": 3, "c": 0}, resume=True)
    (run / "attacks.csv").write_text("x,y\n1,2\n")
    with pytest.raises(
        ValueError, match=r"is not a run table: its header lacks the column\(s\) round, client"
    ):
        ReconstructionStore(run, resume=True)


def test_resume_of_an_old_table_keeps_its_columns(tmp_path: Path) -> None:
    old_columns = [
        column
        for column in TABLE_COLUMNS
        if column
        not in ("verdict", "verdict_reason", "input_space", "queued_at", "started_at", "finished_at")
    ]
    run = tmp_path / "old-run"
    (run / "round-001" / "partition-0").mkdir(parents=True)
    old_row = [
        "1",
        "partition-0",
        "ok",
        "2.0",
        "3",
        "True",
        "0.99",
        "3",
        "120.0",
        "118.0",
        "1.0",
        "1.0",
        "True",
        "",
        "round-001/partition-0",
    ]
    old_table = (",".join(old_columns) + "\n" + ",".join(old_row) + "\n").encode()
    (run / "attacks.csv").write_bytes(old_table)

    old_rows = load_table(run / "attacks.csv")
    assert old_rows[0]["verdict"] == "" and old_rows[0]["finished_at"] == ""
    assert old_rows[0]["mean_psnr"] == "120.0" and old_rows[0]["directory"] == "round-001/partition-0"

    store = ReconstructionStore(run, resume=True)
    directory = store.save(_record(verdict="exact", finished_at=5.0))
    content = store.table_path.read_bytes()
    assert content.startswith(old_table)
    assert content.splitlines()[0].decode() == ",".join(old_columns)
    rows = store.rows()
    assert rows[1]["directory"] == "round-001/partition-0-dup2" == directory.relative_to(run).as_posix()
    assert rows[1]["verdict"] == ""  # not in this table's columns; metrics.json has it
    assert json.loads((directory / "metrics.json").read_text())["verdict"] == "exact"


def test_existing_plain_directory_gets_a_private_subdirectory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    (shared / "notes.txt").write_text("someone else's file")

    first = ReconstructionStore(shared, run_config={"a": 1})
    second = ReconstructionStore.create(shared)
    assert _mode(shared) == 0o1777
    assert (shared / "notes.txt").read_text() == "someone else's file"
    for store in (first, second):
        assert store.directory.parent == shared.resolve()
        assert store.directory.name.startswith("audit-")
        assert _mode(store.directory) == DIRECTORY_MODE
    assert first.directory != second.directory
    assert (first.directory / "run_config.json").is_file() and not (shared / "attacks.csv").exists()


def test_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        ReconstructionStore(tmp_path / "file")
    with pytest.raises(NotADirectoryError, match="a parent is not a directory"):
        ReconstructionStore(tmp_path / "file" / "run")
