"""Benchmark: SPEAR++ on the one-hidden-layer tutorial MLP against its default victim (issue #35 item 2).

The same CIFAR-10 batches (normalised, b = 20) are attacked through two freshly initialised
victims of width 200: one hidden layer (``Linear(3072, 200), ReLU, Linear(200, 10)``: the attacked
layer feeds the output layer) and SPEAR++'s default three hidden layers. The attack is called as
a user calls it, ``SpearPlusPlus(time_budget=..., seed=...).invert(...)``, without ``head_weight``
unless ``--head auto``. Batch and victim of trial ``t`` use seed ``seed + t``.

Prints, per victim, the exact count, the median and the per-batch seconds (wall clock, as the
attack's budget counts them, and the process's CPU seconds, which the load of other jobs on a
shared machine does not inflate), and appends a markdown table to ``--out``::

    python -m experiments.shallow_victim --trials 10 --time-budget 30 --out experiments/results/shallow_victim.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from experiments.input_distributions import attack_batch, load_source, warm_up

#: (label, hidden layers) of the two victims.
VICTIMS = (("one hidden layer", 1), ("three hidden layers", 3))


def load_average() -> str:
    """The 1-minute load average, as ``uptime`` shows it."""
    return f"{os.getloadavg()[0]:.2f}"


def run(args: argparse.Namespace) -> str:
    """Attack every (victim, trial); the markdown report."""
    torch.set_num_threads(1)
    source = load_source("cifar10", root=args.data_root)
    warm_up()
    loads = [load_average()]
    lines = [
        f"CIFAR-10, b = {args.batch_size}, m = {args.width}, budget {args.time_budget:g} s, head "
        f"{args.head}, seeds {args.seed}-{args.seed + args.trials - 1}, torch 1 thread, "
        f"started {time.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        "",
        "| victim | exact | claimed complete | median s | max s | x three-hidden median | median CPU s |"
        " x three-hidden CPU | seconds per batch | CPU seconds per batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[int, float] = {}
    cpu_medians: dict[int, float] = {}
    rows: list[tuple[str, int, int, float, float, list[float], list[float]]] = []
    for label, hidden in VICTIMS:
        seconds, cpu, exact, complete = [], [], 0, 0
        for trial in range(args.trials):
            started = time.process_time()
            outcome, _ = attack_batch(
                source,
                hidden_layers=hidden,
                batch_size=args.batch_size,
                width=args.width,
                seed=args.seed + trial,
                time_budget=args.time_budget,
                use_head=args.head == "auto",
            )
            cpu.append(time.process_time() - started)
            seconds.append(float(outcome["seconds"]))
            exact += bool(outcome["exact"])
            complete += bool(outcome["complete"])
            print(
                f"{label} seed {args.seed + trial}: exact={outcome['exact']} complete={outcome['complete']} "
                f"{outcome['seconds']:.2f}s (cpu {cpu[-1]:.2f}s) {outcome['error']}",
                file=sys.stderr,
                flush=True,
            )
            loads.append(load_average())
        medians[hidden] = statistics.median(seconds)
        cpu_medians[hidden] = statistics.median(cpu)
        rows.append((label, exact, complete, medians[hidden], max(seconds), seconds, cpu))
    for label, exact, complete, median, largest, seconds, used in rows:
        ratio = median / medians[3] if medians.get(3) else float("nan")
        cpu_ratio = statistics.median(used) / cpu_medians[3] if cpu_medians.get(3) else float("nan")
        per_batch = " ".join(f"{value:.2f}" for value in seconds)
        per_batch_cpu = " ".join(f"{value:.2f}" for value in used)
        lines.append(
            f"| {label} | {exact}/{args.trials} | {complete}/{args.trials} | {median:.2f} | {largest:.2f} | "
            f"{ratio:.1f} | {statistics.median(used):.2f} | {cpu_ratio:.1f} | {per_batch} | {per_batch_cpu} |"
        )
    lines += ["", f"Load average (1 min) before the run and after each batch: {', '.join(loads)}", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.shallow_victim", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--trials", type=int, default=10, help="batches per victim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--width", type=int, default=200)
    parser.add_argument("--time-budget", type=float, default=30.0, help="seconds per batch")
    parser.add_argument(
        "--head", choices=("off", "auto"), default="off", help="auto: pass head_weight= where it applies"
    )
    parser.add_argument("--data-root", default=None, help="root of the datasets (default: searched)")
    parser.add_argument("--out", default=None, help="append the markdown report to this file")
    parser.add_argument("--title", default=None, help="a heading written above the report")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.trials < 1 or not args.time_budget > 0:
        print("--trials must be >= 1 and --time-budget > 0", file=sys.stderr)
        return 2
    report = run(args)
    if args.title:
        report = f"## {args.title}\n\n{report}"
    print(report)
    if args.out:
        with Path(args.out).open("a") as handle:
            handle.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
