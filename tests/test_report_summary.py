"""Tests of the report's figures (report.json / load_summary), verdict sentence and recommendations."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from fl_attack.results.report import SUMMARY_FILE, NotARunDirectoryError, load_summary, write_report
from fl_attack.results.report.formatting import percent, share_text
from fl_attack.results.report.recommendations import Evidence, measured_defenses, recommendations
from fl_attack.results.report.settings import active_defenses, dp_budget, local_steps, relevant_settings
from fl_attack.results.report.verdicts import derive_verdict
from fl_attack.results.store import AttackRecord, ReconstructionStore
from tests.report_runs import add_verdicts, images, make_run, ok_record, simple_run, user_shaped_run

REPOSITORY = Path(__file__).resolve().parents[1]


def test_summary_figures(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    summary = load_summary(run)
    assert summary["attacks"] == 4 and summary["failed_attacks"] == 1 and summary["scored_attacks"] == 2
    assert (summary["scored_samples"], summary["exact_samples"], summary["approximate_samples"]) == (7, 3, 4)
    assert summary["exact_sample_share"] == pytest.approx(3 / 7)
    assert summary["approximate_sample_share"] == pytest.approx(4 / 7)
    assert summary["exact_attack_share"] == 0.0 and summary["approximate_attack_share"] == 0.5
    assert summary["verdicts_derived"] == 4
    assert summary["verdict_counts"] == {
        "exact": 0, "approximate": 2, "not-applicable": 0, "failed": 1, "timeout": 1, "dropped": 0,
    }  # fmt: skip
    rounds = {item["round"]: item for item in summary["rounds"]}
    assert set(rounds) == {0, 1, 2}
    assert (rounds[1]["scored_samples"], rounds[1]["exact_samples"], rounds[1]["approximate_samples"]) == (
        4,
        2,
        3,
    )
    assert rounds[1]["exact_sample_share"] == 0.5 and rounds[1]["failed"] == 1
    assert rounds[2]["exact_sample_share"] == pytest.approx(1 / 3) and rounds[2]["test_acc"] == 0.5
    assert (
        rounds[0]["attacks"] == 0 and rounds[0]["exact_sample_share"] is None and rounds[0]["test_acc"] == 0.1
    )
    clients = {item["client"]: item for item in summary["clients"]}
    assert clients["partition-0"]["exact_samples"] == 3 and clients["partition-0"]["scored_samples"] == 7
    assert (
        clients["partition-1"]["scored_samples"] == 0 and clients["partition-1"]["exact_sample_share"] is None
    )
    assert clients["partition-1"]["verdict_counts"]["timeout"] == 1
    # PSNR 300 goes to the "> 150 dB" bin; 120, 95, 40, 20, 10, 5 each to their own 5 dB bin.
    histogram = summary["psnr_histogram"]
    assert histogram["above_cap"] == 1 and histogram["cap_db"] == 150.0
    assert histogram["bin_edges_db"][0] == 0.0 and histogram["bin_edges_db"][-1] == 150.0
    filled = {histogram["bin_edges_db"][i]: count for i, count in enumerate(histogram["counts"]) if count}
    assert filled == {5.0: 1, 10.0: 1, 20.0: 1, 40.0: 1, 95.0: 1, 120.0: 1}
    assert summary["final_test"] == {"test_acc": 0.5, "test_loss": 1.6, "test_examples": 50}
    assert summary["defenses"] == [
        {"name": "dpsgd", "text": "DP-SGD (noise multiplier 0.5, clipping norm 2)"}
    ]
    # report.json holds exactly these figures.
    write_report(run)
    assert json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8")) == json.loads(json.dumps(summary))


def test_summary_with_recorded_verdicts_and_no_scores(tmp_path: Path) -> None:
    store = ReconstructionStore(
        tmp_path / "run", run_config={"train-mode": "fedsgd", "audit-ground-truth": False}
    )
    for client in ("node-1", "node-2", "node-3"):
        pictures = images(2, 1)
        store.save(AttackRecord(server_round=1, client=client, status="ok", seconds=1.0,
                                inputs=pictures.reshape(2, -1), reconstructed_images=pictures,
                                attack={"batch_size": 2, "complete": True}))  # fmt: skip
    add_verdicts(
        store.directory,
        {
            (1, "node-1"): {"verdict": "exact", "verdict_reason": "self-check passed"},
            (1, "node-2"): {"verdict": "exact", "verdict_reason": "self-check passed"},
            (1, "node-3"): {"verdict": "not-applicable", "verdict_reason": "several local steps"},
        },
    )
    summary = load_summary(store.directory)
    assert summary["exact_sample_share"] is None and summary["scored_samples"] == 0
    assert summary["exact_attack_share"] == pytest.approx(2 / 3) and summary["verdicts_derived"] == 0
    assert summary["verdict_sentence"] == (
        "No ground truth was scored, so leakage is stated from the verdicts: 2 of 3 client updates (67%) were "
        "reconstructed exactly by the server's own check (2 exact, 1 not-applicable); no defense was on."
    )
    assert summary["recommendations"]["status"] == "shown"


def test_self_check_and_ground_truth_disagreement(tmp_path: Path) -> None:
    run = simple_run(tmp_path, {"train-mode": "fedsgd"}, [[150.0, 10.0]])
    add_verdicts(run, {(1, "partition-0"): {"verdict": "exact", "verdict_reason": "self-check passed"}})
    summary = load_summary(run)
    assert summary["verdict_disagreements"] == [
        {"round": 1, "client": "partition-0", "verdict": "exact", "exact_samples": 1, "scored_samples": 2}
    ]
    text = write_report(run).read_text(encoding="utf-8")
    assert "self-check and the ground truth disagree on 1 update(s)" in text


def test_negative_psnr_and_unscored_secagg_members(tmp_path: Path) -> None:
    """PSNR below 0 dB widens the histogram; a secure-aggregation sum that lists its members unscored."""
    store = ReconstructionStore(tmp_path / "run", run_config={"train-mode": "fedsgd", "secagg-group-size": 2})
    store.save(ok_record(1, "partition-0", [-12.0, 3.0], seed=0))
    store.save(AttackRecord(server_round=1, client="secagg-partition-1_partition-2", status="error",
                            seconds=1.0, error="no low-rank structure",
                            details={"members": ["partition-1", "partition-2"]}))  # fmt: skip
    summary = load_summary(store.directory)
    histogram = summary["psnr_histogram"]
    assert histogram["bin_edges_db"][0] == -15.0 and histogram["counts"][:4] == [1, 0, 0, 1]
    assert summary["secagg_members"] == []
    assert summary["verdict_sentence"] == (
        "The server recovered none of the 2 scored client samples exactly, not even approximately; "
        "secure aggregation over groups of 2 clients was on."
    )
    assert "no low-rank structure" in write_report(store.directory).read_text(encoding="utf-8")


def test_empty_run_and_missing_directory(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"train-mode": "fedsgd"})
    summary = load_summary(store.directory)
    assert summary["attacks"] == 0 and summary["exact_attack_share"] is None
    assert summary["exact_sample_share"] is None and summary["recommendations"]["status"] == "not-attacked"
    assert summary["verdict_sentence"].startswith("No client update was attacked in this run")
    with pytest.raises(NotARunDirectoryError, match="no attacks.csv"):
        load_summary(tmp_path)


FEDAVG_SECAGG = {
    "train-mode": "fedavg", "local-epochs": 2, "samples-per-client": 16, "mini-batch-size": 8,
    "secagg-group-size": 3,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "psnr", "sentence"),
    [
        ({"train-mode": "fedsgd"}, [[150.0, 150.0], [160.0, 100.0]],
         "The server recovered 100% of the 4 scored client samples exactly in every round; "
         "no defense was on."),
        ({"train-mode": "fedsgd"}, [[100.0, 10.0]],
         "The server recovered 50% of the 2 scored client samples exactly in round 1; no defense was on."),
        (FEDAVG_SECAGG, [[100.0, 100.0], [10.0, 30.0]],
         "The server recovered 50% of the 4 scored client samples exactly (round 1: 100%, round 2: 0%) and 75% "
         "at least approximately; secure aggregation over groups of 3 clients and FedAvg with 4 local steps per round "
         "(2 epoch(s) over mini-batches of 8) were on."),
        ({"train-mode": "fedsgd"}, [[30.0, 10.0]],
         "The server recovered none of the 2 scored client samples exactly, but 50% approximately; "
         "no defense was on."),
        ({"train-mode": "dpsgd", "noise-multiplier": 0.0, "max-grad-norm": 1.0}, [[10.0]],
         "The server recovered none of the 1 scored client samples exactly, not even approximately; "
         "DP-SGD clipping without noise (clipping norm 1) was on."),
        (None, [[95.0] * 399 + [10.0]],
         "The server recovered >99% of the 400 scored client samples exactly in round 1; no defense was on."),
    ],
)  # fmt: skip
def test_verdict_sentence(
    tmp_path: Path, config: dict[str, Any] | None, psnr: list[list[float]], sentence: str
) -> None:
    assert load_summary(simple_run(tmp_path, config, psnr))["verdict_sentence"] == sentence


@pytest.mark.parametrize(
    ("status", "error", "counts", "complete", "verdict", "reason"),
    [
        ("dropped", "", (0, 0, 0), None, "dropped", "derived from status dropped: the attack was never run"),
        ("timeout", "killed", (0, 0, 0), None, "timeout",
         "derived from status timeout: the attack was stopped at its limit: killed"),
        ("out-of-memory", "", (0, 0, 0), None, "failed",
         "derived from status out-of-memory: the attack returned no reconstruction"),
        ("ok", "", (3, 3, 3), True, "exact",
         "derived from ground-truth PSNR: 3 of 3 scored samples above 90 dB, 3 above 25 dB"),
        ("ok", "", (3, 2, 3), True, "approximate",
         "derived from ground-truth PSNR: 2 of 3 scored samples above 90 dB, 3 above 25 dB"),
        ("ok", "", (3, 0, 0), True, "failed",
         "derived from ground-truth PSNR: 0 of 3 scored samples above 90 dB, 0 above 25 dB"),
        ("ok", "", (0, 0, 0), False, "failed",
         "derived: the attacker reported an incomplete reconstruction and no ground truth scored it"),
    ],
)  # fmt: skip
def test_derive_verdict(
    status: str, error: str, counts: tuple[int, int, int], complete: bool | None, verdict: str, reason: str
) -> None:
    scored, exact, approximate = counts
    assert derive_verdict(
        status=status, error=error, scored=scored, exact=exact, approximate=approximate, complete=complete
    ) == (verdict, reason)


def test_derive_verdict_never_claims_exact_without_ground_truth() -> None:
    verdict, reason = derive_verdict(status="ok", error="", scored=0, exact=0, approximate=0, complete=True)
    assert verdict == "approximate" and "not confirmed" in reason
    with pytest.raises(ValueError, match="inconsistent sample counts: exact 3, approximate 2, scored 3"):
        derive_verdict(status="ok", error="", scored=3, exact=3, approximate=2, complete=True)


def test_shares_never_round_to_false_ends() -> None:
    assert [share_text(v) for v in (None, 0.0, 0.004, 0.01, 0.5, 0.994, 0.996, 1.0)] == [
        "–", "0%", "<1%", "1%", "50%", "99%", ">99%", "100%",
    ]  # fmt: skip
    assert [percent(v) for v in (None, 0.0, 0.0004, 3 / 7, 0.9996, 1.0)] == [
        "–", "0.0%", "<0.1%", "42.9%", ">99.9%", "100.0%",
    ]  # fmt: skip


def test_settings_and_defenses_from_config() -> None:
    fedsgd = {"train-mode": "fedsgd", "batch-size": 8, "noise-multiplier": 1.0, "max-grad-norm": 1.0,
              "poisson-sampling": True, "local-epochs": 1, "mini-batch-size": 8, "secagg-group-size": 1,
              "partitioning": "iid", "labels-per-client": 2, "output-dir": "/tmp/x", "attack-weight-key": "",
              "attack-partitions": "0,2", "attack-fraction": 0.5, "attack-enabled": True,
              "depth": 0}  # fmt: skip
    shown, omitted = relevant_settings(fedsgd)
    assert [key for key, _ in shown] == ["train-mode", "batch-size", "partitioning", "attack-partitions"]
    assert set(omitted) == set(fedsgd) - {"train-mode", "batch-size", "partitioning", "attack-partitions"}
    assert active_defenses(fedsgd, None) == []
    assert local_steps(fedsgd) == 1 and local_steps({"train-mode": "fedavg", "local-epochs": 3}) is None
    dp = {"train-mode": "dpsgd", "noise-multiplier": 1.0, "max-grad-norm": 2.0, "local-epochs": 2,
          "samples-per-client": 10, "mini-batch-size": 4}  # fmt: skip
    assert local_steps(dp) == 6
    history = {
        "rounds": [{"round": 1, "train": {"epsilon": 3.5, "delta": 1e-5}}, {"round": 2, "train": None}]
    }
    budget = dp_budget(dp, history)
    assert budget is not None and budget.text() == "ε = 3.5 (δ = 1e-05)"
    assert budget.source == "history.json round 1 train: epsilon"
    assert [d.text for d in active_defenses(dp, history)] == [
        "DP-SGD (noise multiplier 1, clipping norm 2, ε = 3.5 (δ = 1e-05))"
    ]
    assert dp_budget(dp, None) is None
    assert dp_budget({**dp, "dp-epsilon": "inf"}, None) is not None


def _evidence(share: float, *, basis: str = "samples", applied: int = 4) -> Evidence:
    return Evidence(
        leaked_share=share, basis=basis, applied=applied, attacks=4, verdicts={"exact": 3, "failed": 1}
    )


def test_recommendations_relevant_to_what_leaked() -> None:
    assert recommendations(config=None, evidence=None)["status"] == "not-attacked"
    quiet = recommendations(config={"train-mode": "fedsgd"}, evidence=_evidence(0.009))
    assert quiet["status"] == "below-target" and quiet["rows"] == []
    assert "no further defense" in quiet["message"]

    open_run = recommendations(config={"train-mode": "fedsgd"}, evidence=_evidence(0.94))
    rows = [(row["parameter"], row["value"], row["stops"]) for row in open_run["rows"]]
    assert rows == [
        ("noise-multiplier", "0.01", True), ("noise-multiplier", "0.1", True),
        ("noise-multiplier", "1.0", True), ("secagg-group-size", "2", False),
        ("secagg-group-size", "3", True),
    ]  # fmt: skip
    assert open_run["local_steps"] == [] and open_run["beyond_measured"] == []
    first = open_run["rows"][0]
    assert first["recovery"] == "0% of 192 scored samples recovered exactly, 0% approximately"
    assert (
        first["utility"]
        == "test accuracy after 8 rounds 0.203 against 0.203 without the defense (+0.0 points)"
    )
    assert first["epsilon"] == "ε = 4.41e+04 (δ = 1e-05)"
    assert open_run["rows"][1]["recovery"] == "the attack failed on all 24 updates: no sample was recovered"
    assert open_run["rows"][3]["recovery"] == "46% of 96 scored samples recovered exactly, 70% approximately"

    strongest = recommendations(
        config={"train-mode": "dpsgd", "noise-multiplier": 1.0, "secagg-group-size": 3},
        evidence=_evidence(0.2),
    )
    assert strongest["rows"] == []
    assert strongest["beyond_measured"] == ["DP-SGD noise multiplier", "secure-aggregation group size"]

    fedavg = recommendations(config={"train-mode": "fedavg"}, evidence=_evidence(0.5))
    assert [finding["text"] for finding in fedavg["local_steps"]] == [
        "per batch, 68% / 59% / 96% of the samples recovered exactly and 100% / 100% / 100% approximately",
        "per batch, 100% / 0% / 100% of the samples recovered exactly and 100% / 10% / 100% approximately",
    ]


def _matching_rows(source: str, match: dict[str, str]) -> list[dict[str, str]]:
    with open(REPOSITORY / source, newline="", encoding="utf-8") as handle:
        return [
            row for row in csv.DictReader(handle) if all(row[key] == value for key, value in match.items())
        ]


def _equal(stored: Any, measured: str) -> bool:
    if measured == "inf":
        return stored == "inf" or (isinstance(stored, float) and math.isinf(stored))
    return math.isclose(float(stored), float(measured), rel_tol=1e-12, abs_tol=0.0)


def test_measured_defenses_are_copied_from_their_source_files() -> None:
    """Every number behind a recommendation equals the row of the result file it cites."""
    data = measured_defenses()
    entries = [
        (sweep["source"], point)
        for sweep in data["sweeps"]
        for point in [sweep["baseline"], *sweep["points"]]
    ]
    entries += [(finding["source"], batch) for finding in data["local_steps"] for batch in finding["batches"]]
    assert len(entries) == 13
    for source, entry in entries:
        rows = _matching_rows(source, entry["match"])
        assert len(rows) == 1, (source, entry["match"])
        for key, value in entry["values"].items():
            assert _equal(value, rows[0][key]), (source, entry["match"], key, value, rows[0][key])


def test_a_user_shaped_run_is_stated_from_its_verdicts(tmp_path: Path) -> None:
    """No ground truth: the headline, the advice and the recommendations say only what the verdicts show."""
    run = user_shaped_run(tmp_path)
    write_report(run)
    summary = json.loads((run / SUMMARY_FILE).read_text(encoding="utf-8"))
    counts = summary["verdict_counts"]
    assert (summary["attacks"], counts["exact"], counts["timeout"], counts["not-applicable"]) == (6, 2, 2, 2)
    assert summary["failed_attacks"] == 0 and summary["scored_samples"] == 0
    assert summary["verdict_sentence"] == (
        "No ground truth was scored, so leakage is stated from the verdicts: 2 of 6 client updates (33%) were "
        "reconstructed exactly by the server's own check (2 exact, 2 not-applicable, 2 timeout); no defense was on."
    )
    advice = summary["verdict_advice"]
    assert advice["timeout"] == (
        "1 of them had every sample found but not confirmed (near-identical samples, or a self-check that "
        "failed; see each reason): a larger time budget is unlikely to settle these, treat them as leaking "
        "approximately; 1 ran out of time before finding the batch: raise attack-time-budget (the batch was "
        "not shown safe)"
    )
    assert advice["not-applicable"].startswith("the exact attack cannot invert these updates")
    recommendation = summary["recommendations"]
    assert recommendation["status"] == "shown" and "no further defense" not in recommendation["message"]
    assert recommendation["message"].startswith(
        "In this run the server's own check reconstructed 33% of the 6 attacked updates at least approximately"
    )
    assert [item["client"] for item in summary["fallback_skipped"]] == ["node-3", "node-3"]


@pytest.mark.parametrize(
    ("evidence", "status"),
    [
        (Evidence(leaked_share=0.0, basis="verdicts", applied=3, attacks=3, verdicts={"failed": 3}), "no-evidence"),
        (Evidence(leaked_share=0.0, basis="samples", applied=0, attacks=2, verdicts={"not-applicable": 2}),
         "no-evidence"),
        (Evidence(leaked_share=0.0, basis="samples", applied=2, attacks=2, verdicts={"failed": 2}), "below-target"),
    ],
)  # fmt: skip
def test_no_further_defense_needs_an_attack_that_could_have_recovered(
    evidence: Evidence, status: str
) -> None:
    result = recommendations(config={"train-mode": "fedsgd"}, evidence=evidence)
    assert result["status"] == status
    assert ("no further defense" in result["message"]) == (status == "below-target")
    if status == "no-evidence":
        assert "no evidence that the data is safe" in result["message"] and result["rows"] == []


def test_many_rounds_name_the_range_of_their_exact_shares(tmp_path: Path) -> None:
    psnr = [[150.0, 150.0], [150.0, 10.0], [150.0, 150.0], [10.0, 10.0], [150.0, 150.0]]
    summary = load_summary(simple_run(tmp_path, {"train-mode": "fedsgd"}, psnr))
    assert summary["verdict_sentence"] == (
        "The server recovered 70% of the 10 scored client samples exactly in 4 of 5 rounds (from 0% to 100% per "
        "round); no defense was on."
    )


def test_timeout_advice_follows_each_reason() -> None:
    """A budget spent with nothing found does not advise a larger budget as the first remedy."""
    from fl_attack.results.report.advice import verdict_advice

    attacks = [
        {
            "verdict": "timeout",
            "verdict_reason": "the attack spent its whole 10 s budget with 0 of 2 samples found",
        },
        {
            "verdict": "timeout",
            "verdict_reason": "the attack spent its whole 10 s budget with 5 of 8 samples found",
        },
        {
            "verdict": "timeout",
            "verdict_reason": "the attack spent its whole 10 s budget: all 8 directions were found but not verified",
        },
    ]
    advice = verdict_advice(attacks)["timeout"]
    assert advice.startswith("1 of them had every sample found but not confirmed"), advice
    assert "1 found no sample at all in the whole budget" in advice
    assert "rarely yield to more time" in advice
    assert advice.endswith(
        "1 ran out of time before finding the batch: raise attack-time-budget (the batch was not shown safe)"
    )
