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
``--cnn N [N ...]`` adds the quickstart CNN row (``examples/quickstart_cnn``): clients of ``N`` images
train Flower's quickstart-pytorch CNN as its clients do (:func:`cnn_example.task.train`: one epoch of
mini-batches of 32, SGD at lr 0.01 with momentum 0.9) and the update goes through the audit
(:class:`fl_attack.audit.Auditor`, attacking fc1, float32 state dicts as Flower sends them). The
recovered fc1 inputs are scored against the features fc1 saw at each sample's own step (relative
error below :data:`fl_attack.vocabulary.EXACT_RELATIVE_ERROR` is exact); the verdicts are the audit's.

Published anchor: Dimitrov et al., "Data Leakage in Federated Averaging" (TMLR 2022), over 45%
of FEMNIST images from 10 epochs x 10 batches x 5 images with an approximate attack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_attack import SpearPlusPlus
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import build_victim, fedavg_update, first_linear
from fl_attack.vocabulary import APPROX_PSNR_DB, EXACT_RELATIVE_ERROR

#: A looser bar for the CNN row: rows recovered to 1% (what float32 rounding at lr 0.01 still allows).
CLOSE_RELATIVE_ERROR = 1e-2

#: The quickstart CNN example, whose model and client training the CNN row uses.
QUICKSTART_CNN = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"


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


def client_update(
    cell: TrainingCell, data: ImageData, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Linear]:
    """One client of ``cell`` (victim, data draw and shuffling seeded by ``seed``): its images,
    the first layer's ``W_E - W_0`` and ``b_E - b_0``, and that layer of the global model."""
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
    return images, weight_delta, bias_delta, layer


@dataclass(frozen=True)
class CellResult:
    cell: TrainingCell
    rows: int
    exact_rows: int
    approx_rows: int
    claimed: int
    wrong_claims: int
    seconds: list[float]
    grid_claims: int = 0
    lattice_claims: int = 0  # of the grid's: batches found through the pixel lattice


def run_cell(cell: TrainingCell, data: ImageData, *, batches: int, time_budget: float) -> CellResult:
    """Attack ``batches`` clients (seeds 0, 1, ...) of one cell."""
    exact = approx = claimed = wrong = grid = lattice = 0
    seconds: list[float] = []
    for seed in range(batches):
        images, weight_delta, bias_delta, layer = client_update(cell, data, seed=seed)
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
        grid += int(is_claimed and bool(rec.stats.get("self_check_certificate")))
        lattice += int(is_claimed and rec.stats.get("stopped_by") == "pixel_lattice")
        wrong += int(is_claimed and quality.exact_fraction < 1.0)
    return CellResult(cell, batches * cell.samples, exact, approx, claimed, wrong, seconds, grid, lattice)


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
            f"| {result.claimed} of {len(result.seconds)}{_by_grid(result)} | {result.wrong_claims} "
            f"| {median:.1f} s ({largest:.1f} s) |"
        )
    return "\n".join(lines)


def _by_grid(result: CellResult) -> str:
    if not result.grid_claims:
        return ""
    found = f", {result.lattice_claims} found through its lattice" if result.lattice_claims else ""
    return f" ({result.grid_claims} by the pixel grid{found})"


@dataclass(frozen=True)
class CnnClientResult:
    """One quickstart CNN client through the audit: its fc1 rows exact, the verdict and the time."""

    samples: int
    exact_rows: int
    close_rows: int
    verdict: str
    reason: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


def quickstart_cnn_client(
    data: ImageData,
    *,
    samples: int,
    seed: int,
    batch: int = 32,
    epochs: int = 1,
    lr: float = 0.01,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """A client of the quickstart CNN example: global and trained state dicts, and fc1's true inputs.

    The global CNN is seeded with ``seed``; the client holds ``samples`` images of ``data``
    (drawn with ``seed``) and trains them with the example's own :func:`cnn_example.task.train`.
    The true inputs are the ``(samples, 400)`` rows fc1 saw in the first epoch, each at its own step.
    ``dtype`` float64 trains and sends the weights in double precision (not what Flower sends: a
    diagnosis of what the float32 weights' rounding costs).
    """
    if str(QUICKSTART_CNN) not in sys.path:
        sys.path.insert(0, str(QUICKSTART_CNN))
    from cnn_example.task import Net, train  # the example's own code, as its ClientApp runs it
    from torch.utils.data import DataLoader, TensorDataset

    images, labels, _ = sample_batch(data, samples, seed=seed)
    torch.manual_seed(seed)
    net = Net(num_classes=data.num_classes).to(dtype)
    images = images.to(dtype)
    received = {key: value.detach().numpy().copy() for key, value in net.state_dict().items()}
    loader = DataLoader(
        TensorDataset(images, labels),
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    seen: list[torch.Tensor] = []
    train(net, loader, epochs=epochs, lr=lr, fc1_inputs=seen)
    trained = {key: value.detach().numpy().copy() for key, value in net.state_dict().items()}
    return received, trained, torch.cat(seen).double()


def run_cnn_client(
    data: ImageData,
    *,
    samples: int,
    seed: int,
    time_budget: float,
    batch: int = 32,
    lr: float = 0.01,
    dtype: torch.dtype = torch.float32,
) -> CnnClientResult:
    """Audit one quickstart CNN client of ``samples`` images (the audit estimates the batch size)."""
    from fl_attack import get_attack
    from fl_attack.audit import AttackSettings, Auditor
    from fl_attack.audit.observations import ClientIdentity, ClientUpdate
    from fl_attack.evaluation.scoring_features import match_by_relative_error

    received, trained, truth = quickstart_cnn_client(
        data, samples=samples, seed=seed, batch=batch, lr=lr, dtype=dtype
    )
    auditor = Auditor(
        get_attack("spear++", device="cpu", seed=0, progress=False),
        attack=AttackSettings(time_budget=time_budget, fallback=None),
    )
    auditor.start_round(1, received)
    start = time.perf_counter()
    (record,) = auditor.audit_round(
        1, [ClientUpdate(identity=ClientIdentity(node_id=seed), arrays=trained, num_examples=samples)]
    )
    seconds = time.perf_counter() - start
    auditor.close()
    exact = close = 0
    if record.inputs is not None and len(record.inputs):
        _, errors = match_by_relative_error(np.asarray(record.inputs, dtype=np.float64), truth.numpy())
        exact = int((errors < EXACT_RELATIVE_ERROR).sum())
        close = int((errors < CLOSE_RELATIVE_ERROR).sum())
    keys = ("estimated_batch_size", "relative_noise", "directions_found", "stopped_by", "input_side")
    details = {key: record.attack[key] for key in keys if key in record.attack}
    return CnnClientResult(
        samples, exact, close, record.verdict or "", record.verdict_reason or "", seconds, details
    )


def cnn_markdown(
    results: Sequence[CnnClientResult],
    *,
    dataset: str,
    time_budget: float,
    precision: str = "float32",
    batch: int = 32,
    lr: float = 0.01,
) -> str:
    """The quickstart CNN rows: per client size, fc1 rows exact, verdicts and attack times."""
    lines = [
        f"Quickstart CNN fc1 as Flower's clients train ({dataset}, mini-batch {batch}, 1 epoch, lr {lr:g}, "
        f"momentum 0.9; {precision} weights; audit, {time_budget:g} s budget)",
        "",
        f"| client: N images | fc1 rows exact (< {EXACT_RELATIVE_ERROR:g}) | rows within {CLOSE_RELATIVE_ERROR:g} "
        "| verdicts | time median (max) |",
        "|---|---|---|---|---|",
    ]
    for samples in sorted({result.samples for result in results}):
        group = [result for result in results if result.samples == samples]
        seconds = [result.seconds for result in group]
        exact, rows = sum(result.exact_rows for result in group), samples * len(group)
        close = sum(result.close_rows for result in group)
        verdicts = ", ".join(result.verdict for result in group)
        lines.append(
            f"| {samples} | {exact} / {rows} ({100 * exact / rows:.0f}%) | {close} / {rows} | {verdicts} "
            f"| {statistics.median(seconds):.1f} s ({max(seconds):.1f} s) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=TrainingCell.parse, default=list(DEFAULT_CELLS))
    parser.add_argument("--batches", type=int, default=3, help="clients (seeds) per cell")
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--dataset", default=None, help="default: cifar10 where found, else photo-patches")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cnn", nargs="*", type=int, default=[], help="quickstart CNN client sizes N (the CNN row)"
    )
    parser.add_argument("--json", default=None, help="write the CNN clients' results here")
    parser.add_argument("--cnn-mini-batch", type=int, default=32, help="CNN clients' mini-batch")
    parser.add_argument("--cnn-lr", type=float, default=0.01, help="CNN clients' learning rate")
    parser.add_argument(
        "--cnn-float64", action="store_true", help="CNN clients send float64 weights (a diagnosis)"
    )
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
    if args.cnn:
        return _cnn_rows(args, data, name)
    results = []
    for cell in args.cells:
        results.append(run_cell(cell, data, batches=args.batches, time_budget=args.time_budget))
        print(markdown(results[-1:], dataset=name, time_budget=args.time_budget).splitlines()[-1], flush=True)
    print()
    print(markdown(results, dataset=name, time_budget=args.time_budget))
    return 0


def _cnn_rows(args: argparse.Namespace, data: ImageData, name: str) -> int:
    """The CNN row: ``--batches`` clients (seeds) of every size in ``--cnn``."""
    cnn_results = []
    for samples in args.cnn:
        for seed in range(args.batches):
            result = run_cnn_client(
                data,
                samples=samples,
                seed=seed,
                time_budget=args.time_budget,
                batch=args.cnn_mini_batch,
                lr=args.cnn_lr,
                dtype=torch.float64 if args.cnn_float64 else torch.float32,
            )
            cnn_results.append(result)
            print(json.dumps(result.__dict__), flush=True)
    print()
    precision = "float64" if args.cnn_float64 else "float32"
    table = cnn_markdown(
        cnn_results,
        dataset=name,
        time_budget=args.time_budget,
        precision=precision,
        batch=args.cnn_mini_batch,
        lr=args.cnn_lr,
    )
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in cnn_results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
