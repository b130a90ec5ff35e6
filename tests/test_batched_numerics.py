"""Batched forms of per-row decompositions agree with the per-row originals (CPU)."""

from __future__ import annotations

import pytest
import torch

from fl_attack.pipeline.selection import polish as polish_module
from fl_attack.pipeline.selection.polish import inactive_null_vectors


def _per_row_null_vectors(left: torch.Tensor, inactive: torch.Tensor) -> torch.Tensor:
    """The original polish: one SVD of each column's inactive rows, its last right vector."""
    return torch.stack(
        [torch.linalg.svd(left[inactive[:, i]], full_matrices=False).Vh[-1] for i in range(inactive.shape[1])]
    )


@pytest.mark.parametrize("chunk_entries", [1, 2000, 1 << 22])
def test_inactive_null_vectors_match_one_svd_per_row(
    monkeypatch: pytest.MonkeyPatch, chunk_entries: int
) -> None:
    monkeypatch.setattr(polish_module, "CHUNK_ENTRIES", chunk_entries)  # one row, a few, all per chunk
    generator = torch.Generator().manual_seed(0)
    m, b = 120, 7
    left, _ = torch.linalg.qr(torch.randn(m, b, generator=generator, dtype=torch.float64))
    inactive = torch.rand(m, b, generator=generator) < 0.5
    # a near-null direction per column, as for a recovered sample: its inactive rows barely see it
    directions = torch.nn.functional.normalize(
        torch.randn(b, b, generator=generator, dtype=torch.float64), dim=1
    )
    for i in range(b):
        rows = inactive[:, i]
        left[rows] -= 0.999 * (left[rows] @ directions[i])[:, None] * directions[i]
    batched = inactive_null_vectors(left, inactive)
    reference = _per_row_null_vectors(left, inactive)
    assert batched.shape == (b, b)
    assert torch.allclose(batched.norm(dim=1), torch.ones(b, dtype=torch.float64), atol=1e-12)
    assert torch.all((batched * reference).sum(dim=1).abs() > 1 - 1e-12)


def test_inactive_null_vectors_of_an_exactly_null_direction_are_that_direction() -> None:
    generator = torch.Generator().manual_seed(1)
    m, b = 60, 4
    left, _ = torch.linalg.qr(torch.randn(m, b, generator=generator, dtype=torch.float64))
    direction = torch.nn.functional.normalize(torch.randn(b, generator=generator, dtype=torch.float64), dim=0)
    values = left @ direction
    inactive = (values.abs() < values.abs().median()).unsqueeze(1).expand(m, b).clone()
    left[inactive[:, 0]] -= (left[inactive[:, 0]] @ direction)[:, None] * direction  # exactly null there
    null = inactive_null_vectors(left, inactive)
    assert torch.all((null @ direction).abs() > 1 - 1e-13)
