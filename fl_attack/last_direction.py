"""The last missing direction from the other b - 1, by a one-dimensional ReLU-pattern scan.

With ``b - 1`` columns of the disaggregation matrix known, the missing sample's row ``p`` of
``Q^{-1}`` is orthogonal to all of them, so its input is known up to a scalar:
``x = alpha R^T p``. Its pre-activations ``alpha a + bias`` (``a = W R^T p``) switch sign at
``m`` breakpoints ``alpha_j = -bias_j / a_j``; between two breakpoints the set ``Z`` of
inactive neurons is fixed, and at the true ``alpha`` the rows ``Z`` of ``L`` share a kernel:
the missing direction. All ``m + 1`` patterns are scanned at once with cumulative Gram
matrices updated one neuron at a time. This finds directions whose basins the sphere search keeps missing.
"""

from __future__ import annotations

import torch

from fl_attack.lowrank import LowRankFactors
from fl_attack.sparsity import ZeroTolerance


def scan_last_direction(
    factors: LowRankFactors,
    found: torch.Tensor,
    *,
    pre_activation_basis: torch.Tensor,
    bias: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    max_proposals: int = 8,
    chunk: int = 256,
) -> torch.Tensor:
    """Propose the direction missing from ``b - 1`` found ones.

    Parameters
    ----------
    factors
        Low-rank factors restricted to the informative neurons.
    found
        ``(b - 1, b)`` linearly independent directions believed correct.
    pre_activation_basis
        ``(m', b)`` ``W R^T`` restricted to the same neurons as ``factors.left``.
    bias
        ``(m',)`` the layer's bias on those neurons.
    tolerance
        Zero tolerance of unit gradient columns.
    min_zeros
        Patterns with fewer inactive neurons are not considered.

    Returns
    -------
    torch.Tensor
        Up to ``max_proposals`` unit directions whose pattern has a near-exact kernel.
    """
    left = factors.left
    m, b = left.shape
    if found.shape[0] != b - 1 or b < 2:
        return left.new_zeros(0, b)
    complete, _ = torch.linalg.qr(found.T, mode="complete")
    dual = complete[:, -1]  # orthogonal to every found direction
    slope = pre_activation_basis @ dual
    usable = slope != 0
    breakpoints = torch.where(usable, -bias / torch.where(usable, slope, torch.ones_like(slope)),
                              torch.full_like(slope, float("inf")))
    order = torch.argsort(breakpoints)
    ordered = breakpoints[order]
    finite = torch.isfinite(ordered)
    ordered, order = ordered[finite], order[finite]
    if ordered.numel() == 0:
        return left.new_zeros(0, b)
    # one probe per interval between consecutive breakpoints, plus one beyond each end
    probes = torch.cat([ordered[:1] - 1.0 - ordered[:1].abs(), (ordered[:-1] + ordered[1:]) / 2,
                        ordered[-1:] + 1.0 + ordered[-1:].abs()])
    first_inactive = (probes[0] * slope + bias) <= 0
    counts = first_inactive.sum() + torch.cumsum(torch.where(slope[order] < 0, 1, -1), dim=0)
    counts = torch.cat([first_inactive.sum()[None], counts])
    # crossing breakpoint k upwards flips neuron order[k]: the pattern Gram changes by one outer product
    signs = torch.where(slope[order] < 0, 1.0, -1.0).to(left.dtype)
    gram = left.T @ (first_inactive.to(left.dtype)[:, None] * left)
    lowest_found: list[tuple[float, torch.Tensor]] = []
    minimum = max(min_zeros, b - 1)
    for start in range(0, probes.numel(), chunk):
        stop = min(start + chunk, probes.numel())
        steps = torch.arange(start, stop, device=left.device)
        flips = steps[steps > 0] - 1
        rows = left[order[flips]]
        updates = signs[flips, None, None] * rows[:, :, None] * rows[:, None, :]
        grams = gram + torch.cumsum(updates, dim=0) if flips.numel() else gram[None]
        if flips.numel() < steps.numel():  # the first chunk starts with the initial pattern itself
            grams = torch.cat([gram[None], grams], dim=0)
        gram = grams[-1]
        chunk_counts = counts[start:stop]
        keep = (chunk_counts >= minimum) & (probes[start:stop] != 0)
        if not bool(keep.any()):
            continue
        eigenvalues, eigenvectors = torch.linalg.eigh(grams[keep])
        residual = eigenvalues[:, 0].clamp_min(0).sqrt() / chunk_counts[keep].to(left.dtype).sqrt()
        for value, vector in zip(residual.tolist(), eigenvectors[:, :, 0]):
            if value <= 10 * tolerance.absolute:
                lowest_found.append((value, vector))
    lowest_found.sort(key=lambda item: item[0])
    if not lowest_found:
        return left.new_zeros(0, b)
    return torch.stack([vector for _, vector in lowest_found[:max_proposals]])
