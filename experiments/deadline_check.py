"""How far past its time budget does SPEAR++ return? One row per batch size.

Each row attacks the float32 first-layer gradient of one batch of the SPEAR++ victim (three
hidden ReLU layers, width ``m``) and reports the wall-clock seconds of ``invert`` against the
budget. The attack promises to return within ``budget + 10%``::

    PYTHONPATH=. python3 -m experiments.deadline_check --dataset cifar10 --width 1000 \\
        --batch-sizes 100 150 190 --budget 5

``--noise`` adds Gaussian noise of that many times the gradient's median entry (the noisy
path, with its final pruning of doubtful rows). A row whose decomposition could not fit in the
budget (no search ran) says why under "stopped by". Exit status 1 when any row overshoots.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.simulate.victims import (
    build_victim,
    client_gradient,
    first_linear,
    median_abs_entry,
    noisy_gradient,
)

#: The promised bound: the attack returns within ``budget * (1 + ALLOWED_OVERSHOOT)``.
ALLOWED_OVERSHOOT = 0.10


@dataclass(frozen=True)
class DeadlineRow:
    """One timed attack."""

    batch_size: int
    width: int
    budget: float
    initializations: int
    seconds: float
    stopped_by: str
    found: int
    complete: bool
    stop_reason: str = ""

    @property
    def overshoot(self) -> float:
        """Seconds past the budget, relative to it (negative: returned early)."""
        return (self.seconds - self.budget) / self.budget

    @property
    def within_bound(self) -> bool:
        return self.overshoot <= ALLOWED_OVERSHOOT


def time_attack(
    *,
    dataset: str,
    width: int,
    batch_size: int,
    budget: float,
    noise: float,
    seed: int,
    data_root: str | None = None,
    initializations: int | None = None,
) -> DeadlineRow:
    """Attack one batch with ``budget`` seconds and time the whole ``invert`` call.

    ``initializations`` per search round (default: the attack's own choice); fewer make
    rounds short, so that the stages after the search (pooling, selection, splitting, the
    last-direction scan, pruning) run before the deadline and are timed too.
    """
    data = load_dataset(dataset, root=data_root, split="all")
    images, labels, _ = sample_batch(data, batch_size, seed=seed)
    model = build_victim(
        "spear++", input_dim=data.input_dim, width=width, num_classes=data.num_classes, seed=seed
    )
    weight_grad, bias_grad = client_gradient(model, images, labels)
    if noise > 0:
        sigma = noise * median_abs_entry(weight_grad)
        weight_grad, bias_grad = noisy_gradient(weight_grad, bias_grad, sigma=sigma, seed=seed)
    _, layer = first_linear(model)
    attack = SpearPlusPlus(seed=seed, time_budget=budget, initializations=initializations, progress=False)
    start = time.perf_counter()
    rec = attack.invert(weight_grad, bias_grad, weight=layer.weight.detach(), bias=layer.bias.detach())
    seconds = time.perf_counter() - start
    return DeadlineRow(
        batch_size=batch_size,
        width=width,
        budget=budget,
        initializations=int(rec.stats.get("initializations", 0)),
        seconds=seconds,
        stopped_by=str(rec.stats.get("stopped_by", "accepted")),
        found=rec.found,
        complete=rec.complete,
        stop_reason=str(rec.stats.get("stop_reason", "")),
    )


def markdown(rows: Sequence[DeadlineRow]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| b | m | budget (s) | seconds | overshoot | within +10% | stopped by | initializations | found | complete |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.batch_size} | {row.width} | {row.budget:g} | {row.seconds:.2f} | {100 * row.overshoot:+.1f}% "
            f"| {'yes' if row.within_bound else 'NO'} | {row.stopped_by}"
            f"{': ' + row.stop_reason if row.stop_reason else ''} | {row.initializations} "
            f"| {row.found}/{row.batch_size} "
            f"| {row.complete} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dataset", default="photo-patches", help="image dataset (default: bundled photo-patches)"
    )
    parser.add_argument("--data-root", default=None, help="data root for cifar10 / mnist")
    parser.add_argument("--width", type=int, default=1000, help="width m of the attacked layer")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[100, 150, 190])
    parser.add_argument("--budget", type=float, default=5.0, help="time budget in seconds")
    parser.add_argument(
        "--noise", type=float, default=0.0, help="Gaussian noise, times the median gradient entry"
    )
    parser.add_argument(
        "--initializations", type=int, default=None, help="per search round (default: automatic)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error("--budget must be positive")
    torch.set_num_threads(args.threads)
    rows = []
    for batch_size in args.batch_sizes:
        row = time_attack(
            dataset=args.dataset,
            width=args.width,
            batch_size=batch_size,
            budget=args.budget,
            noise=args.noise,
            seed=args.seed,
            data_root=args.data_root,
            initializations=args.initializations,
        )
        rows.append(row)
        print(markdown([row]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))
    return 0 if all(row.within_bound for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
