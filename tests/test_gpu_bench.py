"""The GPU benchmark's CPU path: a tiny cell on bundled photos, its table, profile and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import gpu_bench


def test_gpu_bench_runs_a_tiny_cell_on_cpu_and_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    empty = tmp_path / "no-data"
    empty.mkdir()
    args = ["--out", str(out), "--devices", "cpu", "--cpu-threads", "1", "--cells", "5x50", "--trials", "1"]
    args += ["--data-root", str(empty), "--fallback-dataset", "photo-patches", "--profile-cells", "5x50"]
    args += ["--time-budget", "20", "--cell-budget", "20", "--next-layer-cells", "all"]
    assert gpu_bench.main(args) == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["config"]["dataset"] == "photo-patches"
    (row,) = payload["summary"]
    assert (row["cell"], row["device"], row["trials"], row["next_layer"]) == ("5x50", "cpu", 1, True)
    (run,) = payload["runs"]
    assert run["found"] == 5 and run["error"] == ""
    assert row["exact"] == int(run["exact"]) == 1 and row["peak_gpu_mib"] is None
    profile = payload["profiles"]["5x50_cpu"]
    assert profile["kernel_launches"] == 0 and profile["item_calls"] > 0
    assert profile["linalg_calls"]
    table = (out / "table.md").read_text()
    assert "| 5x50 | yes | cpu | 1 | 1/1 |" in table
    assert (out / "profile_5x50_cpu.txt").is_file()


def test_gpu_bench_without_cifar_and_without_a_fallback_names_the_problem(tmp_path: Path) -> None:
    empty = tmp_path / "no-data"
    empty.mkdir()
    with pytest.raises(SystemExit, match="cifar10.*fallback-dataset"):
        gpu_bench.main(
            ["--out", str(tmp_path / "o"), "--devices", "cpu", "--data-root", str(empty), "--quick"]
        )


def test_gpu_bench_refuses_cuda_where_torch_sees_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU"):
        gpu_bench.main(["--out", str(tmp_path / "o"), "--devices", "cuda,cpu", "--quick"])


def test_gpu_bench_audits_many_clients_with_each_number_of_workers(tmp_path: Path) -> None:
    out = tmp_path / "many"
    empty = tmp_path / "no-data"
    empty.mkdir()
    args = ["--out", str(out), "--devices", "cpu", "--cpu-threads", "1", "--cells", "none"]
    args += ["--data-root", str(empty), "--fallback-dataset", "photo-patches"]
    args += ["--clients", "3", "--workers", "1", "2", "--clients-cell", "4x50", "--time-budget", "20"]
    assert gpu_bench.main(args) == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["runs"] == [] and payload["config"]["clients"] == 3
    rows = payload["many_clients"]
    assert [row["workers"] for row in rows] == [1, 2]
    for row in rows:
        assert (row["device"], row["cell"], row["clients"]) == ("cpu", "4x50", 3)
        assert row["exact"] == 3 and row["statuses"] == {"ok": 3} and row["peak_gpu_mib"] is None
        assert row["clients_per_second"] == pytest.approx(3 / row["seconds"])
    table = (out / "table.md").read_text()
    assert "## Many clients on one device (3 clients of 4x50" in table
    assert "| cpu | 2 |" in table and "| cell (b, m) |" not in table  # no cell measured, no cell table


def test_gpu_bench_refuses_a_worker_count_below_one(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="every --workers >= 1"):
        gpu_bench.main(["--out", str(tmp_path / "o"), "--devices", "cpu", "--clients", "2", "--workers", "0"])
