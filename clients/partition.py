"""Split a dataset's indices across clients: IID or label-skewed."""

from __future__ import annotations

import numpy as np

PARTITIONINGS = ("iid", "label-skew")


def iid_partition(num_samples: int, *, num_partitions: int, partition_id: int, seed: int = 0) -> np.ndarray:
    """Indices of one client's share of a uniformly shuffled dataset.

    Parameters
    ----------
    num_samples : int
        Size of the dataset.
    num_partitions : int
        Number of clients; the shares differ in size by at most one.
    partition_id : int
        This client's share, in ``[0, num_partitions)``.
    seed : int (default: 0)
        Seed of the shuffle; all clients must use the same one.

    Returns
    -------
    numpy.ndarray
        Sorted int64 dataset indices.
    """
    _check(num_samples, num_partitions, partition_id)
    order = np.random.default_rng(seed).permutation(num_samples)
    return np.sort(np.array_split(order, num_partitions)[partition_id]).astype(np.int64)


def label_skew_partition(
    labels: np.ndarray,
    *,
    num_partitions: int,
    partition_id: int,
    labels_per_partition: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """Indices of one client's share when each client holds only a few labels.

    Client ``p`` holds the labels ``p * k, p * k + 1, ..., p * k + k - 1`` (modulo the
    number of labels, in a seeded random order of the labels), with
    ``k = labels_per_partition``; the samples of every label are split evenly among the
    clients holding it. Every label is used when ``num_partitions * k`` is at least the
    number of labels.

    Parameters
    ----------
    labels : numpy.ndarray
        ``(N,)`` integer labels of the dataset.
    num_partitions : int
        Number of clients.
    partition_id : int
        This client's share, in ``[0, num_partitions)``.
    labels_per_partition : int (default: 2)
        Distinct labels per client (capped at the number of labels).
    seed : int (default: 0)
        Seed of the label order and of the split; all clients must use the same one.

    Returns
    -------
    numpy.ndarray
        Sorted int64 dataset indices.
    """
    values = np.asarray(labels).reshape(-1)
    _check(len(values), num_partitions, partition_id)
    if labels_per_partition < 1:
        raise ValueError(f"labels_per_partition must be positive, got {labels_per_partition}")
    rng = np.random.default_rng(seed)
    classes = rng.permutation(np.unique(values))
    per_client = min(labels_per_partition, len(classes))
    holders: dict[int, list[int]] = {}
    for client in range(num_partitions):
        for offset in range(per_client):
            label = int(classes[(client * per_client + offset) % len(classes)])
            holders.setdefault(label, []).append(client)
    mine: list[np.ndarray] = []
    for label in sorted(holders):
        members = rng.permutation(np.flatnonzero(values == label))
        clients = holders[label]
        if partition_id in clients:
            mine.append(np.array_split(members, len(clients))[clients.index(partition_id)])
    return np.sort(np.concatenate(mine)).astype(np.int64)


def partition_indices(
    labels: np.ndarray,
    *,
    scheme: str,
    num_partitions: int,
    partition_id: int,
    limit: int | None = None,
    labels_per_partition: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """One client's dataset indices, optionally capped to ``limit`` random samples.

    Parameters
    ----------
    labels : numpy.ndarray
        ``(N,)`` integer labels of the whole dataset.
    scheme : str
        ``"iid"`` or ``"label-skew"``.
    num_partitions : int
        Number of clients.
    partition_id : int
        This client's share.
    limit : int or None (default: None)
        Keep at most this many samples of the share (drawn with ``seed``).
    labels_per_partition : int (default: 2)
        Only for ``"label-skew"``.
    seed : int (default: 0)
        Seed shared by all clients.

    Returns
    -------
    numpy.ndarray
        Sorted int64 dataset indices.
    """
    values = np.asarray(labels).reshape(-1)
    if scheme == "iid":
        share = iid_partition(
            len(values), num_partitions=num_partitions, partition_id=partition_id, seed=seed
        )
    elif scheme == "label-skew":
        share = label_skew_partition(
            values,
            num_partitions=num_partitions,
            partition_id=partition_id,
            labels_per_partition=labels_per_partition,
            seed=seed,
        )
    else:
        raise ValueError(f"unknown partitioning {scheme!r}; available: {PARTITIONINGS}")
    if limit is not None and 0 < limit < len(share):
        rng = np.random.default_rng([seed, partition_id])
        share = np.sort(rng.choice(share, size=limit, replace=False))
    return share.astype(np.int64)


def _check(num_samples: int, num_partitions: int, partition_id: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be positive, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
    if num_samples < num_partitions:
        raise ValueError(f"cannot split {num_samples} samples across {num_partitions} clients")
