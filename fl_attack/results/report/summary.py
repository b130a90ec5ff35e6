"""The report's figures as one JSON-ready dict (``report.json``), and its verdict sentence.

``load_summary(run_dir)`` is what a CI gate reads: among others it holds

* ``exact_sample_share``: share of the scored client samples recovered exactly, each by the
  criterion of the scorer that scored it (images: PSNR above
  :data:`~fl_attack.vocabulary.EXACT_PSNR_DB`; features: relative error; tabular: every
  feature; see :mod:`fl_attack.results.recovery`); None when nothing was scored;
* ``approximate_sample_share``: the same, approximately (exact ones included);
* ``exact_criterion``, ``approximate_criterion``: those criteria in words;
* ``exact_attack_share``: share of the attacks whose verdict is exact (None without attacks);
* ``verdict_sentence``, ``verdict_counts``, ``rounds``, ``clients``, ``attacks``;
* ``fallback``: what the approximate fallback attack recovered on the updates the exact attack
  did not recover exactly (None when it never ran); it counts in none of the figures above;
* ``fallback_skipped``: the updates the fallback was not run on because it could say nothing
  there, each with the reason;
* ``verdict_advice``: what to do about each verdict present, chosen from its attacks' reasons;
* ``recommendations``: measured defenses; ``no further defense`` (status ``below-target``) only
  when ground truth was scored and the attack could have recovered samples.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack.results.recovery import KIND_IMAGES, recovery_criteria
from fl_attack.results.report.advice import verdict_advice
from fl_attack.results.report.formatting import share_text
from fl_attack.results.report.loading import AttackEntry, RunData, load_run, number
from fl_attack.results.report.recommendations import Evidence, recommendations
from fl_attack.results.report.settings import Defense, active_defenses
from fl_attack.vocabulary import (
    APPROX_PSNR_DB,
    DISPLAY_PSNR_CAP_DB,
    EXACT_PSNR_DB,
    STATUS_NOT_RUN,
    STATUS_OK,
    VERDICT_APPROXIMATE,
    VERDICT_EXACT,
    VERDICT_NOT_APPLICABLE,
    VERDICTS,
)

__all__ = ["SUMMARY_SCHEMA", "build_summary", "load_summary", "psnr_bin_edges", "verdict_sentence"]

#: Identifies the layout of ``report.json``.
SUMMARY_SCHEMA = "fl-attack-report-summary/1"
#: Width of a PSNR histogram bin (dB).
PSNR_BIN_DB = 5.0
#: The headline names each round's exact share up to this many scored rounds.
MAX_ROUNDS_NAMED = 4


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary of a run directory, computed from its files (``report.json`` is not needed).

    Raises
    ------
    NotARunDirectoryError
        When ``run_dir`` holds no ``attacks.csv``.
    """
    return build_summary(load_run(run_dir))


def _failed(entry: AttackEntry) -> bool:
    """An attack that ran (or should have) and returned nothing; one the spectrum ruled out did not fail."""
    return entry.status not in (STATUS_OK, STATUS_NOT_RUN)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _verdict_counts(entries: Sequence[AttackEntry]) -> dict[str, int]:
    counts = Counter(entry.verdict for entry in entries)
    return {verdict: counts.get(verdict, 0) for verdict in VERDICTS}


def _samples(entries: Sequence[AttackEntry]) -> dict[str, Any]:
    scored = sum(entry.scored_count for entry in entries)
    exact = sum(entry.exact_count for entry in entries)
    approximate = sum(entry.approximate_count for entry in entries)
    return {
        "scored_samples": scored,
        "exact_samples": exact,
        "approximate_samples": approximate,
        "exact_sample_share": _share(exact, scored),
        "approximate_sample_share": _share(approximate, scored),
    }


def _criteria(entries: Sequence[AttackEntry]) -> dict[str, Any]:
    """The recovery criteria of the scorers that scored this run's samples, in words."""
    scored = [entry.recovery for entry in entries if entry.recovery is not None and entry.recovery.scored]
    kinds = list(dict.fromkeys(recovery.kind for recovery in scored))
    if not scored:  # nothing scored, or only a table without metrics.json: PSNR, as stored by old runs
        exact, approximate = recovery_criteria(KIND_IMAGES)
        return {"scorer_kinds": kinds, "exact_criterion": exact, "approximate_criterion": approximate}
    return {
        "scorer_kinds": kinds,
        "exact_criterion": "; ".join(dict.fromkeys(recovery.exact_rule for recovery in scored)),
        "approximate_criterion": "; ".join(dict.fromkeys(recovery.approximate_rule for recovery in scored)),
    }


def psnr_bin_edges(values: Sequence[float]) -> list[float]:
    """Histogram edges every :data:`PSNR_BIN_DB` dB up to the display cap (values above it go to one bin)."""
    low = min([0.0, *values]) if values else 0.0
    low = PSNR_BIN_DB * math.floor(low / PSNR_BIN_DB)
    count = int(round((DISPLAY_PSNR_CAP_DB - low) / PSNR_BIN_DB))
    return [low + PSNR_BIN_DB * index for index in range(count + 1)]


def _histogram(entries: Sequence[AttackEntry]) -> dict[str, Any]:
    values = [value for entry in entries for value in (entry.psnr or [])]
    edges = psnr_bin_edges(values)
    shown = [value for value in values if value <= DISPLAY_PSNR_CAP_DB]
    counts, _ = np.histogram(shown, bins=edges)
    return {
        "bin_edges_db": edges,
        "counts": [int(count) for count in counts],
        "above_cap": sum(1 for value in values if value > DISPLAY_PSNR_CAP_DB),
        "cap_db": DISPLAY_PSNR_CAP_DB,
    }


def _test_metrics(history: Mapping[str, Any] | None) -> dict[int, dict[str, Any]]:
    """``{round: test metrics}`` from ``history.json`` (round 0: the initial model)."""
    result: dict[int, dict[str, Any]] = {}
    rounds = history.get("rounds") if isinstance(history, Mapping) else None
    for item in rounds if isinstance(rounds, list) else []:
        if not isinstance(item, Mapping) or not isinstance(item.get("test"), Mapping):
            continue
        round_number = number(item.get("round"))
        if round_number is not None:
            result[int(round_number)] = dict(item["test"])
    return result


def _rounds(data: RunData) -> list[dict[str, Any]]:
    tests = _test_metrics(data.history)
    summaries = []
    for server_round in sorted({entry.server_round for entry in data.entries} | set(tests)):
        entries = [entry for entry in data.entries if entry.server_round == server_round]
        values = [value for entry in entries for value in (entry.psnr or [])]
        seconds = [entry.seconds for entry in entries if entry.seconds is not None]
        test = tests.get(server_round, {})
        summaries.append(
            {
                "round": server_round,
                "attacks": len(entries),
                "failed": sum(1 for entry in entries if _failed(entry)),
                **_samples(entries),
                "mean_psnr": float(np.mean(values)) if values else None,
                "median_seconds": float(np.median(seconds)) if seconds else None,
                "test_acc": number(test.get("test-acc")),
                "test_loss": number(test.get("test-loss")),
                "verdict_counts": _verdict_counts(entries),
            }
        )
    return summaries


def _clients(entries: Sequence[AttackEntry]) -> list[dict[str, Any]]:
    result = []
    for client in sorted({entry.client for entry in entries}):
        mine = [entry for entry in entries if entry.client == client]
        result.append(
            {
                "client": client,
                "attacks": len(mine),
                **_samples(mine),
                "verdict_counts": _verdict_counts(mine),
            }
        )
    return result


def _secagg_members(entries: Sequence[AttackEntry]) -> list[dict[str, Any]]:
    rows = []
    for entry in entries:
        members = entry.details.get("members")
        if not isinstance(members, Mapping):  # a plain list of names: not scored per member
            continue
        for member, quality in members.items():
            quality = quality if isinstance(quality, Mapping) else {}
            rows.append(
                {
                    "round": entry.server_round,
                    "group": entry.client,
                    "member": str(member),
                    "kind": quality.get("kind") if isinstance(quality.get("kind"), str) else None,
                    "samples": number(quality.get("samples")),
                    "mean_psnr": number(quality.get("mean_psnr")),
                    "exact_share": number(quality.get("exact_fraction")),
                    "approximate_share": number(quality.get("approx_fraction")),
                }
            )
    return rows


def _attack(entry: AttackEntry) -> dict[str, Any]:
    return {
        "round": entry.server_round,
        "client": entry.client,
        "status": entry.status,
        "verdict": entry.verdict,
        "verdict_reason": entry.verdict_reason,
        "verdict_derived": entry.verdict_derived,
        "input_space": entry.input_space,
        "seconds": entry.seconds,
        "queue_seconds": entry.queue_seconds,
        "batch_size": number(entry.row.get("batch_size")),
        "complete": {"True": True, "False": False}.get(entry.row.get("complete", "")),
        "sparsity_matching": number(entry.row.get("sparsity_matching")),
        "scored_samples": entry.scored_count,
        "exact_samples": entry.exact_count,
        "approximate_samples": entry.approximate_count,
        "mean_psnr": number(entry.row.get("mean_psnr")),
        "min_psnr": min(entry.psnr) if entry.psnr else number(entry.row.get("min_psnr")),
        "error": entry.error,
    }


def _disagreements(entries: Sequence[AttackEntry]) -> list[dict[str, Any]]:
    """Recorded verdicts that the ground truth contradicts (exact claimed, or exact missed)."""
    found = []
    for entry in entries:
        if entry.verdict_derived or not entry.scored:
            continue
        all_exact = entry.exact_count == entry.scored_count
        if (entry.verdict == VERDICT_EXACT) != all_exact:
            found.append(
                {
                    "round": entry.server_round,
                    "client": entry.client,
                    "verdict": entry.verdict,
                    "exact_samples": entry.exact_count,
                    "scored_samples": entry.scored_count,
                }
            )
    return found


def _defense_clause(defenses: Sequence[Defense]) -> str:
    if not defenses:
        return "no defense was on"
    texts = [defense.text for defense in defenses]
    joined = texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]
    return f"{joined} {'was' if len(texts) == 1 else 'were'} on"


def verdict_sentence(summary: Mapping[str, Any], defenses: Sequence[Defense]) -> str:
    """One sentence a reviewer can act on, built from the summary's figures."""
    defense = _defense_clause(defenses)
    attacks = int(summary["attacks"])
    if attacks == 0:
        return (
            "No client update was attacked in this run, so it shows nothing about what the server "
            f"could recover; {defense}."
        )
    scored, exact, approx = (
        int(summary[key]) for key in ("scored_samples", "exact_samples", "approximate_samples")
    )
    if scored:
        if exact == 0:
            rest = (
                f", but {share_text(approx / scored)} approximately" if approx else ", not even approximately"
            )
            return (
                f"The server recovered none of the {scored} scored client samples exactly{rest}; {defense}."
            )
        when = _exact_rounds([item for item in summary["rounds"] if item["scored_samples"]])
        more = f" and {share_text(approx / scored)} at least approximately" if approx > exact else ""
        return (
            f"The server recovered {share_text(exact / scored)} of the {scored} scored client samples "
            f"exactly{when}{more}; {defense}."
        )
    counts = summary["verdict_counts"]
    confirmed, partial = counts[VERDICT_EXACT], counts[VERDICT_APPROXIMATE]
    if summary["verdicts_derived"] == attacks and partial:
        return (
            f"No ground truth scored this run and it records no verdicts: the attacker reported {partial} of "
            f"{attacks} reconstructions complete, which cannot be confirmed; {defense}."
        )
    others = ", ".join(f"{count} {verdict}" for verdict, count in counts.items() if count)
    if confirmed or partial:
        more = f", and {partial} more approximately (not confirmed)" if partial else ""
        return (
            "No ground truth was scored, so leakage is stated from the verdicts: "
            f"{confirmed} of {attacks} client updates ({share_text(confirmed / attacks)}) were reconstructed "
            f"exactly by the server's own check{more} ({others}); {defense}."
        )
    return (
        f"The server reconstructed none of the {attacks} attacked client updates ({others}); no ground truth "
        "was scored, so this shows what the attack could not do on these updates, not that they are safe; "
        f"{defense}."
    )


def _exact_rounds(rounds: Sequence[Mapping[str, Any]]) -> str:
    """When the exact recoveries happened, true of every round named (``rounds``: the scored ones)."""
    if len(rounds) == 1:
        return f" in round {rounds[0]['round']}"
    shares = [item["exact_samples"] / item["scored_samples"] for item in rounds]
    if all(share == shares[0] for share in shares):
        return " in every round"
    if len(rounds) <= MAX_ROUNDS_NAMED:
        return (
            " ("
            + ", ".join(
                f"round {item['round']}: {share_text(share)}"
                for item, share in zip(rounds, shares, strict=True)
            )
            + ")"
        )
    leaking = sum(1 for share in shares if share > 0)
    return (
        f" in {leaking} of {len(rounds)} rounds (from {share_text(min(shares))} to {share_text(max(shares))} "
        "per round)"
    )


def build_summary(data: RunData) -> dict[str, Any]:
    """Every figure of the report, JSON-ready (see the module docstring)."""
    entries = data.entries
    defenses = active_defenses(data.config, data.history)
    counts = _verdict_counts(entries)
    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "run_directory": str(data.directory),
        "thresholds": {
            "exact_psnr_db": EXACT_PSNR_DB,
            "approx_psnr_db": APPROX_PSNR_DB,
            "display_psnr_cap_db": DISPLAY_PSNR_CAP_DB,
        },
        "attacks": len(entries),
        "failed_attacks": sum(1 for entry in entries if _failed(entry)),
        "scored_attacks": sum(1 for entry in entries if entry.scored),
        **_samples(entries),
        **_criteria(entries),
        "exact_attack_share": _share(counts[VERDICT_EXACT], len(entries)),
        "approximate_attack_share": _share(counts[VERDICT_APPROXIMATE], len(entries)),
        "statuses": dict(sorted(Counter(entry.status for entry in entries).items())),
        "verdict_counts": counts,
        "verdicts_derived": sum(1 for entry in entries if entry.verdict_derived),
        "defenses": [{"name": defense.name, "text": defense.text} for defense in defenses],
        "rounds": _rounds(data),
        "clients": _clients(entries),
        "secagg_members": _secagg_members(entries),
        "verdict_disagreements": _disagreements(entries),
        "psnr_histogram": _histogram(entries),
        "final_test": _final_test(data.history),
        "unreadable_files": list(data.problems),
        "attack_details": [_attack(entry) for entry in entries],
        "fallback": _fallback(data.fallbacks),
    }
    summary["verdict_sentence"] = verdict_sentence(summary, defenses)
    summary["recommendations"] = recommendations(config=data.config, evidence=_evidence(summary, entries))
    summary["verdict_advice"] = verdict_advice(summary["attack_details"])
    summary["fallback_skipped"] = [
        {
            "round": entry.server_round,
            "client": entry.client,
            "reason": str(entry.details["fallback_skipped"]),
        }
        for entry in entries
        if entry.details.get("fallback_skipped")
    ]
    return summary


def _evidence(summary: Mapping[str, Any], entries: Sequence[AttackEntry]) -> Evidence | None:
    """What the run shows about leakage, for the recommendations (None: nothing was attacked)."""
    if not entries:
        return None
    counts = summary["verdict_counts"]
    # the attack could have recovered samples: it ran to the end on an update it applies to
    applied = sum(
        1 for entry in entries if entry.status == STATUS_OK and entry.verdict != VERDICT_NOT_APPLICABLE
    )
    if summary["scored_samples"]:
        return Evidence(
            leaked_share=float(summary["approximate_sample_share"]),
            basis="samples",
            applied=applied,
            attacks=len(entries),
            verdicts=dict(counts),
        )
    return Evidence(
        leaked_share=(counts[VERDICT_EXACT] + counts[VERDICT_APPROXIMATE]) / len(entries),
        basis="verdicts",
        applied=applied,
        attacks=len(entries),
        verdicts=dict(counts),
    )


def _fallback(fallbacks: Sequence[AttackEntry]) -> dict[str, Any] | None:
    """What the approximate fallback attack recovered where the exact attack did not (None: never run)."""
    if not fallbacks:
        return None
    psnr = [value for entry in fallbacks for value in (entry.psnr or []) if math.isfinite(value)]
    return {
        "attacks": len(fallbacks),
        "attack_names": sorted({entry.row.get("attack") or "" for entry in fallbacks} - {""}),
        "verdict_counts": _verdict_counts(fallbacks),
        **_samples(fallbacks),
        "mean_psnr": sum(psnr) / len(psnr) if psnr else None,
        "attack_details": [_attack(entry) for entry in fallbacks],
    }


def _final_test(history: Mapping[str, Any] | None) -> dict[str, float | None] | None:
    final = history.get("final_test") if isinstance(history, Mapping) else None
    if not isinstance(final, Mapping) or number(final.get("test-acc")) is None:
        return None
    return {
        "test_acc": number(final.get("test-acc")),
        "test_loss": number(final.get("test-loss")),
        "test_examples": number(final.get("test-examples")),
    }
