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
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        logits: torch.Tensor = self.fc3(x)
        return logits


def load_data(
    partition_id: int, num_partitions: int, *, batch_size: int, dataset: str, data_root: str, seed: int
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """This client's share of a 32x32 colour dataset: train and test loaders.

    ``dataset`` is ``photo-patches`` (bundled with scikit-learn / scikit-image, offline) or
    ``cifar10`` (``fl-attack-data fetch cifar10``, or ``data_root``). Partitions take every
    ``num_partitions``-th sample; ``seed`` shuffles the training batches (one draw per round).
    """
    root = data_root or None
    train = load_dataset(dataset, root=root, split="train")
    test = load_dataset(dataset, root=root, split="test")
    generator = torch.Generator().manual_seed(seed)
    train_share = TensorDataset(
        train.images[partition_id::num_partitions], train.labels[partition_id::num_partitions]
    )
    test_share = TensorDataset(
        test.images[partition_id::num_partitions], test.labels[partition_id::num_partitions]
    )
    return (
        DataLoader(train_share, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(test_share, batch_size=64),
    )


def train(net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float) -> float:
    """One SGD step (momentum 0.9, as in Flower's quickstart) per batch; the mean loss."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    net.train()
    total = 0.0
    for images, labels in batches:
        optimizer.zero_grad()
        loss = criterion(net(images), labels)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(batches)


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
