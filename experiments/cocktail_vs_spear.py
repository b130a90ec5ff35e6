"""Exact (SPEAR++) and approximate (Cocktail Party Attack) inversion side by side, b = 10..1000.

Same victims, same batches, same float32 first-layer gradients of the SPEAR++ victim (three
hidden ReLU layers of width m) on CIFAR-10 training images; every reconstruction is matched to
the batch (Hungarian) and scored by PSNR and SSIM on de-normalised images. SPEAR++ runs only
where ``b < m`` leaves it a chance and its budget allows; cells it does not run are marked.

    python -m experiments.cocktail_vs_spear --width 4000 --batch-sizes 10,50,100,200,400,1000 \\
        --spear-up-to 100 --trials 1 --time-budget 300
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fl_attack import CocktailPartyAttack, SpearPlusPlus
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import build_victim, client_gradient

#: What is printed and written: one row per (attack, b), means over the trials.
COLUMNS = ("attack", "b", "m", "trials", "exact share", "mean PSNR", "mean SSIM", "median s")


def _score(inputs: torch.Tensor, truth: torch.Tensor, data: object) -> tuple[float, float, float]:
    quality = evaluate_reconstruction(
        inputs,
        truth.reshape(len(truth), -1).double(),
        denormalize=data.denormalize,  # type: ignore[attr-defined]
        image_shape=tuple(data.image_shape),  # type: ignore[attr-defined]
    )
    ssim = float(quality.ssim.mean()) if quality.ssim is not None else float("nan")
    return quality.exact_fraction, quality.mean_psnr, ssim


def run(
    *, width: int, batch_sizes: Sequence[int], spear_up_to: int, trials: int, time_budget: float, seed: int
) -> list[dict[str, object]]:
    """Measure both attacks on the same gradients; returns one row per (attack, b)."""
    data = load_dataset("cifar10", split="train")
    model = build_victim("spear++", input_dim=data.input_dim, width=width, num_classes=10, seed=seed)
    attacks = {
        "cocktail-party": CocktailPartyAttack(seed=seed),
        "spear++": SpearPlusPlus(seed=seed, progress=False),
    }
    rows: list[dict[str, object]] = []
    for b in batch_sizes:
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in attacks}
        for trial in range(trials):
            inputs, labels, _ = sample_batch(data, b, seed=seed + 1000 * trial + b)
            weight_grad, bias_grad = client_gradient(model, inputs, labels)
            layer = model[1] if isinstance(model[0], torch.nn.Flatten) else model[0]
            for name, attack in attacks.items():
                if name == "spear++" and b > spear_up_to:
                    continue
                start = time.perf_counter()
                kwargs = {"time_budget": time_budget} if name == "spear++" else {"batch_size": b}
                rec = attack.invert(weight_grad, bias_grad, weight=layer.weight, bias=layer.bias, **kwargs)
                seconds = time.perf_counter() - start
                results[name].append((*_score(rec.inputs, inputs, data), seconds))
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
    parser.add_argument("--spear-up-to", type=int, default=100, help="largest b attacked with SPEAR++")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--time-budget", type=float, default=300.0, help="SPEAR++ budget per batch (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        rows = run(
            width=args.width,
            batch_sizes=[int(v) for v in args.batch_sizes.split(",")],
            spear_up_to=args.spear_up_to,
            trials=args.trials,
            time_budget=args.time_budget,
            seed=args.seed,
        )
    except FileNotFoundError as error:
        print(f"{str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    table = markdown(rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
