"""The quickstart CNN's fc1 frontier with and without the input-side proposals, on the same seeds.

Each trial builds the client update exactly as ``examples/quickstart_cnn/measure_frontier.py``
does (fresh seeded CNN, one SGD step, float32 weights as the server sees them) and attacks fc1
twice: with the input side (:mod:`fl_attack.pipeline.input_side`) and without it. Per attack
it prints one JSON line: whether ``complete`` was claimed, the recovered rows within 1e-4 and
1e-3 relative error, the largest error, the attack's seconds and its input-side figures. A
``complete`` claim whose largest error exceeds 1e-3 is counted as wrong.

    PYTHONPATH=. python3 -m experiments.input_side_frontier --batch-size 8 --trials 10 --time-budget 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fl_attack.attacks.spear as spear_module
from clients.ground_truth import layer_inputs
from fl_attack import get_attack
from fl_attack.data.images import ImageData, load_dataset
from fl_attack.evaluation.scoring_features import match_by_relative_error

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"

#: A ``complete`` claim whose largest relative error exceeds this is wrong (float32 noise
#: leaves ~1e-4 on a correct row of this CNN).
WRONG_ABOVE = 1e-3


def client_update(data: ImageData, *, batch_size: int, seed: int, lr: float) -> dict[str, Any]:
    """fc1's update and the features that entered it, as in the example's frontier measurement."""
    sys.path.insert(0, str(EXAMPLE))
    from measure_frontier import client_step

    received, net, images, _ = client_step(data, batch_size=batch_size, seed=seed, lr=lr)
    truth = layer_inputs(received, images).double().numpy()
    weight, bias = received.fc1.weight.detach().double(), received.fc1.bias.detach().double()
    return {
        "weight_grad": net.fc1.weight.detach().double() - weight,
        "bias_grad": net.fc1.bias.detach().double() - bias,
        "weight": weight,
        "bias": bias,
        "truth": truth,
    }


def _without_input_side(
    proposals: Iterator[torch.Tensor], state: object, scorer: object
) -> Iterator[torch.Tensor]:
    return proposals


def attack(update: dict[str, Any], *, input_side: bool, budget: float) -> dict[str, Any]:
    """One attack on ``update``; its claim, its errors against the truth and its figures."""
    original = getattr(spear_module, "interleave_input_side")  # noqa: B009 (not re-exported)
    if not input_side:
        setattr(spear_module, "interleave_input_side", _without_input_side)  # noqa: B010
    try:
        attacker = get_attack("spear++", device="cpu", seed=0, time_budget=budget, progress=False)
        started = time.perf_counter()
        reconstruction = attacker.invert(
            update["weight_grad"],
            update["bias_grad"],
            weight=update["weight"],
            bias=update["bias"],
            time_budget=budget,
        )
        seconds = time.perf_counter() - started
    finally:
        setattr(spear_module, "interleave_input_side", original)  # noqa: B010
    _, errors = match_by_relative_error(np.asarray(reconstruction.inputs, dtype=np.float64), update["truth"])
    stats = reconstruction.stats
    return {
        "input_side": input_side,
        "complete": reconstruction.complete,
        "rows_1e-4": int((errors < 1e-4).sum()),
        "rows_1e-3": int((errors < 1e-3).sum()),
        "max_error": float(errors.max()),
        "wrong_claim": bool(reconstruction.complete and errors.max() > WRONG_ABOVE),
        "seconds": round(seconds, 1),
        "stopped_by": stats.get("stopped_by"),
        "input_side_state": stats.get("input_side"),
        "input_side_proposals": stats.get("input_side_proposals"),
        "self_check_reasons": stats.get("self_check_reasons"),
    }


def main() -> None:
    """Attack every trial with and without the input side; one JSON line each, then a summary."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate")
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--dataset", default="photo-patches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, split="train")
    rows = []
    for seed in range(args.trials):
        update = client_update(data, batch_size=args.batch_size, seed=seed, lr=args.lr)
        for input_side in (False, True):
            row = {"seed": seed, **attack(update, input_side=input_side, budget=args.time_budget)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for input_side in (False, True):
        mine = [row for row in rows if row["input_side"] is input_side]
        summary = {
            "input_side": input_side,
            "batch_size": args.batch_size,
            "trials": len(mine),
            "complete": sum(row["complete"] for row in mine),
            "all_rows_1e-4": sum(row["rows_1e-4"] == args.batch_size for row in mine),
            "all_rows_1e-3": sum(row["rows_1e-3"] == args.batch_size for row in mine),
            "rows_1e-4": sum(row["rows_1e-4"] for row in mine),
            "rows_1e-3": sum(row["rows_1e-3"] for row in mine),
            "wrong_claims": sum(row["wrong_claim"] for row in mine),
        }
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
