"""secagg-example: the model, the data (bundled with scikit-learn / scikit-image) and one FedSGD step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tomli
import torch
from torch import nn

from fl_attack.data.images import ImageData, load_dataset

#: The app's ``pyproject.toml`` (next to this package, also inside the FAB that ``flwr run`` builds).
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def app_config(run_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config completed with the defaults of ``pyproject.toml``, then ``overrides``.

    ``flwr run`` passes the complete run config; ``flwr.simulation.run_simulation`` passes an
    empty one, so the defaults are read from the file and a script's ``overrides`` win.
    """
    defaults: dict[str, Any] = {}
    if PYPROJECT.is_file():
        defaults = dict(tomli.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"])
    return {**defaults, **run_config, **(overrides or {})}


def make_model(*, input_dim: int, num_classes: int, width: int, seed: int) -> nn.Sequential:
    """A ReLU MLP with two hidden layers; ``1.weight`` / ``1.bias`` is its first linear layer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(input_dim, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, num_classes),
        )


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The model's arrays in ``state_dict`` order (what a NumPyClient sends)."""
    return [value.detach().cpu().numpy() for value in model.state_dict().values()]


def set_weights(model: nn.Module, arrays: list[np.ndarray]) -> None:
    """Load arrays in ``state_dict`` order (they may arrive as float64 from SecAgg+)."""
    keys = list(model.state_dict())
    if len(keys) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for a model with {len(keys)}")
    model.load_state_dict(
        {key: torch.as_tensor(np.asarray(array)) for key, array in zip(keys, arrays, strict=True)}
    )


def load_data(name: str) -> ImageData:
    """The training split of a bundled dataset (``photo-patches`` or ``digits``), normalized, offline.

    Sample ``i`` of the split is the one clients report as index ``i``.
    """
    return load_dataset(name, split="train")


def partition(
    num_samples: int, *, partition_id: int, num_partitions: int, size: int, seed: int
) -> np.ndarray:
    """This client's sample indices: an IID share of a seeded permutation, at most ``size`` of them."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    order = np.random.default_rng(seed).permutation(num_samples)
    return np.sort(order[partition_id::num_partitions][:size])


def draw_batch(indices: np.ndarray, *, batch_size: int, seed: int) -> np.ndarray:
    """The round's batch: ``batch_size`` of the client's indices without replacement."""
    if batch_size > len(indices):
        raise ValueError(f"batch-size {batch_size} exceeds the client's {len(indices)} samples")
    return np.sort(np.random.default_rng(seed).choice(indices, size=batch_size, replace=False))


def fedsgd_step(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, lr: float) -> float:
    """One SGD step on the batch with the mean cross-entropy; returns the loss before the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(inputs), labels)
    torch.autograd.backward(loss)
    optimizer.step()
    return float(loss.detach())
