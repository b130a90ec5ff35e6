"""The example Flower apps of ``examples/``, run in-process, get the verdicts their READMEs promise.

Each run is small (2 clients, 1 round, a short attack budget, attacks in a thread); the
seeds fix the initial model and the clients' batches, so every run is the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fl_attack.results.store import load_table
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR
from tests.example_apps import CNN_ONE_STEP, EXAMPLES, configured_apps, load_example, run_example

QUICK = {
    "num-server-rounds": 1,
    "fraction-evaluate": 0.0,
    "attack-isolation": "thread",
    "attack-time-budget": 15.0,
}


def _audit(name: str, output: Path, **overrides: Any) -> list[dict[str, Any]]:
    """Run an example; the exact attack's stored table rows joined with their metrics.json."""
    run_example(name, {**QUICK, **overrides, "output-dir": str(output)})
    rows = _rows(output)
    assert rows, f"{name} stored no attack"
    return rows


def _rows(output: Path, *, fallback: bool = False) -> list[dict[str, Any]]:
    """The exact attack's rows, or with ``fallback`` those of the approximate fallback (cocktail-party)."""
    rows = [
        row for row in load_table(output / "attacks.csv") if (row["attack"] == "cocktail-party") == fallback
    ]
    return [{**row, **json.loads((output / row["directory"] / "metrics.json").read_text())} for row in rows]


def test_example_folders_have_the_flower_app_shape() -> None:
    for name, package in (
        ("quickstart_cnn", "cnn_example"),
        ("tabular", "tabular_example"),
        ("opacus", "opacus_example"),
    ):
        example = load_example(name)
        assert example.serverapp == f"{package}.server_app:app"
        assert example.clientapp == f"{package}.client_app:app"
        for module in ("server_app", "client_app", "task"):
            assert (example.folder / package / f"{module}.py").is_file()
        assert {"attack-time-budget", "attack-isolation", "output-dir"} <= set(example.config)
        server_code = (example.folder / package / "server_app.py").read_text()
        assert server_code.count("HonestButCuriousStrategy.from_context(") == 1
        client_code = (example.folder / package / "client_app.py").read_text()
        assert client_code.count("attach_ground_truth(") == 1
        readme = (example.folder / "README.md").read_text()
        assert "## Expected results" in readme and f"flwr run examples/{name}" in readme
    with pytest.raises(KeyError, match="not run-config keys of tabular"):
        configured_apps(load_example("tabular"), {"optimiser": "adam"})


def test_quickstart_cnn_recovers_fc1_input_features(tmp_path: Path) -> None:
    records = _audit("quickstart_cnn", tmp_path / "run", seed=0, **CNN_ONE_STEP)
    assert len(records) == 2
    assert all(record["input_space"] == "features" for record in records)
    assert all(record["quality"]["kind"] == "features" for record in records)
    exact = [
        error
        for record in records
        for error in record["quality"]["relative_error"]
        if error < EXACT_RELATIVE_ERROR
    ]
    assert exact, [record["quality"]["relative_error"] for record in records]
    assert any(record["verdict"] == "exact" for record in records)
    for record in records:
        if record["verdict"] == "exact":
            assert record["quality"]["exact_fraction"] == 1.0
            assert "features" in record["verdict_reason"]


def test_tabular_sgd_one_step_is_exact(tmp_path: Path) -> None:
    records = _audit("tabular", tmp_path / "run", optimizer="sgd", seed=0)
    assert [record["verdict"] for record in records] == ["exact", "exact"], [
        r["verdict_reason"] for r in records
    ]
    for record in records:
        assert record["input_space"] == "inputs"
        quality = record["quality"]
        assert quality["kind"] == "tabular" and quality["num_reference"] == 8
        assert quality["exact_fraction"] == 1.0 and quality["tableak_accuracy"] == 100.0
        assert quality["plausibility"]["valid_category_fraction"] == 1.0


def test_tabular_adam_is_not_applicable_and_says_why(tmp_path: Path) -> None:
    # the verdict needs no search: a short budget keeps the run short
    options: dict[str, Any] = {"optimizer": "adam", "lr": 0.001, "seed": 0, "attack-time-budget": 5.0}
    records = _audit("tabular", tmp_path / "run", **options)
    assert len(records) == 2
    for record in records:
        assert record["verdict"] == "not-applicable", record["verdict_reason"]
        assert "Adam" in record["verdict_reason"] or "adaptive" in record["verdict_reason"]
    approximate = _rows(tmp_path / "run", fallback=True)  # the Cocktail Party fallback on the same updates
    assert [record["verdict"] for record in approximate] == ["approximate", "approximate"]
    assert all(record["quality"]["kind"] == "tabular" for record in approximate)


def test_opacus_clipping_only_is_exact_noise_is_not(tmp_path: Path) -> None:
    records = _audit("opacus", tmp_path / "run", **{"noise-multipliers": "0.0,1.0", "seed": 3})
    by_verdict = {record["verdict"]: record for record in records}
    assert sorted(by_verdict) == ["exact", "not-applicable"], [r["verdict_reason"] for r in records]
    clipped = by_verdict["exact"]
    assert clipped["attack"]["estimated_batch_size"] == clipped["quality"]["num_reference"]  # Poisson batch
    assert clipped["quality"]["exact_fraction"] == 1.0
    assert "noise" in by_verdict["not-applicable"]["verdict_reason"]


@pytest.mark.skipif(
    not (EXAMPLES / "secagg" / "pyproject.toml").is_file(), reason="examples/secagg is not here"
)
def test_secagg_example_runs_and_stores_its_audit(tmp_path: Path) -> None:
    example = load_example("secagg")
    overrides = {key: value for key, value in QUICK.items() if key in example.config}
    output = tmp_path / "run"
    clients = int(example.config.get("num-clients", 3))  # secure aggregation needs its clients
    run_example("secagg", {**overrides, "output-dir": str(output)}, num_supernodes=clients)
    rows = load_table(output / "attacks.csv")
    assert rows and all(row["verdict"] for row in rows)
