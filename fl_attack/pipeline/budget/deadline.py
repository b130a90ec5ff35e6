"""Bounded chunks of batched work, so that every stage can stop at the attack's deadline.

A deadline is a :class:`fl_attack.pipeline.budget.budget.Deadline` (``Deadline.never()``: none). Each stage splits its
batched tensor work into chunks estimated to take :data:`CHUNK_SECONDS` and checks the
deadline between chunks, so it overruns the deadline by about one chunk at most. A LAPACK
call that cannot be split (the decomposition's singular values or eigenvectors) is not started
when its estimated cost does not fit before the deadline (:func:`require_time`). The
estimates come from a fixed cost model of the operations (below), never from timings, so
chunk sizes depend only on the problem's shape and the device: the same seed gives the same
reconstruction whenever the deadline is not reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fl_attack.pipeline.budget.budget import Deadline

#: Target duration of one chunk of work between two deadline checks, on a CPU.
CHUNK_SECONDS = 0.05

#: Accelerators take this many times more rows per chunk (kernel launches dominate below it).
ACCELERATOR_CHUNK_FACTOR = 100

# Cost model, measured on one busy core of the 2-core CI machine (torch on one thread):
# BLAS matrix products run at ~5-100 GFlop/s (batched small ones at the low end), while batched small LAPACK calls cost per matrix
# roughly in proportion to its squared size (b = 20 / 100 / 190: eigh 0.16 / 3.4 / 12 ms,
# complete QR 0.04 / 1.6 / 4.5 ms, Cholesky 0.005 / 0.4 / 1.1 ms).
_SECONDS_PER_FLOP = 1e-10
_EIGH_SECONDS_PER_SQUARE = 3.5e-7
_QR_SECONDS_PER_SQUARE = 1.5e-7
_CHOLESKY_SECONDS_PER_SQUARE = 4e-8
_SECONDS_PER_ENTRY = 2e-9
# One large LAPACK call on a float64 matrix with long side M and short side N, same busy core:
# singular values take ~(4 M N^2 - 4/3 N^3) flops at 1e-10 s each (4000 x 3072: model 11 s, measured
# 4.8 s idle and 11-24 s at load 1.5-8), singular vectors add ~20 N^3, and a symmetric
# eigendecomposition with vectors ~9 N^3 (3072: model 26 s, measured 54 s at load 8).
_LAPACK_SECONDS_PER_FLOP = 1e-10

#: Gram matrices are summed over chunks of at least this many rows: a matrix product whose inner
#: dimension is shorter runs far below the speed the cost model assumes.
GRAM_MIN_ROWS = 256


class DeadlineReached(TimeoutError):
    """The deadline passed inside a stage that has nothing to return before it ends.

    Raised between chunks of the work, or before an uninterruptible call whose estimated cost
    (from the cost model of this module) does not fit in the time left.
    """


def matmul_seconds(flops: float) -> float:
    """Estimated seconds of ``flops`` floating-point operations in matrix products."""
    return flops * _SECONDS_PER_FLOP


def lstsq_seconds(rows: int, columns: int) -> float:
    """Estimated seconds of one least-squares solve with a ``rows x columns`` matrix."""
    return 1e-9 * rows * columns * columns


def elementwise_seconds(entries: float) -> float:
    """Estimated seconds of a few element-wise passes (comparisons, sorting) over ``entries``."""
    return entries * _SECONDS_PER_ENTRY


def eigh_seconds(size: int) -> float:
    """Estimated seconds of one symmetric eigendecomposition of a ``size x size`` matrix."""
    return _EIGH_SECONDS_PER_SQUARE * size * size + matmul_seconds(4.0 * size**3)


def qr_seconds(size: int) -> float:
    """Estimated seconds of one (complete) QR decomposition of a ``size x size`` matrix."""
    return _QR_SECONDS_PER_SQUARE * size * size + matmul_seconds(2.0 * size**3)


def cholesky_seconds(size: int) -> float:
    """Estimated seconds of one Cholesky factorization of a ``size x size`` matrix."""
    return _CHOLESKY_SECONDS_PER_SQUARE * size * size + matmul_seconds(size**3 / 3.0)


def svdvals_seconds(rows: int, columns: int) -> float:
    """Estimated seconds of the singular values (no vectors) of one ``rows x columns`` matrix."""
    large, small = max(rows, columns), min(rows, columns)
    return _LAPACK_SECONDS_PER_FLOP * (4.0 * large * small * small - 4.0 / 3.0 * small**3)


def svd_seconds(rows: int, columns: int) -> float:
    """Estimated seconds of the thin SVD (with singular vectors) of one ``rows x columns`` matrix."""
    small = min(rows, columns)
    return svdvals_seconds(rows, columns) + _LAPACK_SECONDS_PER_FLOP * 20.0 * small**3


def symmetric_eigen_seconds(size: int) -> float:
    """Estimated seconds of the eigenvalues and eigenvectors of one large ``size x size`` symmetric matrix."""
    return _LAPACK_SECONDS_PER_FLOP * 9.0 * size**3


def require_time(
    seconds: float, *, deadline: Deadline, what: str, device: torch.device | None = None
) -> None:
    """Raise :class:`DeadlineReached` unless ``seconds`` of uninterruptible work fit before ``deadline``.

    Parameters
    ----------
    seconds
        Estimated cost of the work on a CPU, from the cost model of this module.
    deadline
        The stage's deadline (``Deadline.never()``: never raises).
    what
        The work, for the message (``"the singular values of a 4000 x 3072 update"``).
    device
        Where the work runs: an accelerator is assumed :data:`ACCELERATOR_CHUNK_FACTOR` times
        faster (the CPU model would refuse it work it finishes in a fraction of the budget).
    """
    if device is not None and device.type != "cpu":
        seconds /= ACCELERATOR_CHUNK_FACTOR
    left = deadline.remaining()
    if seconds > left:
        raise DeadlineReached(
            f"{what} would take about {seconds:.3g} s and {max(left, 0.0):.3g} s are left before the deadline"
        )


def chunked_product(left: torch.Tensor, right: torch.Tensor, *, deadline: Deadline) -> torch.Tensor:
    """``left @ right`` computed in chunks of rows of ``left``, checking the deadline between them.

    Each row of the product is computed by the same kernel as in one call, so the result is the
    same whatever the chunks (measured bit for bit with MKL).

    Raises
    ------
    DeadlineReached
        When the deadline passes before the last chunk.
    """
    size = chunk_rows(matmul_seconds(2.0 * left.shape[1] * right.shape[1]), device=left.device)
    parts = []
    for start in range(0, left.shape[0], size):
        if deadline.expired():
            raise DeadlineReached(f"the deadline passed after {start} of {left.shape[0]} rows of a product")
        parts.append(left[start : start + size] @ right)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def chunked_gram(matrix: torch.Tensor, *, deadline: Deadline) -> torch.Tensor:
    """``matrix^T matrix`` summed over chunks of rows, checking the deadline between them.

    Raises
    ------
    DeadlineReached
        When the deadline passes before the last chunk.
    """
    columns = matrix.shape[1]
    size = max(GRAM_MIN_ROWS, chunk_rows(matmul_seconds(2.0 * columns * columns), device=matrix.device))
    gram = matrix.new_zeros(columns, columns)
    for start in range(0, matrix.shape[0], size):
        if deadline.expired():
            raise DeadlineReached(
                f"the deadline passed after {start} of {matrix.shape[0]} rows of a Gram matrix"
            )
        block = matrix[start : start + size]
        gram += block.T @ block
    return gram


def chunk_rows(seconds_per_row: float, *, device: torch.device | None = None) -> int:
    """How many rows of a batched computation fit in one chunk (at least one).

    Parameters
    ----------
    seconds_per_row
        Estimated seconds one row (one direction, one trial set) costs on a CPU, from the
        cost model of this module.
    device
        Where the work runs: accelerators take :data:`ACCELERATOR_CHUNK_FACTOR` times more.
    """
    if not seconds_per_row > 0 or not math.isfinite(seconds_per_row):
        raise ValueError(f"seconds_per_row must be positive and finite, got {seconds_per_row}")
    rows = max(1, int(CHUNK_SECONDS / seconds_per_row))
    if device is not None and device.type != "cpu":
        rows *= ACCELERATOR_CHUNK_FACTOR
    return rows


def map_rows(
    function: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    *,
    seconds_per_row: float,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Apply a row-wise ``function`` to chunks of ``rows`` until the deadline passes.

    Returns the results of the chunks that ran, concatenated in order: the results of a
    prefix of ``rows`` (all of them when the deadline is not reached, none when it had
    passed before the first chunk). ``function`` must accept any number of rows, zero
    included, and return a tensor whose rows belong to its input rows in order.
    """
    size = chunk_rows(seconds_per_row, device=rows.device)
    parts = []
    for start in range(0, rows.shape[0], size):
        if deadline.expired():
            break
        parts.append(function(rows[start : start + size]))
    if not parts:
        return function(rows[:0])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
