"""fc1's inputs through the Auditor: SPEAR++, then the next-layer route where SPEAR++ stops short.

Each trial is one client's FedSGD step as ``measure_frontier.py`` takes it (a fresh seeded
quickstart CNN, one SGD step on a batch of photo patches, float32 weights before and after).
The global and the client's whole state dicts go through :class:`fl_attack.audit.Auditor`
exactly as the Flower strategy hands them over, so fc2's update reaches the route
(:mod:`fl_attack.audit.next_layer_stage`). Only afterwards is the record scored: rows exact
(distinct true feature vectors matched below a relative error of 1e-4), rows the route
confirmed ("checked", the rows the verdict claims) and checked rows that are not exact.

    PYTHONPATH=. python examples/quickstart_cnn/audit_route.py --batch-sizes 32 --trials 3 --time-budget 60

``--model mlp`` audits the CNN's image twin instead: the same head (120 -> 84 -> 10, ReLU) on the
flattened photo patches, ``Linear(3072, 120)`` as its first layer, the same batches, seeds, step
and budget. fc1 then sees the images themselves, so the rows are scored against the pixels: the
like-for-like answer to "are the CNN's features recovered as reliably as images?".

``--images`` then fits images through the conv layers to the rows the audit *claims*
(``fl_attack.attacks.feature_inversion``, features only, total-variation weight
``--tv-weight``, default 1.0) and scores them against the photos (PSNR, SSIM): what a server
gets back as pictures from a batch of 32 it does not recover whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_frontier import client_step, fit_images, image_scores  # noqa: E402

from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack import get_attack  # noqa: E402
from fl_attack.audit import AttackSettings, Auditor  # noqa: E402
from fl_attack.audit.observations import ClientIdentity, ClientUpdate  # noqa: E402
from fl_attack.data.images import ImageData, load_dataset  # noqa: E402
from fl_attack.results.store import AttackRecord  # noqa: E402
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402


def image_twin(seed: int) -> torch.nn.Sequential:
    """The CNN's head on flattened images: ``Linear(3072, 120)``, then 120 -> 84 -> 10 with ReLU."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 32 * 32, 120),
        torch.nn.ReLU(),
        torch.nn.Linear(120, 84),
        torch.nn.ReLU(),
        torch.nn.Linear(84, 10),
    )


def twin_step(
    images: torch.Tensor, labels: torch.Tensor, *, seed: int, lr: float
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The image twin's global weights and the client's after one SGD step on the same batch."""
    net = image_twin(seed)
    received = image_twin(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(net(images), labels).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return received, net


def state_arrays(net: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's state dict as numpy arrays (what a Flower ArrayRecord carries)."""
    return {key: value.detach().numpy().copy() for key, value in net.state_dict().items()}


def score(record: AttackRecord, truth: np.ndarray) -> dict[str, Any]:
    """Rows exact, rows the route checked, and checked rows that are not exact (ground truth)."""
    summary = record.attack
    checked = int(summary.get("next_layer_checked", 0) or 0)
    row: dict[str, Any] = {
        "verdict": record.verdict,
        "complete": bool(summary.get("complete", False)),
        "seconds": round(record.seconds, 1),
        "route_seconds": round(float(summary.get("next_layer_seconds", 0.0)), 1),
        "route_found": summary.get("next_layer_found"),
        "checked": checked,
        "unchecked": summary.get("next_layer_unchecked"),
    }
    if record.inputs is None:
        return row | {"exact": 0, "checked_wrong": 0}
    errors = np.array(
        [np.linalg.norm(truth - x, axis=1) / np.linalg.norm(truth, axis=1) for x in record.inputs]
    )
    nearest, nearest_error = errors.argmin(1), errors.min(1)
    is_exact = nearest_error < EXACT_RELATIVE_ERROR
    # the merge puts the route's checked rows first
    return row | {
        "exact": len(set(nearest[is_exact].tolist())),
        "checked_wrong": int((~is_exact[:checked]).sum()),
        "worst_checked_error": float(f"{nearest_error[:checked].max():.2e}") if checked else None,
    }


def trial(batch_size: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One client's step through the Auditor, scored."""
    data = load_dataset("photo-patches", split="train")
    received, net, images, labels = client_step(data, batch_size=batch_size, seed=seed, lr=args.lr)
    if args.model == "mlp":
        received, net = twin_step(images, labels, seed=seed, lr=args.lr)
    truth = layer_inputs(received, images).double().numpy()
    attack = get_attack("spear++", device="cpu", seed=0, progress=False)
    auditor = Auditor(
        attack, attack=AttackSettings(batch_size=batch_size, time_budget=args.time_budget, fallback=None)
    )
    auditor.start_round(1, state_arrays(received))
    started = time.perf_counter()
    (record,) = auditor.audit_round(
        1, [ClientUpdate(identity=ClientIdentity(node_id=seed), arrays=state_arrays(net))]
    )
    auditor.close()
    row = {
        "model": args.model,
        "batch_size": batch_size,
        "seed": seed,
        "wall_s": round(time.perf_counter() - started, 1),
    } | score(record, truth)
    if args.images and args.model == "cnn" and record.inputs is not None and row["checked"]:
        row |= claimed_images(record.inputs[: row["checked"]], received, images, truth, data, args, seed)
    return row


def claimed_images(
    claimed: np.ndarray,
    received: torch.nn.Module,
    images: torch.Tensor,
    truth: np.ndarray,
    data: ImageData,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """Images fitted through the conv layers to the rows the audit claims, scored against the photos.

    The server picks the rows (the claimed ones) and fits them without ground truth; only the
    score pairs each row with the true photo whose features lie nearest.
    """
    features = torch.from_numpy(np.asarray(claimed, dtype=np.float64))
    nearest = [int(np.argmin(np.linalg.norm(truth - row, axis=1))) for row in claimed]
    fit_args = argparse.Namespace(
        steps=args.steps, fit_lr=0.01, tv_weight=args.tv_weight, gradient_weight=0.0
    )
    fitted = fit_images(received, features.float(), data, gradients=None, init=None, args=fit_args, seed=seed)
    pictures = data.denormalize(fitted).clamp(0.0, 1.0)
    true_pixels = data.denormalize(images[nearest]).clamp(0.0, 1.0)
    flat = torch.tensor(data.mean).view(1, -1, 1, 1).expand_as(true_pixels)  # the data's mean colour
    return (
        {"images_fitted": len(nearest)}
        | image_scores(pictures, true_pixels, "claimed")
        | image_scores(flat, true_pixels, "flat")
    )


def main() -> None:
    """Run the trials; one JSON line each and a summary per batch size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate")
    parser.add_argument(
        "--time-budget", type=float, default=60.0, help="the attack's budget (the route: half)"
    )
    parser.add_argument(
        "--model", choices=("cnn", "mlp"), default="cnn", help="the quickstart CNN or its image twin"
    )
    parser.add_argument(
        "--images", action="store_true", help="fit images through the conv layers to the claimed rows"
    )
    parser.add_argument("--tv-weight", type=float, default=1.0, help="TV prior of the image fit")
    parser.add_argument("--steps", type=int, default=2000, help="Adam steps of the image fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch_size in (int(item) for item in args.batch_sizes.split(",")):
        rows = []
        for seed in range(args.first_seed, args.first_seed + args.trials):
            rows.append(trial(batch_size, seed, args))
            print(json.dumps(rows[-1]), flush=True)
        summary = {
            "model": args.model,
            "batch_size": batch_size,
            "trials": len(rows),
            "exact": f"{sum(r['exact'] for r in rows)}/{batch_size * len(rows)}",
            "checked": sum(r["checked"] for r in rows),
            "checked_wrong": sum(r["checked_wrong"] for r in rows),
            "batches_all_exact": sum(r["exact"] == batch_size for r in rows),
            "verdicts": [r["verdict"] for r in rows],
            "wall_s": [r["wall_s"] for r in rows],
        }
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
