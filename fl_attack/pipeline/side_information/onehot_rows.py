"""Directions of samples with one-hot columns: the one-hot rows that the update's row space holds.

With ``dW = L R`` every input is ``x = a^T R`` for a row ``a`` of ``Q^{-1}``. On the columns
``M`` of the one-hot groups that :mod:`fl_attack.pipeline.side_information.onehot_groups` detected, a sample's
input is a 0/1 vector with exactly one 1 per group, and it lies in the row space of ``R_M``. So
do some *virtual* one-hot vectors: integer combinations such as ``p_1 + p_2 - p_3`` of samples
that share categories. All of them are enumerated exactly: a one-hot vector ``p`` is in the row
space iff ``N p = 0`` for a basis ``N`` of its orthogonal complement, a sum of one column of
``N`` per group, so a meet-in-the-middle over two halves of the groups finds every one (about the
square root of the number of one-hot vectors; Adult's live categories give ~10^3 per half).

A one-hot vector ``p`` fixes ``a`` up to the lineality ``{d : d^T R_M = 0}``: directions that
change only the other (continuous) columns, which appear when two samples share every
categorical value (near-twins) or their one-hot rows are linearly dependent.

* lineality 0: ``a`` is unique, and so is the input with its scale (each group sums to 1): its
  pre-activations ``W x + bias`` give its exact ReLU pattern, whose inactive rows of ``L`` share
  a kernel when ``x`` is a sample (the sample's direction ``q``) and generically not when it is
  virtual;
* lineality 1: the inputs of ``p`` form a line; scanning its ReLU patterns (every breakpoint
  of ``W x(t) + bias``, both directions) finds the kernel of every sample on it, twins included;
* lineality 2 or more: nothing is proposed. Known directions (``a^T q = 0`` holds for every
  other sample's ``q``) cut the lineality: :mod:`fl_attack.pipeline.side_information.onehot_rounds` calls this
  again with directions the search found, and one near-twin's direction per extra dimension
  brings it to 1 (:func:`cutting_directions`).

What is identifiable: a sample whose one-hot row is unique in the batch and not a combination
of others' is pinned by its categories alone; near-twins (same categories) only through the
continuous columns, where their ReLU patterns differ, and only once the lineality is at most 1.
Every proposal goes to the candidate pool: its filters, the selection and the self-check decide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.sparsity import ZeroTolerance

#: Relative singular value below which the one-hot columns' row space loses a dimension (Adult,
#: seeds 0-11: kept ones >= 7.8e-3, dropped ones <= 5.1e-9).
RANK_TOLERANCE = 1e-6

#: A one-hot vector is in the row space when its distance to it is below this (its norm is the
#: square root of the number of groups; Adult, seeds 0-11: samples' rows <= 2.1e-7 after float32
#: rounding, every other one-hot vector > 0.05).
MEMBER_TOLERANCE = 1e-5

#: The enumeration is skipped when one of its halves would hold more partial sums than this.
MAX_HALF = 200_000

#: ... or when more than this many one-hot vectors pass its one-projection match (a row space
#: holding most one-hot vectors pins nothing).
MAX_ROWS = 20_000

#: Smallest singular value per row below which a pattern's rows count as sharing a kernel.
KERNEL_FLOOR = 1e-6

#: One-hot vectors whose single input is checked at once (one Gram matrix each).
POINT_CHUNK = 512

#: One-hot vectors whose lines are scanned at once (each holds ``m + 1`` Gram matrices).
LINE_CHUNK = 16


def check_known(known: torch.Tensor, batch_size: int) -> None:
    """Raise ``ValueError`` unless ``known`` holds ``k`` directions of ``batch_size`` entries, ``k < batch_size``."""
    b = batch_size
    if known.ndim != 2 or known.shape[1] != b or not 0 <= known.shape[0] < b:
        raise ValueError(f"known must have shape (k, {b}) with 0 <= k < {b}, got {tuple(known.shape)}")


@dataclass(frozen=True)
class OneHotSide:
    """The attack's factors seen through the detected one-hot groups.

    Attributes
    ----------
    right
        ``(b, n)`` right factor ``R``: inputs are ``a^T R``.
    groups
        Live columns of each one-hot group (disjoint).
    left
        ``(m', b)`` orthonormal left factor on the informative neurons.
    pre_activation_basis
        ``(m', b)`` ``W R^T`` on the same neurons.
    bias
        ``(m',)`` the layer's bias on those neurons.
    """

    right: torch.Tensor
    groups: tuple[tuple[int, ...], ...]
    left: torch.Tensor
    pre_activation_basis: torch.Tensor
    bias: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.right.shape[0])


@dataclass(frozen=True)
class OneHotProposals:
    """What one enumeration found.

    Attributes
    ----------
    directions
        ``(k, b)`` unit gradient-side directions whose ReLU pattern has a kernel.
    one_hot_rows
        One-hot vectors in the row space (samples and virtual ones).
    lineality
        Dimension of the directions that change no one-hot column (``-1``: not computed).
    """

    directions: torch.Tensor
    one_hot_rows: int
    lineality: int


def _complement(known: torch.Tensor, size: int) -> torch.Tensor:
    """``(b, b - k)`` orthonormal basis of the rows ``a`` with ``a^T q = 0`` for each known ``q``."""
    if known.shape[0] == 0:
        return torch.eye(size, dtype=known.dtype, device=known.device)
    complete, _ = torch.linalg.qr(known.T, mode="complete")
    return complete[:, known.shape[0] :]


def _sums(columns: list[list[int]], table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sum of one column of ``table`` per group, and the chosen column indices ``(k, groups)``."""
    sums = table.new_zeros(1, table.shape[0])
    chosen = torch.zeros(1, 0, dtype=torch.long, device=table.device)
    for group in columns:
        index = torch.tensor(group, dtype=torch.long, device=table.device)
        sums = (sums[:, None, :] + table[:, index].T[None]).reshape(-1, table.shape[0])
        chosen = torch.cat(
            [chosen.repeat_interleave(len(group), dim=0), index.repeat(chosen.shape[0])[:, None]], dim=1
        )
    return sums, chosen


def one_hot_rows(complement: torch.Tensor, *, groups: list[list[int]], width: int) -> torch.Tensor | None:
    """``(k, width)`` every one-hot vector ``p`` (one 1 per group) with ``complement @ p ~= 0``.

    ``groups`` index the ``width`` columns; None when a half of the enumeration would exceed
    ``MAX_HALF`` partial sums or more than ``MAX_ROWS`` vectors pass the first match.
    """
    sizes = [len(group) for group in groups]
    order = sorted(range(len(groups)), key=lambda i: -sizes[i])
    halves: tuple[list[list[int]], list[list[int]]] = ([], [])
    products = [1, 1]
    for i in order:
        side = 0 if products[0] <= products[1] else 1
        halves[side].append(groups[i])
        products[side] *= sizes[i]
    if max(products) > MAX_HALF:
        return None
    if complement.shape[0] == 0:
        first, first_chosen = _sums(halves[0], complement.new_zeros(1, width))
        second, second_chosen = _sums(halves[1], complement.new_zeros(1, width))
    else:
        first, first_chosen = _sums(halves[0], complement)
        second, second_chosen = _sums(halves[1], complement)
    # first + second = 0: match on one random projection, then check every coordinate
    weights = torch.randn(first.shape[1], generator=torch.Generator().manual_seed(0), dtype=first.dtype)
    weights = weights.to(first.device) / weights.norm().clamp_min(1e-300)
    keys, targets = first @ weights, -(second @ weights)
    ordered, order_index = torch.sort(targets)
    low = torch.searchsorted(ordered, keys - MEMBER_TOLERANCE)
    high = torch.searchsorted(ordered, keys + MEMBER_TOLERANCE, right=True)
    counts = high - low
    if int(counts.sum()) > MAX_ROWS:
        return None
    rows_first = torch.repeat_interleave(torch.arange(keys.numel(), device=keys.device), counts)
    offsets = torch.arange(int(counts.sum()), device=keys.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    rows_second = order_index[torch.repeat_interleave(low, counts) + offsets]
    close = (first[rows_first] + second[rows_second]).norm(dim=1) <= MEMBER_TOLERANCE
    chosen = torch.cat([first_chosen[rows_first[close]], second_chosen[rows_second[close]]], dim=1)
    rows = complement.new_zeros(chosen.shape[0], width)
    rows.scatter_(1, chosen, 1.0)
    return rows


def _pattern_kernels(
    left: torch.Tensor, inactive: torch.Tensor, *, minimum: int, limit: float
) -> torch.Tensor:
    """``(h, b)`` kernels of the inactive rows of ``left`` for those of the ``(p, m')`` patterns that have one."""
    counts = inactive.sum(dim=1)
    usable = counts >= minimum
    if not bool(usable.any()):
        return left.new_zeros(0, left.shape[1])
    chosen = inactive[usable].to(left.dtype)
    grams = torch.einsum("pm,mi,mj->pij", chosen, left, left)
    eigenvalues, eigenvectors = torch.linalg.eigh(grams)
    residual = eigenvalues[:, 0].clamp_min(0).sqrt() / counts[usable].to(left.dtype).sqrt()
    return eigenvectors[residual <= limit, :, 0]


def _line_kernels(
    left: torch.Tensor,
    offsets: torch.Tensor,
    slope: torch.Tensor,
    *,
    minimum: int,
    limit: float,
    deadline: Deadline,
) -> list[torch.Tensor]:
    """Kernels of the patterns of ``offsets[c] + t * slope <= 0`` over every real ``t``, per line ``c``.

    Neighbouring patterns differ by one neuron, so each line's Gram matrices are a running sum
    of signed outer products; a Cholesky attempt of ``G - eps I`` screens them.
    """
    m, b = left.shape
    flat = slope == 0
    safe = torch.where(flat, torch.ones_like(slope), slope)
    eye = torch.eye(b, dtype=left.dtype, device=left.device)
    outer = left[:, :, None] * left[:, None, :]  # (m', b, b)
    found: list[torch.Tensor] = []
    for start in range(0, offsets.shape[0], LINE_CHUNK):
        if deadline.expired():
            break
        chunk = offsets[start : start + LINE_CHUNK]
        breakpoints = torch.where(flat, torch.full_like(chunk, math.inf), -chunk / safe)
        ordered, order = torch.sort(breakpoints, dim=1)
        finite = torch.isfinite(ordered)
        lowest = torch.where(finite, ordered, torch.zeros_like(ordered)).amin(dim=1, keepdim=True)
        start_t = lowest - 1.0 - lowest.abs()  # below every breakpoint
        first = (chunk + start_t * slope) <= 0  # (c, m')
        # crossing a breakpoint upwards: a neuron with a positive slope turns active, else inactive
        steps = torch.where(slope[order] > 0, -1.0, 1.0).to(left.dtype) * finite.to(left.dtype)
        grams = torch.einsum("cm,mij->cij", first.to(left.dtype), outer)
        updates = steps[:, :, None, None] * outer[order]  # (c, m', b, b)
        grams = torch.cat([grams[:, None], grams[:, None] + torch.cumsum(updates, dim=1)], dim=1)
        counts = first.sum(dim=1, keepdim=True) + torch.cat(
            [torch.zeros_like(steps[:, :1]), torch.cumsum(steps, dim=1)], dim=1
        ).to(torch.long)
        keep = counts >= minimum
        if not bool(keep.any()):
            continue
        kept, kept_counts = grams[keep], counts[keep].to(left.dtype)
        eps = (limit**2) * kept_counts
        _, info = torch.linalg.cholesky_ex(kept - eps[:, None, None] * eye)
        suspicious = info != 0
        if not bool(suspicious.any()):
            continue
        eigenvalues, eigenvectors = torch.linalg.eigh(kept[suspicious])
        residual = eigenvalues[:, 0].clamp_min(0).sqrt() / kept_counts[suspicious].sqrt()
        good = residual <= limit
        if bool(good.any()):
            found.append(eigenvectors[good, :, 0])
    return found


def one_hot_proposals(
    side: OneHotSide,
    known: torch.Tensor,
    *,
    tolerance: ZeroTolerance,
    min_zeros: int,
    deadline: Deadline = Deadline.never(),
) -> OneHotProposals:
    """Gradient-side directions of the samples not among ``known``, from their one-hot rows.

    Parameters
    ----------
    side
        The factors and the detected groups.
    known
        ``(k, b)`` directions believed correct, ``0 <= k < b``: only rows ``a`` with
        ``a^T q = 0`` for each of them (the other samples) are searched.
    tolerance
        Zero tolerance of unit gradient columns: a kernel's smallest singular value per row
        must be within ``10 * tolerance.absolute`` (at least ``KERNEL_FLOOR``).
    min_zeros
        Patterns with fewer inactive neurons (and fewer than ``b - 1``) are not considered.
    deadline
        Deadline after which no further chunk of rows is checked.

    Returns
    -------
    OneHotProposals
        The directions (deduplicated), the number of one-hot rows and the lineality.

    Raises
    ------
    ValueError
        When ``known`` is not ``(k, b)`` with ``0 <= k < b``.
    """
    b = side.batch_size
    check_known(known, b)
    empty = OneHotProposals(side.left.new_zeros(0, b), 0, -1)
    columns = [column for group in side.groups for column in group]
    if not columns or deadline.expired():
        return empty
    local: list[list[int]] = []  # the groups as positions among ``columns``
    offset = 0
    for group in side.groups:
        local.append(list(range(offset, offset + len(group))))
        offset += len(group)
    basis, restricted, vectors_h, rank = _restricted_rows(side, known)
    lineality = basis.shape[1] - rank
    if lineality >= 2:
        return OneHotProposals(empty.directions, 0, lineality)
    rows = one_hot_rows(vectors_h[rank:], groups=local, width=len(columns))
    if rows is None or rows.shape[0] == 0:
        return OneHotProposals(empty.directions, 0, lineality)
    coordinates = torch.linalg.lstsq(restricted.T, rows.T).solution  # (d, k)
    points = (basis @ coordinates).T  # (k, b): rows a
    offsets = points @ side.pre_activation_basis.T + side.bias  # (k, m')
    minimum = max(min_zeros, b - 1)
    limit = max(10.0 * tolerance.absolute, KERNEL_FLOOR)
    if lineality == 0:
        found = []
        for start in range(0, offsets.shape[0], POINT_CHUNK):
            if deadline.expired():
                break
            chunk = offsets[start : start + POINT_CHUNK] <= 0
            found.append(_pattern_kernels(side.left, chunk, minimum=minimum, limit=limit))
        directions = torch.cat(found, dim=0) if found else side.left.new_zeros(0, b)
    else:
        line = basis @ _null_vector(restricted)
        slope = side.pre_activation_basis @ line
        hits = _line_kernels(side.left, offsets, slope, minimum=minimum, limit=limit, deadline=deadline)
        directions = torch.cat(hits, dim=0) if hits else side.left.new_zeros(0, b)
    return OneHotProposals(_distinct(directions), int(rows.shape[0]), lineality)


def _restricted_rows(
    side: OneHotSide, known: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows ``a`` orthogonal to ``known``: their basis ``(b, d)``, ``R_M`` there ``(d, |M|)``, its ``V^T`` and rank."""
    basis = _complement(known.to(side.right), side.batch_size)
    restricted = basis.T @ side.right[:, [column for group in side.groups for column in group]]
    _, values, vectors_h = torch.linalg.svd(restricted, full_matrices=True)
    rank = int((values > RANK_TOLERANCE * values[0]).sum()) if values.numel() and values[0] > 0 else 0
    return basis, restricted, vectors_h, rank


def lineality(side: OneHotSide, known: torch.Tensor) -> int:
    """Dimension of the rows ``a`` orthogonal to ``known`` ``(k, b)`` that change no one-hot column."""
    basis, _, _, rank = _restricted_rows(side, known)
    return int(basis.shape[1]) - rank


def single_sample_mask(
    side: OneHotSide, candidates: torch.Tensor, *, tolerance: ZeroTolerance
) -> torch.Tensor:
    """``(c,)`` bool: candidates whose zeros' rows of ``L`` leave a one-dimensional kernel.

    A mixture of ``k`` samples vanishes on the neurons inactive for all of them, and those rows
    of ``L`` are orthogonal to each of the ``k`` directions: a ``k``-dimensional kernel. A sample's
    own inactive neurons (at least ``b - 1`` of them, in general position) leave only its direction.
    """
    if candidates.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=candidates.device)
    unit = candidates / candidates.norm(dim=1, keepdim=True).clamp_min(1e-300)
    zeros = ((unit.to(side.left) @ side.left.T).abs() <= tolerance.absolute).to(side.left.dtype)  # (c, m')
    grams = torch.einsum("cm,mi,mj->cij", zeros, side.left, side.left)
    eigenvalues = torch.linalg.eigvalsh(grams)  # ascending
    limit = max(10.0 * tolerance.absolute, KERNEL_FLOOR) ** 2 * zeros.sum(dim=1, keepdim=True)
    return (eigenvalues <= limit).sum(dim=1) == 1


def cutting_directions(side: OneHotSide, candidates: torch.Tensor, *, target: int = 1) -> torch.Tensor | None:
    """A few of the ``(c, b)`` candidate directions, in order, that bring the lineality down to ``target``.

    Greedy: a candidate is kept when it lowers the lineality. A sample's direction that lowers
    it belongs to a near-twin (a sample with unique categories is orthogonal to the twins'
    differences); a wrong one (pass candidates that :func:`single_sample_mask` keeps) cuts off
    only the samples it mixes, and the pool rejects what is not a sample. None when all of them
    together do not reach ``target``.
    """
    b = side.batch_size
    known = side.right.new_zeros(0, b)
    current = lineality(side, known)
    for index in range(candidates.shape[0]):
        if current <= target or known.shape[0] >= b - 1:
            break
        trial = torch.cat([known, candidates[index : index + 1].to(known)], dim=0)
        value = lineality(side, trial)
        if value < current:
            known, current = trial, value
    return known if current <= target else None


def _null_vector(restricted: torch.Tensor) -> torch.Tensor:
    """``(d,)`` unit ``v`` with ``v^T restricted ~= 0`` (the smallest left singular vector)."""
    vectors, _, _ = torch.linalg.svd(restricted, full_matrices=True)
    return vectors[:, -1]


def _distinct(directions: torch.Tensor) -> torch.Tensor:
    """Unit ``directions`` without repeats (up to sign)."""
    if directions.shape[0] < 2:
        return directions
    unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    similar = (unit @ unit.T).abs() > 1 - 1e-9
    first = torch.argmax(similar.to(torch.int8), dim=1)
    return unit[first == torch.arange(unit.shape[0], device=unit.device)]


__all__ = [
    "MAX_HALF",
    "MAX_ROWS",
    "MEMBER_TOLERANCE",
    "RANK_TOLERANCE",
    "OneHotProposals",
    "OneHotSide",
    "cutting_directions",
    "lineality",
    "one_hot_proposals",
    "one_hot_rows",
    "single_sample_mask",
]
