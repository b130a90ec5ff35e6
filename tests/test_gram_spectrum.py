"""The spectrum of a noisy update from its Gram matrix (fl_attack.pipeline.spectrum.gram_spectrum) and the
decomposition's use of it on large layers with a known batch size."""

from __future__ import annotations

import pytest
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.spectrum import decompose as decomposition
from fl_attack.pipeline.spectrum.gram_spectrum import noisy_spectrum


def _update(*, rows: int = 300, columns: int = 200, rank: int = 10, noise: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    left = torch.randn(rows, rank, generator=generator, dtype=torch.float64)
    right = torch.randn(rank, columns, generator=generator, dtype=torch.float64)
    signal = left @ right
    return signal + noise * torch.randn(rows, columns, generator=generator, dtype=torch.float64)


def _same_subspace(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of the largest principal angle between the column spans of ``a`` and ``b``."""
    qa, _ = torch.linalg.qr(a)
    qb, _ = torch.linalg.qr(b)
    return float(torch.linalg.svdvals(qa.T @ qb).min())


def _call(update: torch.Tensor, rank: int = 10) -> tuple[torch.Tensor, torch.Tensor] | None:
    return noisy_spectrum(
        update,
        rank=rank,
        oversample=decomposition.SUBSPACE_OVERSAMPLE,
        max_ratio=decomposition.SUBSPACE_MAX_RATIO,
        deadline=Deadline.never(),
    )


@pytest.mark.parametrize("shape", [(300, 200), (200, 300)])
def test_a_noisy_update_gets_its_singular_values_and_top_gram_vectors(shape: tuple[int, int]) -> None:
    update = _update(rows=shape[0], columns=shape[1], noise=0.5)
    result = _call(update)
    assert result is not None
    values, vectors = result
    expected = torch.linalg.svdvals(update)
    assert values.shape == expected.shape
    assert torch.allclose(values, expected, rtol=1e-10, atol=0)
    _, _, vh = torch.linalg.svd(update if shape[0] >= shape[1] else update.T, full_matrices=False)
    assert vectors.shape == (min(shape), 10)
    assert _same_subspace(vectors, vh[:10].T) > 1 - 1e-10


def test_a_clean_update_is_not_noisy() -> None:
    assert _call(_update(noise=0.0)) is None


def test_a_faint_tail_is_not_noisy() -> None:
    # 1e-13 of the energy beyond the sketch: svdvals keeps the values, which the Gram matrix would blur
    assert _call(_update(noise=1e-6)) is None


def test_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[1, 199\], got 200"):
        _call(_update(noise=0.5), rank=200)


def test_decompose_takes_the_gram_route_for_a_noisy_large_update(monkeypatch: pytest.MonkeyPatch) -> None:
    update = _update(noise=0.5)
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
    factors = decomposition.decompose(update, batch_size=10)
    monkeypatch.setattr(decomposition, "noisy_spectrum", lambda *args, **kwargs: None)
    reference = decomposition.decompose(update, batch_size=10)  # singular values, then Gram vectors
    assert not torch.equal(factors.singular_values, reference.singular_values)  # another route...
    assert torch.allclose(factors.singular_values, reference.singular_values, rtol=1e-10, atol=0)
    assert _same_subspace(factors.left, reference.left) > 1 - 1e-10  # ...to the same factors
    assert torch.allclose(factors.left @ factors.right, reference.left @ reference.right, atol=1e-9)
    assert factors.spectrum.batch_size == 10 and factors.spectrum.noisy == reference.spectrum.noisy


def test_decompose_keeps_the_clean_route_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    update = _update(noise=0.0)
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
    factors = decomposition.decompose(update, batch_size=10)
    assert torch.equal(factors.singular_values, torch.linalg.svdvals(update))
    monkeypatch.setattr(decomposition, "noisy_spectrum", lambda *args, **kwargs: None)
    reference = decomposition.decompose(update, batch_size=10)
    assert torch.equal(factors.left, reference.left) and torch.equal(factors.right, reference.right)
