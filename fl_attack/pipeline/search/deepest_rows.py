"""The last missing direction of a local epoch's sample, from the rows deepest below zero.

With ``b - 1`` columns of the disaggregation matrix known, the missing input lies on a known line
``x = alpha R^T u`` (:mod:`fl_attack.pipeline.search.last_direction`), whose pre-activations at
``W_0`` are ``alpha * slope + bias``. The exact scan there needs the sample's column to vanish
exactly on its inactive neurons at ``W_0``; a sample of a later mini-batch step of one local
epoch vanishes where it is inactive at *its own* step's weights instead, which differ from
``W_0`` on the neurons its pre-activation left within the other samples' drift of zero (CIFAR-10
(20, 200), lr 0.1: 27 of 89 zeros). The rows far below zero stay inactive at every step, so at
the right ``alpha`` the kernel of the ``b - 1`` rows deepest below zero is that sample's exact
direction. The deepest rows change only at the breakpoints, so one ``alpha`` per interval
between consecutive breakpoints (as the exact scan probes) covers every set; each distinct set
gives one kernel, and those with the most zeros are proposed (the candidate pool refines and
filters them as any proposal; the selection and self-check judge them).
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import chunk_rows, eigh_seconds, matmul_seconds
from fl_attack.pipeline.search.pattern_scan import line_breakpoints, probe_alphas
from fl_attack.pipeline.search.sparsity import ZeroTolerance, deduplicate

__all__ = ["deepest_row_kernels"]

#: ``1 - |cos|`` below which two kernels are one direction (kernels of different rows of one
#: sample agree to float64 rounding; distinct samples' directions are far apart).
SAME_DIRECTION = 1e-6
#: Rows are also taken this many times ``b - 1`` deep: where the ``b - 1`` deepest are zero for
#: several samples their kernel is not one direction, and more rows pin it.
ROW_MULTIPLE = 2
#: Kernels, the sparsest first, among which duplicates are dropped (per proposal returned).
CONSIDERED = 16
#: Flops (about ``b^3`` per kernel) of one call's kernels, at most.
KERNEL_FLOPS = 1e10


def deepest_row_kernels(
    left: torch.Tensor,
    slopes: torch.Tensor,
    bias: torch.Tensor,
    *,
    known: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    end: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_proposals: int = 8,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Kernels of the rows of ``left`` deepest below zero along the lines ``alpha * slope + bias``.

    Parameters
    ----------
    left
        ``(m', b)`` orthonormal left factor on the informative neurons.
    slopes
        ``(m', k)``: the pre-activation slope at ``W_0`` of each of ``k`` lines of inputs through
        the origin.
    bias
        ``(m',)`` the layer's bias on the same neurons.
    known
        ``(j, b)`` unit directions already found: their samples' zeros hold the deepest rows of
        many lines too, so kernels repeating them are not proposed.
    tolerance
        Zero tolerance of unit gradient columns.
    min_zeros
        Kernels with fewer zero entries are not proposed.
    end
        The lines' ``(m', k)`` slopes and ``(m',)`` bias at the end weights ``W_0 + dW``, when
        known: rows are then also taken deepest by the larger of both ends' pre-activations (with
        momentum a later step's sample drifts further from ``W_0``).
    max_proposals
        Most kernels returned, the sparsest first.
    deadline
        Deadline after which no further chunk of ``alpha`` values is tried.

    Returns
    -------
    torch.Tensor
        ``(p, b)`` unit directions, ``p <= max_proposals``, possibly none.
    """
    m, b = left.shape
    empty = left.new_zeros(0, b)
    if b < 2 or m < b - 1:
        return empty
    sizes = sorted({size for size in (b - 1, min(m, ROW_MULTIPLE * (b - 1)))})
    chunk = chunk_rows(len(sizes) * (matmul_seconds(2.0 * m) + eigh_seconds(b)), device=left.device)
    seen: set[tuple[int, ...]] = set()
    kernels = []
    for line in range(slopes.shape[1]):
        ordered = line_breakpoints(slopes[:, line], bias)
        if ordered.numel() == 0:
            continue
        probes = probe_alphas(ordered, positive_only=False)
        # on wide layers and large batches every other (or n-th) interval: the deepest rows of
        # neighbouring intervals mostly agree
        sets = slopes.shape[1] * probes.numel() * len(sizes) * (1 if end is None else 2)
        probes = probes[:: max(1, math.ceil(sets * b**3 / KERNEL_FLOPS))]
        for start in range(0, probes.numel(), chunk):
            if deadline.expired():
                break
            alphas = probes[start : start + chunk, None]
            depths = [alphas * slopes[:, line][None, :] + bias[None, :]]
            if end is not None:
                depths.append(torch.maximum(depths[0], alphas * end[0][:, line][None, :] + end[1][None, :]))
            for depth in depths:
                for size in sizes:
                    deepest = torch.topk(depth, k=size, dim=1, largest=False)
                    fresh = []
                    shallowest = deepest.values[:, -1].tolist()  # one host read, not one per row
                    for row, rows in enumerate(deepest.indices.sort(dim=1).values.tolist()):
                        key = tuple(rows)
                        if key not in seen and shallowest[row] < 0:
                            seen.add(key)
                            fresh.append(row)
                    if fresh:
                        rows_of = left[deepest.indices[fresh]]  # (p, size, b)
                        _, vectors = torch.linalg.eigh(rows_of.transpose(1, 2) @ rows_of)
                        kernels.append(vectors[:, :, 0])
    if not kernels:
        return empty
    vectors = torch.cat(kernels, dim=0)
    counts = ((vectors @ left.T).abs() <= tolerance.thresholds(vectors)[:, None]).sum(dim=1)
    keep = counts >= max(min_zeros, b)
    if known.shape[0]:
        keep &= (vectors @ known.T).abs().amax(dim=1) < 1.0 - SAME_DIRECTION
    vectors, counts = vectors[keep], counts[keep]
    order = torch.argsort(counts, descending=True, stable=True)[: CONSIDERED * max_proposals]
    vectors = vectors[order]
    return vectors[deduplicate(vectors, cos_tolerance=SAME_DIRECTION)[:max_proposals]]
