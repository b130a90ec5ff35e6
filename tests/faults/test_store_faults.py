"""The store on a real full disk (a 64 KiB tmpfs) and under a real file-size limit (RLIMIT_FSIZE).

Every save either completes (files readable with the right sizes, row in the table) or raises
StoreWriteError; nothing stored earlier is lost or truncated; no temporary file remains.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fl_attack.results.files import StoreWriteError, atomic_write_bytes, atomic_write_npy
from fl_attack.results.store import AttackRecord, ReconstructionStore, load_table

REPOSITORY = Path(__file__).resolve().parents[2]


def _record(index: int, rng: np.random.Generator) -> AttackRecord:
    """Records of varied size: a failed attack (metrics only), small and larger reconstructions."""
    client = f"partition-{index}"
    if index % 3 == 0:
        return AttackRecord(server_round=1, client=client, status="error", seconds=0.1, error="boom " * index)
    rows = 2 if index % 3 == 1 else 24
    images = rng.random((2, 3, 8, 8))
    return AttackRecord(
        server_round=1,
        client=client,
        status="ok",
        seconds=1.0,
        inputs=rng.standard_normal((rows, 64)),
        reconstructed_images=images,
        reference_images=images[::-1].copy(),
        psnr=[100.0, 40.0],
        quality={"mean_psnr": 70.0},
        verdict="approximate",
    )


def _temporary_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.name.endswith(".tmp")]


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_saving_until_the_disk_is_full(tiny_disk: Path) -> None:
    store = ReconstructionStore(tiny_disk / "run", run_config={"dataset": "digits"})
    rng = np.random.default_rng(0)
    stored: dict[str, tuple[Path, dict[str, bytes], np.ndarray | None]] = {}
    failures: list[str] = []
    failures_in_a_row = 0
    index = 0
    while failures_in_a_row < 6:
        assert index < 500, "the 64 KiB disk never filled up"
        record = _record(index, rng)
        try:
            directory = store.save(record)
        except StoreWriteError as error:
            failures_in_a_row += 1
            failures.append(str(error))
            assert error.errno == errno.ENOSPC
            assert "disk full" in str(error) and str(error).startswith(f"could not write {store.directory}/")
            assert not (store.directory / "round-001" / record.client).exists()
        else:
            failures_in_a_row = 0
            inputs = None if record.inputs is None else np.asarray(record.inputs)
            stored[record.client] = (directory, _files(directory), inputs)
            if inputs is not None:
                on_disk = np.load(directory / "reconstruction.npy", allow_pickle=False)
                np.testing.assert_array_equal(on_disk, inputs)
            assert json.loads((directory / "metrics.json").read_text())["client"] == record.client
        index += 1

        # After every attempt: nothing stored is lost or changed, the table lists exactly the saved ones.
        assert _temporary_files(tiny_disk) == []
        assert [row["client"] for row in load_table(store.table_path)] == list(stored)
        for directory, content, _ in stored.values():
            assert _files(directory) == content

    assert len(stored) >= 2 and failures, (len(stored), failures)
    # The disk filled up both while writing an attack's own files and while writing the table.
    assert any("/attacks.csv: disk full" in failure for failure in failures), failures
    assert any("/round-001/partition-" in failure for failure in failures), failures
    for _directory, content, inputs in stored.values():
        metrics = json.loads(content["metrics.json"])
        assert metrics["status"] in ("ok", "error")
        if inputs is not None:
            assert len(content["reconstruction.npy"]) == 128 + inputs.nbytes
    assert json.loads((store.directory / "run_config.json").read_text()) == {"dataset": "digits"}


def test_npy_one_page_too_large_for_the_disk_is_never_installed(tiny_disk: Path) -> None:
    """The case np.save/tofile lost silently: the data fits the stdio buffer, the flush fails."""
    status = os.statvfs(tiny_disk)
    free = status.f_bavail * status.f_frsize
    page = status.f_frsize
    atomic_write_bytes(tiny_disk / "filler", b"\0" * (free - page))  # leave exactly one page
    target = tiny_disk / "reconstruction.npy"

    too_large = np.arange(float((page - 128) // 8 + 4))  # header + data a few bytes over one page
    with pytest.raises(StoreWriteError, match="disk full") as caught:
        atomic_write_npy(target, too_large)
    assert caught.value.errno == errno.ENOSPC
    assert not target.exists() and _temporary_files(tiny_disk) == []

    fits = np.arange(float((page - 128) // 8))
    atomic_write_npy(target, fits)
    np.testing.assert_array_equal(np.load(target), fits)


_SIZE_LIMIT_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys
    import numpy as np
    from fl_attack.results.files import StoreWriteError, atomic_write_npy
    from fl_attack.results.store import AttackRecord, ReconstructionStore

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that write() fails with EFBIG instead
    target, run = sys.argv[1], sys.argv[2]
    atomic_write_npy(target, np.arange(10.0))
    store = ReconstructionStore(run)
    store.save(AttackRecord(server_round=1, client="partition-0", status="ok", seconds=1.0,
                            inputs=np.arange(8.0).reshape(2, 4)))
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    outcome = {}
    try:
        atomic_write_npy(target, np.arange(1000.0))
        outcome["npy"] = "installed"
    except StoreWriteError as error:
        outcome["npy"] = [error.errno, str(error)]
    try:
        store.save(AttackRecord(server_round=1, client="partition-1", status="ok", seconds=1.0,
                                inputs=np.ones((100, 50))))
        outcome["save"] = "saved"
    except StoreWriteError as error:
        outcome["save"] = [error.errno, str(error)]
    print(json.dumps(outcome))
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ (POSIX)")
def test_file_size_limit_never_installs_a_truncated_npy(tmp_path: Path) -> None:
    target = tmp_path / "inputs.npy"
    run = tmp_path / "run"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    result = subprocess.run(
        [sys.executable, "-c", _SIZE_LIMIT_SCRIPT, str(target), str(run)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPOSITORY,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])

    assert outcome["npy"][0] == errno.EFBIG
    assert outcome["npy"][1].startswith(f"could not write {target}: file too large")
    np.testing.assert_array_equal(np.load(target, allow_pickle=False), np.arange(10.0))

    assert outcome["save"][0] == errno.EFBIG
    assert "partition-1/reconstruction.npy: file too large" in outcome["save"][1]
    assert [row["client"] for row in load_table(run / "attacks.csv")] == ["partition-0"]
    assert not (run / "round-001" / "partition-1").exists()
    np.testing.assert_array_equal(
        np.load(run / "round-001" / "partition-0" / "reconstruction.npy"), np.arange(8.0).reshape(2, 4)
    )
    assert _temporary_files(tmp_path) == []
