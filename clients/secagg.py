"""Opt-in ground truth for a legacy ``NumPyClient`` (e.g. one running Flower's ``secaggplus_mod``).

Under SecAgg+ a legacy strategy receives each client's ``FitRes``: the securely aggregated
parameters, the client's example count and its metrics, which Flower's SecAgg+ does *not*
mask. Extra records and arrays never reach the strategy (the mod clears every array record),
so a client that wants its audit scored adds its batch to its metrics, one line in ``fit``::

    metrics.update(audit_metrics(context, sample_indices=batch_indices, partition_id=partition_id))

Nothing is added unless the client itself opted in (its node config says
``audit-ground-truth=true``, or its own app passes ``simulation=True``). The auditing server
(:class:`strategies.secagg.AuditedLegacyStrategy`) removes these metrics before the inner
strategy aggregates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.app import Context

from fl_attack.audit.protocol import (
    LEGACY_METRIC_PREFIX,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
    TRAIN_MODE_KEY,
)

from .ground_truth import ground_truth_enabled


def audit_metrics(
    context: Context,
    *,
    sample_indices: Sequence[int],
    partition_id: int | None = None,
    train_mode: str | None = None,
    simulation: bool = False,
) -> dict[str, int | str]:
    """The audit metrics of one training reply, or ``{}`` when this client did not opt in.

    Parameters
    ----------
    context : Context
        The client's context; only its ``node_config`` decides.
    sample_indices : Sequence[int]
        Dataset indices of the samples the client trained on (the scorer's dataset).
    partition_id : int or None (default: None)
        The client's partition, which names it in the audit (else its node id does).
    train_mode : str or None (default: None)
        How it trained (``fedsgd``, ``fedavg``, ...), which names the cause of a verdict.
    simulation : bool (default: False)
        The ClientApp's own switch for simulations.

    Raises
    ------
    ValueError
        If an index is not a non-negative integer.
    """
    if not ground_truth_enabled(context, simulation=simulation):
        return {}
    indices = []
    for index in sample_indices:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"sample indices must be non-negative integers, got {list(sample_indices)!r}")
        indices.append(int(index))
    metrics: dict[str, int | str] = {
        LEGACY_METRIC_PREFIX + SAMPLE_INDICES_KEY: ",".join(str(index) for index in indices)
    }
    if partition_id is not None:
        metrics[LEGACY_METRIC_PREFIX + PARTITION_ID_KEY] = int(partition_id)
    if train_mode is not None:
        metrics[LEGACY_METRIC_PREFIX + TRAIN_MODE_KEY] = str(train_mode)
    return metrics
