"""Splitting sparse mixtures: new exact directions from two known ones, in O(m log m).

When two samples share many inactive neurons, ``q_x + t q_f`` is itself sparse (its zeros
are the shared ones) and the search converges to it instead of to ``q_x``. Such a mixture
``c`` and the found direction ``f`` span a plane that contains ``q_x``. In that plane each
neuron ``j`` vanishes at exactly one angle ``theta_j = atan(-(L c)_j / (L f)_j)``; the angles
of the neurons inactive for sample ``x`` coincide, so ``q_x`` is the densest cluster of
angles away from ``c`` (theta = 0) and ``f`` (theta = pi/2). No optimization is needed.
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import chunk_rows, elementwise_seconds, matmul_seconds
from fl_attack.pipeline.search.sparsity import ZeroTolerance, zero_masks
from fl_attack.pipeline.spectrum.decompose import LowRankFactors


def _densest_angle(angles: torch.Tensor, width: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``(p, m)`` angles in ``(-pi/2, pi/2]``: the densest window's size and centre."""
    ordered, _ = torch.sort(angles, dim=1)
    wrapped = torch.cat([ordered, ordered + math.pi], dim=1)  # angles live on a circle of length pi
    ends = torch.searchsorted(wrapped.contiguous(), (ordered + width).contiguous(), right=True)
    counts = ends - torch.arange(ordered.shape[1], device=angles.device)
    best = counts.argmax(dim=1)
    first = ordered.gather(1, best[:, None]).squeeze(1)
    return counts.gather(1, best[:, None]).squeeze(1), first + width / 2


def split_mixtures(
    factors: LowRankFactors,
    mixtures: torch.Tensor,
    found: torch.Tensor,
    tolerance: ZeroTolerance,
    *,
    partners: int = 3,
    chunk: int = 4096,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Propose directions hidden in the planes spanned by a mixture and a found direction.

    Parameters
    ----------
    factors
        Low-rank factors (orthonormal ``left``).
    mixtures
        ``(p, b)`` unit directions that are sparse but not accepted as samples.
    found
        ``(f, b)`` unit directions accepted as samples.
    tolerance
        Zero tolerance; sets the angular width of a cluster.
    partners
        Each mixture is paired with the found directions whose zero sets overlap it most
        (a mixture's zeros are a subset of each constituent's zeros).
    chunk
        Most pairs processed at once (fewer on wide layers, to bound each chunk's time).
    deadline
        Deadline after which no further chunk of pairs is processed.

    Returns
    -------
    torch.Tensor
        ``(k, b)`` proposals (not yet filtered) whose angle cluster had at least ``b - 1``
        neurons.
    """
    b = factors.batch_size
    if mixtures.shape[0] == 0 or found.shape[0] == 0 or b < 2:
        return mixtures.new_zeros(0, b)
    left = factors.left
    mix_zero = zero_masks(factors, mixtures, tolerance).to(left.dtype)
    found_zero = zero_masks(factors, found, tolerance).to(left.dtype)
    overlap = (mix_zero @ found_zero.T) / mix_zero.sum(dim=1, keepdim=True).clamp_min(1)
    k = min(partners, found.shape[0])
    partner_index = torch.topk(overlap, k=k, dim=1).indices  # (p, k)
    pair_mix = torch.arange(mixtures.shape[0], device=left.device).repeat_interleave(k)
    pair_found = partner_index.reshape(-1)
    # angular width: a unit column's zero is perturbed by `absolute`, its entries are ~1/sqrt(m)
    width = float(min(0.05, max(1e-7, 10.0 * tolerance.absolute * math.sqrt(left.shape[0]))))
    m = left.shape[0]
    chunk = min(
        chunk,
        chunk_rows(
            matmul_seconds(4.0 * m * b) + elementwise_seconds(8.0 * m * math.log2(m)), device=left.device
        ),
    )
    proposals = []
    for start in range(0, pair_mix.numel(), chunk):
        if deadline.expired():
            break
        c = mixtures[pair_mix[start : start + chunk]]
        f = found[pair_found[start : start + chunk]]
        along_c = c @ left.T
        along_f = f @ left.T
        angles = torch.atan(-along_c / torch.where(along_f == 0, torch.full_like(along_f, 1e-300), along_f))
        # neurons at theta = 0 or pi/2 are zeros of c or f themselves: move them out of the way
        trivial = (along_c.abs() <= tolerance.absolute) | (along_f.abs() <= tolerance.absolute)
        spread = (torch.arange(m, device=left.device, dtype=angles.dtype) + 0.5) * (math.pi / m) - math.pi / 2
        angles = torch.where(trivial, spread.expand_as(angles), angles)
        counts, centre = _densest_angle(angles, width)
        good = (counts >= b - 1) & (centre.abs() > 2 * width) & ((math.pi / 2 - centre.abs()) > 2 * width)
        if bool(good.any()):
            # the window centre is only accurate to half its width: fit the plane direction
            # that vanishes on the rows inside the window by least squares
            offset = torch.remainder(angles[good] - centre[good, None] + math.pi / 2, math.pi) - math.pi / 2
            inside = (offset.abs() <= width / 2).to(left.dtype)
            pair = torch.stack([along_c[good], along_f[good]], dim=-1) * inside.unsqueeze(-1)
            _, vectors = torch.linalg.eigh(pair.transpose(1, 2) @ pair)
            weights = vectors[:, :, 0]
            proposals.append(weights[:, :1] * c[good] + weights[:, 1:] * f[good])
    if not proposals:
        return mixtures.new_zeros(0, b)
    return torch.cat(proposals, dim=0)
