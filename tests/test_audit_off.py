"""``attack-enabled=false``: the run a user compares an audit against is a normal, complete run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strategies.cli import main as audit_main


def test_the_audit_off_run_trains_writes_its_history_and_attacks_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "run"
    settings = (
        "num-server-rounds=2 dataset='digits' width=32 batch-size=4 samples-per-client=12 "
        f"attack-enabled=false output-dir='{output}'"
    )
    assert audit_main(["--num-supernodes", "2", "-c", settings]) == 0
    out = capsys.readouterr().out
    assert "The audit was off (attack-enabled=false)" in out
    assert f"training history: {output / 'history.json'}" in out
    history = json.loads((output / "history.json").read_text(encoding="utf-8"))
    assert [entry["round"] for entry in history["rounds"]] == [0, 1, 2]
    assert set(history["round_seconds"]) == {"1", "2"}
    assert all(seconds > 0.0 for seconds in history["round_seconds"].values())
    assert history["final_test"]["test-examples"] == 359  # the digits test split
    assert json.loads((output / "run_config.json").read_text(encoding="utf-8"))["attack-enabled"] is False
    assert sorted(path.name for path in output.iterdir()) == ["history.json", "run_config.json"]


def test_the_leakage_gate_needs_the_audit_on(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit_main(["--fail-above", "0.1", "-c", "attack-enabled=false"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fl-attack-audit: --fail-above needs the audit on (attack-enabled=true)"
    )
