"""tabular-example: Flower's fl-tabular income classifier on UCI Adult, unchanged by the audit.

As in Flower's ``fl-tabular`` example, the 14 Adult features become 14 numbers (categories as
integer codes) standardized column by column, and ``IncomeClassifier`` starts with
``Linear(14, 128)``. The data are a bundled 600-row sample of UCI Adult
(``adult_sample.json``, CC BY 4.0), or the full ``adult.data`` (``data-source = "uci"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_attack.data.adult import ADULT_FEATURES, MISSING
from fl_attack.data.locate import locate_dataset
from fl_attack.evaluation.scoring import OrdinalSchema

FEATURES: tuple[str, ...] = tuple(name for name, _ in ADULT_FEATURES)
CATEGORIES: dict[str, tuple[str, ...]] = {name: values for name, values in ADULT_FEATURES if values}
SAMPLE = Path(__file__).with_name("adult_sample.json")


class IncomeClassifier(nn.Module):
    """Flower's fl-tabular model: 14 -> 128 -> 64 -> 1 with ReLUs and a sigmoid."""

    def __init__(self, input_dim: int = 14) -> None:
        super().__init__()
        self.layer1 = nn.Linear(input_dim, 128)
        self.layer2 = nn.Linear(128, 64)
        self.output = nn.Linear(64, 1)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Probability that each row earns more than 50K."""
        x = self.relu(self.layer1(x))
        x = self.relu(self.layer2(x))
        probabilities: torch.Tensor = self.sigmoid(self.output(x))
        return probabilities


def _code(name: str, value: str | int) -> float:
    if name in CATEGORIES:
        return float(CATEGORIES[name].index(str(value)))
    return float(value)


def load_table(source: str, data_root: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw rows ``(N, 14)`` (categories as codes) and labels ``(N,)`` (1: income > 50K).

    ``source`` is ``"bundled"`` (the 600-row sample next to this file) or ``"uci"`` (the complete
    rows of ``adult.data``, found by ``fl-attack-data``'s search or under ``data_root``).
    """
    if source == "bundled":
        rows = json.loads(SAMPLE.read_text(encoding="utf-8"))["rows"]
    elif source == "uci":
        path = locate_dataset("adult", root=data_root or None) / "adult.data"
        rows = [
            [field.strip() for field in line.split(",")]
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.count(",") == len(FEATURES) and MISSING not in line
        ]
    else:
        raise ValueError(f"data-source must be 'bundled' or 'uci', got {source!r}")
    raw = np.array([[_code(name, value) for name, value in zip(FEATURES, row, strict=False)] for row in rows])
    labels = np.array([str(row[-1]).rstrip(".") == ">50K" for row in rows], dtype=np.float32)
    return raw, labels


def table_schema(raw: np.ndarray) -> OrdinalSchema:
    """How rows are encoded: each column standardized by the whole table's mean and std."""
    return OrdinalSchema.fit(raw, names=FEATURES, categories=CATEGORIES)


def load_data(
    partition_id: int, num_partitions: int, *, batch_size: int, source: str, data_root: str, seed: int
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """This client's share of the table (every ``num_partitions``-th row): 80% train, 20% test."""
    raw, labels = load_table(source, data_root)
    features = torch.from_numpy(table_schema(raw).encode(raw))
    targets = torch.from_numpy(labels)
    share = torch.arange(partition_id, len(raw), num_partitions)
    cut = int(0.8 * len(share))
    train = TensorDataset(features[share[:cut]], targets[share[:cut]])
    test = TensorDataset(features[share[cut:]], targets[share[cut:]])
    generator = torch.Generator().manual_seed(seed)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(test, batch_size=128),
    )


def train(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], *, optimizer: str, lr: float
) -> float:
    """One step of ``optimizer`` (``"sgd"`` or ``"adam"``, Flower's choice) per batch; the mean loss."""
    step: torch.optim.Optimizer
    if optimizer == "sgd":
        step = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "adam":
        step = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    criterion = nn.BCELoss()
    model.train()
    total = 0.0
    for rows, targets in batches:
        step.zero_grad()
        loss = criterion(model(rows).squeeze(1), targets)
        loss.backward()
        step.step()
        total += loss.item()
    return total / len(batches)


def evaluate(model: nn.Module, loader: DataLoader[Any]) -> tuple[float, float, int]:
    """Mean BCE loss, accuracy and row count of ``model`` on ``loader``."""
    criterion = nn.BCELoss()
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for rows, targets in loader:
            probabilities = model(rows).squeeze(1)
            loss += float(criterion(probabilities, targets)) * len(targets)
            correct += int(((probabilities > 0.5).float() == targets).sum())
            count += len(targets)
    return loss / max(count, 1), correct / max(count, 1), count
