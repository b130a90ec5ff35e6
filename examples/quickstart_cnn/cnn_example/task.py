"""cnn-example: Flower's quickstart-pytorch CNN and its data, unchanged by the audit."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_attack.data.images import load_dataset


class Net(nn.Module):
    """Flower's quickstart-pytorch CNN: conv-pool-conv-pool, then fc 400 -> 120 -> 84 -> 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a ``(B, 3, 32, 32)`` batch."""
        return self.head(self.features(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """fc1's inputs: the pooled conv features of a ``(B, 3, 32, 32)`` batch, ``(B, 400)``."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return x.view(-1, 16 * 5 * 5)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits from fc1's inputs (fc1, fc2, fc3 with ReLU)."""
        x = F.relu(self.fc1(features))
        x = F.relu(self.fc2(x))
        logits: torch.Tensor = self.fc3(x)
        return logits


def load_data(
    partition_id: int,
    num_partitions: int,
    *,
    batch_size: int,
    dataset: str,
    data_root: str,
    seed: int,
    samples: int = 0,
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """This client's share of a 32x32 colour dataset: train and test loaders.

    ``dataset`` is ``photo-patches`` (bundled with scikit-learn / scikit-image, offline) or
    ``cifar10`` (``fl-attack-data fetch cifar10``, or ``data_root``). Partitions take every
    ``num_partitions``-th sample; ``samples`` above 0 keeps the first ``samples`` of the share
    (a small client). ``seed`` shuffles the training mini-batches, a new order every epoch.
    """
    root = data_root or None
    train = load_dataset(dataset, root=root, split="train")
    test = load_dataset(dataset, root=root, split="test")
    generator = torch.Generator().manual_seed(seed)
    images = train.images[partition_id::num_partitions]
    labels = train.labels[partition_id::num_partitions]
    if samples > 0:
        images, labels = images[:samples], labels[:samples]
    train_share = TensorDataset(images, labels)
    test_share = TensorDataset(
        test.images[partition_id::num_partitions], test.labels[partition_id::num_partitions]
    )
    return (
        DataLoader(train_share, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(test_share, batch_size=64),
    )


def train(
    net: Net,
    trainloader: DataLoader[Any],
    *,
    epochs: int,
    lr: float,
    max_steps: int = 0,
    fc1_inputs: list[torch.Tensor] | None = None,
) -> float:
    """Flower's quickstart-pytorch training: ``epochs`` passes over ``trainloader``'s mini-batches.

    ``torch.optim.SGD`` with ``lr`` and momentum 0.9, cross-entropy loss, as Flower's example.
    ``max_steps`` above 0 stops after that many mini-batch steps (one step: FedSGD). Given a
    list, ``fc1_inputs`` receives the first epoch's fc1 inputs, one ``(batch, 400)`` tensor per
    step, as fc1 saw them at that step (the convolutions move between steps).

    Returns
    -------
    float
        The mean loss over the steps taken.
    """
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    net.train()
    total, steps = 0.0, 0
    for epoch in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            features = net.features(images)
            if fc1_inputs is not None and epoch == 0:
                fc1_inputs.append(features.detach().clone())
            loss = criterion(net.head(features), labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += loss.item()
            steps += 1
            if steps == max_steps:
                return total / steps
    return total / max(steps, 1)


def test(net: nn.Module, loader: DataLoader[Any]) -> tuple[float, float, int]:
    """Mean loss, accuracy and sample count of ``net`` on ``loader``."""
    criterion = nn.CrossEntropyLoss()
    net.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            outputs = net(images)
            loss += float(criterion(outputs, labels)) * len(labels)
            correct += int((outputs.argmax(1) == labels).sum())
            count += len(labels)
    return loss / max(count, 1), correct / max(count, 1), count
