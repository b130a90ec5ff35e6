"""The last one or two missing directions, by scanning ReLU patterns of the known input space.

With ``b - d`` columns of the disaggregation matrix known, the rows of ``Q^{-1}`` of the
``d`` missing samples are orthogonal to all of them, so the missing inputs lie in a known
``d``-dimensional space: ``x = R^T P beta``. Along a line ``beta = alpha u`` the
pre-activations ``alpha (W R^T P u) + bias`` switch sign at ``m`` breakpoints; between two
breakpoints the set ``Z`` of inactive neurons is fixed, and when ``Z`` is a missing sample's
pattern the rows ``Z`` of ``L`` share a kernel: the missing direction.

* ``d = 1``: the line through the origin is the whole space, so one scan of its ``m + 1``
  patterns is exact.
* ``d = 2``: lines through the origin at many angles; a line crossing the cell of a missing
  sample's ``beta`` finds its direction.

Patterns along a line differ by one neuron at a time, so their Gram matrices are rank-one
updates of each other, and a Cholesky attempt of ``G - eps I`` screens them cheaply.
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import cholesky_seconds, chunk_rows, matmul_seconds
from fl_attack.pipeline.search.pattern_scan import line_pattern_kernels
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: Upper bound on the flops spent on the ``d = 2`` scan (Cholesky screens of all patterns).
PAIR_SCAN_FLOPS = 3e10


def scan_missing_directions(
    factors: LowRankFactors,
    found: torch.Tensor,
    *,
    pre_activation_basis: torch.Tensor,
    bias: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    max_proposals: int = 8,
    chunk: int = 256,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Propose the directions missing from ``b - 1`` or ``b - 2`` found ones.

    Parameters
    ----------
    factors
        Low-rank factors restricted to the informative neurons.
    found
        ``(b - d, b)`` linearly independent directions believed correct, ``d`` in {1, 2}.
    pre_activation_basis
        ``(m', b)`` ``W R^T`` restricted to the same neurons as ``factors.left``.
    bias
        ``(m',)`` the layer's bias on those neurons.
    tolerance
        Zero tolerance of unit gradient columns.
    min_zeros
        Patterns with fewer inactive neurons are not considered.
    chunk
        Most patterns screened at once (fewer for large ``b``, to bound each chunk's time).
    deadline
        Deadline after which the scans stop (both ``d = 1`` and ``d = 2``).

    Returns
    -------
    torch.Tensor
        Up to ``max_proposals`` unit directions whose pattern has a near-exact kernel.
    """
    left = factors.left
    m, b = left.shape
    missing = b - found.shape[0]
    if missing not in (1, 2) or b < 2:
        return left.new_zeros(0, b)
    complete, _ = torch.linalg.qr(found.T, mode="complete")
    dual = complete[:, b - missing :]  # (b, d): orthogonal to every found direction
    slopes = pre_activation_basis @ dual  # (m, d)
    minimum = max(min_zeros, b - 1)
    limit = 10.0 * tolerance.absolute
    chunk = min(chunk, chunk_rows(cholesky_seconds(b) + matmul_seconds(4.0 * b * b), device=left.device))
    hits: list[tuple[float, torch.Tensor]] = []
    if missing == 1:
        hits = line_pattern_kernels(
            left, slopes[:, 0], bias, minimum=minimum, limit=limit, chunk=chunk, deadline=deadline
        )
    else:
        lines = int(max(8, min(4 * m, PAIR_SCAN_FLOPS / (m * b**3 / 3 + 1))))
        offset = 0.5 * math.pi / lines
        for k in range(lines):
            if deadline.expired():
                break
            angle = offset + math.pi * k / lines
            slope = math.cos(angle) * slopes[:, 0] + math.sin(angle) * slopes[:, 1]
            hits.extend(
                line_pattern_kernels(
                    left, slope, bias, minimum=minimum, limit=limit, chunk=chunk, deadline=deadline
                )
            )
    if not hits:
        return left.new_zeros(0, b)
    hits.sort(key=lambda item: item[0])
    return torch.stack([vector for _, vector in hits[: max_proposals * missing]])
