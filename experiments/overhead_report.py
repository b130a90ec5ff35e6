"""Summaries and the markdown table of :mod:`experiments.audit_overhead`.

Each summary reduces the raw results of one part to the numbers its target is judged on; a part
whose runs failed gives None for what it could not measure, and the table says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: Audited over not-audited median round time must stay at or below this.
ROUND_RATIO_TARGET = 1.2
#: Attacks per second with 2 local workers over 1 worker must reach this.
THROUGHPUT_RATIO_TARGET = 1.7
#: The audit's own share of the 100-client run's memory (peak PSS of the process tree audited
#: minus not audited, overall and in every round) must stay at or below this many MiB. Flower and
#: Ray alone take ~2.9 GB there, so a bound on the whole tree would judge them, not the audit.
SCALE_AUDIT_SHARE_TARGET_MIB = 300.0

MIB = 1024 * 1024


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ok(run: Mapping[str, Any]) -> bool:
    return run.get("exit_code") == 0 and "error" not in run


def warm_rounds(runs: Sequence[Mapping[str, Any]], *, audited: bool) -> list[float]:
    """Round seconds of the successful runs of one arm, without each run's first round.

    The first round of a simulation also starts Ray's actors (imports torch and the client
    app), in both arms alike; it would dominate a median of a few rounds.
    """
    return [
        seconds
        for run in runs
        if _ok(run) and bool(run.get("audited")) == audited
        for seconds in run.get("round_seconds", [])[1:]
    ]


def rounds_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median warm round of the audited and the not-audited arm, and their ratio."""
    audited, plain = warm_rounds(runs, audited=True), warm_rounds(runs, audited=False)
    ratio = _ratio(_median(audited), _median(plain))
    return {
        "audited_median_seconds": _median(audited),
        "not_audited_median_seconds": _median(plain),
        "audited_rounds": len(audited),
        "not_audited_rounds": len(plain),
        "ratio": ratio,
        "target": ROUND_RATIO_TARGET,
        "met": None if ratio is None else ratio <= ROUND_RATIO_TARGET,
    }


def throughput_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """Median attacks per second and CPU seconds per attack of each worker count, and the ratio 2 : 1."""
    measured = [m for m in result.get("measurements", []) if m.get("statuses", {}).keys() <= {"ok"}]
    arms: dict[str, dict[str, Any]] = {}
    for workers in (1, 2):
        mine = [m for m in measured if m["workers"] == workers]
        arms[str(workers)] = {
            "runs": len(mine),
            "attacks_per_second": _median([m["attacks_per_second"] for m in mine]),
            "cpu_seconds_per_attack": _median([m["cpu_seconds_per_attack"] for m in mine]),
        }
    ratio = _ratio(arms["2"]["attacks_per_second"], arms["1"]["attacks_per_second"])
    return {
        "workers": arms,
        "ratio": ratio,
        "target": THROUGHPUT_RATIO_TARGET,
        "met": None if ratio is None else ratio >= THROUGHPUT_RATIO_TARGET,
        "excluded_runs": len(result.get("measurements", [])) - len(measured),
    }


def scale_summary(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Wall time and peak memory of the audited scale run (and of its not-audited twin, if run)."""
    summary: dict[str, Any] = {"target_audit_share_mib": SCALE_AUDIT_SHARE_TARGET_MIB}
    for arm, run in runs.items():
        summary[arm] = {
            "wall_seconds": run.get("wall_seconds") if _ok(run) else None,
            "peak_pss_mib": run.get("peak_pss_mib") if _ok(run) else None,
            "peak_rss_mib": run.get("peak_rss_mib") if _ok(run) else None,
        }
    peak = summary.get("audited", {}).get("peak_pss_mib")
    baseline = summary.get("not_audited", {}).get("peak_pss_mib")
    summary["audit_adds_pss_mib"] = None if peak is None or baseline is None else peak - baseline
    audited_rounds = runs.get("audited", {}).get("round_peak_pss_mib") or []
    plain_rounds = runs.get("not_audited", {}).get("round_peak_pss_mib") or []
    per_round = [a - b for a, b in zip(audited_rounds, plain_rounds, strict=False)]
    summary["audit_adds_per_round_mib"] = per_round
    added = summary["audit_adds_pss_mib"]
    summary["met"] = None if added is None else max([added, *per_round]) <= SCALE_AUDIT_SHARE_TARGET_MIB
    return summary


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[met]


def _failures(runs: Sequence[Mapping[str, Any]]) -> str:
    failed = [f"{run['name']}: {run.get('error', 'failed')}" for run in runs if not _ok(run)]
    return f" Failed: {'; '.join(failed)}." if failed else ""


def _loads(runs: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{run['load_before']:.1f}" for run in runs)


def _rounds_rows(runs: Sequence[Mapping[str, Any]], plan: Mapping[str, Any]) -> list[str]:
    summary = rounds_summary(runs)
    waits = ", ".join(
        _fmt(run.get("after_rounds_seconds")) for run in runs if run.get("audited") and _ok(run)
    )
    last = plan["rounds_rounds"]
    what = (
        f"round time, default app, {plan['rounds_clients']} clients (median of round"
        f"{' 2' if last == 2 else f's 2-{last}'} over {plan['rounds_repeats']} interleaved run(s) per arm)"
    )
    details = (
        f"{summary['not_audited_rounds']} + {summary['audited_rounds']} rounds; after the last round the "
        f"audited runs waited {waits or '-'} s for their attack queue; load before each run {_loads(runs)}."
        + _failures(runs)
    )
    return [
        f"| {what} | not audited | {_fmt(summary['not_audited_median_seconds'], 2)} s | | {details} |",
        f"| | audited | {_fmt(summary['audited_median_seconds'], 2)} s (**{_fmt(summary['ratio'], 2)}x**) | "
        f"<= {ROUND_RATIO_TARGET}x: {_verdict(summary['met'])} | |",
    ]


def _throughput_rows(result: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    summary = throughput_summary(result)
    measured = result.get("measurements", [])
    what = (
        f"attack throughput, {plan['throughput_jobs']} SPEAR++ attacks on default-app updates "
        f"({plan['throughput_repeats']} interleaved run(s) per arm)"
    )
    loads = ", ".join(f"{m['load']:.1f}" for m in measured)
    details = f"load after each run {loads or '-'}." + (
        f" {summary['excluded_runs']} runs with failed attacks left out." if summary["excluded_runs"] else ""
    )
    details += _failures([result]) if result else " Not run."
    one, two = summary["workers"]["1"], summary["workers"]["2"]
    return [
        f"| {what} | 1 worker | {_fmt(one['attacks_per_second'], 2)} attacks/s "
        f"({_fmt(one['cpu_seconds_per_attack'], 2)} CPU s per attack) | | {details} |",
        f"| | 2 workers | {_fmt(two['attacks_per_second'], 2)} attacks/s "
        f"({_fmt(two['cpu_seconds_per_attack'], 2)} CPU s per attack) (**{_fmt(summary['ratio'], 2)}x**) | "
        f">= {THROUGHPUT_RATIO_TARGET}x: {_verdict(summary['met'])} | |",
    ]


def _scale_cell(run: Mapping[str, Any]) -> str:
    if not _ok(run):
        return f"failed: {run.get('error', '?')}"
    rounds = ", ".join(_fmt(seconds) for seconds in run.get("round_seconds", []))
    return (
        f"wall {_fmt(run['wall_seconds'], 0)} s (rounds {rounds} s, then {_fmt(run.get('after_rounds_seconds'))} s "
        f"draining), peak PSS **{run['peak_pss_mib']:.0f} MiB** (RSS sum {run['peak_rss_mib']:.0f} MiB, "
        f"{run['peak_processes']} processes)"
    )


def _scale_rows(runs: Mapping[str, Mapping[str, Any]], plan: Mapping[str, Any]) -> list[str]:
    summary = scale_summary(runs)
    what = (
        f"{plan['scale_clients']} clients x {plan['scale_rounds']} rounds, m = "
        f"{plan['scale_overrides'].get('width', 200)}, {plan['scale_overrides'].get('dataset', 'photo-patches')}"
    )
    queue = {key: value for key, value in plan["scale_overrides"].items() if key.startswith("attack-")}
    if queue:
        what += ", " + ", ".join(f"{key}={value}" for key, value in sorted(queue.items()))
    audited = runs["audited"]
    per_round = ", ".join(_fmt(value, 0) for value in audited.get("round_peak_pss_mib", []))
    largest = ", ".join(f"{name} {size:.0f}" for size, name in audited.get("processes_at_peak", [])[:4])
    details = (
        f"{audited.get('attacked_updates', 0)} updates attacked ({audited.get('attacks', {})}), stored as they "
        f"finish; peak PSS per round {per_round or '-'} MiB, while draining "
        f"{_fmt(audited.get('after_rounds_peak_pss_mib'), 0)} MiB; largest at the peak (MiB): {largest or '-'}; "
        f"load before {_loads(list(runs.values()))}."
    )
    rows = [
        f"| {what} | audited | {_scale_cell(audited)} | audit's share <= "
        f"{SCALE_AUDIT_SHARE_TARGET_MIB:.0f} MiB: {_verdict(summary['met'])} | {details} |"
    ]
    if "not_audited" in runs:
        added = summary["audit_adds_pss_mib"]
        rows.append(
            f"| | not audited | {_scale_cell(runs['not_audited'])} | | the audit adds "
            f"{_fmt(added, 0)} MiB of peak PSS (per round: "
            f"{', '.join(_fmt(value, 0) for value in summary['audit_adds_per_round_mib']) or '-'} MiB) |"
        )
    return rows


def markdown(results: Mapping[str, Any]) -> str:
    """The results as one markdown table, headed by the machine and its load."""
    plan, machine = results["plan"], results["machine"]
    start, end = machine["load_start"], machine["load_end"]
    lines = []
    if results["quick"]:
        lines += ["**Quick run (--quick): a smoke test of the benchmark, not its measurement.**", ""]
    lines += [
        f"Audit overhead on {machine['cpus']} CPU cores, shared with other jobs: load average (1, 5, 15 min) "
        f"{start[0]:.2f} {start[1]:.2f} {start[2]:.2f} at the start, {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at the "
        f"end; {results['seconds']:.0f} s in all.",
        "",
        "| measurement | arm | result | target | details |",
        "|---|---|---|---|---|",
    ]
    runs = results["runs"]
    if "rounds" in runs:
        lines += _rounds_rows(runs["rounds"], plan)
    if "throughput" in runs:
        lines += _throughput_rows(runs["throughput"], plan)
    if "scale" in runs:
        lines += _scale_rows(runs["scale"], plan)
    lines += [
        "",
        "Round time: from Flower's `[ROUND r/n]` log line to the next (training, aggregation, federated and "
        "server evaluation), the first round of each run left out (it starts Ray's actors). Throughput: "
        "attacks from queueing to the last result, after warm-up attacks that started every worker process; "
        "CPU seconds of the whole process tree. Memory: the sum over the process tree (driver, Ray services "
        "and actors, attack workers), sampled from /proc; PSS counts shared pages once.",
    ]
    if machine.get("autogroup_scheduling"):
        lines[-1] += (
            " This kernel schedules by autogroup: with other sessions busy, each run gets a fair share of the "
            "cores however many processes it starts, which caps what a second worker can add."
        )
    return "\n".join(lines)
