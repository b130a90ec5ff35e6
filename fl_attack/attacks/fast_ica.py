"""Whitening by one truncated decomposition, then symmetric FastICA with a deadline between iterations.

The Cocktail Party Attack unmixes ``b`` sources from an ``(m, n)`` mixture whose rank is ``b``
(up to noise). Instead of a general-purpose ICA on the full ``(n, m)`` data, the mixture is
reduced once to its top-``b`` principal subspace (a randomized range finder when ``b`` is small
against ``min(m, n)``, otherwise one eigendecomposition of the smaller Gram matrix) and the
fixed-point iteration of Hyvarinen (1999, symmetric decorrelation) runs on the ``(b, n)``
whitened data, checking the deadline between iterations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline

#: Nonlinearities of the fixed-point iteration: ``logcosh`` (robust, G(y) = log cosh y) or
#: ``cube`` (kurtosis, G(y) = y^4 / 4).
NONLINEARITIES = ("logcosh", "cube")
#: Extra random directions of the range finder, and its power iterations.
OVERSAMPLING = 10
POWER_ITERATIONS = 2
#: The range finder is used while ``b + OVERSAMPLING`` is at most this share of ``min(m, n)``.
RANGE_FINDER_SHARE = 0.25


@dataclass(frozen=True)
class PrincipalSubspace:
    """The top-``b`` singular triplets of a centred mixture ``D ~= U diag(s) V^T``.

    Attributes
    ----------
    left : torch.Tensor
        ``(m, b)`` orthonormal columns ``U``.
    singular_values : torch.Tensor
        ``(b,)`` in decreasing order.
    right : torch.Tensor
        ``(n, b)`` orthonormal columns ``V``.
    spectrum : torch.Tensor
        Every singular value the decomposition computed, decreasing (for a batch-size estimate).
    """

    left: torch.Tensor
    singular_values: torch.Tensor
    right: torch.Tensor
    spectrum: torch.Tensor


@dataclass(frozen=True)
class IcaResult:
    """Outcome of :func:`symmetric_fastica`.

    Attributes
    ----------
    unmixing : torch.Tensor
        ``(b, b)`` orthogonal matrix ``W``: the sources are ``W @ whitened``.
    iterations : int
        Fixed-point iterations run.
    change : float
        The last iteration's ``max_i | |<w_i, w_i'>| - 1 |`` (inf when none ran).
    stopped_by : str
        ``"converged"``, ``"max_iter"`` or ``"time_budget"``.
    """

    unmixing: torch.Tensor
    iterations: int
    change: float
    stopped_by: str


def principal_subspace(
    centred: torch.Tensor, *, rank: int | None, generator: torch.Generator
) -> PrincipalSubspace:
    """The top-``rank`` singular triplets of ``centred`` by the cheapest adequate route.

    Parameters
    ----------
    centred : torch.Tensor
        ``(m, n)`` float64 mixture.
    rank : int or None
        Triplets wanted; None computes the whole spectrum (to estimate the rank) and keeps
        every triplet, leaving the caller to truncate.
    generator : torch.Generator
        Seeds the range finder's random test matrix.

    Returns
    -------
    PrincipalSubspace
    """
    m, n = centred.shape
    k = min(m, n)
    if rank is not None and rank + OVERSAMPLING <= RANGE_FINDER_SHARE * k:
        return _range_finder(centred, rank=rank, generator=generator)
    # one symmetric eigendecomposition of the smaller Gram matrix (about 3x cheaper than an SVD)
    transposed = n > m
    matrix = centred.T if transposed else centred  # (rows, k) with k the smaller side
    eigenvalues, vectors = torch.linalg.eigh(matrix.T @ matrix)
    order = torch.argsort(eigenvalues, descending=True)
    spectrum = eigenvalues[order].clamp_min(0.0).sqrt()
    keep = k if rank is None else rank
    right = vectors[:, order[:keep]]
    values = spectrum[:keep]
    safe = torch.where(values > 0, values, torch.ones_like(values))
    left = (matrix @ right) / safe
    if transposed:
        left, right = right, left
    return PrincipalSubspace(left=left, singular_values=values, right=right, spectrum=spectrum)


def _range_finder(centred: torch.Tensor, *, rank: int, generator: torch.Generator) -> PrincipalSubspace:
    """Randomized subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4)."""
    n = centred.shape[1]
    test = torch.randn(n, rank + OVERSAMPLING, generator=generator, dtype=centred.dtype)
    basis = torch.linalg.qr(centred @ test.to(centred.device)).Q
    for _ in range(POWER_ITERATIONS):
        basis = torch.linalg.qr(centred.T @ basis).Q
        basis = torch.linalg.qr(centred @ basis).Q
    small_left, values, right_t = torch.linalg.svd(basis.T @ centred, full_matrices=False)
    left = basis @ small_left
    return PrincipalSubspace(
        left=left[:, :rank], singular_values=values[:rank], right=right_t[:rank].T, spectrum=values
    )


def symmetric_decorrelation(matrix: torch.Tensor) -> torch.Tensor:
    """``(W W^T)^(-1/2) W``: the orthogonal matrix nearest to ``W``."""
    eigenvalues, vectors = torch.linalg.eigh(matrix @ matrix.T)
    floor = torch.finfo(matrix.dtype).tiny
    inverse_root = vectors * eigenvalues.clamp_min(floor).rsqrt()
    return (inverse_root @ vectors.T) @ matrix


def symmetric_fastica(
    whitened: torch.Tensor,
    *,
    nonlinearity: str = "logcosh",
    max_iter: int = 200,
    tolerance: float = 1e-4,
    generator: torch.Generator,
    deadline: Deadline = Deadline.never(),
    after_iteration: Callable[[torch.Tensor, int, float], None] | None = None,
) -> IcaResult:
    """Find the orthogonal unmixing of ``whitened`` that makes its rows maximally non-Gaussian.

    Parameters
    ----------
    whitened : torch.Tensor
        ``(b, n)`` data with uncorrelated, unit-variance, centred rows.
    nonlinearity : str (default: "logcosh")
        One of :data:`NONLINEARITIES`.
    max_iter : int (default: 200)
        Fixed-point iterations at most.
    tolerance : float (default: 1e-4)
        Converged when every unmixing row moves by less (``| |<w, w'>| - 1 |``).
    generator : torch.Generator
        Seeds the initial unmixing matrix.
    deadline : Deadline (default: ``Deadline.never()``)
        Not to be passed: no iteration starts when the last one's duration would carry it past
        the deadline.
    after_iteration : callable or None (default: None)
        Called after every iteration that does not end the loop with the unmixing so far, the
        iterations run and the last change; it must not change the unmixing.

    Returns
    -------
    IcaResult
    """
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"nonlinearity must be one of {', '.join(NONLINEARITIES)}, got {nonlinearity!r}")
    b, n = whitened.shape
    initial = torch.randn(b, b, generator=generator, dtype=torch.float64).to(whitened.device)
    unmixing = symmetric_decorrelation(initial.to(whitened.dtype))
    change, last_seconds = math.inf, 0.0
    for iteration in range(max_iter):
        if not deadline.fits(last_seconds):
            return IcaResult(unmixing=unmixing, iterations=iteration, change=change, stopped_by="time_budget")
        started = time.perf_counter()
        projected = unmixing @ whitened
        if nonlinearity == "logcosh":
            values = torch.tanh(projected)
            slopes = (1.0 - values * values).mean(dim=1)
        else:
            values = projected**3
            slopes = 3.0 * (projected * projected).mean(dim=1)
        updated = symmetric_decorrelation((values @ whitened.T) / n - slopes[:, None] * unmixing)
        change = float(((updated * unmixing).sum(dim=1).abs() - 1.0).abs().max())
        unmixing = updated
        last_seconds = time.perf_counter() - started
        if change < tolerance:
            return IcaResult(
                unmixing=unmixing, iterations=iteration + 1, change=change, stopped_by="converged"
            )
        if after_iteration is not None and iteration + 1 < max_iter:
            after_iteration(unmixing, iteration + 1, change)
    return IcaResult(unmixing=unmixing, iterations=max_iter, change=change, stopped_by="max_iter")
