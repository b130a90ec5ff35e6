"""What the quickstart CNN's fc1 update holds: the floor under issue #31's CNN row.

::

    python -m experiments.cnn_fc1_floor --sizes 32 64 96 --seeds 3 --lrs 0.01 0.1

Each client trains Flower's quickstart-pytorch CNN as its clients do (the example's own
:func:`cnn_example.task.train`: one epoch of shuffled mini-batches of 32, SGD with momentum 0.9)
and sends float32 weights. The same training is replayed in float64 from the same weights and
order, which gives every sample's fc1 input ``x_i`` at its own step and its column ``c_i``
(minus the learning rate times the momentum's total weight of that step times the sample's
gradient with respect to fc1's output), so that the replayed update is exactly
``sum_i c_i x_i^T``. Against the float32 update the client sends, per client:

- **relative noise**: ``||dW - sum_i c_i x_i^T|| / ||sum_i c_i x_i^T||``, what rounding the
  weights to float32 (and computing in float32) leaves in fc1's update;
- **rows an oracle reads exactly**: ``x_i`` by least squares from the float32 update given every
  ``c_i`` exactly (no attack knows them), scored like the CNN row of
  :mod:`experiments.fedavg_training` (relative error below
  :data:`fl_attack.vocabulary.EXACT_RELATIVE_ERROR`). An attack that reads the rows from fc1's
  update alone does not beat this oracle by more than chance;
- **zero sets**: samples whose column has at least ``b - 1`` zeros (a sample's direction is
  fixed by its zeros only then: what SPEAR's search needs), and at most how many a search could
  reach by peeling (once ``k`` samples are known, ``b - k - 1`` zeros suffice for the rest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from experiments.fedavg_training import QUICKSTART_CNN, quickstart_cnn_client
from fl_attack.data.images import ImageData, load_dataset, sample_batch
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR

MOMENTUM = 0.9  # Flower's quickstart-pytorch SGD
MINI_BATCH = 32


@dataclass(frozen=True)
class FloorRow:
    """One client's floor: its noise, the oracle's exact rows and the zero sets' reach."""

    samples: int
    lr: float
    seed: int
    relative_noise: float
    oracle_exact: int
    oracle_median_error: float
    enough_zeros: int
    peel_reach: int


def replayed_columns(
    received: dict[str, np.ndarray], images: torch.Tensor, labels: torch.Tensor, *, seed: int, lr: float
) -> tuple[np.ndarray, np.ndarray]:
    """Replay the client's training in float64: fc1's inputs ``(N, 400)`` and columns ``(N, 120)``.

    The loader is built as :func:`experiments.fedavg_training.quickstart_cnn_client` builds it
    (same seed, same order). Rows come in the order the samples were used.
    """
    if str(QUICKSTART_CNN) not in sys.path:
        sys.path.insert(0, str(QUICKSTART_CNN))
    from cnn_example.task import Net

    net = Net(num_classes=len(received["fc3.bias"])).double()
    net.load_state_dict({key: torch.from_numpy(value).double() for key, value in received.items()})
    loader = DataLoader(
        TensorDataset(images.double(), labels),
        batch_size=MINI_BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=MOMENTUM)
    inputs: list[torch.Tensor] = []
    gradients: list[torch.Tensor] = []
    for batch_images, batch_labels in loader:
        optimizer.zero_grad()
        features = net.features(batch_images)
        outputs = net.fc1(features)
        outputs.retain_grad()
        logits = net.fc3(F.relu(net.fc2(F.relu(outputs))))
        F.cross_entropy(logits, batch_labels).backward()  # type: ignore[no-untyped-call]
        assert outputs.grad is not None
        inputs.append(features.detach().clone())
        gradients.append(outputs.grad.detach().clone())
        optimizer.step()
    steps = len(inputs)
    # Step t's gradient reaches the weights through every later momentum buffer.
    weights = [sum(MOMENTUM**k for k in range(steps - t)) for t in range(steps)]
    columns = torch.cat([-lr * w * g for w, g in zip(weights, gradients, strict=True)])
    return torch.cat(inputs).numpy(), columns.numpy()


def peel_reach(zeros: np.ndarray) -> int:
    """At most how many samples zero sets can reach, peeling known samples off one by one."""
    remaining = sorted(int(z) for z in zeros)
    known = 0
    while remaining and remaining[-1] >= len(remaining) - 1:
        remaining.pop()
        known += 1
    return known


def floor_row(data: ImageData, *, samples: int, seed: int, lr: float) -> FloorRow:
    """Measure one client (``samples`` images, seed ``seed``, learning rate ``lr``)."""
    received, trained, _ = quickstart_cnn_client(data, samples=samples, seed=seed, lr=lr)
    images, labels, _ = sample_batch(data, samples, seed=seed)
    inputs, columns = replayed_columns(received, images, labels, seed=seed, lr=lr)
    update = trained["fc1.weight"].astype(np.float64) - received["fc1.weight"].astype(np.float64)
    replayed = columns.T @ inputs
    noise = float(np.linalg.norm(update - replayed) / np.linalg.norm(replayed))
    oracle = np.linalg.lstsq(columns.T, update, rcond=None)[0]
    errors = np.linalg.norm(oracle - inputs, axis=1) / np.linalg.norm(inputs, axis=1)
    zeros = (columns == 0).sum(axis=1)
    return FloorRow(
        samples=samples,
        lr=lr,
        seed=seed,
        relative_noise=noise,
        oracle_exact=int((errors < EXACT_RELATIVE_ERROR).sum()),
        oracle_median_error=float(np.median(errors)),
        enough_zeros=int((zeros >= samples - 1).sum()),
        peel_reach=peel_reach(zeros),
    )


def markdown(rows: Sequence[FloorRow]) -> str:
    """One line per (N, lr): sums over the seeds, medians of the noise and of the oracle's error."""
    lines = [
        "| client: N images, lr | fc1 update's relative noise (float32) | rows an oracle knowing "
        f"every c_i reads exactly (< {EXACT_RELATIVE_ERROR:g}) | oracle's median row error | "
        "samples with >= N - 1 zeros | at most reachable by zero sets (peeling) |",
        "|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((row.samples, row.lr) for row in rows):
        group = [row for row in rows if (row.samples, row.lr) == key]
        total = sum(row.samples for row in group)
        lines.append(
            f"| {key[0]}, lr {key[1]:g} "
            f"| {statistics.median(row.relative_noise for row in group):.1e} "
            f"| {sum(row.oracle_exact for row in group)} / {total} "
            f"| {statistics.median(row.oracle_median_error for row in group):.1e} "
            f"| {sum(row.enough_zeros for row in group)} / {total} "
            f"| {sum(row.peel_reach for row in group)} / {total} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[32, 64, 96], help="client sizes N")
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.01, 0.1], help="learning rates")
    parser.add_argument("--seeds", type=int, default=3, help="clients (seeds 0..) per size")
    parser.add_argument("--dataset", default="cifar10")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, split="train")
    rows = []
    for samples in args.sizes:
        for lr in args.lrs:
            for seed in range(args.seeds):
                rows.append(floor_row(data, samples=samples, seed=seed, lr=lr))
                print(rows[-1], flush=True)
    print()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
