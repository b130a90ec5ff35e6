"""The decomposition under the attack's time budget, and what an attack returns when it runs out."""

from __future__ import annotations

import logging

import torch

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.budget.deadline import DeadlineReached
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose, rounding_floor
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ObservedUpdate

logger = logging.getLogger(__name__)


def decompose_in_time(
    update: ObservedUpdate,
    *,
    name: str,
    batch_size: int | None,
    budget: Budget,
) -> LowRankFactors | Reconstruction:
    """:func:`fl_attack.pipeline.spectrum.decompose.decompose` of the update (with its rounding floor), or the
    attack's result when it does not fit in the time budget.

    Returns the factors when the decomposition ended by :attr:`Budget.decomposition` (its share of
    the budget, leaving the rest, like the search does, for building the scorer, the final
    selection and the self-check), else :func:`out_of_time` (with ``b`` placeholder rows when
    ``b`` is known).

    Parameters
    ----------
    update
        The observed update.
    name
        The attack's name, for ``stats["attack"]``.
    batch_size
        The known batch size, or None to estimate it.
    budget
        The attack's time budget.
    """
    deadline = budget.decomposition
    floor = rounding_floor(update.weight_update, unit_roundoff=update.unit_roundoff, weight=update.weight)
    try:
        factors = decompose(
            update.weight_update, batch_size=batch_size, rounding_floor=floor, deadline=deadline
        )
    except DeadlineReached as stop:
        size = batch_size or 0
        return out_of_time(name, batch_size=size, input_dim=update.input_dim, budget=budget, reason=str(stop))
    if deadline.expired():
        reason = "the decomposition ended past its share of the time budget"
        return out_of_time(
            name, batch_size=factors.batch_size, input_dim=update.input_dim, budget=budget, reason=reason
        )
    return factors


def out_of_time(name: str, *, batch_size: int, input_dim: int, budget: Budget, reason: str) -> Reconstruction:
    """``batch_size`` placeholder rows (confidence 0), incomplete, stopped by the time budget.

    Parameters
    ----------
    name
        The attack's name, for ``stats["attack"]``.
    batch_size
        Rows to return: the batch size when known, else 0.
    input_dim
        Length ``n`` of one input row.
    budget
        The attack's time budget.
    reason
        Why no search ran (``stats["stop_reason"]``).
    """
    if batch_size < 0 or input_dim < 1:
        raise ValueError(f"need batch_size >= 0 and input_dim >= 1, got {batch_size} and {input_dim}")
    logger.info("%s: out of time before the search: %s", name, reason)
    return Reconstruction(
        inputs=torch.zeros(batch_size, input_dim, dtype=torch.float64),
        batch_size=batch_size,
        sparsity_matching=0.0,
        complete=False,
        confidence=torch.zeros(batch_size, dtype=torch.float64),
        seconds=budget.elapsed(),
        stats={
            "attack": name,
            "stopped_by": "time_budget",
            "budget_exhausted": True,
            "time_budget": budget.seconds,
            "directions_found": 0,
            "stop_reason": reason,
        },
    )
