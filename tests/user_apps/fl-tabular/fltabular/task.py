"""The model, the data and the training loop, shaped like Flower's fl-tabular."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.compose import ColumnTransformer
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

#: The synthetic census: categorical columns and their categories, then numeric columns.
CATEGORIES = {
    "workclass": ["private", "self-emp", "gov", "never-worked"],
    "education": ["hs-grad", "some-college", "bachelors", "masters", "doctorate"],
    "marital-status": ["married", "never-married", "divorced"],
    "sex": ["female", "male"],
}
NUMERIC = ("age", "hours-per-week", "capital-gain")


def census(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A census-like table (categorical columns as strings, then numeric ones) and its income labels."""
    rng = np.random.default_rng(seed)
    table = np.empty((rows, len(CATEGORIES) + len(NUMERIC)), dtype=object)
    for column, values in enumerate(CATEGORIES.values()):
        table[:, column] = rng.choice(values, size=rows)
    age = rng.integers(17, 90, size=rows).astype("float64")
    hours = rng.integers(1, 99, size=rows).astype("float64")
    gain = np.round(rng.exponential(1000.0, size=rows))
    table[:, len(CATEGORIES) :] = np.stack([age, hours, gain], axis=1)
    educated = np.isin(table[:, 1], ["masters", "doctorate"]).astype("float64")
    income = (educated + hours / 60.0 + rng.normal(0.0, 0.3, size=rows) > 1.0).astype("float32")
    return table, income


def load_data(
    partition_id: int, num_partitions: int, partition_size: int
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """An IID partition, one-hot encoded and scaled, split 80/20, in loaders of 32 rows."""
    table, income = census(num_partitions * partition_size)
    features, labels = table[partition_id::num_partitions], income[partition_id::num_partitions]
    x_train, x_test, y_train, y_test = train_test_split(features, labels, test_size=0.2, random_state=42)
    categorical = list(range(len(CATEGORIES)))
    numeric = list(range(len(CATEGORIES), len(CATEGORIES) + len(NUMERIC)))
    preprocessor = ColumnTransformer(
        transformers=[
            ("num", StandardScaler(), numeric),
            ("cat", OneHotEncoder(categories=list(CATEGORIES.values()), sparse_output=False), categorical),
        ]
    )
    train_rows = torch.tensor(preprocessor.fit_transform(x_train).astype("float64"), dtype=torch.float32)
    test_rows = torch.tensor(preprocessor.transform(x_test).astype("float64"), dtype=torch.float32)
    train_labels = torch.tensor(y_train).view(-1, 1)
    test_labels = torch.tensor(y_test).view(-1, 1)
    train_loader = DataLoader(TensorDataset(train_rows, train_labels), batch_size=32, shuffle=True)
    test_loader = DataLoader(TensorDataset(test_rows, test_labels), batch_size=32, shuffle=False)
    return train_loader, test_loader


#: Width of an encoded row: the numeric columns and every category's indicator.
INPUT_DIM = len(NUMERIC) + sum(len(values) for values in CATEGORIES.values())


class IncomeClassifier(nn.Module):
    """fl-tabular's MLP: 128 and 64 ReLU units, a sigmoid output."""

    def __init__(self, input_dim: int = INPUT_DIM) -> None:
        super().__init__()
        self.layer1 = nn.Linear(input_dim, 128)
        self.layer2 = nn.Linear(128, 64)
        self.output = nn.Linear(64, 1)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.layer1(x))
        x = self.relu(self.layer2(x))
        return self.sigmoid(self.output(x))


def train(
    model: IncomeClassifier, train_loader: DataLoader[tuple[torch.Tensor, ...]], num_epochs: int = 1
) -> None:
    """Adam (lr 0.001) on binary cross-entropy, every mini-batch of every epoch."""
    criterion = nn.BCELoss()
    optimizer = optim.Adam(model.parameters(), lr=0.001)
    model.train()
    for _ in range(num_epochs):
        for x_batch, y_batch in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x_batch), y_batch)
            loss.backward()
            optimizer.step()


def evaluate(
    model: IncomeClassifier, test_loader: DataLoader[tuple[torch.Tensor, ...]]
) -> tuple[float, float]:
    """Mean batch loss and accuracy at threshold 0.5."""
    model.eval()
    criterion = nn.BCELoss()
    loss, correct, total = 0.0, 0, 0
    with torch.no_grad():
        for x_batch, y_batch in test_loader:
            outputs = model(x_batch)
            loss += criterion(outputs, y_batch).item()
            correct += int(((outputs > 0.5).float() == y_batch).sum())
            total += y_batch.size(0)
    return loss / len(test_loader), correct / total
