"""opacus-example: the quickstart CNN trained with DP-SGD (Opacus), as in Flower's Opacus example.

Each client clips every per-sample gradient to ``max-grad-norm``, adds Gaussian noise of
std ``noise-multiplier x max-grad-norm`` to their sum and takes an SGD step
(``PrivacyEngine.make_private``, Poisson sampling: the batch size varies). As in Flower's
example, clients may use different noise levels: ``noise-multipliers = "0.0,1.0"`` gives
partition 0 clipping only and partition 1 noise.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord
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


def model_from(arrays: ArrayRecord) -> Net:
    """A :class:`Net` holding the received arrays."""
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    return net


def noise_multiplier(multipliers: str, partition_id: int) -> float:
    """This partition's noise multiplier from a comma-separated list, cycled over partitions."""
    values = [float(item) for item in multipliers.split(",") if item.strip()]
    if not values or any(value < 0 for value in values):
        raise ValueError(f"noise-multipliers must list non-negative numbers, got {multipliers!r}")
    return values[partition_id % len(values)]


def load_data(
    partition_id: int, num_partitions: int, *, batch_size: int, dataset: str, data_root: str
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """This client's share (every ``num_partitions``-th sample) of a 32x32 colour dataset."""
    root = data_root or None
    train = load_dataset(dataset, root=root, split="train")
    test = load_dataset(dataset, root=root, split="test")
    share = slice(partition_id, None, num_partitions)
    return (
        DataLoader(TensorDataset(train.images[share], train.labels[share]), batch_size=batch_size),
        DataLoader(TensorDataset(test.images[share], test.labels[share]), batch_size=64),
    )


def train_private(
    net: nn.Module,
    loader: DataLoader[Any],
    *,
    steps: int,
    lr: float,
    noise_multiplier: float,
    max_grad_norm: float,
    seed: int,
) -> tuple[float, list[torch.Tensor]]:
    """``steps`` DP-SGD steps on Poisson-sampled batches; the mean loss and the batches' inputs.

    ``net`` is trained in place (Opacus wraps it only for the duration).
    """
    from opacus import PrivacyEngine

    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    torch.manual_seed(seed)  # Opacus draws the Poisson batches from torch's global generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(secure_mode=False)
        private_net, private_optimizer, private_loader = engine.make_private(
            module=net,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            noise_generator=torch.Generator().manual_seed(seed),
        )
        criterion = nn.CrossEntropyLoss()
        losses: list[float] = []
        inputs: list[torch.Tensor] = []
        for images, labels in private_loader:
            if len(losses) == steps:
                break
            private_optimizer.zero_grad()
            loss = criterion(private_net(images), labels)
            loss.backward()
            private_optimizer.step()
            losses.append(loss.item())
            inputs.append(images)
    return sum(losses) / max(len(losses), 1), inputs


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
