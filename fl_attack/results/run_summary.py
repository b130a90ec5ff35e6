"""The few lines every audited run ends with: verdict counts, what was scored, where the results are.

Built from the records the auditor kept (no run directory needed, so a memory-only audit gets
them too). The wording never claims more than the verdicts and scores show: without ground
truth it counts what the server's own self-check confirmed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from fl_attack.results.record import AttackRecord, fallback_after
from fl_attack.results.recovery import sample_recovery
from fl_attack.vocabulary import VERDICT_EXACT, VERDICTS

__all__ = ["run_summary_lines"]


def _counts(records: Sequence[AttackRecord]) -> str:
    counts = Counter(record.verdict or "unjudged" for record in records)
    order = [verdict for verdict in VERDICTS if counts.get(verdict)] + sorted(set(counts) - set(VERDICTS))
    return ", ".join(f"{counts[verdict]} {verdict}" for verdict in order)


def _rounds(records: Sequence[AttackRecord]) -> str:
    rounds = sorted({record.server_round for record in records})
    if len(rounds) == 1:
        return f"round {rounds[0]}"
    if rounds == list(range(rounds[0], rounds[-1] + 1)):
        return f"rounds {rounds[0]}-{rounds[-1]}"
    return f"{len(rounds)} rounds"


def _scored(records: Sequence[AttackRecord]) -> str | None:
    recoveries = [sample_recovery(quality=record.quality, psnr=record.psnr) for record in records]
    scored = [recovery for recovery in recoveries if recovery is not None and recovery.scored]
    if not scored:
        return None
    total = sum(recovery.scored for recovery in scored)
    exact = sum(recovery.exact for recovery in scored)
    approximate = sum(recovery.approximate for recovery in scored)
    return (
        f"Against the ground truth opted-in clients sent: {exact} of {total} scored samples recovered exactly, "
        f"{approximate} at least approximately."
    )


def run_summary_lines(
    records: Sequence[AttackRecord],
    *,
    directory: Path | None,
    report: Path | None,
    problems: Sequence[str] = (),
) -> list[str]:
    """The closing summary of an audited run, one line per item.

    Parameters
    ----------
    records : Sequence[AttackRecord]
        Every record the auditor kept (the exact attack's and the fallback's).
    directory : Path or None
        The run directory; None for a memory-only audit.
    report : Path or None
        The ``report.html`` written, or None when none was.
    problems : Sequence[str] (default: ())
        Lines saying what went wrong at the end (a report that could not be written, records
        that could not be stored); printed last.

    Returns
    -------
    list[str]
    """
    primary = [record for record in records if fallback_after(record.details) is None]
    fallbacks = [record for record in records if fallback_after(record.details) is not None]
    lines: list[str] = []
    if not primary:
        lines.append(
            "fl-attack audit: no client update was attacked, so the run shows nothing about leakage."
        )
    else:
        exact = sum(1 for record in primary if record.verdict == VERDICT_EXACT)
        lines.append(
            f"fl-attack audit: {len(primary)} client update(s) attacked in {_rounds(primary)}: {_counts(primary)}."
        )
        lines.append(
            f"  {exact} of {len(primary)} updates reconstructed exactly by the server's own check "
            "(no ground truth needed)."
        )
        scored = _scored(primary)
        if scored is not None:
            lines.append(f"  {scored}")
    if fallbacks:
        names = sorted({str(record.attack.get("attack") or "fallback") for record in fallbacks})
        lines.append(
            f"  Approximate fallback ({', '.join(names)}) on {len(fallbacks)} update(s): {_counts(fallbacks)}."
        )
    skipped = [record for record in primary if record.details.get("fallback_skipped")]
    if skipped:
        lines.append(
            f"  Approximate fallback not run on {len(skipped)} update(s) where it could say nothing "
            f"(first: {skipped[0].details['fallback_skipped']})."
        )
    if directory is None:
        lines.append("  Results: kept in memory only (no output directory).")
    elif report is not None:
        lines.append(f"  Results: {directory} (report: {report}; summary: {report.with_suffix('.json')})")
    else:
        lines.append(f"  Results: {directory} (no report written; `fl-attack-report {directory}` writes one)")
    lines.extend(f"  {problem}" for problem in problems)
    return lines
