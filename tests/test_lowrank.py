"""Batch-size estimation from the gradient spectrum and the low-rank decomposition."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from fl_attack.data.images import load_dataset, sample_batch
from fl_attack.pipeline.spectrum.decompose import decompose, estimate_batch_size
from fl_attack.simulate.victims import (
    build_victim,
    client_gradient,
    first_linear,
    median_abs_entry,
    noisy_gradient,
)


@functools.cache
def _gradient(
    name: str, batch: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 first-layer gradient, true ``dL/dZ`` as ``(m, b)`` and the flat inputs ``(b, n)``."""
    data = load_dataset(name, split="all")
    images, labels, _ = sample_batch(data, batch, seed=batch + 10 * seed)
    model = build_victim(
        "spear++", input_dim=data.input_dim, width=width, num_classes=data.num_classes, seed=seed
    )
    weight_grad, _ = client_gradient(model, images, labels)
    flat = images.reshape(batch, -1)
    z = first_linear(model)[1](flat).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model[2:](z), labels)
    (dz,) = torch.autograd.grad(loss, z)
    return weight_grad, dz.T.contiguous(), flat


def _estimate(weight_grad: torch.Tensor):
    singular_values = torch.linalg.svdvals(weight_grad.double())
    return estimate_batch_size(singular_values, shape=tuple(weight_grad.shape))


CLEAN = [("faces", 4, 100, 0), ("photo-patches", 10, 200, 0), ("faces", 16, 200, 0)]


@pytest.mark.parametrize("case", CLEAN, ids=lambda c: f"{c[0]}-b{c[1]}-m{c[2]}")
def test_clean_float32_gradient_gives_the_batch_size(case) -> None:
    weight_grad, _, _ = _gradient(*case)
    estimate = _estimate(weight_grad)
    assert estimate.batch_size == case[1]
    assert not estimate.noisy
    assert estimate.gap >= 1e3  # float32 rounding only: orders of magnitude below the signal
    assert estimate.relative_noise < 1e-4
    assert math.isclose(estimate.relative_noise * estimate.gap, 1.0, rel_tol=1e-9)


@pytest.mark.parametrize(
    "case",
    [("digits", 4, 200, 0), ("digits", 10, 100, 1), ("faces", 1, 100, 0), ("photo-patches", 4, 200, 0)],
    ids=["digits-b4", "digits-b10", "faces-b1", "photo-b4"],
)
def test_dead_neurons_and_constant_pixels_do_not_inflate_the_estimate(case) -> None:
    """Neurons dead for the whole batch give zero rows; pixels equal on the whole batch give equal columns.

    Both make the float32 gradient exactly rank deficient, so some singular values are exact zeros
    below the float32 noise floor: the estimate must still be the batch size, not the noise rank.
    """
    weight_grad, _, _ = _gradient(*case)
    zero_rows = int((weight_grad == 0).all(dim=1).sum())
    equal_columns = weight_grad.shape[1] - int(torch.unique(weight_grad, dim=1).shape[1])
    assert zero_rows + equal_columns > 0  # the cases do exercise the rank-deficient path
    assert _estimate(weight_grad).batch_size == case[1]


@pytest.mark.parametrize(
    ("m", "n", "b"), [(30, 50, 3), (50, 30, 3), (40, 40, 7)], ids=["wide", "tall", "square"]
)
def test_synthetic_rank_deficient_float32_product(m: int, n: int, b: int) -> None:
    gen = torch.Generator().manual_seed(m + n + b)
    dz = torch.randn(m, b, generator=gen)
    dz[: m // 5] = 0  # dead neurons
    x = torch.randn(b, n, generator=gen)
    x[:, 1] = x[:, 0]  # a pixel equal to another on the whole batch
    assert _estimate((dz @ x).float()).batch_size == b


def test_exactly_low_rank_float64_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    weight_grad = torch.randn(60, 5, generator=gen, dtype=torch.float64) @ torch.randn(
        5, 90, generator=gen, dtype=torch.float64
    )
    estimate = _estimate(weight_grad)
    assert estimate.batch_size == 5
    assert estimate.relative_noise < 1e-12
    assert not estimate.noisy


@pytest.mark.parametrize("case", CLEAN, ids=lambda c: f"{c[0]}-b{c[1]}-m{c[2]}")
@pytest.mark.parametrize("noise_seed", [0, 1])
def test_gaussian_noise_uses_gavish_donoho_and_keeps_the_batch_size(case, noise_seed: int) -> None:
    weight_grad, _, _ = _gradient(*case)
    sigma = 0.1 * median_abs_entry(weight_grad)
    noisy, _ = noisy_gradient(weight_grad, torch.ones(weight_grad.shape[0]), sigma=sigma, seed=noise_seed)
    estimate = _estimate(noisy)
    assert estimate.noisy  # no clean gap left: the Gavish-Donoho threshold decided
    assert estimate.batch_size == case[1]
    assert estimate.gap < 1e3
    assert 0 < estimate.relative_noise < 1


@pytest.mark.parametrize(("m", "n"), [(50, 80), (100, 625), (120, 40)])
def test_pure_noise_has_no_low_rank_structure(m: int, n: int) -> None:
    noise = torch.randn(m, n, generator=torch.Generator().manual_seed(m * n), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"min\(m, n\)"):
        _estimate(noise)


def test_zero_spectrum_raises() -> None:
    with pytest.raises(ValueError, match="non-zero singular value"):
        estimate_batch_size(torch.zeros(5, dtype=torch.float64), shape=(5, 8))


# --------------------------------------------------------------------------------------
# decompose
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CLEAN + [("digits", 10, 100, 1)], ids=lambda c: f"{c[0]}-b{c[1]}-m{c[2]}")
def test_decompose_factors(case) -> None:
    weight_grad, dz, _ = _gradient(*case)
    b = case[1]
    w = weight_grad.double()
    factors = decompose(w)
    left, right = factors.left, factors.right
    assert factors.batch_size == b
    assert left.shape == (w.shape[0], b) and right.shape == (b, w.shape[1])
    assert left.dtype == right.dtype == torch.float64
    # orthonormal columns
    assert torch.allclose(left.T @ left, torch.eye(b, dtype=torch.float64), atol=1e-12)
    # left @ right is the best rank-b approximation (truncated SVD)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :b] * s[:b]) @ vh[:b]
    assert torch.allclose(left @ right, best, atol=1e-10 * float(s[0]), rtol=0)
    assert torch.allclose(factors.singular_values, s, atol=1e-12 * float(s[0]), rtol=0)
    # and it reproduces the gradient up to float32 rounding
    residual = torch.linalg.matrix_norm(w - left @ right, ord=2)
    assert float(residual) <= 1.0001 * float(s[b]) + 1e-300
    assert float(residual) < 1e-4 * float(s[0])
    # the left factor spans the true per-sample gradient columns dL/dZ
    dz = dz.double() / dz.double().norm(dim=0, keepdim=True)
    outside = dz - left @ (left.T @ dz)
    assert float(outside.norm(dim=0).max()) < 1e-4


def test_decompose_batch_size_override() -> None:
    weight_grad, _, _ = _gradient("faces", 4, 100, 0)
    w = weight_grad.double()
    assert decompose(w, batch_size=4).batch_size == 4
    smaller = decompose(w, batch_size=2)
    assert smaller.batch_size == 2 and smaller.left.shape == (100, 2)
    assert smaller.spectrum.batch_size == 2
    assert torch.allclose(smaller.left.T @ smaller.left, torch.eye(2, dtype=torch.float64), atol=1e-12)
    # the override's spectrum describes the chosen cut, not the estimated one
    assert smaller.spectrum.relative_noise == pytest.approx(
        float(smaller.singular_values[2] / smaller.singular_values[1])
    )


@pytest.mark.parametrize("batch_size", [0, -3, 100, 625, 1000])
def test_decompose_rejects_unattackable_batch_sizes(batch_size: int) -> None:
    weight_grad, _, _ = _gradient("faces", 4, 100, 0)  # (100, 625)
    with pytest.raises(ValueError, match=r"min\(m, n\) = 100"):
        decompose(weight_grad.double(), batch_size=batch_size)


def test_decompose_orientation_does_not_matter() -> None:
    """The wide matrix is decomposed through its transpose: both orientations agree."""
    weight_grad, _, _ = _gradient("photo-patches", 10, 200, 0)  # (200, 3072): m < n
    w = weight_grad.double()
    wide, tall = decompose(w), decompose(w.T.contiguous())
    assert wide.batch_size == tall.batch_size == 10
    assert torch.allclose(
        wide.left @ wide.right, (tall.left @ tall.right).T, atol=1e-10 * float(wide.singular_values[0])
    )


@pytest.mark.parametrize(("name", "batch"), [("photo-patches", 12), ("photo-patches", 40)])
def test_large_layers_take_the_same_factors_without_a_full_svd(
    monkeypatch: pytest.MonkeyPatch, name: str, batch: int
) -> None:
    """Subspace iteration (used on large layers) gives the full SVD's rank-b factors to float64 precision."""
    import fl_attack.pipeline.spectrum.decompose as decomposition

    weight_grad, _, _ = _gradient(name, batch, 300, 0)
    full = decompose(weight_grad.double())
    calls: list[int] = []
    real_svd = torch.linalg.svd
    monkeypatch.setattr(
        decomposition.torch.linalg, "svd", lambda a, **kw: calls.append(min(a.shape)) or real_svd(a, **kw)
    )
    monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
    fast = decompose(weight_grad.double())
    assert calls and max(calls) <= batch + decomposition.SUBSPACE_OVERSAMPLE  # no SVD of the whole layer
    assert fast.batch_size == full.batch_size == batch
    low_rank = full.left @ full.right
    assert float((fast.left @ fast.right - low_rank).norm() / low_rank.norm()) < 1e-12
    assert float(torch.linalg.svdvals(fast.left.T @ full.left).min()) > 1 - 1e-12


def test_large_noisy_layers_take_the_full_svd_subspace_from_the_gram_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a clean gap subspace iteration would not converge: the vectors come from the Gram
    matrix's eigendecomposition, no SVD of the whole layer, and span the full SVD's subspace."""
    import fl_attack.pipeline.spectrum.decompose as decomposition

    weight_grad, output_grad, _ = _gradient("photo-patches", 12, 300, 0)
    sigma = 0.5 * median_abs_entry(weight_grad)
    noisy, _ = noisy_gradient(weight_grad, output_grad.sum(1), sigma=sigma, seed=0)
    calls: list[int] = []
    real_svd = torch.linalg.svd

    def counted_svd(a: torch.Tensor, **kwargs):
        calls.append(min(a.shape))
        return real_svd(a, **kwargs)

    for update in (torch.as_tensor(noisy).double(), torch.as_tensor(noisy).double().T):
        expected = decompose(update, batch_size=12)
        calls.clear()
        monkeypatch.setattr(decomposition.torch.linalg, "svd", counted_svd)
        monkeypatch.setattr(decomposition, "LARGE_SIDE", 100)
        got = decompose(update, batch_size=12)
        monkeypatch.undo()
        assert calls == [12]  # only the projection on the 12 top vectors
        assert torch.allclose(got.singular_values, expected.singular_values, rtol=1e-12, atol=0)
        assert got.spectrum.batch_size == expected.spectrum.batch_size == 12
        assert math.isclose(got.spectrum.relative_noise, expected.spectrum.relative_noise, rel_tol=1e-12)
        assert got.spectrum.noisy and got.spectrum.relative_noise > 0.9  # heavy noise: a tiny gap
        low_rank = expected.left @ expected.right
        assert float((got.left @ got.right - low_rank).norm() / low_rank.norm()) < 1e-11
        identity = torch.eye(12, dtype=torch.float64)
        assert float((got.left.T @ got.left - identity).abs().max()) < 1e-13  # orthonormal left factor
        assert float(torch.linalg.svdvals(got.left.T @ expected.left).min()) > 1 - 1e-11
