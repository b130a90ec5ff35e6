"""Does the audit path (the next layer's update passed along) ever recover fewer rows than the bare attack?

Each case trains one model of a small suite for one SGD step on a batch of 8 and sends the
update as a float32 delta ``W_new - W_old``, as a Flower client does. SPEAR++ attacks the first
linear layer's delta twice with the same seed and budget: bare, and with ``next_weight_grad``
(the delta of the linear layer its ReLU feeds, which the audit passes). A row is exact when its
relative error to a true input is below ``EXACT_RELATIVE_ERROR``; the script lists every case
where the audit path recovers fewer exact rows and exits 1 when there is one::

    PYTHONPATH=. python3 -m experiments.audit_vs_bare --seeds 0 1 --lrs 0.01 0.05 0.5 --budget 20

The suite: ``mlp`` (non-negative inputs of 32 features, ``Linear(32, 64)``-ReLU-``Linear(64,
32)``-ReLU-``Linear(32, 4)``), ``tabular`` (6 standard-normal columns and two 4-way one-hot
groups, ``Linear(14, 64)``-ReLU-``Linear(64, 32)``-ReLU-``Linear(32, 2)``: issue 35's case at
seed 0, lr 0.05 once lost 7 of 8 rows) and ``cnn`` (3x12x12 images, a convolution, ReLU and
pooling, then ``fc1 = Linear(144, 64)``-ReLU-``Linear(64, 10)``; fc1 is attacked on its pooled
features).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fl_attack import SpearPlusPlus
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR

BATCH = 8


@dataclass(frozen=True)
class Case:
    """One model's one-step update and the first linear layer's true inputs."""

    name: str
    seed: int
    lr: float
    global_model: torch.nn.Sequential
    client_model: torch.nn.Sequential
    first_inputs: torch.Tensor  # (BATCH, n): what the attacked layer saw
    first: int  # index of the attacked linear layer in the Sequential
    following: int  # index of the linear layer its ReLU feeds


def _mlp(rng: np.random.Generator) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor, int, int]:
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    inputs = torch.tensor(np.abs(rng.standard_normal((BATCH, 32))), dtype=torch.float32)
    return model, inputs, torch.tensor(rng.integers(0, 4, BATCH)), 0, 2


def _tabular(rng: np.random.Generator) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor, int, int]:
    model = torch.nn.Sequential(
        torch.nn.Linear(14, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 2),
    )
    groups = [np.eye(4)[rng.integers(0, 4, BATCH)] for _ in range(2)]
    columns = np.concatenate([rng.standard_normal((BATCH, 6)), *groups], axis=1)
    return model, torch.tensor(columns, dtype=torch.float32), torch.tensor(rng.integers(0, 2, BATCH)), 0, 2


def _cnn(rng: np.random.Generator) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor, int, int]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    images = torch.tensor(rng.random((BATCH, 3, 12, 12)), dtype=torch.float32)
    return model, images, torch.tensor(rng.integers(0, 10, BATCH)), 4, 6


SUITE: dict[
    str, Callable[[np.random.Generator], tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor, int, int]]
] = {
    "mlp": _mlp,
    "tabular": _tabular,
    "cnn": _cnn,
}


def build_case(name: str, *, seed: int, lr: float) -> Case:
    """Model ``name`` drawn at ``seed``, one SGD step at ``lr`` on a batch drawn at ``seed``."""
    torch.manual_seed(seed)
    model, inputs, labels, first, following = SUITE[name](np.random.default_rng(1000 + seed))
    client = copy.deepcopy(model)
    optimizer = torch.optim.SGD(client.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(client(inputs), labels).backward()
    optimizer.step()
    with torch.no_grad():
        first_inputs = model[:first](inputs) if first else inputs
    return Case(name, seed, lr, model, client, first_inputs.reshape(BATCH, -1), first, following)


def exact_rows(case: Case, *, with_next_layer: bool, budget: float) -> tuple[int, float]:
    """Exact rows SPEAR++ recovers from the case's float32 delta, and its seconds."""
    before, after = case.global_model[case.first], case.client_model[case.first]
    following = (case.client_model[case.following].weight - case.global_model[case.following].weight).detach()
    started = time.perf_counter()
    rec = SpearPlusPlus(device="cpu", seed=0, progress=False, time_budget=budget).invert(
        (after.weight - before.weight).detach(),
        (after.bias - before.bias).detach(),
        weight=before.weight.detach(),
        bias=before.bias.detach(),
        next_weight_grad=following if with_next_layer else None,
    )
    seconds = time.perf_counter() - started
    truth = case.first_inputs.double()
    errors = torch.cdist(truth, rec.inputs.double()) / truth.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return int((errors.min(dim=1).values < EXACT_RELATIVE_ERROR).sum()), seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=sorted(SUITE), default=sorted(SUITE))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.01, 0.05, 0.5])
    parser.add_argument("--budget", type=float, default=20.0, help="time budget of each attack (s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    losses = []
    print(f"{'case':8} {'seed':>4} {'lr':>5} {'bare':>9} {'audit':>9}")
    for name in args.cases:
        for seed in args.seeds:
            for lr in args.lrs:
                case = build_case(name, seed=seed, lr=lr)
                bare, bare_seconds = exact_rows(case, with_next_layer=False, budget=args.budget)
                audit, audit_seconds = exact_rows(case, with_next_layer=True, budget=args.budget)
                flag = "  LOSES ROWS" if audit < bare else ""
                print(
                    f"{name:8} {seed:>4} {lr:>5g} {bare}/{BATCH} {bare_seconds:4.1f}s "
                    f"{audit}/{BATCH} {audit_seconds:4.1f}s{flag}",
                    flush=True,
                )
                if audit < bare:
                    losses.append(
                        f"{name} seed {seed} lr {lr:g}: {bare} rows bare, {audit} with the next layer"
                    )
    print("no case loses a row" if not losses else "\n".join(["cases where the audit loses rows:", *losses]))
    return 1 if losses else 0


if __name__ == "__main__":
    raise SystemExit(main())
