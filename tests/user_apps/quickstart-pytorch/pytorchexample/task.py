"""The model, the data and the training loop, shaped like Flower's quickstart-pytorch."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """The quickstart's small CNN for 3x32x32 images (conv, pool, conv, pool, three linear layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class ImageDataset(Dataset[dict[str, torch.Tensor]]):
    """Samples as ``{"img": ..., "label": ...}`` dicts, as Flower Datasets hands them out."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"img": self.images[index], "label": self.labels[index]}


def load_data(
    partition_id: int, num_partitions: int, batch_size: int, partition_size: int
) -> tuple[DataLoader[dict[str, torch.Tensor]], DataLoader[dict[str, torch.Tensor]]]:
    """An IID partition, split 80/20 into train and test loaders, normalized to [-1, 1]."""
    images, labels = load_digits(return_X_y=True)
    rows = np.arange(partition_id, len(labels), num_partitions)[:partition_size]
    # 8x8 grey digits -> 3x32x32 "photos", the shape of CIFAR-10
    square = np.kron(images[rows].reshape(-1, 8, 8) / 16.0, np.ones((4, 4)))
    pictures = torch.tensor(np.repeat(square[:, None], 3, axis=1), dtype=torch.float32)
    pictures = (pictures - 0.5) / 0.5
    targets = torch.tensor(labels[rows])
    split = int(0.8 * len(rows))
    generator = torch.Generator().manual_seed(42)
    trainloader = DataLoader(
        ImageDataset(pictures[:split], targets[:split]),
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
    )
    testloader = DataLoader(ImageDataset(pictures[split:], targets[split:]), batch_size=batch_size)
    return trainloader, testloader


def train(
    net: Net, trainloader: DataLoader[dict[str, torch.Tensor]], epochs: int, lr: float, device: torch.device
) -> float:
    """Local epochs of mini-batch SGD with momentum 0.9; the mean training loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"].to(device)), batch["label"].to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(
    net: Net, testloader: DataLoader[dict[str, torch.Tensor]], device: torch.device
) -> tuple[float, float]:
    """Loss and accuracy on the test loader."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            outputs = net(batch["img"].to(device))
            labels = batch["label"].to(device)
            loss += criterion(outputs, labels).item()
            correct += int((outputs.argmax(1) == labels).sum())
    return loss / len(testloader), correct / len(testloader.dataset)  # type: ignore[arg-type]
