"""Table "FedAvg as clients train": local epochs of mini-batch SGD with momentum and weight decay.

::

    python -m experiments.fedavg_training --batches 3 --time-budget 60
    python -m experiments.fedavg_training --cells 20:5:1:0.1:0.9:5e-4:200 --batches 1

Each client holds ``N`` images of the dataset (CIFAR-10 where it is found, else the bundled
photo patches; ``--dataset`` picks), trains the SPEAR++ victim of width ``m`` as Flower clients
do (``E`` shuffled epochs of mini-batches of ``B``, ``torch.optim.SGD`` with ``lr``, momentum
and weight decay; :func:`fl_attack.simulate.victims.fedavg_update`) and sends ``W_E - W_0``.
The server runs the public ``SpearPlusPlus().invert(dW, db, weight=W0, bias=b0)`` with nothing
else known. Per cell: rows exact (above :data:`fl_attack.vocabulary.EXACT_PSNR_DB`) and above
25 dB over all batches, batches claimed (``complete`` on a clean check: exact), wrong claims
(claimed yet a row below the exact threshold; must be 0), and the median and largest time.
Published anchor: Dimitrov et al., "Data Leakage in Federated Averaging" (TMLR 2022), over 45%
of FEMNIST images from 10 epochs x 10 batches x 5 images with an approximate attack.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_attack import SpearPlusPlus
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import build_victim, fedavg_update, first_linear
from fl_attack.vocabulary import APPROX_PSNR_DB


@dataclass(frozen=True)
class TrainingCell:
    """One client setting: ``N`` samples, mini-batches of ``B``, ``E`` epochs, SGD settings, width ``m``."""

    samples: int
    batch: int
    epochs: int
    lr: float
    momentum: float
    weight_decay: float
    width: int

    @classmethod
    def parse(cls, text: str) -> TrainingCell:
        """``N:B:E:lr:momentum:weight_decay:m``."""
        parts = text.split(":")
        if len(parts) != 7:
            raise argparse.ArgumentTypeError(f"a cell is N:B:E:lr:momentum:weight_decay:m, got {text!r}")
        n, b, e, lr, mu, wd, m = parts
        try:
            return cls(int(n), int(b), int(e), float(lr), float(mu), float(wd), int(m))
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"bad cell {text!r}: {error}") from error

    def label(self) -> str:
        steps = self.epochs * -(-self.samples // self.batch)
        return (
            f"N {self.samples}, B {self.batch}, E {self.epochs} ({steps} steps), lr {self.lr:g}, "
            f"momentum {self.momentum:g}, wd {self.weight_decay:g}, m {self.width}"
        )


#: The issue's targets (#31): one epoch with and without momentum and weight decay, five epochs
#: at lr 0.1, and the anchor's shape (N 50, B 5, E 10) at lr 0.01 and 0.05.
DEFAULT_CELLS = (
    TrainingCell(20, 5, 1, 0.1, 0.0, 0.0, 200),
    TrainingCell(20, 5, 1, 0.1, 0.9, 0.0, 200),
    TrainingCell(20, 5, 1, 0.1, 0.9, 5e-4, 200),
    TrainingCell(20, 5, 5, 0.1, 0.0, 0.0, 200),
    TrainingCell(50, 5, 10, 0.01, 0.0, 0.0, 1000),
    TrainingCell(50, 5, 10, 0.05, 0.0, 0.0, 1000),
)


@dataclass(frozen=True)
class CellResult:
    cell: TrainingCell
    rows: int
    exact_rows: int
    approx_rows: int
    claimed: int
    wrong_claims: int
    seconds: list[float]


def run_cell(cell: TrainingCell, data: ImageData, *, batches: int, time_budget: float) -> CellResult:
    """Attack ``batches`` clients (seeds 0, 1, ...) of one cell."""
    exact = approx = claimed = wrong = 0
    seconds: list[float] = []
    for seed in range(batches):
        model = build_victim(
            "spear++", input_dim=data.input_dim, width=cell.width, num_classes=data.num_classes, seed=seed
        )
        images, labels, _ = sample_batch(data, cell.samples, seed=seed)
        weight_delta, bias_delta = fedavg_update(
            model,
            images,
            labels,
            lr=cell.lr,
            epochs=cell.epochs,
            mini_batch_size=cell.batch,
            seed=seed,
            momentum=cell.momentum,
            weight_decay=cell.weight_decay,
        )
        _, layer = first_linear(model)
        start = time.perf_counter()
        rec = SpearPlusPlus(seed=0, time_budget=time_budget, progress=False).invert(
            weight_delta, bias_delta, weight=layer.weight.detach(), bias=layer.bias.detach()
        )
        seconds.append(time.perf_counter() - start)
        reference = images.reshape(cell.samples, -1).double()
        quality = evaluate_reconstruction(
            rec.inputs, reference, denormalize=data.denormalize, image_shape=data.image_shape
        )
        psnr = torch.as_tensor(quality.psnr, dtype=torch.float64)
        exact += int(round(quality.exact_fraction * psnr.numel()))
        approx += int((psnr > APPROX_PSNR_DB).sum())
        is_claimed = rec.complete and rec.self_check is not None and rec.self_check.exact
        claimed += int(is_claimed)
        wrong += int(is_claimed and quality.exact_fraction < 1.0)
    return CellResult(cell, batches * cell.samples, exact, approx, claimed, wrong, seconds)


def markdown(results: Sequence[CellResult], *, dataset: str, time_budget: float) -> str:
    lines = [
        f"FedAvg as clients train ({dataset}, SPEAR++ victim, {time_budget:g} s budget)",
        "",
        "| client: N, mini-batch B, epochs E, lr, momentum, weight decay, width m | rows exact "
        f"| rows above {APPROX_PSNR_DB:g} dB | batches claimed exact | wrong claims | time median (max) |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        median, largest = statistics.median(result.seconds), max(result.seconds)
        lines.append(
            f"| {result.cell.label()} | {result.exact_rows} / {result.rows} | {result.approx_rows} / {result.rows} "
            f"| {result.claimed} of {len(result.seconds)} | {result.wrong_claims} | {median:.1f} s ({largest:.1f} s) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=TrainingCell.parse, default=list(DEFAULT_CELLS))
    parser.add_argument("--batches", type=int, default=3, help="clients (seeds) per cell")
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--dataset", default=None, help="default: cifar10 where found, else photo-patches")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = args.dataset
    if name is None:
        try:
            data, name = load_dataset("cifar10", split="train"), "cifar10"
        except (FileNotFoundError, ValueError, OSError):
            data, name = load_dataset("photo-patches", split="train"), "photo-patches (CIFAR-10 not found)"
    else:
        data = load_dataset(name, split="train")
    results = []
    for cell in args.cells:
        results.append(run_cell(cell, data, batches=args.batches, time_budget=args.time_budget))
        print(markdown(results[-1:], dataset=name, time_budget=args.time_budget).splitlines()[-1], flush=True)
    print()
    print(markdown(results, dataset=name, time_budget=args.time_budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
