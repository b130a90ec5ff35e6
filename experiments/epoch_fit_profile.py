"""Where the one-local-epoch fit spends its time, on the selections real attacks hand it.

Attacks FedSGD batches (the SPEAR++ Table 1 victim, as :mod:`experiments.fedsgd_epoch_cost`) and
FedAvg clients (one epoch of mini-batches, as :mod:`experiments.fedavg_training`) and records the
patterns of every selection :class:`fl_attack.pipeline.local_training.epoch_scorer.LocalEpochScorer`
is asked to fit. Each is then fitted again on its own: the search
(:func:`fl_attack.pipeline.local_training.local_epochs.fit_one_epoch`, best of 3), whether the
reach bound (:func:`fl_attack.pipeline.local_training.epoch_reach.unreachable`) refuses it before
the search, the torch operator calls and host syncs of one search, and with ``--cprofile`` its
top functions.

    PYTHONPATH=. python experiments/epoch_fit_profile.py --fedsgd 20x200:1 --fedavg 20:5:1:0.1:0.9:0:200:3
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.config import Setting, parse_cells
from experiments.fedavg_training import TrainingCell, client_update
from experiments.host_sync_census import Census
from experiments.observe import draw_trial, observe
from fl_attack import SpearPlusPlus
from fl_attack.data.images import ImageData, load_dataset
from fl_attack.pipeline.local_training.epoch_reach import unreachable
from fl_attack.pipeline.local_training.epoch_scorer import LocalEpochScorer
from fl_attack.pipeline.local_training.local_epochs import MOMENTA, EpochPatterns, fit_one_epoch


@dataclass(frozen=True)
class Request:
    """One selection the scorer was asked to fit."""

    source: str
    patterns: EpochPatterns
    decay_scale: float


@contextmanager
def recording(source: list[str], requests: list[Request]) -> Iterator[None]:
    """Record the patterns of every one-epoch fit (cache misses of ``LocalEpochScorer.fit``)."""
    original = LocalEpochScorer._fit

    @functools.wraps(original)
    def recorded(self: LocalEpochScorer, selection: Any) -> Any:
        requests.append(Request(source[0], self.patterns(selection), self.decay_scale))
        return original(self, selection)

    LocalEpochScorer._fit = recorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalEpochScorer._fit = original  # type: ignore[method-assign]


def attack_fedsgd(text: str, *, budget: float, source: list[str]) -> None:
    """``BxM:trials``: FedSGD batches of ``experiments.fedsgd_epoch_cost`` (seeds 0, 1, ...)."""
    cells, trials = text.split(":")
    data = load_dataset("cifar10")
    for cell in parse_cells(cells):
        setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1)
        for index in range(int(trials)):
            source[0] = f"FedSGD {cell.label} trial {index}"
            trial = draw_trial(data, setting, index=index, seed=index)
            update = observe(setting, trial, data).update
            SpearPlusPlus(seed=trial.seed, time_budget=budget, progress=False).invert(
                update.weight_update, update.bias_update, weight=update.weight, bias=update.bias
            )


def attack_fedavg(text: str, *, data: ImageData, budget: float, source: list[str]) -> None:
    """``N:B:E:lr:momentum:weight_decay:m:clients``: clients of ``experiments.fedavg_training``."""
    *fields, clients = text.split(":")
    cell = TrainingCell.parse(":".join(fields))
    for seed in range(int(clients)):
        source[0] = f"FedAvg N {cell.samples} B {cell.batch} momentum {cell.momentum:g} client {seed}"
        _, weight_delta, bias_delta, layer = client_update(cell, data, seed=seed)
        SpearPlusPlus(seed=0, time_budget=budget, progress=False).invert(
            weight_delta, bias_delta, weight=layer.weight.detach(), bias=layer.bias.detach()
        )


def search(request: Request) -> Any:
    return fit_one_epoch(request.patterns, momenta=MOMENTA, decay_scale=request.decay_scale)


def operator_calls(request: Request) -> tuple[int, str]:
    """Torch operator calls of one search, and the three with the most self CPU time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        search(request)
    averages = sorted(prof.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    top = ", ".join(f"{event.key} x{event.count}" for event in averages[:3])
    return sum(event.count for event in averages), top


def host_syncs(request: Request) -> int:
    """Host syncs (``.tolist()``, ``int()``, mask indexing, ...) of one search: a device round trip each on a GPU."""
    census = Census()
    with census:
        search(request)
    return sum(count for (kind, _), count in census.calls.items() if kind.startswith("sync"))


def top_functions(request: Request, *, rows: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    search(request)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fedsgd", nargs="*", default=["20x200:6"], help="BxM:trials")
    parser.add_argument("--fedavg", nargs="*", default=[], help="N:B:E:lr:momentum:weight_decay:m:clients")
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cprofile", type=int, default=0, help="top functions of each search (0: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    requests: list[Request] = []
    source = [""]
    with recording(source, requests):
        for text in args.fedsgd:
            attack_fedsgd(text, budget=args.time_budget, source=source)
        if args.fedavg:
            data = load_dataset("cifar10", split="train")
            for text in args.fedavg:
                attack_fedavg(text, data=data, budget=args.time_budget, source=source)
    print(
        "| selection | N x m | search s (best of 3) | fit | refused by the reach bound "
        "| torch ops | host syncs | top ops |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for request in requests:
        seconds, fit = float("inf"), None
        for _ in range(3):
            start = time.perf_counter()
            fit = search(request)
            seconds = min(seconds, time.perf_counter() - start)
        calls, top = operator_calls(request)
        size = f"{request.patterns.size} x {request.patterns.start.shape[0]}"
        refused = "yes" if request.decay_scale >= 0.0 and unreachable(request.patterns) else "no"
        found = "none" if fit is None else fit.describe()
        syncs = host_syncs(request)
        print(
            f"| {request.source} | {size} | {seconds:.3f} | {found} | {refused} | {calls} | {syncs} | {top} |"
        )
        if args.cprofile:
            print(top_functions(request, rows=args.cprofile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
