"""Stopping settled sphere-search points early and skipping the rounding of spurious minima."""

from __future__ import annotations

import math

import pytest
import torch

from fl_attack.pipeline.search.sphere import (
    SETTLED_ENTRY,
    SettledPruning,
    SphereSchedule,
    get_surrogate,
    optimize_on_sphere,
    sparse_minima,
)


def _unit(rows: torch.Tensor) -> torch.Tensor:
    unit: torch.Tensor = rows / rows.norm(dim=1, keepdim=True)
    return unit


def test_pruning_schedule() -> None:
    prune = SettledPruning(known=torch.zeros(0, 3), after=250, every=50)
    assert [step for step in range(501) if prune.due(step)] == [250, 300, 350, 400, 450, 500]


def test_points_at_known_directions_and_repeats_are_dropped() -> None:
    known = torch.eye(4, dtype=torch.float64)[:1]
    points = _unit(
        torch.tensor(
            [
                [1.0, 0.01, 0.0, 0.0],  # |cos| 0.99995 with the known e1: dropped
                [0.0, 1.0, 0.0, 0.0],
                [0.0, -1.0, 0.02, 0.0],  # repeats row 1 up to sign (|cos| 0.9998): dropped
                [0.0, 0.0, 1.0, 0.0],
                [0.0, 0.7, 0.7, 0.0],  # |cos| 0.71 with rows 1 and 3: kept
            ],
            dtype=torch.float64,
        )
    )
    keep = SettledPruning(known=known).survivors(points)
    assert keep.tolist() == [False, True, False, True, True]


def test_pruned_search_returns_the_survivors_minima() -> None:
    """A start next to a known minimum stops; the others end where the unpruned search ends."""
    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(60, 5, generator=generator, dtype=torch.float64))
    starts = _unit(torch.randn(6, 5, generator=generator, dtype=torch.float64))
    schedule = SphereSchedule(steps=300, lr=0.05, milestones=(100, 200))
    surrogate = get_surrogate("l1")
    plain = optimize_on_sphere(left, starts, surrogate=surrogate, schedule=schedule)
    # know where start 0 goes: pruning drops it at step 250 and leaves every other row as it was
    prune = SettledPruning(known=plain[:1], after=250, every=50, cos=0.99)
    others = (plain[1:] @ plain[0]).abs() <= 0.99
    pruned = optimize_on_sphere(left, starts, surrogate=surrogate, schedule=schedule, prune=prune)
    survivors = plain[1:][others]
    distinct = SettledPruning(known=plain[:0], cos=0.99).survivors(survivors)
    assert pruned.shape[0] == int(distinct.sum())
    assert torch.allclose(pruned, survivors[distinct], atol=1e-12)


def test_sparse_minima_keeps_columns_with_enough_vanishing_entries() -> None:
    m, b = 100, 4
    generator = torch.Generator().manual_seed(1)
    # entries of magnitude 0.5-1.5: only the zeros set below vanish
    magnitude = 0.5 + torch.rand(m, b, generator=generator, dtype=torch.float64)
    columns = magnitude * torch.sign(torch.randn(m, b, generator=generator, dtype=torch.float64))
    columns[:40, 0] = 0.0  # sample 0 has 40 inactive neurons
    columns[:10, 1] = 0.0
    left, upper = torch.linalg.qr(columns)
    # the coordinates q of each column in the orthonormal factor: left @ q is that column
    directions = _unit(upper.T.contiguous())
    threshold = SETTLED_ENTRY / math.sqrt(m)
    small = ((directions @ left.T).abs() < threshold).sum(dim=1)
    assert small[:2].tolist() == [40, 10]
    kept = sparse_minima(left, directions, min_small=20)
    assert torch.equal(kept, directions[:1])
    assert sparse_minima(left, directions, min_small=10).shape[0] == 2
    assert sparse_minima(left, directions[:0], min_small=10).shape == (0, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_minima_accepts_the_search_dtype(dtype: torch.dtype) -> None:
    left, _ = torch.linalg.qr(
        torch.randn(30, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    )
    minima = _unit(torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert sparse_minima(left.to(dtype), minima, min_small=0).shape == (5, 3)
    assert sparse_minima(left.to(dtype), minima, min_small=31).shape == (0, 3)
