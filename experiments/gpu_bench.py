"""SPEAR++ on a GPU against the CPU threads beside it, cell by cell, in one run.

Runs the public :class:`fl_attack.SpearPlusPlus` on the SPEAR++ Table 1 victim (FedSGD, one
linear layer of width m on CIFAR-10) for each cell, on ``cuda`` and on ``cpu`` with
``--cpu-threads`` threads, attacking the same batches on both. Per cell and device it reports
the exact rate (every sample of the batch recovered above the exact PSNR), the median
wall-clock seconds, and the peak GPU memory. Trials of a cell stop on a device once it has used
``--cell-budget`` seconds there (each attack also has a time budget and a hard limit).
``--profile-cells`` adds a ``torch.profiler`` summary of one warm attack per cell: kernel
launches, host synchronisations, ``.item()`` calls, device-host copies and the top operators.
``--clients C`` adds the many-clients measurement (:mod:`experiments.many_clients`): one round of
C clients' ``--clients-cell`` updates audited by the Auditor on the first device with ``k``
attacks at once (thread isolation: one process, a CUDA stream per attack) for each ``k`` of
``--workers``; ``--cells none`` measures only that.

    PYTHONPATH=. python experiments/gpu_bench.py --out outputs/gpu_bench
    PYTHONPATH=. python experiments/gpu_bench.py --quick --devices cpu --out /tmp/gpu_bench
    PYTHONPATH=. python experiments/gpu_bench.py --cells none --clients 100 --workers 1 4 8 --out /tmp/many

Writes ``results.json`` (every trial and the summary; rewritten after each cell, so a run cut
short keeps what it measured), ``table.md`` and, per profiled cell, ``profile_<cell>_<device>.txt``
and ``.json``. CIFAR-10 is searched as everywhere (``--data-root``, ``$FL_ATTACK_DATA``,
``../shared/data``, ``./data``); ``--fallback-dataset photo-patches`` uses 32x32 patches of the
photos bundled with scikit-learn / scikit-image when CIFAR-10 is absent (and says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments import many_clients
from experiments.config import Cell, Setting, parse_cells
from experiments.observe import Observation, Trial, draw_trial, observe
from experiments.runner import AttackTimeout, hard_time_limit
from fl_attack import SpearPlusPlus
from fl_attack.data.images import ImageData, load_dataset
from fl_attack.data.locate import DatasetNotFoundError
from fl_attack.evaluation.metrics import evaluate_reconstruction

CELLS = "20x200,30x200,100x1000,150x4000,400x4000"
#: Trials per cell in a full run; (400, 4000) takes a minute on 16 CPU threads.
TRIALS = {"20x200": 5, "30x200": 3, "100x1000": 3, "150x4000": 3, "400x4000": 1}
QUICK_CELLS = "8x100,20x200"
_WARM_UP = Cell(4, 50)

#: Profiler event names counted in the summary (CUDA runtime / driver calls and ATen operators).
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_EVENTS = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync")
ITEM_EVENTS = ("aten::item", "aten::_local_scalar_dense")


@dataclass
class Run:
    """One attack of one batch on one device."""

    cell: str
    device: str
    trial: int
    seed: int
    seconds: float
    exact: bool
    found: int
    complete: bool
    mean_psnr: float
    peak_gpu_mib: float | None
    next_layer: bool
    error: str = ""


@dataclass
class Bench:
    """Everything a run measured, written as ``results.json``."""

    config: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    many_clients: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> list[dict[str, Any]]:
        """Per cell and device: trials, exact rate, median seconds, peak GPU memory."""
        rows: list[dict[str, Any]] = []
        for cell in dict.fromkeys(run.cell for run in self.runs):
            for device in dict.fromkeys(run.device for run in self.runs if run.cell == cell):
                runs = [run for run in self.runs if run.cell == cell and run.device == device]
                peaks = [run.peak_gpu_mib for run in runs if run.peak_gpu_mib is not None]
                rows.append(
                    {
                        "cell": cell,
                        "device": device,
                        "next_layer": runs[0].next_layer,
                        "trials": len(runs),
                        "exact": sum(run.exact for run in runs),
                        "exact_rate": sum(run.exact for run in runs) / len(runs),
                        "median_seconds": statistics.median(run.seconds for run in runs),
                        "peak_gpu_mib": max(peaks) if peaks else None,
                        "errors": sum(bool(run.error) for run in runs),
                    }
                )
        return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    parser.add_argument("--cells", default=None, help=f"<b>x<m> cells (default {CELLS}; 'none': no cell)")
    parser.add_argument(
        "--trials", type=int, default=None, help="trials per cell (default: per cell, TRIALS)"
    )
    parser.add_argument(
        "--devices", default=None, help="comma-separated, default cuda,cpu (cpu without a GPU)"
    )
    parser.add_argument("--cpu-threads", type=int, default=16, help="torch threads of the CPU runs")
    parser.add_argument("--time-budget", type=float, default=120.0, help="attack time budget per batch (s)")
    parser.add_argument("--cell-budget", type=float, default=75.0, help="seconds per cell and device (hard)")
    parser.add_argument(
        "--next-layer-cells",
        default="400x4000",
        help="cells given the next layer's update too ('all', 'none')",
    )
    parser.add_argument(
        "--profile-cells", default="", help="cells to profile once (warm) with torch.profiler"
    )
    parser.add_argument(
        "--total-budget", type=float, default=math.inf, help="seconds after which no new attack starts"
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 matmuls on the GPU (an ablation; default off as in torch)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None)
    parser.add_argument(
        "--fallback-dataset", default=None, help="bundled dataset used when CIFAR-10 is absent"
    )
    parser.add_argument(
        "--clients", type=int, default=0, help="many-clients measurement: clients in the round (0: none)"
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 4, 8], help="attacks at once, one measurement each"
    )
    parser.add_argument("--clients-cell", default="20x200", help="<b>x<m> of every client's update")
    parser.add_argument("--quick", action="store_true", help=f"cells {QUICK_CELLS}, 1 trial, 20 s budgets")
    args = parser.parse_args(argv)
    if args.quick:
        args.cells = args.cells or QUICK_CELLS
        args.trials = args.trials or 1
        args.time_budget = min(args.time_budget, 20.0)
        args.cell_budget = min(args.cell_budget, 20.0)
    args.cells = args.cells or CELLS
    if args.devices is None:
        args.devices = "cuda,cpu" if torch.cuda.is_available() else "cpu"
    return args


def load_images(root: str | None, fallback: str | None) -> ImageData:
    """CIFAR-10 (training split), or the bundled ``fallback`` when it cannot be found."""
    try:
        return load_dataset("cifar10", root=root, split="train")
    except DatasetNotFoundError as error:
        if fallback is None:
            raise SystemExit(
                f"gpu_bench: {str(error).splitlines()[0]} (or pass --fallback-dataset photo-patches)"
            ) from None
        print(f"gpu_bench: CIFAR-10 not found; using the bundled {fallback!r} instead", flush=True)
        return load_dataset(fallback, split="all")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class Timed:
    """What one attack returned (None when it failed), its seconds, peak GPU memory and error."""

    rec: Any
    seconds: float
    peak_gpu_mib: float | None
    error: str


def invert_on(
    device: str, trial: Trial, observation: Observation, *, budget: float, next_layer: bool
) -> Timed:
    """Attack one observed update on ``device``, timed to the device's last kernel; never raises."""
    update = observation.update
    following = observation.next_weight_update if next_layer else None
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    attack = SpearPlusPlus(device=device, seed=trial.seed, time_budget=budget, progress=False)
    start = time.perf_counter()
    rec, error = None, ""
    try:
        with hard_time_limit(2 * budget + 30.0):
            rec = attack.invert(
                update.weight_update,
                update.bias_update,
                weight=update.weight,
                bias=update.bias,
                next_weight_grad=following,
            )
            synchronize(device)
    except (Exception, AttackTimeout) as failure:  # a failed attack is a data point
        error = f"{type(failure).__name__}: {failure}".replace("\n", " ")[:300]
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return Timed(rec, seconds, peak, error)


def attack_once(
    device: str, trial: Trial, observation: Observation, data: ImageData, *, budget: float, next_layer: bool
) -> Run:
    """Attack one observed update on ``device`` and score it against the true batch."""
    cell = f"{trial.inputs.shape[0]}x{observation.update.width}"
    timed = invert_on(device, trial, observation, budget=budget, next_layer=next_layer)
    exact, psnr, found, complete = False, math.nan, 0, False
    if timed.rec is not None:
        rec = timed.rec
        quality = evaluate_reconstruction(
            rec.inputs, observation.reference, denormalize=data.denormalize, image_shape=data.image_shape
        )
        exact = quality.exact_fraction == 1.0 and bool(rec.complete)
        psnr, found, complete = quality.mean_psnr, int(rec.found), bool(rec.complete)
    return Run(
        cell,
        device,
        trial.index,
        trial.seed,
        timed.seconds,
        exact,
        found,
        complete,
        psnr,
        timed.peak_gpu_mib,
        next_layer,
        timed.error,
    )


def profile_summary(profiler: torch.profiler.profile, *, device: str, top: int = 25) -> dict[str, Any]:
    """Counts of launches, syncs, copies and ``.item()`` calls, and the top operators."""
    events = profiler.events()  # type: ignore[no-untyped-call]
    counts = Counter(event.name for event in events)
    averages = profiler.key_averages()
    cuda = device.startswith("cuda")

    def self_device_us(item: Any) -> float:
        return float(getattr(item, "self_device_time_total", getattr(item, "self_cuda_time_total", 0.0)))

    def row(item: Any) -> dict[str, Any]:
        return {
            "name": item.key,
            "calls": int(item.count),
            "self_cpu_ms": item.self_cpu_time_total / 1e3,
            "self_device_ms": self_device_us(item) / 1e3,
        }

    linalg = {name: n for name, n in counts.items() if name.startswith(("aten::linalg", "aten::_linalg"))}
    device_ms = sum(self_device_us(item) for item in averages) / 1e3 if cuda else None
    by_cpu = sorted(averages, key=lambda item: item.self_cpu_time_total, reverse=True)[:top]
    by_device = sorted(averages, key=self_device_us, reverse=True)[:top] if cuda else []
    return {
        "kernel_launches": sum(counts[name] for name in LAUNCH_EVENTS),
        "synchronizations": sum(counts[name] for name in SYNC_EVENTS),
        "memcpy_calls": sum(counts[name] for name in COPY_EVENTS),
        "item_calls": counts["aten::item"],
        "local_scalar_dense": counts["aten::_local_scalar_dense"],
        "linalg_calls": dict(sorted(linalg.items())),
        "device_busy_ms": device_ms,
        "top_by_self_cpu": [row(item) for item in by_cpu],
        "top_by_self_device": [row(item) for item in by_device],
    }


def profile_cell(
    device: str, trial: Trial, observation: Observation, *, budget: float, next_layer: bool
) -> tuple[dict[str, Any], str]:
    """One warm attack under ``torch.profiler``: its summary and the profiler's own table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        timed = invert_on(device, trial, observation, budget=budget, next_layer=next_layer)
    complete = timed.rec is not None and bool(timed.rec.complete)
    summary = {"wall_seconds": timed.seconds, "complete": complete, "error": timed.error}
    summary |= profile_summary(profiler, device=device)
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=40)
    return summary, table


def write_outputs(bench: Bench, out: Path) -> None:
    """``results.json`` and ``table.md``, each written whole (temporary file, then rename)."""
    payload = {
        "config": bench.config,
        "summary": bench.summary(),
        "runs": [vars(run) for run in bench.runs],
        "profiles": bench.profiles,
        "many_clients": bench.many_clients,
    }
    _write(out / "results.json", json.dumps(payload, indent=2, default=str) + "\n")
    _write(out / "table.md", markdown(bench))


def _write(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".part")
    partial.write_text(text)
    os.replace(partial, path)


def markdown(bench: Bench) -> str:
    """The cell x device table, GPU / CPU speed-up, and the profile counts."""
    config = bench.config
    lines = [
        f"# SPEAR++ GPU vs CPU ({config['gpu_name'] or 'no GPU'}; CPU: {config['cpu_threads']} threads)",
        "",
        f"Data: {config['dataset']}; torch {config['torch']}; attack time budget {config['time_budget']} s, "
        f"{config['cell_budget']} s per cell and device.",
    ]
    summary = bench.summary()
    if summary:
        lines += [
            "",
            "| cell (b, m) | next layer | device | trials | exact | median s | peak GPU MiB | errors |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for row in summary:
        peak = "-" if row["peak_gpu_mib"] is None else f"{row['peak_gpu_mib']:.0f}"
        lines.append(
            f"| {row['cell']} | {'yes' if row['next_layer'] else 'no'} | {row['device']} | {row['trials']} | "
            f"{row['exact']}/{row['trials']} | {row['median_seconds']:.2f} | {peak} | {row['errors']} |"
        )
    speedups = []
    for cell in dict.fromkeys(row["cell"] for row in summary):
        by_device = {row["device"]: row["median_seconds"] for row in summary if row["cell"] == cell}
        gpu = next((s for d, s in by_device.items() if d.startswith("cuda")), None)
        if gpu is not None and "cpu" in by_device:
            speedups.append(f"| {cell} | {by_device['cpu'] / gpu:.2f}x |")
    if speedups:
        lines += ["", "| cell | CPU median / GPU median |", "|---|---|", *speedups]
    for key, profile in bench.profiles.items():
        lines += [
            "",
            f"## Profile {key} (one warm attack, {profile['wall_seconds']:.2f} s, complete={profile['complete']})",
            "",
            f"- kernel launches {profile['kernel_launches']}, synchronisations {profile['synchronizations']}, "
            f"memcpy calls {profile['memcpy_calls']}, `.item()` {profile['item_calls']} "
            f"(`_local_scalar_dense` {profile['local_scalar_dense']})",
            f"- device busy {profile['device_busy_ms']} ms"
            if profile["device_busy_ms"] is not None
            else "- CPU only",
            "- linalg calls: " + ", ".join(f"{k} {v}" for k, v in profile["linalg_calls"].items()),
            "",
            "| op | calls | self CPU ms | self device ms |",
            "|---|---|---|---|",
        ]
        top = profile["top_by_self_device"] or profile["top_by_self_cpu"]
        lines += [
            f"| `{r['name']}` | {r['calls']} | {r['self_cpu_ms']:.1f} | {r['self_device_ms']:.1f} |"
            for r in top[:15]
        ]
    lines += many_clients.markdown(bench.many_clients)
    return "\n".join(lines) + "\n"


def cells_of(text: str, all_cells: Sequence[Cell]) -> set[str]:
    if text == "all":
        return {cell.label for cell in all_cells}
    if text in ("", "none"):
        return set()
    return {cell.label for cell in parse_cells(text)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.clients < 0 or any(count < 1 for count in args.workers):
        raise SystemExit("gpu_bench: --clients must be >= 0 and every --workers >= 1")
    cells = [] if args.cells in ("", "none") else parse_cells(args.cells)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: --devices names cuda but torch sees no GPU")
    next_cells, profile_cells = cells_of(args.next_layer_cells, cells), cells_of(args.profile_cells, cells)
    torch.set_num_threads(args.cpu_threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    args.out.mkdir(parents=True, exist_ok=True)
    data = load_images(args.data_root, args.fallback_dataset)
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    config = {
        "cells": [cell.label for cell in cells],
        "devices": devices,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "time_budget": args.time_budget,
        "cell_budget": args.cell_budget,
        "next_layer_cells": sorted(next_cells),
        "dataset": data.name,
        "seed": args.seed,
        "tf32": args.tf32,
        "torch": torch.__version__,
        "gpu_name": gpu_name,
        "python": sys.version.split()[0],
        "clients": args.clients,
        "workers": args.workers,
        "clients_cell": args.clients_cell,
    }
    bench = Bench(config)
    stop_at = time.perf_counter() + args.total_budget
    print(f"gpu_bench: {json.dumps(config)}", flush=True)
    for device in devices:  # one-time set-up (CUDA context, solver handles) is not timed
        setting = Setting(section="fedsgd", cell=_WARM_UP, methods=("l1",), trials=1)
        trial = draw_trial(data, setting, index=0, seed=10_000)
        attack_once(device, trial, observe(setting, trial, data), data, budget=10.0, next_layer=False)
    for cell in cells:
        setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1)
        trials = args.trials or TRIALS.get(cell.label, 3)
        next_layer = cell.label in next_cells
        spent = dict.fromkeys(devices, 0.0)
        last: tuple[Trial, Observation] | None = None
        for index in range(trials):
            trial = draw_trial(data, setting, index=index, seed=args.seed + index)
            observation = observe(setting, trial, data)
            last = (trial, observation)
            for device in devices:
                if spent[device] >= args.cell_budget or time.perf_counter() > stop_at:
                    continue
                budget = max(1.0, min(args.time_budget, args.cell_budget - spent[device]))
                run = attack_once(device, trial, observation, data, budget=budget, next_layer=next_layer)
                spent[device] += run.seconds
                bench.runs.append(run)
                print(
                    f"{cell.label} {device} trial {index}: {run.seconds:.2f} s exact={int(run.exact)} "
                    f"found {run.found}/{cell.batch_size} psnr={run.mean_psnr:.1f} peak={run.peak_gpu_mib} "
                    f"{run.error}",
                    flush=True,
                )
        if cell.label in profile_cells and last is not None and time.perf_counter() < stop_at:
            for device in devices[:1]:  # the first device (the GPU when there is one)
                summary, table = profile_cell(device, *last, budget=args.time_budget, next_layer=next_layer)
                key = f"{cell.label}_{device.replace(':', '')}"
                bench.profiles[key] = summary
                _write(args.out / f"profile_{key}.txt", table)
                _write(args.out / f"profile_{key}.json", json.dumps(summary, indent=2) + "\n")
                print(f"profile {key}: {json.dumps({k: summary[k] for k in list(summary)[:8]})}", flush=True)
        write_outputs(bench, args.out)
    if args.clients > 0 and time.perf_counter() < stop_at:

        def measured(run: many_clients.ManyClientsRun) -> None:
            bench.many_clients.append(run.row())
            write_outputs(bench, args.out)

        many_clients.measure(
            devices[0],
            data,
            parse_cells(args.clients_cell)[0],
            clients=args.clients,
            workers=args.workers,
            budget=args.time_budget,
            seed=args.seed,
            measured=measured,
        )
    write_outputs(bench, args.out)
    print((args.out / "table.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
