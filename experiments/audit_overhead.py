"""What the audit costs a federation: round time, attack throughput, and a 100-client run.

::

    python -m experiments.audit_overhead                 # the full benchmark (about 10 min on 2 CPUs)
    python -m experiments.audit_overhead --quick         # a smoke test of every part
    python -m experiments.audit_overhead --parts rounds,throughput --out /tmp/overhead

Three parts, each measurement in a fresh child process (:mod:`experiments.overhead_children`)
whose whole process tree is sampled from /proc (:mod:`experiments.process_tree`):

``rounds``
    The default app (``fl-attack-audit``: the project's ServerApp and ClientApp in
    ``flwr.simulation.run_simulation``, one CPU per client) with 10 clients, audited against
    ``attack-enabled=false``, runs interleaved; the median round time of each arm (target:
    audited <= 1.2x).
``throughput``
    Attacks per second of 1 and 2 local attack workers on the same queue of default-app
    updates (target: >= 1.7x).
``scale``
    100 clients x 3 rounds at m = 200 on CIFAR-10 (50 samples per client), audited with the
    store streaming every record to disk, then the same federation not audited: wall time and
    the peak memory of the process tree (target: the audit's own share, audited minus not
    audited, <= 300 MiB of peak PSS overall and in every round).

Writes ``audit_overhead.json`` (the plan, the load averages at start and end, every run's raw
numbers, the summaries) and ``audit_overhead.md`` (the table) to
``outputs/experiments/audit_overhead/`` (``audit_overhead_quick`` under ``--quick``; ``--out``
elsewhere), child logs under ``logs/`` and the audited runs' directories under ``runs/<timestamp>/`` there.
The machine may be shared: the table reports the load average around every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from experiments.output import OUTPUTS_DIR, environment, json_safe
from experiments.overhead_report import markdown, rounds_summary, scale_summary, throughput_summary
from experiments.process_tree import TreeMemory, autogroup_scheduling, load_average

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("rounds", "throughput", "scale")
NAME = "audit_overhead"


@dataclass(frozen=True)
class Plan:
    """Sizes of the three parts.

    Attributes
    ----------
    rounds_clients, rounds_rounds, rounds_repeats : int
        Clients and rounds of each ``rounds`` run; runs per arm.
    throughput_jobs, throughput_repeats, warmup_per_worker : int
        Timed attacks per measurement; measurements per worker count; warm-up attacks per worker.
    scale_clients, scale_rounds : int
        The ``scale`` federation.
    scale_overrides : Mapping[str, Any]
        Run-config overrides of the ``scale`` runs (beyond rounds and output directory).
    common_overrides : Mapping[str, Any]
        Run-config overrides of every simulation (none: the default app).
    scale_baseline : bool
        Also run the ``scale`` federation without the audit.
    cpus : int
        CPUs Ray may use in a simulation (one per client).
    simulation_timeout, throughput_timeout : float
        Seconds a child may run before its process group is killed.
    memory_interval : float
        Seconds between memory samples.
    """

    rounds_clients: int
    rounds_rounds: int
    rounds_repeats: int
    throughput_jobs: int
    throughput_repeats: int
    warmup_per_worker: int
    scale_clients: int
    scale_rounds: int
    scale_overrides: Mapping[str, Any] = field(default_factory=dict)
    common_overrides: Mapping[str, Any] = field(default_factory=dict)
    scale_baseline: bool = True
    cpus: int = 2
    simulation_timeout: float = 600.0
    throughput_timeout: float = 300.0
    memory_interval: float = 0.5


FULL = Plan(
    rounds_clients=10,
    rounds_rounds=5,
    rounds_repeats=2,
    throughput_jobs=12,
    throughput_repeats=2,
    warmup_per_worker=2,
    scale_clients=100,
    scale_rounds=3,
    scale_overrides={"dataset": "cifar10", "samples-per-client": 50, "width": 200},
)
QUICK = Plan(
    rounds_clients=2,
    rounds_rounds=2,
    rounds_repeats=1,
    throughput_jobs=2,
    throughput_repeats=1,
    warmup_per_worker=1,
    scale_clients=2,
    scale_rounds=1,
    scale_overrides={"width": 200},
    # an attack that fails would spend the default 30 s budget: the smoke test caps it
    common_overrides={"attack-time-budget": 5.0},
    scale_baseline=False,
    cpus=1,
    simulation_timeout=240.0,
    throughput_timeout=180.0,
    memory_interval=0.25,
)


def child_environment() -> dict[str, str]:
    """The environment of a child: this checkout first on the path, one thread per torch process.

    ``OMP_NUM_THREADS=1`` reaches every process the child starts (Ray's actors, the spawned
    attack workers), so that none of them runs more threads than its one CPU.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(part for part in (str(ROOT), env.get("PYTHONPATH", "")) if part)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    return env


def _log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:])


def run_child(
    mode: str, spec: Mapping[str, Any], *, out: Path, timeout: float, interval: float
) -> dict[str, Any]:
    """Run one measurement in a child process; return its result with the tree's memory and the load.

    A child that fails or overruns ``timeout`` (its process group is then killed) gives a result
    with ``error`` and the end of its log.
    """
    name = str(spec["name"])
    for folder in ("children", "logs"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    spec_path, result_path = out / "children" / f"{name}.spec.json", out / "children" / f"{name}.json"
    log_path = out / "logs" / f"{name}.log"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(dict(spec), indent=2) + "\n", encoding="utf-8")
    command = [sys.executable, "-m", "experiments.overhead_children", mode, str(spec_path), str(result_path)]
    print(f"[{NAME}] {name} ...", file=sys.stderr, flush=True)
    load_before, started = load_average(), time.time()
    with (
        log_path.open("w", encoding="utf-8") as log,
        subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=child_environment(), start_new_session=True
        ) as child,
        TreeMemory(child.pid, interval=interval) as memory,
    ):
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    result: dict[str, Any] = {}
    if result_path.exists():
        result = json.loads(result_path.read_text(encoding="utf-8"))
    result |= {
        "name": name,
        "exit_code": child.returncode,
        "wall_seconds": time.time() - started,
        "peak_pss_mib": memory.peak_pss_kib / 1024,
        "peak_rss_mib": memory.peak_rss_kib / 1024,
        "peak_processes": memory.peak_processes,
        "processes_at_peak": memory.at_peak[:8],
        "pss_timeline_mib": memory.pss_timeline_mib(since=started, spacing=2.0),
        "load_before": load_before[0],
        "load_after": load_average()[0],
        "log": str(log_path),
    }
    if child.returncode != 0 or not result_path.exists():
        why = "timed out" if child.returncode == -signal.SIGKILL else f"exit code {child.returncode}"
        result["error"] = f"{why}: {_log_tail(log_path)}"
    if "round_starts" in result and result.get("finished"):
        bounds = [*result["round_starts"], result["finished"], time.time()]
        peaks = [memory.peak_pss_between(start, end) for start, end in zip(bounds, bounds[1:], strict=False)]
        mib = [None if peak is None else peak / 1024 for peak in peaks]
        result["round_peak_pss_mib"], result["after_rounds_peak_pss_mib"] = mib[:-1], mib[-1]
    print(f"[{NAME}] {name}: {result.get('error', 'done')} ({result['wall_seconds']:.0f} s)", file=sys.stderr)
    return result


def _simulation_spec(plan: Plan, name: str, *, clients: int, overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "clients": clients,
        "cpus": plan.cpus,
        "overrides": {**plan.common_overrides, **overrides},
    }


def rounds_part(plan: Plan, out: Path, *, runs_dir: Path) -> list[dict[str, Any]]:
    """The default app audited and not, interleaved (audited first in every pair)."""
    runs = []
    for repeat in range(plan.rounds_repeats):
        for audited in (True, False):
            name = f"rounds-{'audited' if audited else 'not-audited'}-{repeat + 1}"
            overrides = {
                "num-server-rounds": plan.rounds_rounds,
                "attack-enabled": audited,
                "output-dir": str(runs_dir / name),
            }
            spec = _simulation_spec(plan, name, clients=plan.rounds_clients, overrides=overrides)
            result = run_child("simulate", spec, out=out, timeout=plan.simulation_timeout, interval=1.0)
            runs.append({"audited": audited, **result})
    return runs


def throughput_part(plan: Plan, out: Path) -> dict[str, Any]:
    """1 against 2 local attack workers on the same queue, interleaved."""
    spec = {
        "name": "throughput",
        "jobs": plan.throughput_jobs,
        "repeats": plan.throughput_repeats,
        "warmup_per_worker": plan.warmup_per_worker,
        "workers": [1, 2],
    }
    return run_child("throughput", spec, out=out, timeout=plan.throughput_timeout, interval=1.0)


def scale_overrides(plan: Plan, *, data_root: str | None) -> dict[str, Any]:
    """Run-config overrides of the ``scale`` runs (the output directory and the audit switch aside)."""
    overrides = {**plan.scale_overrides, "num-server-rounds": plan.scale_rounds}
    if data_root:
        overrides["data-root"] = data_root
    return overrides


def scale_part(plan: Plan, out: Path, *, runs_dir: Path, data_root: str | None) -> dict[str, dict[str, Any]]:
    """The large federation audited, then (``scale_baseline``) not audited."""
    runs = {}
    for arm in ("audited", "not_audited") if plan.scale_baseline else ("audited",):
        name = f"scale-{arm.replace('_', '-')}"
        overrides = scale_overrides(plan, data_root=data_root) | {
            "attack-enabled": arm == "audited",
            "output-dir": str(runs_dir / name),
        }
        spec = _simulation_spec(plan, name, clients=plan.scale_clients, overrides=overrides)
        runs[arm] = run_child(
            "simulate",
            spec,
            out=out,
            timeout=plan.simulation_timeout * max(1.0, plan.scale_rounds / FULL.scale_rounds),
            interval=plan.memory_interval,
        )
    return runs


def check_scale_data(plan: Plan, *, data_root: str | None) -> None:
    """Raise ``ValueError`` (one line, how to get it) when the ``scale`` dataset is not on this machine."""
    from strategies.cli import check_data
    from strategies.run_config import resolve_run_config

    check_data(resolve_run_config({}, scale_overrides(plan, data_root=data_root)))


def run_benchmark(
    plan: Plan, *, parts: Sequence[str], out: Path, quick: bool, data_root: str | None
) -> dict[str, Any]:
    """Run ``parts`` of ``plan``; write ``<name>.json`` and ``<name>.md`` to ``out``; return the results."""
    out.mkdir(parents=True, exist_ok=True)
    load_start, started = load_average(), time.time()
    # every invocation gets its own run directories: a run directory is never reused
    runs_dir = out / "runs" / time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    runs: dict[str, Any] = {}
    if "rounds" in parts:
        runs["rounds"] = rounds_part(plan, out, runs_dir=runs_dir)
    if "throughput" in parts:
        runs["throughput"] = throughput_part(plan, out)
    if "scale" in parts:
        runs["scale"] = scale_part(plan, out, runs_dir=runs_dir, data_root=data_root)
    summary: dict[str, Any] = {}
    if "rounds" in runs:
        summary["rounds"] = rounds_summary(runs["rounds"])
    if "throughput" in runs:
        summary["throughput"] = throughput_summary(runs["throughput"])
    if "scale" in runs:
        summary["scale"] = scale_summary(runs["scale"])
    results = {
        "quick": quick,
        "parts": list(parts),
        "plan": dataclasses.asdict(plan),
        "machine": {
            "cpus": os.cpu_count(),
            "load_start": load_start,
            "load_end": load_average(),
            "autogroup_scheduling": autogroup_scheduling(),
        },
        "environment": environment(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "summary": summary,
        "runs": runs,
    }
    name = f"{NAME}_quick" if quick else NAME
    table = markdown(results)
    (out / f"{name}.json").write_text(json.dumps(json_safe(results), indent=2) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(table + "\n", encoding="utf-8")
    return results


def parse_parts(text: str) -> list[str]:
    """``--parts`` (``"rounds,scale"``) in the order of :data:`PARTS`; ``ValueError`` for an unknown or empty one."""
    given = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(given) - set(PARTS))
    if unknown or not given:
        raise ValueError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}; got {text!r}")
    return [part for part in PARTS if part in given]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.audit_overhead", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smoke test of every part (a few clients)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}"
    )
    parser.add_argument("--out", type=Path, help=f"output folder (default {OUTPUTS_DIR}/{NAME}[_quick])")
    parser.add_argument("--data-root", help="root of CIFAR-10 for the scale part (default: searched)")
    parser.add_argument(
        "--scale-rounds",
        type=int,
        help="rounds of the scale runs (default 3; more shows whether memory stays flat)",
    )
    parser.add_argument(
        "--scale-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run-config setting of the scale runs, e.g. attack-queue-size=16 (repeatable)",
    )
    return parser


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as run-config overrides (values parsed as TOML: 16, 'block', true)."""
    settings: dict[str, Any] = {}
    for item in items:
        key, separator, value = item.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"--scale-set takes KEY=VALUE, got {item!r}")
        try:
            settings[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            settings[key.strip()] = value
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table; 2 on bad arguments or a missing dataset, 1 if a run failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parts = parse_parts(args.parts)
    except ValueError as error:
        parser.error(str(error))
    plan = QUICK if args.quick else FULL
    try:
        settings = parse_settings(args.scale_set)
    except ValueError as error:
        parser.error(str(error))
    if settings:
        plan = dataclasses.replace(plan, scale_overrides={**plan.scale_overrides, **settings})
    if args.scale_rounds is not None:
        if args.scale_rounds < 1:
            parser.error(f"--scale-rounds must be at least 1, got {args.scale_rounds}")
        plan = dataclasses.replace(plan, scale_rounds=args.scale_rounds)
    data_root = str(Path(args.data_root).resolve()) if args.data_root else None
    if "scale" in parts:
        try:
            check_scale_data(plan, data_root=data_root)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    out = (args.out or OUTPUTS_DIR / (f"{NAME}_quick" if args.quick else NAME)).resolve()
    results = run_benchmark(plan, parts=parts, out=out, quick=args.quick, data_root=data_root)
    print(markdown(results))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0 if all(_succeeded(results["runs"][part]) for part in parts) else 1


def _succeeded(runs: Any) -> bool:
    if isinstance(runs, Mapping) and "name" not in runs:
        return all(_succeeded(run) for run in runs.values())
    if isinstance(runs, list):
        return all(_succeeded(run) for run in runs)
    return bool(runs.get("exit_code") == 0 and "error" not in runs)


if __name__ == "__main__":
    raise SystemExit(main())
