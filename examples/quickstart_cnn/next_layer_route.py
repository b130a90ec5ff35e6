"""fc1's inputs at batch 32 from fc2's update: the next-layer route (an exploration, not wired in).

In FedSGD the server sees every layer's update. fc2's update ``dW2 = sum_i d2_i a_i^T`` has the
batch's fc1 activations ``a_i = relu(W1 x_i + b1)`` as its row space ``U2`` (rank b), and fc1's
update ``dW1`` has the batch's inputs as its row space ``V``. With ``x = V u`` each sample
satisfies ``relu(W1 V u + b1) in U2``: 120 - b conditions on b unknowns whose scale is fixed by
the bias, linear once the ReLU pattern is fixed. The search:

1. smooth start: Adam on ``|P_perp softplus(A u + b1)|^2 / |softplus(A u + b1)|^2`` from random
   non-negative inputs projected on ``V`` (softplus sharpened from beta 5 to 200);
2. pattern iteration (Lloyd): pattern of ``A u + b1`` -> least squares of ``P_perp D_S (A u + b1)``
   -> pattern, until the pattern repeats;
3. a pattern is accepted when the residual is small AND fc1's gradient side agrees: the rows
   of ``L`` (``dW1 = L R``) at the inactive neurons share a kernel ``q`` (SPEAR's own test);
4. deflation: a later sample's ``u`` is orthogonal to every accepted ``q`` (``X^T = Q^-1 R``),
   so the search continues in the complement (only ``q`` with a clean kernel deflate);
5. exact input: the zeros of the approximate input pin it in the row space of ``[dW1 db1]``
   (the bias column fixes the scale); zeros the kernel contradicts are dropped and it is solved
   again. A sample counts as claimed when that kernel is clean (relative singular value below
   ``--claim-kernel``) with a clear gap to the next one.

Scoring against the true features (``measure_frontier.py``'s match, exact below 1e-4) is done
only after the search; nothing in the search reads them.

    PYTHONPATH=. python examples/quickstart_cnn/next_layer_route.py --batch-sizes 32 --trials 3 --time-budget 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_frontier import client_step  # noqa: E402

from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack.data.images import load_dataset  # noqa: E402
from fl_attack.evaluation.scoring_features import match_by_relative_error  # noqa: E402
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402

#: Lloyd results with a relative residual outside U2 above this are dropped.
MAX_RESIDUAL = 3e-3
#: The inactive rows of L must share a kernel this clean (relative singular value) to accept.
MAX_PATTERN_KERNEL = 1e-3
#: Only directions whose kernel is this clean deflate the search space.
DEFLATE_KERNEL = 1e-5


@dataclass(frozen=True)
class Observed:
    """What the server holds for one FedSGD client update (float64 copies of float32 arrays)."""

    weight1: np.ndarray
    bias1: np.ndarray
    weight2: np.ndarray
    update1: np.ndarray
    bias_update1: np.ndarray
    update2: np.ndarray


@dataclass
class Recovered:
    """One sample found by the route: approximate and exact input, and the checks' numbers."""

    approximate: np.ndarray
    exact: np.ndarray
    residual: float
    pattern_kernel: float
    input_kernel: float
    input_gap: float
    direction: np.ndarray
    seconds: float


@dataclass
class SearchResult:
    """All samples found, the rounds run and the time taken."""

    samples: list[Recovered] = field(default_factory=list)
    rounds: int = 0
    seconds: float = 0.0


def top_factors(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``L = U S`` (``(m, rank)``) and ``V`` (``(n, rank)``) of the top ``rank`` singular triplets."""
    left, values, right = np.linalg.svd(matrix, full_matrices=False)
    return left[:, :rank] * values[:rank], right[:rank].T


def complement(directions: list[np.ndarray], size: int) -> np.ndarray:
    """Orthonormal basis of the vectors in ``R^size`` orthogonal to every one of ``directions``."""
    if not directions:
        return np.eye(size)
    stacked = np.array(directions).T
    left = np.linalg.svd(stacked, full_matrices=True)[0]
    return left[:, stacked.shape[1] :]


def smooth_starts(
    inputs_map: np.ndarray, bias: np.ndarray, outside: np.ndarray, starts: np.ndarray, *, steps: int = 300
) -> np.ndarray:
    """Adam on the softplus relaxation of ``|P_perp relu(A u + b)| / |relu(A u + b)|`` for every start."""
    matrix, shift, projector = (torch.from_numpy(item) for item in (inputs_map, bias, outside))
    points = torch.from_numpy(starts.copy()).requires_grad_(True)
    optimizer = torch.optim.Adam([points], lr=0.05)
    for step in range(steps):
        beta = 5.0 * 40.0 ** (step / (steps - 1))
        active = torch.nn.functional.softplus(points @ matrix.T + shift, beta=beta)
        loss = ((active @ projector) ** 2).sum(1) / (active**2).sum(1)
        optimizer.zero_grad()
        loss.sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return points.detach().numpy()


def pattern_iteration(
    point: np.ndarray, inputs_map: np.ndarray, bias: np.ndarray, outside: np.ndarray, *, iterations: int = 30
) -> tuple[np.ndarray, float]:
    """Lloyd: ReLU pattern -> least squares of the part outside U2 -> pattern; the point and its residual."""
    previous: np.ndarray | None = None
    for _ in range(iterations):
        active = inputs_map @ point + bias > 0
        if not active.any() or (previous is not None and (active == previous).all()):
            break
        previous = active
        point = np.linalg.lstsq(outside[:, active] @ inputs_map[active], -outside[:, active] @ bias[active])[
            0
        ]
    outputs = np.maximum(inputs_map @ point + bias, 0.0)
    norm = float(np.linalg.norm(outputs))
    return point, float(np.linalg.norm(outside @ outputs)) / norm if norm > 0 else np.inf


def exact_from_zeros(
    augmented_basis: np.ndarray, approximate: np.ndarray, *, threshold: float = 1e-3, passes: int = 3
) -> tuple[np.ndarray, float, float]:
    """The row-space vector of ``[dW1 db1]`` vanishing on ``approximate``'s zeros, scaled by the bias.

    Zeros are entries below ``threshold`` times the largest; after each solve the zeros whose
    rows the kernel fits worst (beyond 5 times the median misfit) are dropped. Returns the input,
    the kernel's relative singular value and the next one (the gap).
    """
    zeros = approximate <= threshold * float(np.abs(approximate).max())
    rows = augmented_basis[:-1]
    kernel = np.zeros(augmented_basis.shape[1])
    values = np.ones(1)
    for _ in range(passes):
        if zeros.sum() < augmented_basis.shape[1]:
            break
        _, values, right = np.linalg.svd(rows[zeros], full_matrices=False)
        kernel = right[-1]
        misfit = np.abs(rows @ kernel)
        median = float(np.median(misfit[zeros]))
        keep = zeros & (misfit <= 5.0 * median + 1e-300)
        if (keep == zeros).all():
            break
        zeros = keep
    vector = augmented_basis @ kernel
    if vector[-1] == 0 or values.size < 2:
        return np.zeros(rows.shape[0]), 1.0, 1.0
    return vector[:-1] / vector[-1], float(values[-1] / values[0]), float(values[-2] / values[0])


def search(
    observed: Observed,
    *,
    batch_size: int,
    budget: float,
    starts: int,
    seed: int,
    max_rounds: int | None = None,
) -> SearchResult:
    """Find the batch's fc1 inputs from fc1's and fc2's updates (module docstring).

    Stops after ``budget`` seconds, ``max_rounds`` rounds of ``starts`` starts (None: no limit)
    or when ``batch_size`` samples are found; ``seed`` fixes the starts.
    """
    if batch_size < 1 or starts < 1 or budget <= 0:
        raise ValueError(
            f"batch_size, starts and budget must be positive, got {batch_size}, {starts}, {budget}"
        )
    rng = np.random.default_rng(seed)
    left, basis = top_factors(observed.update1, batch_size)
    _, rows2 = top_factors(observed.update2, batch_size)
    outside = np.eye(observed.bias1.size) - rows2 @ rows2.T
    augmented = np.linalg.svd(
        np.hstack([observed.update1, observed.bias_update1[:, None]]), full_matrices=False
    )[2][:batch_size].T
    full_map = observed.weight1 @ basis
    result = SearchResult()
    deflating: list[np.ndarray] = []
    started = time.perf_counter()
    while time.perf_counter() - started < budget and len(result.samples) < batch_size:
        if max_rounds is not None and result.rounds >= max_rounds:
            break
        result.rounds += 1
        reduced = complement(deflating, batch_size)
        space = basis @ reduced
        inputs_map = observed.weight1 @ space
        noise = np.maximum(rng.standard_normal((starts, basis.shape[0])), 0.0)
        points = (noise * rng.exponential(size=noise.shape)) @ space
        ratio = np.exp(rng.uniform(np.log(0.5), np.log(8.0), size=(starts, 1)))
        points *= ratio * observed.bias1.std() / (points @ inputs_map.T).std(1, keepdims=True)
        points = smooth_starts(inputs_map, observed.bias1, outside, points)
        for point in points:
            if time.perf_counter() - started > budget:
                break
            solved, residual = pattern_iteration(point, inputs_map, observed.bias1, outside)
            if residual > MAX_RESIDUAL:
                continue
            # deflating by noisy directions moves the other samples slightly out of the reduced
            # space: polish in the whole row space
            solved, residual = pattern_iteration(reduced @ solved, full_map, observed.bias1, outside)
            if residual > MAX_RESIDUAL:
                continue
            inactive = full_map @ solved + observed.bias1 <= 0
            if inactive.sum() < batch_size:
                continue
            _, values, right = np.linalg.svd(left[inactive], full_matrices=False)
            kernel_value, direction = float(values[-1] / values[0]), right[-1]
            if kernel_value > MAX_PATTERN_KERNEL:
                continue
            approximate = basis @ solved
            exact, input_kernel, gap = exact_from_zeros(augmented, approximate)
            if any(_cosine(exact, other.exact) > 0.999 for other in result.samples):
                continue
            if kernel_value < DEFLATE_KERNEL:
                deflating.append(direction)
            result.samples.append(
                Recovered(
                    approximate=approximate,
                    exact=exact,
                    residual=residual,
                    pattern_kernel=kernel_value,
                    input_kernel=input_kernel,
                    input_gap=gap,
                    direction=direction,
                    seconds=time.perf_counter() - started,
                )
            )
    result.seconds = time.perf_counter() - started
    return result


def _cosine(first: np.ndarray, second: np.ndarray) -> float:
    norms = float(np.linalg.norm(first) * np.linalg.norm(second))
    return abs(float(first @ second)) / norms if norms > 0 else 0.0


def observe(batch_size: int, seed: int, lr: float) -> tuple[Observed, np.ndarray]:
    """One client's FedSGD step as ``measure_frontier.py`` takes it; the server's view and fc1's true inputs."""
    data = load_dataset("photo-patches", split="train")
    received, net, images, _ = client_step(data, batch_size=batch_size, seed=seed, lr=lr)

    def delta(new: torch.Tensor, old: torch.Tensor) -> np.ndarray:
        return (new.detach().double() - old.detach().double()).numpy()

    observed = Observed(
        weight1=received.fc1.weight.detach().double().numpy(),
        bias1=received.fc1.bias.detach().double().numpy(),
        weight2=received.fc2.weight.detach().double().numpy(),
        update1=delta(net.fc1.weight, received.fc1.weight),
        bias_update1=delta(net.fc1.bias, received.fc1.bias),
        update2=delta(net.fc2.weight, received.fc2.weight),
    )
    return observed, layer_inputs(received, images).double().numpy()


def score(result: SearchResult, truth: np.ndarray, *, claim_kernel: float) -> dict[str, Any]:
    """Exact samples (distinct true rows below 1e-4), claimed ones, and claims that are wrong."""
    row: dict[str, Any] = {
        "found": len(result.samples),
        "rounds": result.rounds,
        "seconds": round(result.seconds, 1),
    }
    if not result.samples:
        return row | {
            "exact": 0,
            "approximate_1e_2": 0,
            "claimed": 0,
            "claimed_wrong": 0,
            "claimed_wrong_sample": 0,
        }
    exact = np.array([sample.exact for sample in result.samples])
    approximate = np.array([sample.approximate for sample in result.samples])
    errors = np.array([np.linalg.norm(truth - x, axis=1) / np.linalg.norm(truth, axis=1) for x in exact])
    nearest, nearest_error = errors.argmin(1), errors.min(1)
    claimed = np.array(
        [s.input_kernel < claim_kernel and s.input_gap > 100 * claim_kernel for s in result.samples]
    )
    is_exact = nearest_error < EXACT_RELATIVE_ERROR
    _, approximate_errors = match_by_relative_error(approximate, truth)
    row.update(
        exact=len(set(nearest[is_exact].tolist())),
        approximate_1e_2=int((approximate_errors < 1e-2).sum()),
        claimed=int(claimed.sum()),
        claimed_wrong=int((claimed & ~is_exact).sum()),
        claimed_wrong_sample=int((claimed & (nearest_error > 1e-2)).sum()),
        worst_claimed_error=float(f"{nearest_error[claimed].max():.2e}") if claimed.any() else None,
        exact_unclaimed=int((~claimed & is_exact).sum()),
        first_exact_s=round(
            min((s.seconds for s, e in zip(result.samples, is_exact, strict=True) if e), default=-1), 1
        ),
    )
    return row


def main() -> None:
    """Run the trials; one JSON line each and a summary per batch size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate")
    parser.add_argument("--time-budget", type=float, default=60.0, help="seconds of search per batch")
    parser.add_argument("--starts", type=int, default=100, help="random starts per round")
    parser.add_argument("--claim-kernel", type=float, default=1e-5, help="input-side kernel a claim needs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch_size in (int(item) for item in args.batch_sizes.split(",")):
        rows = []
        for seed in range(args.trials):
            observed, truth = observe(batch_size, seed, args.lr)
            result = search(
                observed, batch_size=batch_size, budget=args.time_budget, starts=args.starts, seed=seed
            )
            rows.append(
                {"batch_size": batch_size, "seed": seed}
                | score(result, truth, claim_kernel=args.claim_kernel)
            )
            print(json.dumps(rows[-1]), flush=True)
        summary = {
            "batch_size": batch_size,
            "trials": len(rows),
            "exact": f"{sum(r['exact'] for r in rows)}/{batch_size * len(rows)}",
            "batches_all_exact": sum(r["exact"] == batch_size for r in rows),
            "claimed": sum(r["claimed"] for r in rows),
            "claimed_wrong": sum(r["claimed_wrong"] for r in rows),
            "claimed_wrong_sample": sum(r["claimed_wrong_sample"] for r in rows),
            "seconds": [r["seconds"] for r in rows],
        }
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
