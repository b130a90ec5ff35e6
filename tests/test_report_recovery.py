"""Recovered samples are counted by every scorer's own criterion: table, report.json, report and leakage gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import strategies.cli as cli
from fl_attack.evaluation.scoring import FeatureScorer, OrdinalSchema, TabularScorer
from fl_attack.results.recovery import sample_recovery
from fl_attack.results.report import load_summary, write_report
from fl_attack.results.store import TABLE_FILE, AttackRecord, ReconstructionStore, load_table


def _features() -> tuple[np.ndarray, np.ndarray]:
    """5 true feature rows; the reconstruction has 3 exact, 1 within 5% and 1 unrelated row (shuffled)."""
    rng = np.random.default_rng(3)
    truth = np.abs(rng.normal(size=(5, 12))) + 0.5
    rows = truth.copy()
    rows[3] = truth[3] * 1.05  # relative error 0.05: approximate
    rows[4] = 1.5 * truth[4]  # relative error 0.5: not recovered
    return rows[[4, 0, 3, 1, 2]], truth


def _table() -> tuple[np.ndarray, np.ndarray, OrdinalSchema]:
    """4 true table rows; rows 0, 1 exact, row 2 off by 0.1 std (approximate), row 3 in the wrong category."""
    raw = np.array([[0, 1.0], [1, 3.0], [2, 5.0], [0, 9.0], [1, 2.0], [2, 7.0]])
    schema = OrdinalSchema.fit(raw, names=["colour", "size"], categories={"colour": ["red", "green", "blue"]})
    truth = schema.encode(raw[:4]).astype(np.float64)
    rows = truth.copy()
    rows[2, 1] += 0.1  # 0.1 std in the standardized column
    rows[3, 0] = schema.encode(np.array([[2, 0.0]]))[0, 0]  # category 2 instead of 0
    return rows[[1, 0, 3, 2]], truth, schema


def _record(server_round: int, client: str, inputs: np.ndarray, quality: dict[str, Any]) -> AttackRecord:
    """A successful attack whose own verdict is approximate (the self-check did not confirm it)."""
    return AttackRecord(
        server_round=server_round,
        client=client,
        status="ok",
        seconds=1.0,
        inputs=inputs,
        attack={"batch_size": len(inputs), "complete": False},
        quality=quality,
        verdict="approximate",
        verdict_reason="not confirmed by the self-check",
        input_space="features" if quality["kind"] == "features" else "inputs",
    )


def _feature_and_table_run(base: Path) -> Path:
    store = ReconstructionStore(base / "run", run_config=None)
    rows, truth = _features()
    scored = FeatureScorer().score_against(rows, truth)
    store.save(_record(1, "partition-0", rows, scored.quality))
    table_rows, table_truth, schema = _table()
    tabular = TabularScorer(schema).score_against(table_rows, table_truth)
    store.save(_record(1, "partition-1", table_rows, tabular.quality))
    return store.directory


def test_each_scorer_counts_by_its_own_criterion() -> None:
    rows, truth = _features()
    features = sample_recovery(quality=FeatureScorer().score_against(rows, truth).quality, psnr=None)
    assert features is not None
    assert (features.kind, features.scored, features.exact, features.approximate) == ("features", 5, 3, 4)
    assert features.exact_rule == "relative error < 0.0001"
    table_rows, table_truth, schema = _table()
    tabular = sample_recovery(
        quality=TabularScorer(schema).score_against(table_rows, table_truth).quality, psnr=None
    )
    assert tabular is not None
    assert (tabular.kind, tabular.scored, tabular.exact, tabular.approximate) == ("tabular", 4, 2, 3)
    assert tabular.approximate_rule == "every category right, every continuous value within 0.319 std"
    images = sample_recovery(quality={"kind": "images"}, psnr=[300.0, 95.0, 40.0, 10.0])
    assert images is not None and (images.scored, images.exact, images.approximate) == (4, 2, 3)


def test_stored_nulls_count_as_scored_and_not_recovered() -> None:
    # an infinite relative error (a non-finite reconstructed row) is stored as null
    counted = sample_recovery(quality={"kind": "features", "relative_error": [0.0, None, 0.05]}, psnr=None)
    assert counted is not None and (counted.scored, counted.exact, counted.approximate) == (3, 1, 2)
    assert sample_recovery(quality={"kind": "features"}, psnr=None) is None
    assert sample_recovery(quality={}, psnr=None) is None
    legacy = sample_recovery(quality={"mean_psnr": 50.0}, psnr=[50.0])  # written before scorers named a kind
    assert legacy is not None and (legacy.kind, legacy.scored, legacy.approximate) == ("images", 1, 1)


def test_table_and_summary_count_feature_and_tabular_samples(tmp_path: Path) -> None:
    run = _feature_and_table_run(tmp_path)
    rows = {row["client"]: row for row in load_table(run / TABLE_FILE)}
    assert rows["partition-0"]["num_references"] == "5" and rows["partition-1"]["num_references"] == "4"
    summary = load_summary(run)
    assert (summary["scored_samples"], summary["exact_samples"], summary["approximate_samples"]) == (9, 5, 7)
    assert summary["exact_sample_share"] == pytest.approx(5 / 9)
    assert summary["scorer_kinds"] == ["features", "tabular"]
    assert summary["exact_criterion"] == (
        "relative error < 0.0001; every category right, every continuous value within 0.0001 std"
    )
    assert summary["verdict_sentence"].startswith(
        "The server recovered 56% of the 9 scored client samples exactly"
    )
    details = {item["client"]: item for item in summary["attack_details"]}
    assert (details["partition-0"]["exact_samples"], details["partition-0"]["scored_samples"]) == (3, 5)
    assert (details["partition-1"]["approximate_samples"], details["partition-1"]["scored_samples"]) == (3, 4)


def test_report_headline_shows_the_counts_and_criteria(tmp_path: Path) -> None:
    run = _feature_and_table_run(tmp_path)
    page = write_report(run).read_text(encoding="utf-8")
    assert (
        "Exactly recovered (relative error &lt; 0.0001; every category right, every continuous value within "
        "0.0001 std): <b>55.6%</b> of the 9 scored client samples (5)"
    ) in page


def test_leakage_gate_trips_on_samples_scored_without_psnr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _feature_and_table_run(tmp_path)
    monkeypatch.setattr(cli, "run_audit_simulation", lambda overrides, **_: run)
    # no attack's verdict is exact: only the counted samples can trip the gate
    assert cli.main(["--fail-above", "0.5"]) == 3
    captured = capsys.readouterr()
    assert "leakage gate failed: 55.6% of samples recovered exactly (relative error < 0.0001;" in captured.err
    assert "56% of the 9 scored client samples recovered exactly" in captured.out
    assert cli.main(["--fail-above", "0.6"]) == 0


def test_a_derived_verdict_names_the_scorers_criteria(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config=None)
    rows, truth = _features()
    quality = FeatureScorer().score_against(rows, truth).quality
    store.save(
        AttackRecord(
            server_round=1, client="partition-0", status="ok", seconds=1.0, inputs=rows, quality=quality
        )
    )
    (attack,) = load_summary(store.directory)["attack_details"]
    assert attack["verdict_derived"] and attack["verdict"] == "approximate"
    assert attack["verdict_reason"] == (
        "derived from ground-truth scores: 3 of 5 scored samples with relative error < 0.0001, "
        "4 with relative error < 0.1"
    )
