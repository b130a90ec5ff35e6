"""One-hot column groups, detected from a first-layer update alone.

A one-hot encoded categorical feature puts a 1 in exactly one of its columns, so its columns
sum to 1 in every row. The update ``dW = sum_i g_i x_i^T``, ``db = sum_i g_i`` then satisfies
``dW 1_g = db`` for the group's columns ``g``: the vector ``(1_g, -1)`` is orthogonal to every
row ``[x_i, 1]``. The server tests every contiguous range of columns for this identity, with no
schema and no ground truth. Ranges are found by sorting one random projection of the column
prefix sums (``O(n log n)`` plus the candidates it leaves), then checked on all ``m`` rows.

Only a range whose identity holds to the update's own rounding is reported: the residual's norm
within ``TOLERANCE_FACTOR`` unit roundoffs of the norm of the magnitudes summed (``|dW|`` over
the range plus ``|db|``). Noisy updates (DP noise), dense signed inputs (normalised images) and
updates rounded coarser than their own entries (a float32 weight difference ``W_new - W_old``
carries the rounding of ``W``) give no group, and the attack runs as without this module. A
reported group is a fact about the batch (its columns sum to 1 in every row); that the columns
are non-negative with one non-zero per row is what the one-hot proposals then assume, and the
candidate pool, the selection and the self-check verify whatever they propose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: A range is a group when ``||dW 1_g - db||`` is within this many unit roundoffs of the norm of
#: the magnitudes summed (float32 gradients of UCI Adult batches leave 0.3-0.6 unit roundoff).
TOLERANCE_FACTOR = 64.0

#: At most this many ranges pass the one-projection screen before their full check; beyond it
#: (degenerate updates: many equal prefix sums) no group is reported.
MAX_SCREENED_RANGES = 200_000

#: Random projections that screen the ranges left by the first one before the check on every row.
SCREEN_PROJECTIONS = 8


@dataclass(frozen=True)
class OneHotGroups:
    """Disjoint groups of live input columns that sum to 1 in every row of the batch.

    Attributes
    ----------
    groups
        The live (not all-zero) columns of each group, ascending; groups are disjoint and
        ordered by their first column.
    ranges
        ``(start, stop)`` of the contiguous column range each group was detected as.
    """

    groups: tuple[tuple[int, ...], ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def columns(self) -> tuple[int, ...]:
        """Every column of every group, in group order."""
        return tuple(column for group in self.groups for column in group)

    def __len__(self) -> int:
        return len(self.groups)


NO_GROUPS = OneHotGroups(groups=(), ranges=())


def _screen(
    prefix: torch.Tensor, target: torch.Tensor, band: float, generator: torch.Generator
) -> torch.Tensor | None:
    """``(k, 2)`` ranges ``(start, stop)`` whose projected column sum is within ``band`` of the target's.

    None when more than ``MAX_SCREENED_RANGES`` pass.
    """
    weights = torch.randn(prefix.shape[0], generator=generator, dtype=prefix.dtype).to(prefix.device)
    weights = weights / weights.norm()
    projected = weights @ prefix  # (n + 1,)
    goal = float(weights @ target)
    ordered, order = torch.sort(projected)
    low = torch.searchsorted(ordered, projected + goal - band)
    high = torch.searchsorted(ordered, projected + goal + band, right=True)
    counts = high - low
    total = int(counts.sum())
    if total > MAX_SCREENED_RANGES:
        return None
    if total == 0:
        return prefix.new_zeros(0, 2, dtype=torch.long)
    starts = torch.repeat_interleave(torch.arange(projected.numel(), device=prefix.device), counts)
    offsets = torch.arange(total, device=prefix.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    stops = order[torch.repeat_interleave(low, counts) + offsets]
    pairs = torch.stack([starts, stops], dim=1)
    return pairs[pairs[:, 1] > pairs[:, 0]]


def detect_onehot_groups(
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    *,
    live: torch.Tensor,
    unit_roundoff: float,
) -> OneHotGroups:
    """The contiguous column ranges ``g`` with ``dW 1_g = db`` to the update's rounding.

    Parameters
    ----------
    weight_grad, bias_grad
        ``(m, n)`` and ``(m,)`` update (any common scale and sign).
    live
        ``(n,)`` bool: columns not zero for the whole batch (dead columns join no group).
    unit_roundoff
        ``eps`` of the precision the update was computed in.

    Returns
    -------
    OneHotGroups
        Minimal detected groups (no detected group lies strictly inside them), restricted to
        live columns, made disjoint by keeping the earlier of two that overlap;
        :data:`NO_GROUPS` when none holds.

    Raises
    ------
    ValueError
        On shapes that do not match.
    """
    if (
        weight_grad.ndim != 2
        or bias_grad.shape != (weight_grad.shape[0],)
        or live.shape != weight_grad.shape[1:]
    ):
        raise ValueError(
            f"weight_grad (m, n), bias_grad (m,) and live (n,) must agree, got "
            f"{tuple(weight_grad.shape)}, {tuple(bias_grad.shape)} and {tuple(live.shape)}"
        )
    if not bool(bias_grad.any()) or not math.isfinite(unit_roundoff) or unit_roundoff <= 0:
        return NO_GROUPS
    m = weight_grad.shape[0]
    zero = weight_grad.new_zeros(m, 1)
    prefix = torch.cat([zero, torch.cumsum(weight_grad, dim=1)], dim=1)
    magnitude = torch.cat([zero, torch.cumsum(weight_grad.abs(), dim=1)], dim=1)
    tolerance = TOLERANCE_FACTOR * unit_roundoff
    # a unit projection moves a range's residual by at most its norm
    band = tolerance * float((magnitude[:, -1] + bias_grad.abs()).norm())
    generator = torch.Generator().manual_seed(0)
    pairs = _screen(prefix, bias_grad, band, generator)
    if pairs is None or pairs.shape[0] == 0:
        return NO_GROUPS
    # a few more projections P first (||P r|| <= ||P|| ||r||, ||v||_2 <= ||v||_1 bounds the
    # magnitudes' norm), then every row of the survivors
    projections = torch.randn(SCREEN_PROJECTIONS, m, generator=generator, dtype=prefix.dtype).to(
        prefix.device
    )
    projected = projections @ prefix
    residual = (
        projected[:, pairs[:, 1]] - projected[:, pairs[:, 0]] - (projections @ bias_grad)[:, None]
    ).norm(dim=0)
    total = magnitude.sum(dim=0)
    allowed = (
        tolerance
        * float(torch.linalg.matrix_norm(projections, ord=2))
        * (total[pairs[:, 1]] - total[pairs[:, 0]] + bias_grad.abs().sum())
    )
    pairs = pairs[residual <= allowed]
    residual = (prefix[:, pairs[:, 1]] - prefix[:, pairs[:, 0]] - bias_grad[:, None]).norm(dim=0)
    allowed = tolerance * (
        magnitude[:, pairs[:, 1]] - magnitude[:, pairs[:, 0]] + bias_grad.abs()[:, None]
    ).norm(dim=0)
    pairs = pairs[residual <= allowed]
    found: dict[tuple[int, ...], tuple[int, int]] = {}
    for start, stop in pairs.tolist():
        columns = tuple(int(c) for c in torch.nonzero(live[start:stop]).flatten().tolist())
        if columns:
            columns = tuple(start + c for c in columns)
            found.setdefault(columns, (start, stop))
    minimal = [g for g in found if not any(set(other) < set(g) for other in found)]
    kept: list[tuple[int, ...]] = []
    used: set[int] = set()
    for group in sorted(minimal):
        if used.isdisjoint(group):
            kept.append(group)
            used.update(group)
    return OneHotGroups(groups=tuple(kept), ranges=tuple(found[g] for g in kept))


__all__ = ["MAX_SCREENED_RANGES", "NO_GROUPS", "TOLERANCE_FACTOR", "OneHotGroups", "detect_onehot_groups"]
