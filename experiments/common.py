"""Shared helpers of the benchmark scripts: trials, attacks, scoring, aggregation, reports.

A *trial* is one client batch plus one freshly initialised victim network, both drawn from
the trial's seed, so that every method (and every defence setting) of a benchmark is run on
exactly the same data and the same weights. An attack on one update gives an
:class:`Outcome`; outcomes are grouped by setting and summarised into accuracy (fraction of
batches whose mean PSNR beats a threshold), mean PSNR and median seconds per batch.

An attack that raises, or that overruns its hard wall-clock limit, is recorded as a failed
batch with its error string: a benchmark never crashes on one batch.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import platform
import signal
import statistics
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from fl_attack import Spear, SpearPlusPlus
from fl_attack.attacks.spear import GradientInversionAttack
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.reconstruction import Reconstruction
from fl_attack.evaluation.metrics import BatchQuality, evaluate_reconstruction
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear

__all__ = [
    "METHODS",
    "RESULTS_DIR",
    "AttackRun",
    "AttackTimeout",
    "Cell",
    "MethodSpec",
    "Outcome",
    "PaperNumber",
    "ResultsWriter",
    "Trial",
    "Update",
    "attack_update",
    "run_attack",
    "configure_runtime",
    "environment",
    "fedsgd_update_of",
    "format_accuracy",
    "format_number",
    "hard_time_limit",
    "layer_update",
    "load_cifar10",
    "log_progress",
    "make_attack",
    "make_trial",
    "markdown_table",
    "parse_cells",
    "parse_floats",
    "parse_ints",
    "parse_names",
    "summarize",
]

RESULTS_DIR: Path = Path(__file__).resolve().parent / "results"
"""Default output folder of the benchmark scripts (committed: keep what goes there small)."""

_ERROR_CHARS = 300


# --------------------------------------------------------------------------- command line


@dataclass(frozen=True, order=True)
class Cell:
    """One benchmark cell: client batch size b and victim width m."""

    batch_size: int
    width: int

    @property
    def label(self) -> str:
        """``"<b>x<m>"``, the form accepted by :func:`parse_cells`."""
        return f"{self.batch_size}x{self.width}"


def parse_cells(text: str) -> list[Cell]:
    """Parse ``"20x200,25x200"`` into cells; an empty string gives no cells.

    Raises
    ------
    ValueError
        On a malformed entry or a non-positive size.
    """
    cells: list[Cell] = []
    for item in parse_names(text):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"cell {item!r} is not of the form <b>x<m>, e.g. 20x200")
        b, m = (int(p) for p in parts)
        if b < 1 or m < 1:
            raise ValueError(f"cell {item!r} needs a positive batch size and width")
        cells.append(Cell(b, m))
    return cells


def parse_names(text: str) -> list[str]:
    """Split a comma-separated list, dropping blanks."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_floats(text: str) -> list[float]:
    """Parse ``"0.5,1,2"`` into floats."""
    return [float(item) for item in parse_names(text)]


def parse_ints(text: str) -> list[int]:
    """Parse ``"1,5,10"`` into integers."""
    return [int(item) for item in parse_names(text)]


def configure_runtime(*, threads: int | None) -> None:
    """Set torch's thread count (1 unless given) and silence library warnings.

    Parameters
    ----------
    threads
        Intra-op threads for torch; None means 1, the polite setting on a shared machine.
    """
    torch.set_num_threads(threads if threads is not None else 1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("fl_attack").setLevel(logging.WARNING)


# --------------------------------------------------------------------------- trials


@dataclass(frozen=True)
class Trial:
    """One client batch and the victim network it is fed to.

    Attributes
    ----------
    index
        Trial number within its cell (0-based).
    seed
        Seed of both the batch draw and the victim initialisation.
    inputs
        ``(b, C, H, W)`` normalized float32 images.
    labels
        ``(b,)`` int64 labels.
    model
        The float32 SPEAR++ victim (three hidden ReLU layers of width m).
    """

    index: int
    seed: int
    inputs: torch.Tensor
    labels: torch.Tensor
    model: nn.Module

    @property
    def reference(self) -> torch.Tensor:
        """The ground truth as the attack sees it: ``(b, n)`` float64 flattened inputs."""
        return self.inputs.reshape(self.inputs.shape[0], -1).to(torch.float64)


@dataclass(frozen=True)
class Update:
    """What the server observes of the attacked first layer, and where it was taken."""

    weight_grad: torch.Tensor
    bias_grad: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor


def load_cifar10() -> ImageData:
    """CIFAR-10 training images (found under ``shared/data/cifar10`` automatically)."""
    return load_dataset("cifar10", split="train")


def make_trial(
    data: ImageData,
    *,
    cell: Cell,
    index: int,
    seed: int,
    architecture: str = "spear++",
) -> Trial:
    """Draw trial ``index``: a batch of ``cell.batch_size`` images and a fresh victim.

    Parameters
    ----------
    data
        The image dataset.
    cell
        Batch size and victim width.
    index
        Trial number, stored for reporting.
    seed
        Seeds the batch draw and the victim initialisation alike, so that every method
        attacks the same gradients.
    architecture
        Victim architecture name of :func:`fl_attack.simulate.victims.build_victim`.
    """
    inputs, labels, _ = sample_batch(data, cell.batch_size, seed=seed)
    model = build_victim(
        architecture,
        input_dim=data.input_dim,
        width=cell.width,
        num_classes=data.num_classes,
        seed=seed,
    )
    return Trial(index=index, seed=seed, inputs=inputs, labels=labels, model=model)


def layer_update(model: nn.Module, weight_grad: torch.Tensor, bias_grad: torch.Tensor) -> Update:
    """Bundle a first-layer update with the layer's parameters at which it was taken."""
    _, layer = first_linear(model)
    return Update(
        weight_grad=weight_grad,
        bias_grad=bias_grad,
        weight=layer.weight.detach().clone(),
        bias=layer.bias.detach().clone(),
    )


def fedsgd_update_of(trial: Trial) -> Update:
    """The undefended FedSGD float32 client gradient of the trial's batch."""
    weight_grad, bias_grad = client_gradient(trial.model, trial.inputs, trial.labels)
    return layer_update(trial.model, weight_grad, bias_grad)


# --------------------------------------------------------------------------- attacks


@dataclass(frozen=True)
class MethodSpec:
    """A named attack configuration of the benchmarks."""

    name: str
    label: str
    build: Callable[[int, float], GradientInversionAttack]


def _spear_pp(surrogate: str, optimizer: str) -> Callable[[int, float], GradientInversionAttack]:
    def build(seed: int, time_budget: float) -> GradientInversionAttack:
        return SpearPlusPlus(
            seed=seed,
            time_budget=time_budget,
            surrogate=surrogate,
            optimizer=optimizer,
            progress=False,
        )

    return build


def _spear(seed: int, time_budget: float) -> GradientInversionAttack:
    return Spear(seed=seed, time_budget=time_budget, progress=False)


METHODS: dict[str, MethodSpec] = {
    "l1": MethodSpec("l1", "SPEAR++ l1 (RAdam)", _spear_pp("l1", "radam")),
    "logcosh": MethodSpec("logcosh", "SPEAR++ LogCosh (RAdam)", _spear_pp("logcosh", "radam")),
    "neg_l4": MethodSpec("neg_l4", "SPEAR++ -l4 (RAdam)", _spear_pp("neg_l4", "radam")),
    "pgd": MethodSpec("pgd", "SPEAR++ l1 (PGD)", _spear_pp("l1", "pgd")),
    "spear": MethodSpec("spear", "SPEAR (sampling)", _spear),
}
"""Attack configurations by name: surrogate ``l1``/``logcosh``/``neg_l4`` with Riemannian
Adam, ``pgd`` (l1 with projected subgradient descent) and ``spear`` (SPEAR's sampling)."""


def make_attack(method: str, *, seed: int, time_budget: float) -> GradientInversionAttack:
    """Instantiate a method of :data:`METHODS`.

    Raises
    ------
    ValueError
        For an unknown method name.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {list(METHODS)}")
    return METHODS[method].build(seed, time_budget)


class AttackTimeout(TimeoutError):
    """Raised inside an attack that overran its hard wall-clock limit."""


@contextmanager
def hard_time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the enclosed code with :class:`AttackTimeout` after ``seconds``.

    The attack's own time budget is checked only between search rounds; this limit (a
    ``SIGALRM`` timer) bounds a whole benchmark even when one round takes much longer.
    It is a no-op when ``seconds`` is None or outside the main thread.
    """
    usable = seconds is not None and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        raise AttackTimeout(f"hard time limit of {seconds:.0f} s exceeded")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Outcome:
    """The scored result of attacking one batch.

    Attributes
    ----------
    method
        Method name (a key of :data:`METHODS`).
    batch_size
        True number of samples in the batch.
    seconds
        Wall-clock seconds of the attack, also when it failed.
    mean_psnr, min_psnr
        PSNR in dB over the batch after Hungarian matching; NaN when the attack raised.
    exact_fraction, approx_fraction
        Fractions of samples above 90 dB and 25 dB.
    psnr
        Per-sample PSNR in the order of the reference batch (empty when the attack raised).
    found
        Directions the attack found (rows not filled by placeholders).
    complete
        Whether the attack reported a complete reconstruction.
    sparsity_matching
        The attack's own confidence lambda in [0, 1]; NaN when it raised.
    error
        ``"<Exception>: <message>"`` when the attack raised, else empty.
    """

    method: str
    batch_size: int
    seconds: float
    mean_psnr: float = math.nan
    min_psnr: float = math.nan
    exact_fraction: float = 0.0
    approx_fraction: float = 0.0
    psnr: list[float] = field(default_factory=list)
    found: int = 0
    complete: bool = False
    sparsity_matching: float = math.nan
    error: str = ""

    @classmethod
    def scored(cls, method: str, run: AttackRun, quality: BatchQuality) -> Outcome:
        """The outcome of a successful attack run, scored by ``quality``."""
        rec = run.reconstruction
        assert rec is not None, "only a run that returned a reconstruction can be scored"
        return cls(
            method=method,
            batch_size=int(quality.psnr.numel()),
            seconds=run.seconds,
            mean_psnr=quality.mean_psnr,
            min_psnr=float(quality.psnr.min()),
            exact_fraction=quality.exact_fraction,
            approx_fraction=quality.approx_fraction,
            psnr=[float(v) for v in quality.psnr],
            found=rec.found,
            complete=bool(rec.complete),
            sparsity_matching=float(rec.sparsity_matching),
        )

    def succeeded(self, threshold_db: float) -> bool:
        """Batch criterion of the papers: mean PSNR above ``threshold_db`` (False on error)."""
        return not math.isnan(self.mean_psnr) and self.mean_psnr > threshold_db

    def record(self, threshold_db: float) -> dict[str, Any]:
        """Flat CSV fields of this outcome (per-sample PSNRs excluded)."""
        return {
            "method": self.method,
            "ok": int(self.succeeded(threshold_db)),
            "mean_psnr": _round(self.mean_psnr),
            "min_psnr": _round(self.min_psnr),
            "exact_fraction": _round(self.exact_fraction),
            "approx_fraction": _round(self.approx_fraction),
            "seconds": _round(self.seconds),
            "found": self.found,
            "batch_size": self.batch_size,
            "complete": int(self.complete),
            "sparsity_matching": _round(self.sparsity_matching),
            "error": self.error,
        }


def _round(value: float, digits: int = 4) -> float:
    return value if math.isnan(value) else round(float(value), digits)


@dataclass(frozen=True)
class AttackRun:
    """One attack call: the reconstruction (None when it raised) and its wall-clock time."""

    reconstruction: Reconstruction | None
    seconds: float
    error: str = ""


def run_attack(
    method: str,
    update: Update,
    *,
    seed: int,
    time_budget: float,
    hard_limit: float | None,
    batch_size: int | None,
) -> AttackRun:
    """Run one method of :data:`METHODS` on one update; never raises for a failing attack.

    An exception or an overrun of ``hard_limit`` (seconds, None for none) is returned as
    ``error``; callers score the reconstruction their own way (PSNR, LPIPS, MAE, ...).
    """
    start = time.perf_counter()
    try:
        attack = make_attack(method, seed=seed, time_budget=time_budget)
        with hard_time_limit(hard_limit):
            rec = attack.invert(
                update.weight_grad,
                update.bias_grad,
                weight=update.weight,
                bias=update.bias,
                batch_size=batch_size,
            )
    except Exception as exc:  # a failed attack is a data point
        message = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        return AttackRun(None, time.perf_counter() - start, message[:_ERROR_CHARS])
    return AttackRun(rec, time.perf_counter() - start)


def attack_update(
    method: str,
    update: Update,
    reference: torch.Tensor,
    data: ImageData,
    *,
    seed: int,
    time_budget: float,
    hard_limit: float | None,
    batch_size: int | None,
) -> Outcome:
    """Run one method on one update and score it against the ground truth.

    Parameters
    ----------
    method
        Key of :data:`METHODS`.
    update
        The observed first-layer update.
    reference
        ``(b, n)`` true inputs, in the model's normalized input space.
    data
        The dataset, for de-normalization to ``[0, 1]`` images before PSNR.
    seed
        Seed of the attack's own randomness.
    time_budget
        The attack's time budget (seconds).
    hard_limit
        Wall-clock seconds after which the attack is interrupted and the batch counted as
        failed; None for no limit.
    batch_size
        Passed to the attack as the known batch size; None lets it estimate b from the
        spectrum of the update.

    Returns
    -------
    Outcome
        Never raises for a failing attack: the exception text goes to ``Outcome.error``.
    """
    true_b = int(reference.shape[0])
    run = run_attack(
        method, update, seed=seed, time_budget=time_budget, hard_limit=hard_limit, batch_size=batch_size
    )
    rec = run.reconstruction
    if rec is None:
        return Outcome(method=method, batch_size=true_b, seconds=run.seconds, error=run.error)
    quality = evaluate_reconstruction(
        rec.inputs, reference, denormalize=data.denormalize, image_shape=data.image_shape
    )
    return Outcome.scored(method, run, quality)


# --------------------------------------------------------------------------- aggregation


def summarize(outcomes: Sequence[Outcome], *, threshold_db: float) -> dict[str, Any]:
    """Aggregate the outcomes of one setting.

    Returns
    -------
    dict
        ``trials``; ``successes`` and ``accuracy`` (percent of batches with mean PSNR above
        ``threshold_db``); ``mean_psnr`` over the batches the attack returned (None when it
        never did); ``median_seconds`` over all batches; ``errors`` (batches where the attack
        raised or timed out); ``complete`` (percent of batches the attack reported complete);
        ``mean_found_fraction`` (directions found over b, averaged).
    """
    if not outcomes:
        raise ValueError("summarize needs at least one outcome")
    scored = [o.mean_psnr for o in outcomes if not math.isnan(o.mean_psnr)]
    successes = sum(o.succeeded(threshold_db) for o in outcomes)
    return {
        "trials": len(outcomes),
        "successes": successes,
        "accuracy": 100.0 * successes / len(outcomes),
        "mean_psnr": statistics.fmean(scored) if scored else None,
        "median_seconds": statistics.median(o.seconds for o in outcomes),
        "errors": sum(bool(o.error) for o in outcomes),
        "complete": 100.0 * sum(o.complete for o in outcomes) / len(outcomes),
        "mean_found_fraction": statistics.fmean(o.found / o.batch_size for o in outcomes),
        "threshold_db": threshold_db,
    }


@dataclass(frozen=True)
class PaperNumber:
    """A published result, quoted for comparison: accuracy (%) and mean PSNR (dB)."""

    accuracy: float
    psnr: float
    source: str


# --------------------------------------------------------------------------- reporting


def log_progress(
    context: str, outcome: Outcome, *, threshold_db: float, stream: TextIO | None = None
) -> None:
    """One progress line per batch on stderr.

    Example: ``b=20 m=200 trial 1/3 l1: ok=1 psnr=160.86 dB 1.92 s found 20/20 complete=1``.
    """
    psnr_text = "n/a" if math.isnan(outcome.mean_psnr) else f"{outcome.mean_psnr:.2f} dB"
    line = (
        f"{context} {outcome.method}: ok={int(outcome.succeeded(threshold_db))} "
        f"psnr={psnr_text} {outcome.seconds:.2f} s found {outcome.found}/{outcome.batch_size} "
        f"complete={int(outcome.complete)}"
    )
    if outcome.error:
        line += f" error={outcome.error}"
    print(line, file=stream if stream is not None else sys.stderr, flush=True)


def format_accuracy(summary: Mapping[str, Any]) -> str:
    """``"67% (2/3)"``."""
    return f"{summary['accuracy']:.0f}% ({summary['successes']}/{summary['trials']})"


def format_number(value: float | None, digits: int = 2) -> str:
    """A float with ``digits`` decimals, or an em dash for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def environment() -> dict[str, Any]:
    """Versions and thread count, stored with every result."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }


class ResultsWriter:
    """Writes a run's results: ``<name>.csv`` row by row, then ``<name>.json`` and ``<name>.md``.

    Rows are flushed as they come, so an interrupted run keeps every finished batch.

    Parameters
    ----------
    directory
        Output folder, created when missing.
    name
        File stem of the run.
    fields
        CSV columns; rows may omit some (left blank) but not add others.
    """

    def __init__(self, directory: Path, *, name: str, fields: Sequence[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.name = name
        self.fields = list(fields)
        self.csv_path = directory / f"{name}.csv"
        self.json_path = directory / f"{name}.json"
        self.markdown_path = directory / f"{name}.md"
        self._handle = self.csv_path.open("w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._handle, fieldnames=self.fields, extrasaction="raise")
        self._writer.writeheader()
        self._handle.flush()

    def add(self, row: Mapping[str, Any]) -> None:
        """Append one batch row to the CSV."""
        self._writer.writerow({key: row.get(key, "") for key in self.fields} | dict(row))
        self._handle.flush()

    def finish(self, summary: Mapping[str, Any], markdown: str) -> None:
        """Close the CSV and write the JSON summary and the markdown report."""
        self._handle.close()
        payload = {"environment": environment(), **summary}
        self.json_path.write_text(
            json.dumps(_json_safe(payload), indent=2) + "\n", encoding="utf-8"
        )
        self.markdown_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handle.closed:
            self._handle.close()


def add_output_arguments(parser: argparse.ArgumentParser, *, script: str) -> None:
    """Options shared by every benchmark script: batch-size estimation, output, threads, seed."""
    parser.add_argument(
        "--estimate-batch-size",
        action="store_true",
        help="let the attack estimate b instead of passing the true b",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})"
    )
    parser.add_argument("--name", help=f"file stem of the results (default {script}[_quick])")
    parser.add_argument("--threads", type=int, help="torch threads (default 1)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of trial 0; trial t uses seed + t (default 0)"
    )
