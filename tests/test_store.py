"""Tests of the reconstruction store: layout, content, permissions and atomic writes."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_attack.results.store import (
    DIRECTORY_MODE,
    FILE_MODE,
    AttackRecord,
    ReconstructionStore,
    atomic_write,
    atomic_write_bytes,
    atomic_write_npy,
    image_grid,
    load_table,
)


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


def test_layout_content_and_table(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"width": 200, "dataset": "digits"})
    record = _record()
    directory = store.save(record)

    assert directory == store.directory / "round-001" / "partition-0"
    inputs = np.load(directory / "reconstruction.npy", allow_pickle=False)
    np.testing.assert_array_equal(inputs, record.inputs)
    assert inputs.dtype == np.float64

    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["status"] == "ok"
    assert metrics["psnr"] == [118.0, 121.0, 300.0]
    assert metrics["complete"] is True
    assert metrics["sparsity_matching"] == pytest.approx(0.999)
    assert metrics["quality"]["exact_fraction"] == 1.0
    assert metrics["details"]["node_id"] == 7

    with Image.open(directory / "reconstruction.png") as picture:
        assert picture.mode == "RGB"
        width, height = picture.size
    assert width > height > 0  # two rows (truth, reconstruction), three columns

    assert json.loads((store.directory / "run_config.json").read_text()) == {
        "width": 200,
        "dataset": "digits",
    }
    rows = load_table(store.table_path)
    assert len(rows) == 1
    assert rows[0]["round"] == "1" and rows[0]["client"] == "partition-0"
    assert rows[0]["min_psnr"] == "118.0"
    assert rows[0]["directory"] == "round-001/partition-0"


def test_table_has_one_row_per_round_and_client(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    store.save(_record(1, "partition-0"))
    store.save(_record(1, "partition-1"))
    store.save(_record(2, "partition-0"))
    store.save(_record(2, "partition-0", status="timeout", inputs=None, reconstructed_images=None,
                       reference_images=None, quality={}, psnr=None, error="too slow"))
    rows = load_table(store.table_path)
    keys = [(row["round"], row["client"]) for row in rows]
    assert sorted(keys) == [("1", "partition-0"), ("1", "partition-1"), ("2", "partition-0")]
    replaced = next(row for row in rows if (row["round"], row["client"]) == ("2", "partition-0"))
    assert replaced["status"] == "timeout" and replaced["error"] == "too slow"
    assert len(store.records) == 3


def test_failed_attack_stores_metrics_only(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(
        AttackRecord(server_round=3, client="node-12", status="error", seconds=0.2, error="boom")
    )
    assert sorted(path.name for path in directory.iterdir()) == ["metrics.json"]
    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["error"] == "boom" and metrics["psnr"] is None


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
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


def test_default_directories_are_unique(tmp_path: Path) -> None:
    first = ReconstructionStore.create(None, base=tmp_path)
    second = ReconstructionStore.create(None, base=tmp_path)
    assert first.directory != second.directory


def test_failing_writer_leaves_no_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"

    def crash(handle: object) -> None:
        handle.write(b"half of it")  # type: ignore[attr-defined]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, crash)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []

    atomic_write_bytes(target, b"complete")
    with pytest.raises(RuntimeError):
        atomic_write(target, crash)
    assert target.read_bytes() == b"complete"
    assert [path.name for path in tmp_path.iterdir()] == ["data.bin"]


def test_crash_while_saving_keeps_previous_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(_record())
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    table_before = store.table_path.read_bytes()

    def broken_png(picture: np.ndarray) -> bytes:
        raise OSError("crash while encoding")

    monkeypatch.setattr("fl_attack.results.store.encode_png", broken_png)
    with pytest.raises(OSError):
        store.save(_record(inputs=np.zeros((3, 48))))
    after = {path.name: path.read_bytes() for path in directory.iterdir()}
    assert set(after) == set(before)  # no temporary files left behind
    assert after["metrics.json"] == before["metrics.json"]
    assert after["reconstruction.png"] == before["reconstruction.png"]
    assert store.table_path.read_bytes() == table_before


def test_npy_refuses_pickle(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        atomic_write_npy(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object))
    assert list(tmp_path.iterdir()) == []


def test_image_grid_shapes() -> None:
    gray = np.random.default_rng(0).random((4, 1, 8, 8))
    picture = image_grid(gray, gray, min_tile=16, padding=1)
    assert picture.dtype == np.uint8
    assert picture.shape == (2 * 16 + 3, 4 * 16 + 5, 3)
    only = image_grid(gray[:2], None, min_tile=8, padding=0)
    assert only.shape == (8, 16, 3)
    np.testing.assert_array_equal(only[:, :, 0], only[:, :, 2])  # gray stays gray


def test_record_rejects_unsafe_names() -> None:
    with pytest.raises(ValueError):
        AttackRecord(server_round=1, client="../escape", status="ok", seconds=0.0)
    with pytest.raises(ValueError):
        AttackRecord(server_round=1, client="partition-0", status="finished", seconds=0.0)
