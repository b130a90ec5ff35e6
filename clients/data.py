"""Load a client's data once per process: the dataset and this client's indices."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .partition import partition_indices


@dataclass(frozen=True)
class ClientData:
    """The dataset as seen by one client.

    Attributes
    ----------
    images : torch.Tensor
        ``(N, C, H, W)`` normalized float32 images of the *whole* dataset; the client
        only ever reads the rows in ``indices``.
    labels : torch.Tensor
        ``(N,)`` int64 labels.
    indices : numpy.ndarray
        The client's dataset indices.
    num_classes : int
        Classes of the dataset.
    input_dim : int
        Features per flattened sample.
    """

    images: torch.Tensor
    labels: torch.Tensor
    indices: np.ndarray
    num_classes: int
    input_dim: int


@lru_cache(maxsize=4)
def load_image_data(name: str, root: str, limit: int) -> Any:
    """``fl_attack.data.images.load_dataset`` cached per process (clients reuse it every round)."""
    from fl_attack.data.images import load_dataset  # pylint: disable=import-outside-toplevel

    return load_dataset(name, root=root or None, split="train", limit=limit or None)


def client_data(
    *,
    dataset: str,
    data_root: str,
    dataset_limit: int,
    partitioning: str,
    num_partitions: int,
    partition_id: int,
    samples_per_client: int,
    labels_per_client: int,
    seed: int,
) -> ClientData:
    """Load the dataset and pick this client's share of it.

    Parameters
    ----------
    dataset : str
        Dataset name for ``fl_attack.data.images.load_dataset``.
    data_root : str
        Directory with the data files ("" for the default search path).
    dataset_limit : int
        Load at most this many samples (0 for all).
    partitioning : str
        ``"iid"`` or ``"label-skew"``.
    num_partitions : int
        Number of clients.
    partition_id : int
        This client's partition.
    samples_per_client : int
        Keep at most this many samples of the partition.
    labels_per_client : int
        Labels per client for ``"label-skew"``.
    seed : int
        Partitioning seed shared by all clients.

    Returns
    -------
    ClientData
    """
    data = load_image_data(dataset, data_root, dataset_limit)
    labels = torch.as_tensor(data.labels, dtype=torch.long)
    indices = partition_indices(
        labels.numpy(),
        scheme=partitioning,
        num_partitions=num_partitions,
        partition_id=partition_id,
        limit=samples_per_client,
        labels_per_partition=labels_per_client,
        seed=seed,
    )
    return ClientData(
        images=data.images,
        labels=labels,
        indices=indices,
        num_classes=int(data.num_classes),
        input_dim=int(data.input_dim),
    )
