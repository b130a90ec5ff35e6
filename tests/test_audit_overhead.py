"""The audit-overhead benchmark: its quick run end to end, and the pieces that compute its numbers."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from experiments.audit_overhead import main, parse_parts
from experiments.overhead_children import RoundClock
from experiments.overhead_report import rounds_summary, scale_summary, throughput_summary
from experiments.process_tree import TreeMemory, descendants, load_average


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow  # the benchmark's quick run: several simulations of a few rounds
def test_quick_run_writes_every_arm_with_positive_numbers(tmp_path: Path) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "audit_overhead_quick.json").read_text(encoding="utf-8"))
    table = (tmp_path / "audit_overhead_quick.md").read_text(encoding="utf-8")

    assert results["quick"] is True and results["parts"] == ["rounds", "throughput", "scale"]
    assert results["plan"]["rounds_clients"] == 2 and results["plan"]["scale_baseline"] is False
    machine = results["machine"]
    assert machine["cpus"] >= 1 and len(machine["load_start"]) == 3 and len(machine["load_end"]) == 3
    assert all(math.isfinite(value) and value >= 0 for value in machine["load_start"] + machine["load_end"])

    rounds = results["summary"]["rounds"]
    assert rounds["audited_rounds"] == 1 and rounds["not_audited_rounds"] == 1  # round 2 of one run each
    for key in ("audited_median_seconds", "not_audited_median_seconds", "ratio"):
        assert _positive(rounds[key]), key
    assert rounds["met"] is (rounds["ratio"] <= 1.2)

    throughput = results["summary"]["throughput"]
    for workers in ("1", "2"):
        assert throughput["workers"][workers]["runs"] == 1
        assert _positive(throughput["workers"][workers]["attacks_per_second"])
        assert _positive(throughput["workers"][workers]["cpu_seconds_per_attack"])
    assert _positive(throughput["ratio"]) and throughput["excluded_runs"] == 0

    scale = results["summary"]["scale"]
    assert _positive(scale["audited"]["wall_seconds"]) and _positive(scale["audited"]["peak_pss_mib"])
    # a quick run has no not-audited twin, so the audit's share (the target) is not measured
    assert scale["met"] is None and scale["audit_adds_pss_mib"] is None

    runs = results["runs"]
    simulations = [*runs["rounds"], runs["scale"]["audited"]]
    assert [run["name"] for run in simulations] == [
        "rounds-audited-1",
        "rounds-not-audited-1",
        "scale-audited",
    ]
    for run in [*simulations, runs["throughput"]]:
        assert run["exit_code"] == 0 and "error" not in run, run.get("error")
        assert _positive(run["peak_pss_mib"]) and run["peak_rss_mib"] >= run["peak_pss_mib"]
        times = [seconds for seconds, _ in run["pss_timeline_mib"]]
        assert times == sorted(times) and all(
            later - earlier >= 1.9
            for earlier, later in itertools.pairwise(times)  # times rounded to 0.1 s
        )
        assert max(pss for _, pss in run["pss_timeline_mib"]) <= run["peak_pss_mib"] + 0.1
    assert runs["scale"]["audited"]["attacked_updates"] == 2  # 2 clients x 1 round, every update stored
    assert [m["workers"] for m in runs["throughput"]["measurements"]] == [1, 2]

    assert table.startswith("**Quick run (--quick)")
    start = machine["load_start"]
    assert f"{start[0]:.2f} {start[1]:.2f} {start[2]:.2f} at the start" in table
    for arm in ("| not audited |", "| audited |", "| 1 worker |", "| 2 workers |"):
        assert arm in table, arm
    assert "| 2 clients x 1 rounds, m = 200, photo-patches | audited |" in table


def test_parts_are_checked_and_ordered() -> None:
    assert parse_parts("scale, rounds") == ["rounds", "scale"]
    with pytest.raises(ValueError, match="subset of rounds, throughput, scale; got 'round'"):
        parse_parts("round")
    with pytest.raises(ValueError, match="got ' , '"):
        parse_parts(" , ")


def test_round_clock_times_rounds_between_flower_log_lines() -> None:
    clock = RoundClock()
    for created, message in (
        (10.0, "[ROUND 1/3]"),
        (15.0, "noise"),
        (17.5, "[ROUND 2/3]"),
        (20.0, "[ROUND 3/3]"),
    ):
        record = logging.LogRecord("flwr", logging.INFO, __file__, 0, message, None, None)
        record.created = created
        clock.emit(record)
    assert clock.round_seconds() == [7.5, 2.5]  # the last round is open until the run finishes
    finished = logging.LogRecord(
        "flwr", logging.INFO, __file__, 0, "Strategy execution finished in %.2fs", (9,), None
    )
    finished.created = 21.0
    clock.emit(finished)
    assert clock.round_seconds() == [7.5, 2.5, 1.0]


def test_summaries_leave_out_first_rounds_and_failed_runs() -> None:
    runs = [
        {"name": "a", "audited": True, "exit_code": 0, "round_seconds": [30.0, 2.0, 4.0]},
        {"name": "p", "audited": False, "exit_code": 0, "round_seconds": [25.0, 2.0, 2.0]},
        {"name": "x", "audited": True, "exit_code": 1, "error": "exit code 1", "round_seconds": [9.0, 99.0]},
    ]
    summary = rounds_summary(runs)
    assert summary["audited_median_seconds"] == 3.0 and summary["not_audited_median_seconds"] == 2.0
    assert summary["ratio"] == 1.5 and summary["met"] is False

    measured = [
        {"workers": 1, "attacks_per_second": 1.0, "cpu_seconds_per_attack": 0.5, "statuses": {"ok": 4}},
        {"workers": 2, "attacks_per_second": 1.8, "cpu_seconds_per_attack": 0.6, "statuses": {"ok": 4}},
        {
            "workers": 2,
            "attacks_per_second": 9.0,
            "cpu_seconds_per_attack": 0.1,
            "statuses": {"ok": 3, "error": 1},
        },
    ]
    throughput = throughput_summary({"measurements": measured})
    assert throughput["ratio"] == 1.8 and throughput["met"] is True and throughput["excluded_runs"] == 1

    def scale_runs(audited_rounds: list[float]) -> dict[str, dict[str, Any]]:
        return {
            "audited": {
                "exit_code": 0,
                "wall_seconds": 5.0,
                "peak_pss_mib": 1500.0,
                "peak_rss_mib": 2000.0,
                "round_peak_pss_mib": audited_rounds,
            },
            "not_audited": {
                "exit_code": 0,
                "wall_seconds": 4.0,
                "peak_pss_mib": 1200.0,
                "peak_rss_mib": 1900.0,
                "round_peak_pss_mib": [1000.0, 1100.0, 1200.0],
            },
        }

    # the audit's share: 300 MiB at the peak, 250 / 300 / 300 MiB per round: at the target
    scale = scale_summary(scale_runs([1250.0, 1400.0, 1500.0]))
    assert scale["met"] is True and scale["audit_adds_pss_mib"] == 300.0
    assert scale["audit_adds_per_round_mib"] == [250.0, 300.0, 300.0]
    # one round 301 MiB over its twin: not met, although the two peaks differ by 300 MiB only
    assert scale_summary(scale_runs([1250.0, 1401.0, 1500.0]))["met"] is False


def test_tree_memory_counts_a_child_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(3)"])
    try:
        with TreeMemory(child.pid, interval=0.1) as memory:
            while memory.peak_rss_kib < 64 * 1024 and child.poll() is None:
                time.sleep(0.1)
        assert memory.peak_rss_kib >= 64 * 1024 and memory.peak_processes == 1
        assert child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert len(load_average()) == 3


def test_scale_settings_are_parsed_as_run_config_values() -> None:
    from experiments.audit_overhead import parse_settings

    assert parse_settings(["attack-queue-size=16", "attack-queue='drop-oldest'", "dataset=digits"]) == {
        "attack-queue-size": 16,
        "attack-queue": "drop-oldest",
        "dataset": "digits",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_settings(["attack-queue-size"])


def test_scale_rounds_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--parts", "scale", "--scale-rounds", "0"])
    assert stop.value.code == 2
    assert "--scale-rounds must be at least 1, got 0" in capsys.readouterr().err
