"""The closing summary of an audited run says what the records show, and where the results are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fl_attack.results.run_summary import run_summary_lines
from fl_attack.results.store import AttackRecord


def _record(server_round: int, client: str, verdict: str, **fields: Any) -> AttackRecord:
    return AttackRecord(
        server_round=server_round, client=client, status="ok", seconds=1.0, verdict=verdict, **fields
    )


def test_verdicts_scores_fallback_and_results() -> None:
    scored = {"kind": "features", "relative_error": [1e-9, 1e-9, 5.0]}
    records = [
        _record(1, "node-1", "exact"),
        _record(1, "node-2", "not-applicable", details={"fallback_skipped": "cocktail-party: no sources"}),
        _record(2, "node-1", "exact", quality=scored),
        _record(
            1,
            "node-2",
            "approximate",
            attack={"attack": "cocktail-party"},
            details={"fallback_after": {"attack": "spear++", "verdict": "not-applicable"}},
        ),
    ]
    run = Path("/runs/audit-1")
    lines = run_summary_lines(records, directory=run, report=run / "report.html")
    assert (
        lines[0] == "fl-attack audit: 3 client update(s) attacked in rounds 1-2: 2 exact, 1 not-applicable."
    )
    assert (
        lines[1]
        == "  2 of 3 updates reconstructed exactly by the server's own check (no ground truth needed)."
    )
    assert lines[2] == (
        "  Against the ground truth opted-in clients sent: 2 of 3 scored samples recovered exactly, "
        "2 at least approximately."
    )
    assert lines[3] == "  Approximate fallback (cocktail-party) on 1 update(s): 1 approximate."
    assert (
        lines[4]
        == "  Approximate fallback not run on 1 update(s) where it could say nothing (first: cocktail-party: no sources)."
    )
    assert lines[5] == f"  Results: {run} (report: {run / 'report.html'}; summary: {run / 'report.json'})"


def test_nothing_attacked_memory_only_and_problems() -> None:
    lines = run_summary_lines([], directory=None, report=None, problems=["report.html could not be written"])
    assert lines == [
        "fl-attack audit: no client update was attacked, so the run shows nothing about leakage.",
        "  Results: kept in memory only (no output directory).",
        "  report.html could not be written",
    ]
    stored = run_summary_lines([], directory=Path("/runs/a"), report=None)
    assert stored[-1] == "  Results: /runs/a (no report written; `fl-attack-report /runs/a` writes one)"
