"""Secure-aggregation members get their own recovered counts whatever scored them (images, features, tables)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fl_attack.audit import AttackSettings, SecAggSettings
from fl_attack.audit.observations import ClientIdentity, ClientUpdate
from fl_attack.audit.units import member_quality
from fl_attack.evaluation.scoring import FeatureScorer, OrdinalSchema, TabularScorer
from fl_attack.results.report import load_summary, write_report
from fl_attack.results.store import ReconstructionStore
from strategies import HonestButCuriousStrategy
from tests.test_audit_strategy import (
    INPUT_DIM,
    RecordingAttacker,
    _audited,
    _client_arrays,
    _configure,
    _fedavg,
    _global_arrays,
    _reply,
    task_identity,
)

__all__ = ["task_identity"]  # the fixture that lets hand-built messages exist outside a run


def _member(partition: int) -> ClientUpdate:
    return ClientUpdate(identity=ClientIdentity(node_id=partition + 1, partition_id=partition), arrays=None)


def _secagg_round(tmp_path: Path) -> HonestButCuriousStrategy:
    """Partitions 0 and 1 summed; the attacker recovers partition 0's features exactly, partition 1's not."""
    rng = np.random.default_rng(6)
    dataset = np.abs(rng.standard_normal((20, INPUT_DIM))) + 0.1
    member_indices = {0: [1, 2], 1: [5, 6, 7], 2: [9]}
    noise = 3.0 * np.abs(rng.standard_normal((3, INPUT_DIM)))
    recovered = np.concatenate([dataset[[2, 1]], dataset[[5, 6]] * 1.05, noise[:1]])
    strategy = _audited(
        _fedavg(),
        RecordingAttacker(inputs=recovered),
        scorer=FeatureScorer(dataset=dataset),
        attack=AttackSettings(batch_size=4),
        secagg=SecAggSettings(group_size=2),
        store=ReconstructionStore(tmp_path / "run", run_config={"secagg-group-size": 2}),
    )
    global_arrays = _global_arrays()
    _configure(strategy, global_arrays)
    replies = [
        _reply(
            11 * (partition + 1),
            _client_arrays(global_arrays, partition),
            partition_id=partition,
            indices=indices,
        )
        for partition, indices in member_indices.items()
    ]
    strategy.aggregate_train(1, replies)
    strategy.close()
    return strategy


def test_feature_scored_members_get_their_counts(tmp_path: Path) -> None:
    strategy = _secagg_round(tmp_path)
    group = next(record for record in strategy.records if record.client.startswith("secagg-"))
    assert group.error is None
    members = group.details["members"]
    first, second = members["partition-0"], members["partition-1"]
    assert first["kind"] == "features" and first["samples"] == 2
    assert (first["exact_samples"], first["approximate_samples"], first["exact_fraction"]) == (2, 2, 1.0)
    assert first["mean_relative_error"] < 1e-12 and first["mean_psnr"] is None
    assert (second["samples"], second["exact_samples"], second["approximate_samples"]) == (3, 0, 2)
    assert second["approx_fraction"] == pytest.approx(2 / 3)
    assert second["mean_relative_error"] > 0.05 - 1e-9

    assert strategy.auditor.store is not None
    summary = load_summary(strategy.auditor.store.directory)
    rows = {row["member"]: row for row in summary["secagg_members"]}
    assert rows["partition-0"]["kind"] == "features" and rows["partition-0"]["exact_share"] == 1.0
    assert rows["partition-1"]["approximate_share"] == pytest.approx(2 / 3)
    page = write_report(strategy.auditor.store.directory).read_text(encoding="utf-8")
    assert "<th>exact (relative error &lt; 0.0001)</th>" in page


def test_tabular_members_are_counted_from_the_scorers_row_flags() -> None:
    raw = np.array([[0, 1.0], [1, 30.0], [2, 60.0], [0, 90.0], [1, 120.0], [2, 150.0]])
    schema = OrdinalSchema.fit(raw, names=["colour", "size"], categories={"colour": ["red", "green", "blue"]})
    truth = schema.encode(raw[:5]).astype(np.float64)
    rows = truth.copy()
    rows[3, 1] += 0.1  # within TabLeak's tolerance, not exact
    rows[4, 1] += 0.5  # continuous value off by 0.5 std: not recovered
    scored = TabularScorer(schema).score_against(rows[::-1], truth)
    members = member_quality([_member(0), _member(1)], [2, 3], scored)
    first, second = members["partition-0"], members["partition-1"]
    assert (first["kind"], first["exact_samples"], first["approximate_samples"]) == ("tabular", 2, 2)
    assert (second["exact_samples"], second["approximate_samples"]) == (1, 2)
    assert second["mean_features_recovered"] == pytest.approx((1.0 + 1.0 + 0.5) / 3)


def test_member_sizes_must_match_the_scored_samples() -> None:
    rows = np.eye(3)
    scored = FeatureScorer().score_against(rows, rows)
    with pytest.raises(ValueError, match="the members sent 4 samples but 3 were scored"):
        member_quality([_member(0), _member(1)], [2, 2], scored)
