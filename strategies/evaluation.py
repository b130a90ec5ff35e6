"""Centralized evaluation of the global model on the task's held-out test split.

A privacy-utility trade-off needs the utility side measured the same way for every
defense: the accuracy of the global model on data no client trained on. The ServerApp
passes :func:`make_test_evaluator` to ``Strategy.start`` as its ``evaluate_fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn

from fl_attack.audit.layer import canonical_key
from fl_attack.simulate.training import evaluate_model

#: Samples scored per forward pass, so large test splits fit in memory.
EVALUATION_CHUNK = 2048


def make_test_evaluator(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """An ``evaluate_fn`` scoring the global arrays on ``(images, labels)``.

    Parameters
    ----------
    model : torch.nn.Module
        A model of the trained architecture; its weights are replaced in every call.
    images, labels : torch.Tensor
        The held-out test split, ``(N, ...)`` and ``(N,)``.

    Returns
    -------
    Callable[[int, ArrayRecord], MetricRecord]
        Gives ``test-loss``, ``test-acc`` and ``test-examples`` for the arrays of a round.
    """
    if len(images) != len(labels) or len(labels) == 0:
        raise ValueError(
            f"test split needs as many labels as images (> 0), got {len(images)} and {len(labels)}"
        )

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        del server_round
        # replies of Opacus clients may carry its "_module." prefix into the global arrays
        state = {canonical_key(key): value for key, value in arrays.to_torch_state_dict().items()}
        model.load_state_dict(state)
        total = len(labels)
        loss_sum = 0.0
        correct = 0.0
        for start in range(0, total, EVALUATION_CHUNK):
            chunk = np.arange(start, min(start + EVALUATION_CHUNK, total))
            loss, accuracy = evaluate_model(model, images, labels, chunk)
            loss_sum += loss * len(chunk)
            correct += accuracy * len(chunk)
        return MetricRecord(
            {"test-loss": loss_sum / total, "test-acc": correct / total, "test-examples": total}
        )

    return evaluate
