"""fc1's inputs at batch 32 from fc2's update: measures ``fl_attack.attacks.next_layer``.

In FedSGD the server sees every layer's update; fc2's update pins fc1's activations, and with
them fc1's inputs (the route is described in :mod:`fl_attack.attacks.next_layer`). For each
trial a fresh quickstart CNN (seeded) takes one SGD step on a batch of photo patches as
``measure_frontier.py`` takes it (float32 weights before and after, as the server sees them);
the route runs on fc1's and fc2's updates; only afterwards are the found inputs matched to
the true features (exact below a relative error of 1e-4). "verified" is the route's own check
(input-side kernel small against its gap); a verified sample off by more than 1e-4 counts in
``verified_wrong`` (and in ``verified_wrong_sample`` when it is off by more than 1e-2).

    PYTHONPATH=. python examples/quickstart_cnn/next_layer_route.py --batch-sizes 32 --trials 3 --time-budget 60
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_frontier import client_step  # noqa: E402

from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack import LayerUpdate  # noqa: E402
from fl_attack.attacks.next_layer import (  # noqa: E402
    NextLayerResult,
    recover_from_next_layer,
)
from fl_attack.data.images import load_dataset  # noqa: E402
from fl_attack.evaluation.scoring_features import match_by_relative_error  # noqa: E402
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402


def observe(batch_size: int, seed: int, lr: float) -> tuple[LayerUpdate[np.ndarray], np.ndarray]:
    """One client's FedSGD step as ``measure_frontier.py`` takes it; the server's view and fc1's true inputs."""
    data = load_dataset("photo-patches", split="train")
    received, net, images, _ = client_step(data, batch_size=batch_size, seed=seed, lr=lr)

    def delta(new: torch.Tensor, old: torch.Tensor) -> np.ndarray:
        return np.asarray((new.detach().double() - old.detach().double()).numpy())

    observed = LayerUpdate(
        weight=received.fc1.weight.detach().double().numpy(),
        bias=received.fc1.bias.detach().double().numpy(),
        weight_update=delta(net.fc1.weight, received.fc1.weight),
        bias_update=delta(net.fc1.bias, received.fc1.bias),
        next_weight_update=delta(net.fc2.weight, received.fc2.weight),
    )
    return observed, np.asarray(layer_inputs(received, images).double().numpy())


def score(result: NextLayerResult, truth: np.ndarray) -> dict[str, Any]:
    """Exact samples (distinct true rows below 1e-4), verified ones, and verified ones that are wrong."""
    row: dict[str, Any] = {
        "found": len(result.samples),
        "rounds": result.rounds,
        "seconds": round(result.seconds, 1),
        "exact": 0,
        "approximate_1e_2": 0,
        "verified": 0,
        "verified_wrong": 0,
        "verified_wrong_sample": 0,
    }
    if not result.samples:
        return row
    errors = np.array(
        [np.linalg.norm(truth - x, axis=1) / np.linalg.norm(truth, axis=1) for x in result.inputs]
    )
    nearest, nearest_error = errors.argmin(1), errors.min(1)
    verified = result.verified
    is_exact = nearest_error < EXACT_RELATIVE_ERROR
    _, approximate_errors = match_by_relative_error(np.array([s.approximate for s in result.samples]), truth)
    row.update(
        exact=len(set(nearest[is_exact].tolist())),
        approximate_1e_2=int((approximate_errors < 1e-2).sum()),
        verified=int(verified.sum()),
        verified_wrong=int((verified & ~is_exact).sum()),
        verified_wrong_sample=int((verified & (nearest_error > 1e-2)).sum()),
        worst_verified_error=float(f"{nearest_error[verified].max():.2e}") if verified.any() else None,
        exact_unverified=int((~verified & is_exact).sum()),
        first_exact_s=round(
            min((s.seconds for s, e in zip(result.samples, is_exact, strict=True) if e), default=-1), 1
        ),
    )
    row["samples"] = [
        {
            "error": float(f"{error:.2e}"),
            "input_kernel": float(f"{s.input_kernel:.2e}"),
            "input_gap": float(f"{s.input_gap:.2e}"),
            "pattern_kernel": float(f"{s.pattern_kernel:.2e}"),
            "residual": float(f"{s.residual:.2e}"),
        }
        for s, error in zip(result.samples, nearest_error, strict=True)
    ]
    return row


def main() -> None:
    """Run the trials; one JSON line each and a summary per batch size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="trials use seeds first-seed, first-seed + 1, ..."
    )
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate")
    parser.add_argument("--time-budget", type=float, default=60.0, help="seconds of search per batch")
    parser.add_argument("--starts", type=int, default=100, help="random starts per round")
    parser.add_argument(
        "--verify-ratio", type=float, default=1e-4, help="input-side kernel over gap a verified sample needs"
    )
    parser.add_argument("--details", action="store_true", help="also print each found sample's checks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch_size in (int(item) for item in args.batch_sizes.split(",")):
        rows = []
        for seed in range(args.first_seed, args.first_seed + args.trials):
            observed, truth = observe(batch_size, seed, args.lr)
            result = recover_from_next_layer(
                observed,
                batch_size=batch_size,
                time_budget=args.time_budget,
                starts=args.starts,
                seed=seed,
                verify_ratio=args.verify_ratio,
            )
            rows.append({"batch_size": batch_size, "seed": seed} | score(result, truth))
            details = rows[-1].pop("samples", [])
            print(json.dumps(rows[-1]), flush=True)
            if args.details:
                print("SAMPLES", json.dumps(details), flush=True)
        summary = {
            "batch_size": batch_size,
            "trials": len(rows),
            "exact": f"{sum(r['exact'] for r in rows)}/{batch_size * len(rows)}",
            "batches_all_exact": sum(r["exact"] == batch_size for r in rows),
            "verified": sum(r["verified"] for r in rows),
            "verified_wrong": sum(r["verified_wrong"] for r in rows),
            "verified_wrong_sample": sum(r["verified_wrong_sample"] for r in rows),
            "seconds": [r["seconds"] for r in rows],
        }
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
