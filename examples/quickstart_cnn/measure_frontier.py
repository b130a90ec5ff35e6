"""The CNN frontier: how often SPEAR++ recovers fc1's inputs, and what they give back as images.

For each trial a fresh quickstart CNN (seeded) takes one SGD step on a batch of photo
patches, as a client of this example does; the server sees the float32 weights before and
after. SPEAR++ attacks fc1's update; recovered feature vectors are scored by relative error
(exact below 1e-4). The exactly recovered features are then inverted back to images through
the known convolutional part (conv-ReLU-pool-conv-ReLU-pool, the global weights) by
optimisation: 400 features per 3072 pixels, so only an approximation exists; its PSNR is
reported beside the exact features.

    PYTHONPATH=. python examples/quickstart_cnn/measure_frontier.py --batch-sizes 8,32 --trials 10

(from the repository root; ``--time-budget`` seconds per attack, ``--steps`` of the image fit).
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cnn_example.task import Net  # noqa: E402

from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack import get_attack  # noqa: E402
from fl_attack.data.images import ImageData, load_dataset  # noqa: E402
from fl_attack.evaluation.metrics import psnr  # noqa: E402
from fl_attack.evaluation.scoring_features import match_by_relative_error  # noqa: E402
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402


def conv_features(net: Net, images: torch.Tensor) -> torch.Tensor:
    """fc1's inputs: the flattened output of the convolutional part, differentiable in ``images``."""
    x: torch.Tensor = net.pool(F.relu(net.conv1(images)))
    x = net.pool(F.relu(net.conv2(x)))
    return x.flatten(1)


def invert_features(
    net: Net, features: torch.Tensor, data: ImageData, *, steps: int, tv_weight: float, seed: int
) -> torch.Tensor:
    """Images whose conv features match ``features``: Adam on the pixels, kept in ``[0, 1]``.

    The loss is the squared feature error relative to the features' norm plus ``tv_weight``
    times the images' total variation (a smoothness prior; 400 features cannot pin 3072 pixels).

    Returns
    -------
    torch.Tensor
        ``(B, 3, 32, 32)`` pixels in ``[0, 1]``.
    """
    generator = torch.Generator().manual_seed(seed)
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    pixels = (0.5 + 0.01 * torch.randn(features.shape[0], 3, 32, 32, generator=generator)).requires_grad_(
        True
    )
    optimizer = torch.optim.Adam([pixels], lr=0.01)
    target = features.float()
    scale = target.norm(dim=1, keepdim=True).clamp_min(1e-12)
    for _ in range(steps):
        optimizer.zero_grad()
        images = pixels.clamp(0.0, 1.0)
        fitted = conv_features(net, (images - mean) / std)
        misfit = ((fitted - target) / scale).pow(2).sum(dim=1).mean()
        variation = (images[..., 1:, :] - images[..., :-1, :]).abs().mean() + (
            images[..., :, 1:] - images[..., :, :-1]
        ).abs().mean()
        (misfit + tv_weight * variation).backward()
        optimizer.step()
    return pixels.detach().clamp(0.0, 1.0)


def trial(
    data: ImageData, *, batch_size: int, seed: int, lr: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One client batch: attack fc1's float32 update, score the features, invert exact ones to images."""
    torch.manual_seed(seed)
    net = Net()
    received = Net()
    received.load_state_dict(net.state_dict())  # the global weights the server sent
    chosen = torch.randperm(len(data), generator=torch.Generator().manual_seed(10_000 + seed))[:batch_size]
    images, labels = data.images[chosen], data.labels[chosen]
    truth = layer_inputs(received, images).double().numpy()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss: torch.Tensor = F.cross_entropy(net(images), labels)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    weight, bias = received.fc1.weight.detach().double(), received.fc1.bias.detach().double()
    attack = get_attack("spear++", device="cpu", seed=0, time_budget=args.time_budget, progress=False)
    started = time.perf_counter()
    reconstruction = attack.invert(
        net.fc1.weight.detach().double() - weight,
        net.fc1.bias.detach().double() - bias,
        weight=weight,
        bias=bias,
        time_budget=args.time_budget,
    )
    seconds = time.perf_counter() - started
    recovered = np.asarray(reconstruction.inputs, dtype=np.float64)
    order, errors = match_by_relative_error(recovered, truth)
    exact = np.flatnonzero(errors < EXACT_RELATIVE_ERROR)
    row: dict[str, Any] = {
        "batch_size": batch_size,
        "seed": seed,
        "estimated_batch_size": reconstruction.batch_size,
        "complete": reconstruction.complete,
        "exact_features": int(exact.size),
        "seconds": round(seconds, 1),
    }
    if exact.size:
        features = torch.from_numpy(recovered[order[exact]])
        pictures = invert_features(
            received, features, data, steps=args.steps, tv_weight=args.tv_weight, seed=seed
        )
        values = psnr(pictures, data.denormalize(images[exact]).clamp(0.0, 1.0))
        true_pixels = data.denormalize(images[exact]).clamp(0.0, 1.0)
        flat = torch.tensor(data.mean).view(1, -1, 1, 1).expand_as(true_pixels)  # the dataset's mean colour
        row["image_psnr_mean"] = round(float(values.mean()), 2)
        row["image_psnr_max"] = round(float(values.max()), 2)
        row["mean_colour_psnr"] = round(float(psnr(flat, true_pixels).mean()), 2)
    return row


def main() -> None:
    """Run the trials and print one JSON line each, then a summary per batch size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate")
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=1000, help="Adam steps of the image fit")
    parser.add_argument("--tv-weight", type=float, default=0.05)
    parser.add_argument("--dataset", default="photo-patches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, split="train")
    for batch_size in (int(item) for item in args.batch_sizes.split(",")):
        rows = [
            trial(data, batch_size=batch_size, seed=seed, lr=args.lr, args=args)
            for seed in range(args.trials)
        ]
        for row in rows:
            print(json.dumps(row), flush=True)
        exact = sum(row["exact_features"] for row in rows)
        psnrs = [row["image_psnr_mean"] for row in rows if "image_psnr_mean" in row]
        baseline = [row["mean_colour_psnr"] for row in rows if "mean_colour_psnr" in row]
        summary = {
            "batch_size": batch_size,
            "trials": len(rows),
            "batches_all_exact": sum(row["exact_features"] == batch_size for row in rows),
            "samples_exact": f"{exact}/{batch_size * len(rows)}",
            "batch_size_right": sum(row["estimated_batch_size"] == batch_size for row in rows),
            "image_psnr_mean_of_exact": round(float(np.mean(psnrs)), 2) if psnrs else None,
            "mean_colour_psnr": round(float(np.mean(baseline)), 2) if baseline else None,
        }
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
