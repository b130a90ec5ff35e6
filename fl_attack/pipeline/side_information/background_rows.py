"""The whole batch from the input side, where the inputs share a background value.

Digits and letters (MNIST, FEMNIST) sit on a background that every image shares; normalization
moves it off zero (MNIST's ``(0 - 0.1307) / 0.3081``), so the cone of non-negative inputs
(:mod:`fl_attack.pipeline.side_information.input_cone`) is empty. The value is in the update: a
feature that is ``v`` for every sample has the column ``dW[:, p] = v db``. Shifted by it, the
update is that of the inputs ``x - v`` (``dW - v db 1^T``, the same ``db``), which are
non-negative with a zero at every background pixel of each sample: each sample is an extreme ray
of the cone and a linear programme reaches it, exactly, whatever its ReLU pattern did during the
client's local steps. Once ``k`` samples are known, the missing ones' columns of ``Q`` span the
complement of the known rows of ``Q^{-1}``; a programme that fixes ``p . q = 1`` for a random
``q`` there reaches a missing sample, never a known one (their rows give ``p . q = 0``).

With all ``b`` rows, ``Q`` is their inverse: its columns are the batch's directions. Nothing here
decides a claim: the selection they make is certified only by its rows' pixel grid
(:mod:`fl_attack.pipeline.selection.pixel_grid`) or the usual self-check.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.side_information.input_cone import InputSide
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ObservedUpdate

__all__ = ["background_rows", "background_value"]

#: At least this many features must hold the shared value (and ``b + 1`` at least).
MIN_BACKGROUND_FEATURES = 16

#: A feature holds one value for the batch when its column is this close to a multiple of ``db``,
#: relative to the column, in units of the update's relative noise.
BACKGROUND_NOISE_FACTOR = 30.0

#: Programmes with random weights before the steered ones.
FREE_PROGRAMMES_PER_SAMPLE = 1

#: Programmes in all, per sample of the batch.
PROGRAMMES_PER_SAMPLE = 4

#: A vertex with fewer zeros than this share of the most any vertex has is a mixture of samples.
ZERO_SHARE = 0.5

#: Weight of the random feature weights beside the steering objective (they only break ties).
TIE_BREAK = 1e-3

#: A candidate whose input (shifted by the background) is this many times the median candidate's
#: is no sample.
SIZE_RATIO = 10.0

#: Two rows of ``Q^{-1}`` closer than this (cosine) are one sample.
SAME_ROW_COS = 1 - 1e-6


def background_value(update: ObservedUpdate, *, relative_noise: float, batch_size: int) -> float | None:
    """The value a share of the input features holds for every sample (``dW[:, p] = v db``), or
    None where fewer than :data:`MIN_BACKGROUND_FEATURES` do or the value is 0 (dead features,
    which the input cone handles as they are)."""
    weight, bias = update.weight_update, update.bias_update
    energy = float(bias.square().sum())
    if not energy > 0:
        return None
    ratio = (weight.T @ bias) / energy  # (n,)
    norms = weight.norm(dim=0)
    residual = (weight - bias[:, None] * ratio[None, :]).norm(dim=0)
    limit = BACKGROUND_NOISE_FACTOR * max(relative_noise, 1e-12)
    held = (residual <= limit * norms) & (norms > 0)
    if int(held.sum()) < max(MIN_BACKGROUND_FEATURES, batch_size + 1):
        return None
    value = float(ratio[held].median())
    agree = (ratio[held] - value).abs() <= limit * max(abs(value), 1e-12)
    if int(agree.sum()) < max(MIN_BACKGROUND_FEATURES, batch_size + 1) or value == 0.0:
        return None
    return value


def background_rows(
    update: ObservedUpdate,
    factors: LowRankFactors,
    *,
    value: float,
    tolerance: ZeroTolerance,
    generator: torch.Generator,
    deadline: Deadline,
) -> torch.Tensor | None:
    """``(b, b)`` unit directions (rows) of the batch reached from the input side shifted by the
    background ``value``, or None when not every sample was reached before ``deadline``.

    ``factors`` are the update's over all its neurons; ``tolerance`` the gradient side's zeros.
    """
    b = factors.batch_size
    left, right = factors.left, factors.right
    bias = update.bias_update.to(left.dtype)
    rho = left.T @ bias  # db = L rho
    shifted = right - value * rho[:, None] * torch.ones(
        1, right.shape[1], dtype=right.dtype, device=right.device
    )
    rotation, scales, basis_t = torch.linalg.svd(shifted, full_matrices=False)
    if not float(scales[-1]) > 0:
        return None
    singular = torch.cat([scales, factors.singular_values[b:].to(scales.dtype)])
    view = LowRankFactors(
        left=left @ rotation,
        right=scales[:, None] * basis_t,
        singular_values=singular,
        spectrum=factors.spectrum,
    )
    side = InputSide.from_factors(
        view,
        relative_noise=tolerance.relative_noise,
        relative_zero=tolerance.absolute * math.sqrt(update.width),
    )
    if side.basis.shape[0] < 2 * b:
        return None
    candidates: list[torch.Tensor] = []  # rows p of Q^{-1} in the factors' coordinates, unit norm
    zero_counts: list[int] = []
    sizes: list[float] = []  # the norm of each candidate's shifted input at its bias's scale
    rows = torch.zeros(0, b, dtype=left.dtype, device=left.device)
    features = side.basis.shape[0]
    for attempt in range(PROGRAMMES_PER_SAMPLE * b):
        if rows.shape[0] == b or deadline.expired():
            break
        weights = torch.rand(features, generator=generator, dtype=torch.float64).numpy()
        steer = None
        if rows.shape[0] and attempt >= FREE_PROGRAMMES_PER_SAMPLE * b:
            complement = _null_space(rows)  # (b, b - k): the missing samples' columns of Q
            mix = torch.randn(complement.shape[1], generator=generator, dtype=complement.dtype)
            q = complement @ mix.to(complement.device)
            steer = ((rotation.T @ q) / scales).detach().cpu().numpy()  # p . q in the side's u
        vertex = _vertex(side, weights, steer=steer, seconds=deadline.remaining())
        if vertex is None:
            continue
        refined, zeros = side.refine(torch.from_numpy(vertex).to(side.basis)[None, :])
        if refined.shape[0] == 0:
            continue
        row = rotation @ (refined[0].to(rotation.device) / scales)
        row = row / row.norm()
        if candidates and float((torch.stack(candidates) @ row).abs().max()) >= SAME_ROW_COS:
            continue
        scale = float(row @ rho)
        if not scale > 0:
            continue  # no sample's row: a sample's input has the bias 1
        candidates.append(row)
        zero_counts.append(int(zeros[0]))
        sizes.append(float((row @ shifted).norm()) / scale)
        counts, norms = torch.tensor(zero_counts, device=left.device), torch.tensor(sizes, device=left.device)
        rows = _sample_rows(torch.stack(candidates), counts, norms, size=b)
    if rows.shape[0] == b - 1:
        last = _last_row(rows, left, tolerance)
        if last is not None and float(last @ rho) > 0:
            rows = torch.cat([rows, last[None, :]])
    if rows.shape[0] < b:
        return None
    inverse = rows
    directions = torch.linalg.inv(inverse).T  # row i: the column q_i of Q = P^{-1}
    return directions / directions.norm(dim=1, keepdim=True)


def _sample_rows(
    candidates: torch.Tensor, zeros: torch.Tensor, sizes: torch.Tensor, *, size: int
) -> torch.Tensor:
    """The independent candidates, most zeros first, with at least :data:`ZERO_SHARE` of the most
    zeros any has (a vertex that mixes samples is zero only where all of them are: MNIST (20, 200)
    after five epochs, mixtures 52-67 zeros, samples 211-290) and an input of a sample's size (a
    row with a bias near 0 implies an input :data:`SIZE_RATIO` times the median and more: a
    difference of samples, not one)."""
    keep = (zeros >= ZERO_SHARE * float(zeros.max())) & (sizes <= SIZE_RATIO * float(sizes.median()))
    order = torch.argsort(zeros[keep], descending=True, stable=True)
    chosen: list[torch.Tensor] = []
    for row in candidates[keep][order]:
        stacked = torch.stack([*chosen, row])
        if int(torch.linalg.matrix_rank(stacked)) == stacked.shape[0]:
            chosen.append(row)
        if len(chosen) == size:
            break
    return torch.stack(chosen) if chosen else candidates[:0]


def _last_row(rows: torch.Tensor, left: torch.Tensor, tolerance: ZeroTolerance) -> torch.Tensor | None:
    """The missing sample's row of ``Q^{-1}`` once the ``(b - 1, b)`` others are known, or None.

    Its column ``q_b`` is the one direction orthogonal to the known rows. Any row ``p`` with
    ``p . q_b = 1`` completes the inverse; moving it by ``a_i p_i`` moves known sample ``i``'s
    column to ``c_i - a_i c_b``, so each ``a_i`` is the ratio ``c_i / c_b`` that zeroes the most
    neurons (sample ``i``'s own zeros outside ``c_b``'s all give the same ratio), the gradient
    side's sparsity deciding what the cone cannot (a sample whose ink covers a known one's is no
    vertex of it: the programmes reach ``x_b - t x_i`` instead).
    """
    k, b = rows.shape
    q_last = _null_space(rows)[:, 0]
    start = q_last / q_last.square().sum()
    try:
        columns = left @ torch.linalg.inv(torch.cat([rows, start[None, :]]))  # (m, b)
    except RuntimeError:
        return None
    last = columns[:, k]
    live = last.abs() > tolerance.absolute * float(last.norm())
    if int(live.sum()) == 0:
        return None
    shifts = torch.zeros(k, dtype=rows.dtype, device=rows.device)
    for index in range(k):
        column = columns[:, index]
        ratios = torch.cat(
            [torch.zeros(1, dtype=column.dtype, device=column.device), column[live] / last[live]]
        )
        moved = column[None, :] - ratios[:, None] * last[None, :]  # (candidates, m)
        limit = tolerance.absolute * moved.norm(dim=1, keepdim=True)
        zeros = (moved.abs() <= limit).sum(dim=1)
        shifts[index] = ratios[int(torch.argmax(zeros))]  # the first maximum: no shift on a tie
    row = start + shifts @ rows
    return row / row.norm()


def _null_space(rows: torch.Tensor) -> torch.Tensor:
    """``(b, b - k)`` orthonormal basis of the vectors orthogonal to ``(k, b)`` independent rows."""
    k, b = rows.shape
    _, _, vh = torch.linalg.svd(rows, full_matrices=True)
    return vh[k:].T


def _vertex(
    side: InputSide, weights: np.ndarray, *, steer: np.ndarray | None, seconds: float
) -> np.ndarray | None:
    """A vertex of the side's cone (unit sum): :meth:`InputSide.vertex`, or the one maximising
    ``steer . u`` (a missing sample's coefficient; the known ones give 0), ties broken by ``weights``."""
    if steer is None:
        return side.vertex(weights, seconds=seconds)
    features = weights @ side.basis.detach().cpu().numpy()
    steer = steer / max(float(np.abs(steer).max()), 1e-300)
    objective = -steer + TIE_BREAK * features / max(float(np.abs(features).max()), 1e-300)
    return side.vertex(weights, seconds=seconds, objective=objective)
