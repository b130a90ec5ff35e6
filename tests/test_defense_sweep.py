"""The defense sweep: CSV schema on a real two-point sweep, leakage/utility summaries, errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from experiments.defense_sweep import DEFENSES, get_defense, main, parse_values, run_sweep
from experiments.sweep_point import COLUMN_DOCS, SWEEP_COLUMNS, dpsgd_epsilon, leakage_of, utility_of
from fl_attack.results.store import TABLE_COLUMNS
from strategies import resolve_run_config

#: The documented schema of ``<name>.csv`` (experiments/defenses.toml, [columns]).
DOCUMENTED_COLUMNS = [
    "parameter",
    "value",
    "status",
    "train_mode",
    "rounds",
    "clients",
    "attacked_updates",
    "attack_failures",
    "scored_samples",
    "exact_fraction",
    "approx_fraction",
    "updates_exact_fraction",
    "mean_psnr",
    "median_attack_seconds",
    "initial_test_acc",
    "final_test_acc",
    "final_test_loss",
    "test_examples",
    "epsilon",
    "delta",
    "seconds",
    "run_dir",
    "error",
]

#: A tiny federation: 8x8 digits, a 64-wide victim, one FedSGD round of two clients.
TINY = {
    "dataset": "digits",
    "width": 64,
    "samples-per-client": 16,
    "attack-time-budget": 2.0,
    "attack-isolation": "thread",
    "fraction-evaluate": 0.0,
    "test-limit": 200,
}


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def test_two_point_sweep_writes_the_documented_csv_markdown_and_plot(tmp_path: Path) -> None:
    results = run_sweep(
        get_defense("batch-size"),
        [3, 5],
        user_overrides=TINY,
        rounds=1,
        clients=2,
        cpus=1,  # one Ray actor trains both clients: half the start-up cost
        output_dir=tmp_path,
        name="two",
    )
    assert [result.ok for result in results] == [True, True], [result.row for result in results]

    header, rows = _read_csv(tmp_path / "two.csv")
    assert header == DOCUMENTED_COLUMNS == list(SWEEP_COLUMNS)
    assert set(COLUMN_DOCS) == set(SWEEP_COLUMNS)
    assert len(rows) == 2
    assert [row["parameter"] for row in rows] == ["batch-size", "batch-size"]
    assert [int(row["value"]) for row in rows] == [3, 5]
    for row, batch in zip(rows, (3, 5), strict=True):
        assert row["status"] == "ok" and row["error"] == "", row
        assert row["train_mode"] == "fedsgd" and row["rounds"] == "1" and row["clients"] == "2"
        assert int(row["attacked_updates"]) == 2  # one per client and round
        assert int(row["scored_samples"]) == 2 * batch  # every sample of both batches scored
        for column in ("exact_fraction", "approx_fraction", "updates_exact_fraction"):
            assert 0.0 <= float(row[column]) <= 1.0, (column, row)
        assert float(row["exact_fraction"]) <= float(row["approx_fraction"])
        assert 0.0 <= float(row["final_test_acc"]) <= 1.0
        assert int(row["test_examples"]) == 200
        assert row["epsilon"] == "" and row["delta"] == ""  # not DP-SGD
        run_dir = tmp_path / row["run_dir"]
        assert (run_dir / "attacks.csv").exists() and (run_dir / "history.json").exists()
        stored = json.loads((run_dir / "run_config.json").read_text())
        assert stored["batch-size"] == batch and stored["model-seed"] == 0
    # Same seeds and model for every point: the same initial accuracy.
    assert rows[0]["initial_test_acc"] == rows[1]["initial_test_acc"] != ""

    markdown = (tmp_path / "two.md").read_text()
    assert "| batch-size | exact (> 90 dB) |" in markdown and "test acc round 1" in markdown
    assert markdown.count("| ok |") == 2
    png = (tmp_path / "two.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    summary = json.loads((tmp_path / "two.json").read_text())
    assert summary["settings"]["parameter"] == "batch-size" and len(summary["rows"]) == 2


def test_failed_points_are_rows_and_dpsgd_points_report_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulation is replaced: the first point crashes, the second writes a run."""
    calls: list[dict[str, Any]] = []

    def fake_simulation(overrides: dict[str, Any], *, num_supernodes: int, cpus: int) -> Path:
        calls.append(dict(overrides))
        if len(calls) == 1:
            raise RuntimeError("ServerApp crashed")
        run_dir = Path(overrides["output-dir"])
        run_dir.mkdir(parents=True)
        rows = [
            {
                "round": 1,
                "client": "partition-0",
                "status": "ok",
                "seconds": 1.0,
                "num_references": 4,
                "mean_psnr": 100.0,
                "min_psnr": 95.0,
                "exact_fraction": 1.0,
                "approx_fraction": 1.0,
            },
            {"round": 1, "client": "partition-1", "status": "timeout", "seconds": 9.0},
        ]
        with (run_dir / "attacks.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=TABLE_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        test = {"test-loss": 2.0, "test-acc": 0.25, "test-examples": 10}
        history = {
            "rounds": [{"round": 0, "test": {**test, "test-acc": 0.1}}, {"round": 1, "test": test}],
            "final_test": test,
        }
        (run_dir / "history.json").write_text(json.dumps(history))
        return run_dir

    monkeypatch.setattr("strategies.cli.run_audit_simulation", fake_simulation)
    run_sweep(
        get_defense("noise-multiplier"),
        [0.0, 1.0],
        rounds=2,
        clients=2,
        output_dir=tmp_path,
        name="fake",
    )
    assert [call["noise-multiplier"] for call in calls] == [0.0, 1.0]
    assert all(call["train-mode"] == "dpsgd" and call["num-server-rounds"] == 2 for call in calls)
    assert calls[0]["output-dir"] != calls[1]["output-dir"]

    header, rows = _read_csv(tmp_path / "fake.csv")
    assert header == DOCUMENTED_COLUMNS and len(rows) == 2
    failed, done = rows
    assert failed["status"] == "error" and "ServerApp crashed" in failed["error"]
    assert failed["final_test_acc"] == "" and failed["epsilon"] == "inf"
    assert done["status"] == "ok" and done["error"] == ""
    assert done["attacked_updates"] == "2" and done["attack_failures"] == "1"
    assert float(done["exact_fraction"]) == 1.0 and float(done["updates_exact_fraction"]) == 0.5
    assert float(done["initial_test_acc"]) == 0.1 and float(done["final_test_acc"]) == 0.25
    assert 0.0 < float(done["epsilon"]) < math.inf and float(done["delta"]) == 1e-5
    assert "error: RuntimeError: ServerApp crashed" in (tmp_path / "fake.md").read_text()
    assert (tmp_path / "fake.png").exists()


def test_unknown_parameter_lists_the_registered_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown defense parameter 'dropout'") as error:
        get_defense("dropout")
    for name in (
        "noise-multiplier",
        "max-grad-norm",
        "local-epochs",
        "local-lr",
        "batch-size",
        "secagg-group-size",
        "width",
    ):
        assert name in str(error.value) and name in DEFENSES
    with pytest.raises(SystemExit) as exit_info:
        main(["--parameter", "dropout", "--values", "1,2"])
    assert exit_info.value.code == 2
    assert "registered: noise-multiplier, max-grad-norm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("parameter", "values", "message"),
    [
        ("local-epochs", "1,2.5", "integers"),
        ("noise-multiplier", "-1", ">= 0"),
        ("max-grad-norm", "0,1", "> 0"),
        ("width", "0", ">= 1"),
        ("local-lr", "0.1,abc", "not a number"),
        ("batch-size", "4,4", "distinct"),
        ("noise-multiplier", " , ", "empty"),
        ("noise-multiplier", "nan", "finite"),
    ],
)
def test_bad_values_are_rejected(parameter: str, values: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_values(get_defense(parameter), values)


def test_values_are_typed_and_defaults_valid() -> None:
    assert parse_values(get_defense("noise-multiplier"), "0,0.5,2") == [0.0, 0.5, 2.0]
    epochs = parse_values(get_defense("local-epochs"), "1, 3")
    assert epochs == [1, 3] and all(type(value) is int for value in epochs)
    for defense in DEFENSES.values():
        values = parse_values(defense, None)
        assert len(values) >= 2
        for value in values:  # every default point is a valid run config
            resolve_run_config({}, {**defense.base, defense.key: value})


def test_sweep_settings_are_checked_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs at least 4 clients"):
        run_sweep(get_defense("secagg-group-size"), [1, 4], clients=3, output_dir=tmp_path)
    with pytest.raises(ValueError, match="must not set 'width'"):
        run_sweep(get_defense("width"), [10], user_overrides={"width": 20}, output_dir=tmp_path)
    with pytest.raises(ValueError, match="train-mode"):
        run_sweep(get_defense("width"), [10], user_overrides={"train-mode": "sgd"}, output_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # no file written, no simulation started


def test_leakage_is_weighted_by_samples_and_counts_failures() -> None:
    rows = [
        {
            "status": "ok",
            "num_references": "2",
            "exact_fraction": "1.0",
            "approx_fraction": "1.0",
            "mean_psnr": "150",
            "min_psnr": "140",
            "seconds": "1",
        },
        {
            "status": "ok",
            "num_references": "6",
            "exact_fraction": "0.5",
            "approx_fraction": "0.5",
            "mean_psnr": "50",
            "min_psnr": "10",
            "seconds": "3",
        },
        {"status": "error", "num_references": "", "exact_fraction": "", "seconds": "5"},
    ]
    leakage = leakage_of(rows)
    assert leakage["attacked_updates"] == 3 and leakage["attack_failures"] == 1
    assert leakage["scored_samples"] == 8
    assert leakage["exact_fraction"] == pytest.approx((2 + 3) / 8)
    assert leakage["updates_exact_fraction"] == pytest.approx(1 / 3)
    assert leakage["mean_psnr"] == pytest.approx((2 * 150 + 6 * 50) / 8)
    assert leakage["median_attack_seconds"] == 3
    only_failures = leakage_of([{"status": "timeout", "seconds": "9"}])
    assert only_failures["exact_fraction"] == 0.0 and only_failures["updates_exact_fraction"] == 0.0
    assert leakage_of([])["exact_fraction"] is None
    assert utility_of(None)["final_test_acc"] is None


def test_epsilon_follows_the_noise() -> None:
    base = resolve_run_config({}, {"train-mode": "dpsgd", "num-server-rounds": 2})
    assert dpsgd_epsilon({**base, "noise-multiplier": 0.0}) == math.inf
    small, large = (dpsgd_epsilon({**base, "noise-multiplier": sigma}) for sigma in (0.5, 2.0))
    assert small is not None and large is not None and 0 < large < small < math.inf
    assert dpsgd_epsilon(resolve_run_config({}, {"train-mode": "fedsgd"})) is None
