"""How precise each recovered row is, estimated from the update alone (no ground truth).

A reconstruction is ``X^T = Q^{-1} R`` with ``R = S_b V_b^T``, the update's top-``b`` right
factor. On a clean update the only error left in ``R`` is the rounding that the spectrum shows
beyond rank ``b``: its rows are off by about ``s_{b+1}`` in norm, so row ``i`` of ``X`` is off
by about ``||(Q^{-1})_i|| s_{b+1}``. Relative to the row itself this is the row's precision,
which an auditor without ground truth can read next to the verdict. Measured on float32
weight differences of the quickstart CNN's fc1 (batch 8, after polishing), it came within
1.5x of the true relative errors.
"""

from __future__ import annotations

from typing import Any

import torch

from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer


def estimated_row_errors(scorer: SparsityMatchingScorer, selection: Selection) -> torch.Tensor:
    """``(b,)`` estimated relative error ``||x_i - x_i^true|| / ||x_i||`` of each recovered row.

    Rows that are zero (placeholders that recovered nothing) get ``inf``. Meaningful for a clean
    update only: under DP noise ``s_{b+1}`` is the edge of the noise bulk, not a row's error.
    """
    factors = scorer.factors
    b = factors.batch_size
    singular_values = factors.singular_values
    beyond = float(singular_values[b]) if singular_values.numel() > b else 0.0
    _, q_inv = scorer.score(selection.directions)
    norms = selection.inputs.norm(dim=-1)
    errors = q_inv.norm(dim=-1) * beyond
    return torch.where(norms > 0, errors / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.inf)


def precision_stats(scorer: SparsityMatchingScorer, selection: Selection) -> dict[str, Any]:
    """``estimated_relative_errors`` (one per row) and ``estimated_max_relative_error``."""
    errors = estimated_row_errors(scorer, selection)
    return {
        "estimated_relative_errors": errors.tolist(),  # one host copy, not one per row
        "estimated_max_relative_error": float(errors.max()),
    }
