"""Exact (SPEAR++) and approximate (Cocktail Party Attack) inversion side by side, b = 10..1000.

Same victims, same batches, same float32 first-layer gradients of the SPEAR++ victim (three
hidden ReLU layers of width m) on CIFAR-10 training images; every reconstruction is matched to
the batch (Hungarian) and scored by PSNR and SSIM on de-normalised images. SPEAR++ runs only
where ``b < m`` leaves it a chance and its budget allows; cells it does not run are marked.
The machine's load average is written beside the table (the timings depend on it).

    python -m experiments.cocktail_vs_spear --width 4000 --batch-sizes 10,50,100,200,400,1000 \\
        --spear-up-to 200 --trials 1 --time-budget 120 --out experiments/results/cocktail_vs_spear.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fl_attack import CocktailPartyAttack, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import build_victim, client_gradient

#: What is printed and written: one row per (attack, b), means over the trials.
COLUMNS = ("attack", "b", "m", "trials", "exact share", "mean PSNR", "mean SSIM", "median s", "how")


def _score(inputs: torch.Tensor, truth: torch.Tensor, data: object) -> tuple[float, float, float]:
    quality = evaluate_reconstruction(
        inputs,
        truth.reshape(len(truth), -1).double(),
        denormalize=data.denormalize,  # type: ignore[attr-defined]
        image_shape=tuple(data.image_shape),  # type: ignore[attr-defined]
    )
    ssim = float(quality.ssim.mean()) if quality.ssim is not None else float("nan")
    return quality.exact_fraction, quality.mean_psnr, ssim


def _how(stats: dict[str, object]) -> str:
    """The attack's own account of one run: the ICA side and stop, or SPEAR's completeness."""
    if "unmixed" in stats:
        return f"{stats['unmixed']}, {stats.get('ica_iterations')} it, {stats.get('stopped_by')}"
    return str(stats.get("stopped_by", ""))


def run(
    *,
    width: int,
    batch_sizes: Sequence[int],
    spear_up_to: int,
    trials: int,
    time_budget: float,
    seed: int,
    cpa_time_budget: float | None = None,
) -> list[dict[str, object]]:
    """Measure both attacks on the same gradients; returns one row per (attack, b)."""
    data = load_dataset("cifar10", split="train")
    model = build_victim("spear++", input_dim=data.input_dim, width=width, num_classes=10, seed=seed)
    attacks: dict[str, LayerAttackBase] = {
        "cocktail-party": CocktailPartyAttack(seed=seed, time_budget=cpa_time_budget),
        "spear++": SpearPlusPlus(seed=seed, time_budget=time_budget, progress=False),
    }
    rows: list[dict[str, object]] = []
    for b in batch_sizes:
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in attacks}
        hows: dict[str, list[str]] = {name: [] for name in attacks}
        for trial in range(trials):
            inputs, labels, _ = sample_batch(data, b, seed=seed + 1000 * trial + b)
            weight_grad, bias_grad = client_gradient(model, inputs, labels)
            layer = model[1] if isinstance(model[0], torch.nn.Flatten) else model[0]
            assert isinstance(layer, torch.nn.Linear)
            for name, attack in attacks.items():
                if name == "spear++" and b > spear_up_to:
                    continue
                start = time.perf_counter()
                exact = name == "spear++"  # SPEAR++ estimates b itself; the baseline is told b
                rec = attack.invert(
                    weight_grad,
                    bias_grad,
                    weight=layer.weight,
                    bias=layer.bias,
                    batch_size=None if exact else b,
                )
                seconds = time.perf_counter() - start
                results[name].append((*_score(rec.inputs, inputs, data), seconds))
                hows[name].append(_how(rec.stats))
                print(f"{name} b={b} trial={trial}: {results[name][-1]}", file=sys.stderr, flush=True)
        for name, measured in results.items():
            if not measured:
                continue
            values = np.array(measured)
            rows.append(
                {
                    "attack": name,
                    "b": b,
                    "m": width,
                    "trials": len(measured),
                    "exact share": float(values[:, 0].mean()),
                    "mean PSNR": float(values[:, 1].mean()),
                    "mean SSIM": float(values[:, 2].mean()),
                    "median s": float(np.median(values[:, 3])),
                    "how": "; ".join(hows[name]),
                }
            )
    return rows


def markdown(rows: Sequence[dict[str, object]]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for column in COLUMNS:
            value = row[column]
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print its markdown table; write it with ``--out``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=4000)
    parser.add_argument("--batch-sizes", default="10,50,100,200,400,1000")
    parser.add_argument("--spear-up-to", type=int, default=200, help="largest b attacked with SPEAR++")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--time-budget", type=float, default=120.0, help="SPEAR++ budget per batch (s)")
    parser.add_argument(
        "--cpa-time-budget",
        type=float,
        default=None,
        help="Cocktail Party budget per batch (s; default none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=None, help="write the markdown table here, and a .json beside it"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    try:
        rows = run(
            width=args.width,
            batch_sizes=[int(v) for v in args.batch_sizes.split(",")],
            spear_up_to=args.spear_up_to,
            trials=args.trials,
            time_budget=args.time_budget,
            seed=args.seed,
            cpa_time_budget=args.cpa_time_budget,
        )
    except FileNotFoundError as error:
        print(f"{str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    load_after = os.getloadavg()
    load = (
        f"load average (1, 5, 15 min) at start {', '.join(f'{v:.2f}' for v in load_before)}, "
        f"at end {', '.join(f'{v:.2f}' for v in load_after)}; {os.cpu_count()} CPUs, {args.threads} torch thread(s)"
    )
    table = markdown(rows) + "\n\n" + load
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            f"`python -m experiments.cocktail_vs_spear {' '.join(argv or sys.argv[1:])}`\n\n{table}\n"
        )
        document = {
            "argv": list(argv or sys.argv[1:]),
            "rows": rows,
            "load_average": {"start": load_before, "end": load_after},
        }
        args.out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
