"""Profile the SPEAR++ sphere search against the truth on one CIFAR-10 FedSGD batch.

For each round of ``--starts`` initializations it reports, at several step counts, how many
rounded minima are exact true directions, how many distinct ones, how many of them are new, and
the seconds spent optimizing and rounding. The true directions are ``L^T G`` with
``G = dW X^+`` (the update and the batch's inputs), restricted to the informative rows the
attack searches.

    PYTHONPATH=. python3 experiments/search_profile.py --cell 200x2000 --seed 0 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from experiments.config import Cell, Setting
from experiments.observe import draw_trial, observe
from experiments.runner import load_data
from fl_attack.pipeline.candidates import informative_rows
from fl_attack.pipeline.decompose import LowRankFactors, decompose
from fl_attack.pipeline.search import (
    SETTLED_ENTRY,
    SphereSchedule,
    _RiemannianAdam,
    get_surrogate,
    random_directions,
)
from fl_attack.pipeline.sparsity import ZeroTolerance, round_minima

#: |cos| above which a rounded minimum is the true direction (exact kernels agree to ~1e-12).
EXACT_COS = 1.0 - 1e-8


@dataclasses.dataclass
class Problem:
    """The searched factors, the true unit directions and the zero tolerance."""

    factors: LowRankFactors
    truth: torch.Tensor  # (b, b) unit rows
    tolerance: ZeroTolerance


def build_problem(*, cell: Cell, seed: int) -> Problem:
    """Decompose one FedSGD batch of the SPEAR++ Table 1 victim and compute its true directions."""
    setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1)
    data = load_data([setting])[setting.data_key]
    trial = draw_trial(data, setting, index=0, seed=seed)
    observation = observe(setting, trial, data)
    update = observation.update
    weight_grad = update.weight_grad.to(torch.float64)
    factors = decompose(weight_grad, batch_size=cell.batch_size)
    relative = factors.spectrum.relative_noise
    tolerance = ZeroTolerance.from_noise(relative, width=cell.width)
    searched, _ = informative_rows(factors, tolerance)
    inputs = observation.reference
    sample_grads = weight_grad @ torch.linalg.pinv(inputs)  # (m, b): each sample's dL/dz
    truth = (factors.left.T @ sample_grads).T
    truth = truth / truth.norm(dim=1, keepdim=True)
    return Problem(searched, truth, tolerance)


def hits(problem: Problem, rounded: torch.Tensor) -> torch.Tensor:
    """For each rounded direction, the index of the true direction it equals, or -1."""
    unit = rounded / rounded.norm(dim=1, keepdim=True).clamp_min(1e-300)
    cos = (unit @ problem.truth.T).abs()
    best, index = cos.max(dim=1)
    return torch.where(best > EXACT_COS, index, torch.full_like(index, -1))


def profile_round(
    problem: Problem,
    initial: torch.Tensor,
    *,
    lr: float,
    checkpoints: tuple[int, ...],
    found: set[int],
    dtype: torch.dtype,
) -> dict[int, tuple[int, int, int, float, float]]:
    """Optimize ``initial``; at each checkpoint round every point and count exact true hits."""
    left = problem.factors.left
    m, b = left.shape
    left_fast = left.to(dtype)
    left_t = left_fast.T.contiguous()
    surrogate = get_surrogate("l1")
    schedule = SphereSchedule(lr=lr)
    state = _RiemannianAdam(initial.to(dtype))
    mu = 0.1 / math.sqrt(m)
    report: dict[int, tuple[int, int, int, float, float]] = {}
    optimize_seconds = 0.0
    torch.set_flush_denormal(True)
    for step in range(max(checkpoints)):
        begin = time.perf_counter()
        values = state.point @ left_t
        grad = surrogate.derivative(values, mu) @ left_fast
        state.step(grad, lr=schedule.lr_at(step), rows=slice(None), step=step + 1)
        optimize_seconds += time.perf_counter() - begin
        if step + 1 in checkpoints:
            begin = time.perf_counter()
            rows = min(m, max(b - 1, int(0.3 * m)))
            rounded = round_minima(problem.factors, state.point.to(torch.float64), rows=rows, exact=True)
            round_seconds = time.perf_counter() - begin
            index = hits(problem, rounded)
            exact = index[index >= 0]
            unit = state.point.to(torch.float64)
            near = (unit / unit.norm(dim=1, keepdim=True) @ problem.truth.T).abs().max(dim=1).values
            small = ((unit @ problem.factors.left.T).abs() < SETTLED_ENTRY / math.sqrt(m)).sum(dim=1)
            true_min = near > 0.99
            line = f"    step {step + 1}: minima with |cos| to a true direction > 0.99: {int(true_min.sum())}"
            line += f", median |cos| {float(near.median()):.3f}; vanishing entries:"
            if bool(true_min.any()):
                line += f" true minima >= {int(small[true_min].min())}"
            if bool((~true_min).any()):
                line += f" others <= {int(small[~true_min].max())} (median {float(small[~true_min].float().median()):.0f})"
            print(line)
            distinct = set(exact.tolist())
            report[step + 1] = (
                int(exact.numel()),
                len(distinct),
                len(distinct - found),
                optimize_seconds,
                round_seconds,
            )
            if step + 1 == max(checkpoints):
                found |= distinct
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="200x2000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=0, help="per round; 0: the attack's default")
    parser.add_argument("--checkpoints", default="50,100,200,300,500")
    parser.add_argument("--aimed", action="store_true", help="later rounds orthogonal to found directions")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--lrs", default="0.5,2.0,0.15", help="step sizes cycled over rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    b, m = (int(part) for part in args.cell.split("x"))
    begin = time.perf_counter()
    problem = build_problem(cell=Cell(b, m), seed=args.seed)
    print(
        f"cell {b}x{m} seed {args.seed}: rows {problem.factors.left.shape[0]}, set-up {time.perf_counter() - begin:.1f} s"
    )
    starts = args.starts or int(max(256, min(32 * b, 4096, 1.5e9 // (m * b))))
    checkpoints = tuple(int(c) for c in args.checkpoints.split(","))
    generator = torch.Generator().manual_seed(args.seed)
    found: set[int] = set()
    learning_rates = tuple(float(v) for v in args.lrs.split(","))
    for round_index in range(args.rounds):
        avoid = problem.truth[sorted(found)] if args.aimed and found else None
        initial = random_directions(starts, b, generator=generator, avoid=avoid)
        lr = learning_rates[round_index % len(learning_rates)]
        report = profile_round(
            problem,
            initial,
            lr=lr,
            checkpoints=checkpoints,
            found=found,
            dtype=torch.float64 if args.float64 else torch.float32,
        )
        for step, (exact, distinct, new, opt_s, round_s) in report.items():
            print(
                f"round {round_index} lr {lr} starts {starts} step {step}: exact {exact} distinct {distinct} "
                f"new {new} optimize {opt_s:.1f} s round {round_s:.1f} s"
            )
        print(f"  found so far {len(found)} / {b}")


if __name__ == "__main__":
    main()
