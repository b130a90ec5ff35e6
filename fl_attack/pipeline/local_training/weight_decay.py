"""Weight decay's share of a local update: one unknown scalar times the known ``W_0``.

A client training with ``torch.optim.SGD(weight_decay=wd)`` sends
``dW = beta W_0 + C X^T`` and ``db = beta b_0 + C 1`` exactly, with one scalar
``beta = a_T - 1 < 0`` for both (:mod:`fl_attack.pipeline.local_training.sgd_schedule`; PyTorch decays the
bias with the same factor). ``beta W_0`` has full rank, so it buries the samples' rank-``N``
part under a flat spectrum and the update looks noisy. ``beta`` is read off the update itself:
on any ``k > N`` rows, ``P = dW_rows`` and ``Q = W0_rows`` satisfy
``P Q^+ = beta I + (C_rows X^T Q^+)``, whose second term has rank ``N``, so ``beta`` is an
eigenvalue of ``P Q^+`` repeated ``k - N`` times. A cluster that tight is the signature of weight
decay; noise (DP) spreads the eigenvalues instead, and then nothing is removed.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fl_attack.types import ObservedUpdate

__all__ = ["refined_scale", "remove_weight_decay", "weight_decay_scale"]

#: Eigenvalues within this relative distance of their median belong to the ``beta`` cluster
#: (measured spread on float32 CIFAR-10 updates: 1e-6 of ``beta``).
CLUSTER_TOLERANCE = 1e-3

#: Rows beyond the rank sampled for the eigenvalue problem: ``beta`` repeats once per extra row.
EXTRA_ROWS = 8


def weight_decay_scale(update: ObservedUpdate, *, batch_size: int, seed: int = 0) -> float | None:
    """``beta`` with ``dW - beta W_0`` of rank ``batch_size``, or None when the update shows none.

    Parameters
    ----------
    update
        The observed update ``W_T - W_0`` (any fixed multiple of it works the same).
    batch_size
        Rank ``N`` of the samples' part.
    seed
        Seeds the choice of rows.

    Returns
    -------
    float or None
        ``beta < 0`` when at least three quarters of the expected ``k - N`` eigenvalues
        cluster at it; None otherwise (no weight decay, noise, or too few neurons).
    """
    width = update.width
    rows = min(width, update.input_dim - 1, 2 * batch_size + EXTRA_ROWS)  # Q must have full row rank
    repeats = rows - batch_size
    if repeats < 3:
        return None
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(width, generator=generator)[:rows].to(update.weight.device)
    observed, start = update.weight_update[chosen], update.weight[chosen]
    gram = start @ start.T
    if not bool(torch.isfinite(gram).all()) or float(torch.linalg.matrix_rank(gram)) < rows:
        return None
    pencil = torch.linalg.solve(gram, start @ observed.T).T  # P Q^T (Q Q^T)^{-1}
    eigenvalues = torch.linalg.eigvals(pencil)
    real = eigenvalues.real
    beta = float(real.median())
    if not beta < 0.0:
        return None
    close = ((eigenvalues - beta).abs() <= CLUSTER_TOLERANCE * abs(beta)).sum()
    if int(close) < 0.75 * repeats:
        return None
    return beta


def refined_scale(update: ObservedUpdate, scale: float, *, left: torch.Tensor) -> float:
    """``scale`` corrected by least squares outside the samples' column space ``left`` (``(m, N)``
    orthonormal, from the update less ``scale W_0``): there only ``(beta - scale) W_0`` is left.

    The eigenvalue estimate carries the error of eigenvalues near the cluster (weak samples,
    e.g. near-duplicates, whose own eigenvalues sit next to ``beta``); this step removes it.
    """
    residual = update.weight_update - scale * update.weight
    outside = residual - left @ (left.T @ residual)
    start = update.weight - left @ (left.T @ update.weight)
    energy = float(start.square().sum())
    if energy <= 0.0:
        return scale
    return scale + float((outside * start).sum()) / energy


def remove_weight_decay(update: ObservedUpdate, scale: float) -> ObservedUpdate:
    """``update`` less ``scale`` times the starting parameters (weight and bias)."""
    return replace(
        update,
        weight_update=update.weight_update - scale * update.weight,
        bias_update=update.bias_update - scale * update.bias,
    )
