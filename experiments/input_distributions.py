"""Benchmark: exact recovery and time across victim depths and input distributions (issue #18).

SPEAR++'s own setting (three hidden ReLU layers, normalised CIFAR-10) is fast; users' models are
often shallower and see non-negative or one-hot inputs. This script attacks FedSGD gradients
(float32, mean cross-entropy) of freshly initialised victims with one or three hidden layers on

* ``cifar10``: normalised CIFAR-10 (per-channel mean / std),
* ``mnist-raw``: MNIST pixels in ``[0, 1]`` (not normalised),
* ``adult``: UCI Adult rows (one-hot discrete columns, standardised continuous ones),

and reports, per (dataset, hidden layers, cell), the share of batches recovered exactly (every
sample above 90 dB for images, every row exact for tabular data), the median and largest attack
time, and how often the attack claimed ``complete`` on a batch that was not exact (it must never).

::

    python -m experiments.input_distributions --trials 10 --label after
    python -m experiments.input_distributions --head off --label before      # without the head hook
    python -m experiments.input_distributions --next-layer auto --label next # with the next layer's gradient
    python -m experiments.input_distributions --summarize OUT/before.csv OUT/after.csv

The script imports nothing but :mod:`fl_attack`, so it can also time another checkout of it
(``PYTHONPATH=that/checkout python path/to/input_distributions.py``); ``--head auto`` passes the
output layer's weight (``head_weight=``) only where the attacked layer feeds the output layer
(one hidden layer) and the attack uses it (:attr:`fl_attack.LayerAttack.uses`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fl_attack
from fl_attack import SpearPlusPlus
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.data.tabular import TabularData, load_adult, sample_tabular_batch
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate import victims
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear, linear_layers

DATASETS = ("cifar10", "mnist-raw", "adult")

#: Image rows loaded per dataset: enough distinct batches, little memory.
IMAGE_LIMIT = 5000

#: The reference setting the targets are measured against: SPEAR++'s own.
REFERENCE = ("cifar10", 3)


@dataclass(frozen=True)
class Source:
    """A dataset as the benchmark uses it: batches, victim shape and an exactness test."""

    name: str
    input_dim: int
    num_classes: int
    sample: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    score: Callable[[torch.Tensor, torch.Tensor], tuple[bool, float]]
    """``(reconstruction, reference) -> (exact, quality)``; quality is the mean PSNR (images)
    or the share of exact rows (tabular)."""


@dataclass(frozen=True)
class Row:
    """One attacked batch."""

    label: str
    dataset: str
    hidden_layers: int
    batch_size: int
    width: int
    trial: int
    seed: int
    head: bool
    exact: bool
    complete: bool
    found: int
    quality: float
    seconds: float
    head_searches: int
    error: str
    next_layer: str = ""
    """The attack's ``stats["next_layer"]`` ("on", "not needed", "off: ..."), empty when not given."""


def _image_source(data: ImageData) -> Source:
    def sample(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels, _ = sample_batch(data, batch_size, seed=seed)
        return inputs.reshape(batch_size, -1), labels

    def score(reconstruction: torch.Tensor, reference: torch.Tensor) -> tuple[bool, float]:
        quality = evaluate_reconstruction(reconstruction, reference, denormalize=data.denormalize)
        return quality.exact_fraction == 1.0, float(quality.mean_psnr)

    return Source(data.name, data.input_dim, data.num_classes, sample, score)


def _tabular_source(data: TabularData) -> Source:
    def sample(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        features, labels, _ = sample_tabular_batch(data, batch_size=batch_size, seed=seed)
        return features, labels

    def score(reconstruction: torch.Tensor, reference: torch.Tensor) -> tuple[bool, float]:
        scored = data.score(reconstruction, reference)
        return scored.exact_fraction == 1.0, float(scored.exact_fraction)

    return Source(data.name, data.schema.input_dim, 2, sample, score)


def load_source(name: str, *, root: str | None) -> Source:
    """The benchmark's view of ``name`` (one of :data:`DATASETS`).

    Raises
    ------
    ValueError
        For an unknown name.
    FileNotFoundError
        When the data set is not on this machine.
    """
    if name == "cifar10":
        return _image_source(load_dataset("cifar10", root=root, limit=IMAGE_LIMIT))
    if name == "mnist-raw":
        normalised = load_dataset("mnist", root=root, limit=IMAGE_LIMIT)
        pixels = normalised.denormalize(normalised.images).clamp(0.0, 1.0).contiguous()
        raw = ImageData(
            name="mnist-raw",
            images=pixels,
            labels=normalised.labels,
            mean=(0.0,),
            std=(1.0,),
            num_classes=normalised.num_classes,
            classes=normalised.classes,
        )
        return _image_source(raw)
    if name == "adult":
        return _tabular_source(load_adult(root=root, split="train"))
    raise ValueError(f"unknown dataset {name!r}; choose from {list(DATASETS)}")


def output_layer_weight(model: nn.Module) -> torch.Tensor | None:
    """The output layer's weight when the attacked (first) layer's ReLU feeds it directly."""
    layers = linear_layers(model)
    return layers[1][1].weight.detach().clone() if len(layers) == 2 else None


def attack_batch(
    source: Source,
    *,
    hidden_layers: int,
    batch_size: int,
    width: int,
    seed: int,
    time_budget: float,
    use_head: bool,
    use_next_layer: bool = False,
) -> tuple[dict[str, Any], bool]:
    """Attack trial ``seed``'s gradient once; the row's outcome fields and whether the head was used.

    ``use_next_layer`` also passes the gradient of the layer the attacked layer's ReLU feeds
    (``next_weight_grad=``), where the attack uses it and one follows.
    """
    inputs, labels = source.sample(batch_size, seed)
    model = build_victim(
        "spear++",
        input_dim=source.input_dim,
        width=width,
        num_classes=source.num_classes,
        depth=hidden_layers + 1,
        seed=seed,
    )
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    _, layer = first_linear(model)
    attack = SpearPlusPlus(time_budget=time_budget, seed=seed, progress=False)
    extra: dict[str, Any] = {}
    uses = getattr(attack, "uses", frozenset())  # a checkout from before LayerAttack.uses: neither
    head = output_layer_weight(model) if use_head and "head_weight" in uses else None
    if head is not None:
        extra["head_weight"] = head
    gradient_of_next = getattr(victims, "next_layer_gradient", None)  # absent from older checkouts
    if use_next_layer and gradient_of_next is not None and "next_weight_update" in uses:
        following = gradient_of_next(model, inputs, labels)
        if following is not None:
            extra["next_weight_grad"] = following
    start = time.perf_counter()
    try:
        rec = attack.invert(
            weight_grad,
            bias_grad,
            weight=layer.weight.detach(),
            bias=layer.bias.detach(),
            batch_size=batch_size,
            **extra,
        )
    except Exception as error:  # a failed attack is a data point, not the end of the benchmark
        seconds = time.perf_counter() - start
        return {
            "exact": False,
            "complete": False,
            "found": 0,
            "quality": math.nan,
            "seconds": seconds,
            "head_searches": 0,
            "error": f"{type(error).__name__}: {error}",
        }, head is not None
    exact, quality = source.score(rec.inputs, inputs.reshape(batch_size, -1).to(torch.float64))
    return {
        "exact": exact,
        "complete": bool(rec.complete),
        "found": rec.found,
        "quality": quality,
        "seconds": rec.seconds,
        "head_searches": int(rec.stats.get("head_searches", 0)),
        "error": "",
        "next_layer": str(rec.stats.get("next_layer", "")),
    }, head is not None


def warm_up() -> None:
    """One small untimed attack: geoopt's import and TorchScript compilation take seconds once."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 30, generator=generator)
    model = build_victim("spear++", input_dim=30, width=40, num_classes=3, depth=2, seed=0)
    weight_grad, bias_grad = client_gradient(model, x, torch.tensor([0, 1, 2, 0]))
    _, layer = first_linear(model)
    SpearPlusPlus(time_budget=5.0, progress=False).invert(
        weight_grad, bias_grad, weight=layer.weight.detach(), bias=layer.bias.detach(), batch_size=4
    )


def parse_cells(text: str) -> list[tuple[int, int]]:
    cells = []
    for part in text.split(","):
        b, _, m = part.strip().partition("x")
        if not (b.isdigit() and m.isdigit()) or int(b) < 1 or int(m) <= int(b):
            raise argparse.ArgumentTypeError(f"a cell is <b>x<m> with 1 <= b < m, got {part!r}")
        cells.append((int(b), int(m)))
    return cells


def parse_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DATASETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"datasets are among {list(DATASETS)}, got {text!r}")
    return names


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(value) for value in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"hidden layers are integers >= 1, got {text!r}") from None
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"hidden layers are integers >= 1, got {text!r}")
    return depths


def run(args: argparse.Namespace) -> list[Row]:
    """Attack every (dataset, hidden layers, cell, trial); append each row to the CSV as it ends."""
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{args.label}.csv"
    names = [field.name for field in fields(Row)]
    sources = {name: load_source(name, root=args.data_root) for name in args.datasets}
    warm_up()
    rows: list[Row] = []
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for name in args.datasets:
            for hidden in args.hidden_layers:
                for batch_size, width in args.cells:
                    for trial in range(args.trials):
                        seed = args.seed + trial
                        outcome, used_head = attack_batch(
                            sources[name],
                            hidden_layers=hidden,
                            batch_size=batch_size,
                            width=width,
                            seed=seed,
                            time_budget=args.time_budget,
                            use_head=args.head == "auto",
                            use_next_layer=args.next_layer == "auto",
                        )
                        row = Row(
                            label=args.label,
                            dataset=name,
                            hidden_layers=hidden,
                            batch_size=batch_size,
                            width=width,
                            trial=trial,
                            seed=seed,
                            head=used_head,
                            **outcome,
                        )
                        rows.append(row)
                        writer.writerow(asdict(row))
                        handle.flush()
                        print(
                            f"{name} hidden={hidden} {batch_size}x{width} trial {trial}: exact={row.exact} "
                            f"complete={row.complete} {row.seconds:.2f}s {row.error}",
                            file=sys.stderr,
                            flush=True,
                        )
    environment = {
        "label": args.label,
        "fl_attack": str(Path(fl_attack.__file__).parent),
        "torch": torch.__version__,
        "threads": args.threads,
        "time_budget": args.time_budget,
        "head": args.head,
        "next_layer": args.next_layer,
        "argv": sys.argv[1:],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / f"{args.label}.json").write_text(json.dumps(environment, indent=2) + "\n")
    return rows


def read_rows(paths: Sequence[str]) -> list[Row]:
    """Rows of earlier runs' CSV files."""
    rows = []
    for path in paths:
        with open(path, newline="") as handle:
            for record in csv.DictReader(handle):
                rows.append(
                    Row(
                        label=record["label"],
                        dataset=record["dataset"],
                        hidden_layers=int(record["hidden_layers"]),
                        batch_size=int(record["batch_size"]),
                        width=int(record["width"]),
                        trial=int(record["trial"]),
                        seed=int(record["seed"]),
                        head=record["head"] == "True",
                        exact=record["exact"] == "True",
                        complete=record["complete"] == "True",
                        found=int(record["found"]),
                        quality=float(record["quality"]),
                        seconds=float(record["seconds"]),
                        head_searches=int(record["head_searches"]),
                        error=record["error"],
                        next_layer=record.get("next_layer", ""),
                    )
                )
    return rows


def summarize(rows: Sequence[Row]) -> str:
    """Markdown: one line per (dataset, hidden layers, cell, label), with the reference ratio."""
    groups: dict[tuple[str, int, int, int, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.dataset, row.hidden_layers, row.batch_size, row.width, row.label), []).append(
            row
        )
    medians = {key: statistics.median(r.seconds for r in group) for key, group in groups.items()}
    # the reference setting (three hidden layers) never uses the head: a run without it (e.g.
    # one with only one hidden layer) is compared with another run's reference at the same cell
    any_reference = {
        (key[2], key[3]): median for key, median in medians.items() if (key[0], key[1]) == REFERENCE
    }
    lines = [
        "| dataset | hidden layers | b x m | run | head | batches | exact | median s | max s | x reference median |"
        " complete but not exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(
        groups, key=lambda k: (k[2], k[3], DATASETS.index(k[0]) if k[0] in DATASETS else 9, k[1], k[4])
    ):
        group = groups[key]
        dataset, hidden, b, m, label = key
        reference = medians.get((REFERENCE[0], REFERENCE[1], b, m, label), any_reference.get((b, m)))
        ratio = f"{medians[key] / reference:.1f}" if reference else "n/a"
        exact = sum(r.exact for r in group)
        lying = sum(r.complete and not r.exact for r in group)
        lines.append(
            f"| {dataset} | {hidden} | {b}x{m} | {label} | {'yes' if any(r.head for r in group) else 'no'} | "
            f"{len(group)} | {exact}/{len(group)} ({100.0 * exact / len(group):.0f}%) | {medians[key]:.2f} | "
            f"{max(r.seconds for r in group):.2f} | {ratio} | {lying} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.input_distributions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--datasets", type=parse_names, default=list(DATASETS), help="comma-separated")
    parser.add_argument(
        "--hidden-layers", type=parse_depths, default=[1, 3], help="comma-separated, e.g. 1,3"
    )
    parser.add_argument(
        "--cells", type=parse_cells, default=[(10, 200), (20, 200)], help="<b>x<m>, comma-separated"
    )
    parser.add_argument("--trials", type=int, default=10, help="batches per setting (trial t uses seed + t)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=30.0, help="attack budget, seconds per batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--head",
        choices=("auto", "off"),
        default="auto",
        help="auto: pass the output layer's weight where it follows the attacked layer",
    )
    parser.add_argument(
        "--next-layer",
        choices=("off", "auto"),
        default="off",
        help="auto: pass the gradient of the layer the attacked layer's ReLU feeds (next_weight_grad=)",
    )
    parser.add_argument(
        "--label", default="run", help="names the CSV / JSON files and the run in the summary"
    )
    parser.add_argument("--data-root", default=None, help="root of the datasets (default: searched)")
    parser.add_argument("--out", default="outputs/experiments/input_distributions")
    parser.add_argument(
        "--summarize", nargs="+", metavar="CSV", help="only summarize earlier runs' CSV files"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarize:
        print(summarize(read_rows(args.summarize)), end="")
        return 0
    if args.trials < 1 or not args.time_budget > 0 or args.threads < 1:
        print("--trials and --threads must be >= 1 and --time-budget > 0", file=sys.stderr)
        return 2
    try:
        rows = run(args)
    except FileNotFoundError as error:
        print(str(error).splitlines()[0], file=sys.stderr)
        return 2
    summary = summarize(rows)
    (Path(args.out) / f"{args.label}.md").write_text(summary)
    print(summary, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
