"""What the one-local-epoch machinery costs SPEAR++ on a plain FedSGD update.

Attacks the SPEAR++ Table 1 victim (FedSGD, one linear layer of width m on CIFAR-10) twice per
batch with the same seed: ``epoch`` is :class:`fl_attack.SpearPlusPlus` as shipped (every
noiseless update is judged by :class:`fl_attack.pipeline.local_training.epoch_scorer.LocalEpochScorer`),
``plain`` swaps that scorer for the plain
:class:`fl_attack.pipeline.selection.select.SparsityMatchingScorer` (what a FedSGD update
needs). Per run it reports the wall-clock seconds, the seconds and calls spent in one-epoch fits
(``LocalEpochScorer._fit``), and whether both modes gave the same reconstruction. The load average
is recorded before and after each run: on a shared machine the seconds are only comparable
within one run of this script.

    PYTHONPATH=. python experiments/fedsgd_epoch_cost.py --cells 100x1000 --trials 2
    PYTHONPATH=. python experiments/fedsgd_epoch_cost.py --cells 150x4000 --threads 16

Writes ``results.json`` and ``table.md`` under ``--out`` when it is given.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import fl_attack.attacks.spear as spear_module
from experiments.config import Setting, parse_cells
from experiments.observe import Observation, draw_trial, observe
from fl_attack import Reconstruction, SpearPlusPlus
from fl_attack.data.images import load_dataset
from fl_attack.pipeline.local_training.epoch_scorer import LocalEpochScorer
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ObservedUpdate

MODES = ("epoch", "plain")


@dataclass
class Run:
    """One attack of one batch in one mode."""

    cell: str
    trial: int
    mode: str
    seconds: float
    fit_seconds: float
    fit_calls: int
    complete: bool
    found: int
    same_as_epoch: bool | None
    same_rows_as_epoch: bool | None
    load_before: float
    load_after: float


@dataclass
class FitCounter:
    """Seconds and calls of ``LocalEpochScorer._fit`` while :func:`counting_fits` is active."""

    seconds: float = 0.0
    calls: int = 0


@contextmanager
def counting_fits() -> Iterator[FitCounter]:
    """Time every one-epoch fit (cache misses of ``LocalEpochScorer.fit``)."""
    counter = FitCounter()
    original = LocalEpochScorer._fit

    @functools.wraps(original)
    def timed(self: LocalEpochScorer, selection: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, selection)
        finally:
            counter.seconds += time.perf_counter() - start
            counter.calls += 1

    LocalEpochScorer._fit = timed  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        LocalEpochScorer._fit = original  # type: ignore[method-assign]


def _plain_scorer(
    update: ObservedUpdate, factors: LowRankFactors, tolerance: ZeroTolerance, *, decay_scale: float = 0.0
) -> SparsityMatchingScorer:
    del decay_scale
    return SparsityMatchingScorer(update, factors, tolerance)


@contextmanager
def scorer_mode(mode: str) -> Iterator[None]:
    """``epoch``: the attack as shipped; ``plain``: no one-local-epoch scorer."""
    if mode == "epoch":
        yield
        return
    original: Callable[..., SparsityMatchingScorer] = getattr(spear_module, "LocalEpochScorer")  # noqa: B009
    setattr(spear_module, "LocalEpochScorer", _plain_scorer)  # noqa: B010
    try:
        yield
    finally:
        setattr(spear_module, "LocalEpochScorer", original)  # noqa: B010


def attack(observation: Observation, *, seed: int, budget: float) -> tuple[Reconstruction, float]:
    """One SPEAR++ attack of ``observation`` and its wall-clock seconds."""
    update = observation.update
    spear = SpearPlusPlus(seed=seed, time_budget=budget, progress=False)
    start = time.perf_counter()
    rec = spear.invert(update.weight_update, update.bias_update, weight=update.weight, bias=update.bias)
    return rec, time.perf_counter() - start


def same_rows_up_to_order(inputs: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``inputs`` holds the rows of ``reference`` (bit for bit) in some order."""
    if inputs.shape != reference.shape:
        return False
    remaining = [row for row in reference]
    for row in inputs:
        match = next((i for i, other in enumerate(remaining) if torch.equal(row, other)), None)
        if match is None:
            return False
        remaining.pop(match)
    return True


def run_cell(
    label: str, observation: Observation, *, trial: int, seed: int, budget: float, out: Path | None
) -> list[Run]:
    """Both modes on one observed update, ``epoch`` first; each reconstruction is saved under ``out``
    (``inputs_<cell>_<trial>_<mode>.pt``) to compare runs of two versions of the attack."""
    runs: list[Run] = []
    reference: torch.Tensor | None = None
    for mode in MODES:
        load_before = os.getloadavg()[0]
        with scorer_mode(mode), counting_fits() as fits:
            rec, seconds = attack(observation, seed=seed, budget=budget)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            torch.save(rec.inputs, out / f"inputs_{label}_{trial}_{mode}.pt")
        same = None if reference is None else bool(torch.equal(rec.inputs, reference))
        same_rows = None if reference is None else same_rows_up_to_order(rec.inputs, reference)
        reference = rec.inputs if reference is None else reference
        runs.append(
            Run(
                label,
                trial,
                mode,
                seconds,
                fits.seconds,
                fits.calls,
                bool(rec.complete),
                int(rec.found),
                same,
                same_rows,
                load_before,
                os.getloadavg()[0],
            )
        )
    return runs


def markdown(runs: Sequence[Run], config: dict[str, Any]) -> str:
    """The runs as one table."""
    lines = [
        "# SPEAR++ on FedSGD: cost of the one-local-epoch scorer",
        "",
        f"Config: `{json.dumps(config)}`",
        "",
        "| cell | trial | mode | s | epoch-fit s | fits | complete | found | same as epoch (rows) | load 1 min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        same = "-"
        if run.same_as_epoch is not None:
            same = "yes" if run.same_as_epoch else ("reordered" if run.same_rows_as_epoch else "NO")
        lines.append(
            f"| {run.cell} | {run.trial} | {run.mode} | {run.seconds:.2f} | {run.fit_seconds:.2f} | "
            f"{run.fit_calls} | {run.complete} | {run.found} | {same} | "
            f"{run.load_before:.1f}-{run.load_after:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", default="100x1000", help="comma-separated BxM cells")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--time-budget", type=float, default=300.0)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset("cifar10", root=args.data_root)
    config = {"cells": args.cells, "trials": args.trials, "seed": args.seed, "threads": args.threads}
    config.update(cpu_count=os.cpu_count(), torch=torch.__version__, time_budget=args.time_budget)
    runs: list[Run] = []
    for cell in parse_cells(args.cells):
        setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1)
        for index in range(args.trials):
            trial = draw_trial(data, setting, index=index, seed=args.seed + index)
            observation = observe(setting, trial, data)
            for run in run_cell(
                cell.label, observation, trial=index, seed=trial.seed, budget=args.time_budget, out=args.out
            ):
                runs.append(run)
                print(json.dumps(asdict(run)), flush=True)
    table = markdown(runs, config)
    print(table, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps({"config": config, "runs": [asdict(r) for r in runs]}, indent=2) + "\n"
        )
        (args.out / "table.md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
