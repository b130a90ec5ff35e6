"""The CNN frontier: how often SPEAR++ recovers fc1's inputs, and what they give back as images.

For each trial a fresh quickstart CNN (seeded) takes one SGD step on a batch of photo
patches, as a client of this example does; the server sees the float32 weights before and
after. SPEAR++ attacks fc1's update; recovered feature vectors are scored by relative error
(exact below 1e-4). From the exact features and fc1's update the server gets each sample's
label and ``dL_i/df_i`` (``fl_attack.attacks.head_gradients``). The exact features are then
inverted back to images through the known convolutional part (conv-ReLU-pool-conv-ReLU-pool,
the global weights) by optimisation (``fl_attack.attacks.feature_inversion``): first the
features alone (with a total-variation prior), then, for batches recovered whole, a refinement
that also matches the conv layers' update. 400 features per 3072 pixels: only an approximation
exists; its PSNR and SSIM are reported beside those of a flat image of the mean colour.
``--oracle`` fits the true features instead of the attack's (an upper bound).

    PYTHONPATH=. python examples/quickstart_cnn/measure_frontier.py --batch-sizes 8,32 --trials 10

(from the repository root; ``--time-budget`` seconds per attack, ``--steps`` of the image fit,
``--gradient-weight`` of the conv-update term, 0 to skip the refinement).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cnn_example.task import Net  # noqa: E402

from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack import get_attack  # noqa: E402
from fl_attack.attacks.feature_inversion import invert_features_to_inputs  # noqa: E402
from fl_attack.attacks.head_gradients import feature_gradients_from_head  # noqa: E402
from fl_attack.data.images import ImageData, load_dataset  # noqa: E402
from fl_attack.evaluation.metrics import psnr, ssim  # noqa: E402
from fl_attack.evaluation.scoring_features import match_by_relative_error  # noqa: E402
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR  # noqa: E402


def conv_prefix(net: Net) -> nn.Sequential:
    """The layers before fc1 (conv-ReLU-pool-conv-ReLU-pool, flattened), sharing ``net``'s weights."""
    return nn.Sequential(net.conv1, nn.ReLU(), net.pool, net.conv2, nn.ReLU(), net.pool, nn.Flatten())


def head_after_fc1(net: Net) -> Callable[[torch.Tensor], torch.Tensor]:
    """fc1's outputs to logits (ReLU, fc2, ReLU, fc3) in float64, with ``net``'s weights."""
    fc2, fc3 = copy.deepcopy(net.fc2).double(), copy.deepcopy(net.fc3).double()

    def head(outputs: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = fc3(F.relu(fc2(F.relu(outputs))))
        return logits

    return head


def fit_images(
    received: Net,
    features: torch.Tensor,
    data: ImageData,
    *,
    gradients: tuple[torch.Tensor, list[torch.Tensor]] | None,
    init: torch.Tensor | None,
    args: argparse.Namespace,
    seed: int,
) -> torch.Tensor:
    """Normalized images whose conv features match ``features`` (and, given, the conv update).

    Without ``gradients``: ``args.steps`` Adam steps at ``args.fit_lr``. With them: a
    refinement of ``init`` by ``args.gradient_steps`` steps at ``args.gradient_lr``.
    """
    mean = torch.tensor(data.mean).view(-1, 1, 1)
    std = torch.tensor(data.std).view(-1, 1, 1)
    fitted = invert_features_to_inputs(
        prefix=conv_prefix(received),
        features=features,
        input_shape=data.image_shape,
        feature_grads=None if gradients is None else gradients[0],
        observed_prefix_grads=None if gradients is None else gradients[1],
        lower=(0.0 - mean) / std,
        upper=(1.0 - mean) / std,
        gradient_weight=args.gradient_weight,
        tv_weight=args.tv_weight,
        steps=args.steps if gradients is None else args.gradient_steps,
        lr=args.fit_lr if gradients is None else args.gradient_lr,
        seed=seed,
        init=init,
        device="auto",
    )
    return fitted.inputs


def image_scores(pictures: torch.Tensor, truth: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean and best PSNR and mean SSIM of ``pictures`` against ``truth``, keys starting with ``prefix``."""
    values = psnr(pictures, truth)
    return {
        f"{prefix}_psnr_mean": round(float(values.mean()), 2),
        f"{prefix}_psnr_max": round(float(values.max()), 2),
        f"{prefix}_ssim_mean": round(float(ssim(pictures, truth).mean()), 3),
    }


def prefix_update(net: Net, received: Net, *, lr: float) -> list[torch.Tensor]:
    """The conv layers' observed batch-mean gradient, ``-(new - old) / lr`` of the float32 weights."""
    pairs = zip(conv_prefix(net).parameters(), conv_prefix(received).parameters(), strict=True)
    return [-(new.detach() - old.detach()) / lr for new, old in pairs]


def client_step(
    data: ImageData, *, batch_size: int, seed: int, lr: float
) -> tuple[Net, Net, torch.Tensor, torch.Tensor]:
    """One client's FedSGD step: the global CNN the server sent, the client's after one SGD step
    on a seeded batch, and that batch's images and labels (float32, as the server sees them)."""
    torch.manual_seed(seed)
    net = Net()
    received = Net()
    received.load_state_dict(net.state_dict())  # the global weights the server sent
    chosen = torch.randperm(len(data), generator=torch.Generator().manual_seed(10_000 + seed))[:batch_size]
    images, labels = data.images[chosen], data.labels[chosen]
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss: torch.Tensor = F.cross_entropy(net(images), labels)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return received, net, images, labels


def trial(
    data: ImageData, *, batch_size: int, seed: int, lr: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One client batch: attack fc1's float32 update, score the features, invert exact ones to images.

    With ``args.oracle`` the attack is skipped and the true features stand in for its output
    (an upper bound on what the image fit can do from exact features).
    """
    received, net, images, labels = client_step(data, batch_size=batch_size, seed=seed, lr=lr)
    truth = layer_inputs(received, images).double().numpy()
    weight, bias = received.fc1.weight.detach().double(), received.fc1.bias.detach().double()
    weight_update = net.fc1.weight.detach().double() - weight
    row: dict[str, Any] = {"batch_size": batch_size, "seed": seed, "oracle": bool(args.oracle)}
    if args.oracle:
        recovered, estimated = truth, batch_size
        order, exact = np.arange(batch_size), np.arange(batch_size)
    else:
        attack = get_attack("spear++", device="cpu", seed=0, time_budget=args.time_budget, progress=False)
        started = time.perf_counter()
        reconstruction = attack.invert(
            weight_update,
            net.fc1.bias.detach().double() - bias,
            weight=weight,
            bias=bias,
        )
        row["seconds"] = round(time.perf_counter() - started, 1)
        row["complete"] = reconstruction.complete
        recovered = np.asarray(reconstruction.inputs, dtype=np.float64)
        estimated = reconstruction.batch_size
        order, errors = match_by_relative_error(recovered, truth)
        exact = np.flatnonzero(errors < EXACT_RELATIVE_ERROR)
    row["estimated_batch_size"] = estimated
    row["exact_features"] = int(exact.size)
    if not exact.size:
        return row
    # What the server computes from the exact features alone (no ground truth): labels and dL_i/df_i.
    features = torch.from_numpy(recovered[order[exact]])
    head = feature_gradients_from_head(
        features=features,
        weight=weight,
        bias=bias,
        head=head_after_fc1(received),
        observed_weight_grad=-weight_update / lr,
        batch_size=min(estimated, batch_size),
    )
    row["labels_right"] = int((head.labels == labels[exact]).sum())
    true_pixels = data.denormalize(images[exact]).clamp(0.0, 1.0)
    flat = torch.tensor(data.mean).view(1, -1, 1, 1).expand_as(true_pixels)  # the dataset's mean colour
    row["mean_colour_psnr"] = round(float(psnr(flat, true_pixels).mean()), 2)
    row["mean_colour_ssim"] = round(float(ssim(flat, true_pixels).mean()), 3)
    first = fit_images(received, features, data, gradients=None, init=None, args=args, seed=seed)
    row.update(image_scores(data.denormalize(first).clamp(0.0, 1.0), true_pixels, "features"))
    if args.gradient_weight > 0 and exact.size == batch_size:
        # The conv update is the whole batch's: it constrains the images only when every sample is known.
        gradients = (head.feature_grads.float(), prefix_update(net, received, lr=lr))
        refined = fit_images(received, features, data, gradients=gradients, init=first, args=args, seed=seed)
        row.update(image_scores(data.denormalize(refined).clamp(0.0, 1.0), true_pixels, "gradient"))
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
    parser.add_argument("--steps", type=int, default=2000, help="Adam steps of the image fit")
    parser.add_argument("--tv-weight", type=float, default=0.05)
    parser.add_argument("--fit-lr", type=float, default=0.01, help="Adam learning rate of the image fit")
    parser.add_argument("--gradient-steps", type=int, default=1000, help="Adam steps of the refinement")
    parser.add_argument(
        "--gradient-lr", type=float, default=0.001, help="Adam learning rate of the refinement"
    )
    parser.add_argument(
        "--gradient-weight",
        type=float,
        default=1.0,
        help="weight of the conv-update term when refining fully exact batches (0: features only)",
    )
    parser.add_argument(
        "--oracle", action="store_true", help="skip the attack: fit images to the TRUE features (upper bound)"
    )
    parser.add_argument("--dataset", default="photo-patches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, split="train")
    for batch_size in (int(item) for item in args.batch_sizes.split(",")):
        rows = []
        for seed in range(args.trials):
            rows.append(trial(data, batch_size=batch_size, seed=seed, lr=args.lr, args=args))
            print(json.dumps(rows[-1]), flush=True)
        exact = sum(row["exact_features"] for row in rows)
        summary = {
            "batch_size": batch_size,
            "trials": len(rows),
            "oracle": bool(args.oracle),
            "batches_all_exact": sum(row["exact_features"] == batch_size for row in rows),
            "samples_exact": f"{exact}/{batch_size * len(rows)}",
            "batch_size_right": sum(row["estimated_batch_size"] == batch_size for row in rows),
            "labels_right": sum(row.get("labels_right", 0) for row in rows),
        }
        for key in (
            "mean_colour_psnr",
            "mean_colour_ssim",
            "features_psnr_mean",
            "features_ssim_mean",
            "gradient_psnr_mean",
            "gradient_ssim_mean",
        ):
            values = [row[key] for row in rows if key in row]
            summary[key] = round(float(np.mean(values)), 3) if values else None
        print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
