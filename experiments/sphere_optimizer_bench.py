"""geoopt's ``Sphere`` + ``RiemannianAdam`` against the search's own Riemannian Adam, per paper cell.

Both take the same steps (``tests/test_sphere_optimizer.py`` checks them bit for bit); this
times them on the shapes SPEAR++ optimizes per round: ``k`` starts (``SpearPlusPlus``'s default
for the cell) of dimension ``b`` against an ``(m, b)`` float32 left factor, the l1 surrogate.
Runs alternate between the two (the machine may be loaded), and geoopt's one-time cost (its
import and the ``torch._dynamo`` import its first step triggers) is timed apart, in a fresh
interpreter.

    PYTHONPATH=. python experiments/sphere_optimizer_bench.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from experiments.config import parse_cells
from fl_attack import SpearPlusPlus
from fl_attack.pipeline.search.sphere import SphereSchedule, get_surrogate, optimize_on_sphere

CELLS = "20x200,30x200,100x1000,150x4000,400x4000"

_FIRST_USE = """
import time, torch
start = time.perf_counter()
import geoopt
point = geoopt.ManifoldParameter(torch.nn.functional.normalize(torch.randn(4, 3), dim=1), manifold=geoopt.Sphere())
opt = geoopt.optim.RiemannianAdam([point], lr=0.1)
point.grad = torch.randn(4, 3)
opt.step()
print(time.perf_counter() - start)
"""


def geoopt_search(left: torch.Tensor, start: torch.Tensor, schedule: SphereSchedule) -> torch.Tensor:
    """The search's loop with geoopt's ``Sphere`` and ``RiemannianAdam`` doing each step."""
    import geoopt

    mu = 0.1 / left.shape[0] ** 0.5
    derivative = get_surrogate("l1").derivative
    point = geoopt.ManifoldParameter(start.clone(), manifold=geoopt.Sphere())
    optimizer = geoopt.optim.RiemannianAdam([point], lr=schedule.lr)
    left_t = left.T.contiguous()
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        with torch.no_grad():
            point.grad = derivative(point @ left_t, mu) @ left
        optimizer.step()
    return point.detach()


def own_search(left: torch.Tensor, start: torch.Tensor, schedule: SphereSchedule) -> torch.Tensor:
    return optimize_on_sphere(
        left, start, surrogate=get_surrogate("l1"), optimizer="radam", schedule=schedule
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=CELLS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flops-per-run", type=float, default=2e10, help="sets the steps timed per cell")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if importlib.util.find_spec("geoopt") is None:
        raise SystemExit("sphere_optimizer_bench: geoopt is not installed (pip install 'fl-attack[test]')")
    first_use = float(
        subprocess.run([sys.executable, "-c", _FIRST_USE], capture_output=True, text=True).stdout
    )
    print(f"geoopt first use (import + first RiemannianAdam step, fresh interpreter): {first_use:.2f} s")
    rows = []
    for cell in parse_cells(args.cells):
        b, m = cell.batch_size, cell.width
        k = SpearPlusPlus()._initializations_per_round(b, m)
        steps = int(max(10, min(500, args.flops_per_run / (4.0 * k * m * b))))
        generator = torch.Generator().manual_seed(0)
        left, _ = torch.linalg.qr(torch.randn(m, b, generator=generator, dtype=torch.float64))
        left = left.to(torch.float32)
        start = torch.nn.functional.normalize(torch.randn(k, b, generator=generator), dim=1)
        schedule = SphereSchedule(steps=steps, lr=0.5, milestones=(int(0.4 * steps), int(0.8 * steps)))
        same = torch.equal(own_search(left, start, schedule), geoopt_search(left, start, schedule))
        times: dict[str, list[float]] = {"own": [], "geoopt": []}
        for _ in range(args.repeats):
            for name, search in (("own", own_search), ("geoopt", geoopt_search)):
                begin = time.perf_counter()
                search(left, start, schedule)
                times[name].append((time.perf_counter() - begin) / steps * 1e3)
        own, geo = statistics.median(times["own"]), statistics.median(times["geoopt"])
        row = {"cell": cell.label, "k": k, "steps": steps, "own_ms_per_step": own, "geoopt_ms_per_step": geo}
        row |= {"geoopt_over_own": geo / own, "bitwise_equal": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| cell | k | own ms/step | geoopt ms/step | geoopt / own | same points |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['cell']} | {row['k']} | {row['own_ms_per_step']:.2f} | {row['geoopt_ms_per_step']:.2f} | "
            f"{row['geoopt_over_own']:.2f}x | {row['bitwise_equal']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
