"""The ReLU patterns along a line of inputs, and the kernels they give: one breakpoint scan.

An input moving along a line has pre-activations ``alpha * slope + bias``. Each neuron
switches between active and inactive at its *breakpoint* ``alpha = -bias / slope``; between two
consecutive breakpoints the set ``Z`` of inactive neurons is fixed. When ``Z`` is a sample's
pattern, the rows ``Z`` of the orthonormal left factor ``L`` share a kernel: that sample's
gradient-side direction. Consecutive patterns differ by one neuron, so their Gram matrices
``L_Z^T L_Z`` are rank-one updates of each other, and a Cholesky attempt of ``G - eps I`` screens
them cheaply (a pattern with a kernel makes it indefinite); a short scan may instead compute each
pattern's Gram afresh (``fresh_grams``).

In: ``L`` (``(m', b)``), the line's ``slope`` and the ``bias`` (``(m',)`` each). Out: the patterns'
``(residual, kernel vector)`` pairs within a limit. Used by the last-direction scan (the whole
line) and by the input side (``alpha > 0``: a vertex of the input cone at its unknown scale).
"""

from __future__ import annotations

import torch

from fl_attack.pipeline.budget.budget import Deadline


def probe_alphas(ordered: torch.Tensor, *, positive_only: bool) -> torch.Tensor:
    """One ``alpha`` inside each interval between consecutive sorted breakpoints, and beyond each end."""
    if positive_only:
        first, last = ordered[:1] / 2, 2 * ordered[-1:]
    else:
        first, last = ordered[:1] - 1.0 - ordered[:1].abs(), ordered[-1:] + 1.0 + ordered[-1:].abs()
    return torch.cat([first, (ordered[:-1] + ordered[1:]) / 2, last])


def _sorted_breakpoints(
    slope: torch.Tensor, bias: torch.Tensor, *, positive_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The finite breakpoints ``-bias / slope`` in increasing order (``alpha > 0`` only when
    ``positive_only``) and the neuron of each."""
    usable = slope != 0
    breakpoints = torch.where(
        usable,
        -bias / torch.where(usable, slope, torch.ones_like(slope)),
        torch.full_like(slope, float("inf")),
    )
    if positive_only:
        breakpoints = torch.where(breakpoints > 0, breakpoints, torch.full_like(breakpoints, float("inf")))
    order = torch.argsort(breakpoints)
    ordered = breakpoints[order]
    finite = torch.isfinite(ordered)
    return ordered[finite], order[finite]


def line_breakpoints(slope: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The finite breakpoints ``-bias / slope`` of a line of inputs, in increasing order."""
    ordered, _ = _sorted_breakpoints(slope, bias, positive_only=False)
    return ordered


def line_pattern_kernels(
    left: torch.Tensor,
    slope: torch.Tensor,
    bias: torch.Tensor,
    *,
    minimum: int,
    limit: float,
    chunk: int,
    deadline: Deadline = Deadline.never(),
    positive_only: bool = False,
    fresh_grams: bool = False,
) -> list[tuple[float, torch.Tensor]]:
    """Kernels of the inactive rows of ``left`` for the patterns of ``alpha * slope + bias <= 0``.

    Parameters
    ----------
    left
        ``(m', b)`` orthonormal left factor.
    slope, bias
        ``(m',)`` the line's pre-activation slope and offset.
    minimum
        Patterns with fewer inactive neurons are skipped.
    limit
        A pattern counts when its smallest singular value per inactive row is at most this.
    chunk
        Most patterns screened at once (the deadline is checked between chunks).
    deadline
        Deadline after which no further chunk is screened.
    positive_only
        Scan ``alpha > 0`` only (from just above 0), instead of every real ``alpha``.
    fresh_grams
        Compute each pattern's Gram matrix afresh from its rows (``m' b^2`` per pattern) instead
        of as a running sum of rank-one updates screened by Cholesky (``b^3 / 3``). For short
        scans whose ``limit`` sits near float64's own precision (the input side's floor), where a
        running sum's rounding would reorder the near-zero residuals of equivalent patterns.

    Returns
    -------
    list[tuple[float, torch.Tensor]]
        ``(residual, unit kernel vector)`` of every pattern within ``limit``, in scan order.
    """
    b = left.shape[1]
    ordered, order = _sorted_breakpoints(slope, bias, positive_only=positive_only)
    if ordered.numel() == 0:
        if not positive_only:
            return []
        probes = torch.ones(1, dtype=left.dtype, device=left.device)  # one pattern for every alpha > 0
    else:
        probes = probe_alphas(ordered, positive_only=positive_only)
    found: list[tuple[float, torch.Tensor]] = []
    if fresh_grams:
        for start in range(0, probes.numel(), chunk):
            if deadline.expired():
                break
            inactive = (probes[start : start + chunk, None] * slope[None, :] + bias[None, :]) <= 0
            masks = inactive[inactive.sum(dim=1) >= minimum].to(left.dtype)
            if masks.shape[0]:
                grams = torch.einsum("pm,mi,mj->pij", masks, left, left)
                found.extend(_kernels(grams, masks.sum(dim=1), limit=limit))
        return found
    first_inactive = (probes[0] * slope + bias) <= 0
    steps = torch.where(slope[order] < 0, 1, -1)
    counts = torch.cat([first_inactive.sum()[None], first_inactive.sum() + torch.cumsum(steps, dim=0)])
    # crossing breakpoint k upwards flips neuron order[k]: the Gram changes by one outer product
    signs = steps.to(left.dtype)
    gram = left.T @ (first_inactive.to(left.dtype)[:, None] * left)
    eye = torch.eye(b, dtype=left.dtype, device=left.device)
    for start in range(0, probes.numel(), chunk):
        if deadline.expired():
            break
        stop = min(start + chunk, probes.numel())
        index = torch.arange(start, stop, device=left.device)
        flips = index[index > 0] - 1
        rows = left[order[flips]]
        grams = (
            gram + torch.cumsum(signs[flips, None, None] * rows[:, :, None] * rows[:, None, :], dim=0)
            if flips.numel()
            else gram[None]
        )
        if flips.numel() < index.numel():  # the first chunk starts with the initial pattern itself
            grams = torch.cat([gram[None], grams], dim=0)
        gram = grams[-1]
        chunk_counts = counts[start:stop]
        keep = (chunk_counts >= minimum) & (probes[start:stop] != 0)
        if not bool(keep.any()):
            continue
        kept_grams, kept_counts = grams[keep], chunk_counts[keep].to(left.dtype)
        # a pattern with a kernel makes G - eps I indefinite: Cholesky fails exactly there
        eps = limit**2 * kept_counts
        _, info = torch.linalg.cholesky_ex(kept_grams - eps[:, None, None] * eye)
        hits = info != 0
        if bool(hits.any()):
            found.extend(_kernels(kept_grams[hits], kept_counts[hits], limit=limit))
    return found


def _kernels(grams: torch.Tensor, counts: torch.Tensor, *, limit: float) -> list[tuple[float, torch.Tensor]]:
    """``(residual, kernel)`` of each ``(p, b, b)`` Gram whose smallest singular value per row is within ``limit``."""
    eigenvalues, eigenvectors = torch.linalg.eigh(grams)
    residual = eigenvalues[:, 0].clamp_min(0).sqrt() / counts.sqrt()
    return [
        (value, vector)
        for value, vector in zip(residual.tolist(), eigenvectors[:, :, 0], strict=True)
        if value <= limit
    ]
