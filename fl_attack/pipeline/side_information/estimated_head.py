"""A head prior estimated from the directions found, where the caller passed no head weight.

When the attacked layer's ReLU feeds the output layer, sample ``i``'s column of the output
gradient is ``mask_i * (W2^T g_i)`` with ``g_i`` close to its class prototype ``1/c - e_{y_i}``
(:mod:`fl_attack.pipeline.side_information.output_layer`): two samples of the same class carry
the same signs wherever both are active. Without ``head_weight`` the plain l1 search then finds
few true directions (same-class differences are as sparse as samples), yet the true directions
it does find reveal the class signs themselves.

Measured on the true columns (CIFAR-10, (20, 200), seeds 0-3, 190 pairs each): with one hidden
layer same-class pairs agree in sign on 90-100% of their common active neurons (median 97-100%),
other pairs on at most 70%; with three hidden layers no pair of either kind exceeds 70%. So a
pair of found directions agreeing on at least :data:`SAME_CLASS_AGREEMENT` of
:data:`MIN_COMMON` or more common neurons is taken as evidence of the output-layer structure;
the found directions linked by such pairs are grouped into classes, and each group's summed
oriented columns give the class signs where the group is active (0, unconstrained, elsewhere).
Without such a pair nothing is estimated and the attack runs as before.

Like the given head, the estimate only steers the search: every proposal is rounded and
filtered by the candidate pool, selected and self-checked as any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.sparsity import zero_masks
from fl_attack.pipeline.side_information.output_layer import (
    CONFIDENT_FRACTION,
    HEAD_PATIENCE,
    HeadPrior,
    HeadRounds,
)

#: Share of common active neurons on which two found columns must agree in sign (up to the
#: orientation of either) to count as samples of one class.
SAME_CLASS_AGREEMENT = 0.9

#: Common active neurons two columns need before their sign agreement counts.
MIN_COMMON = 20

#: Active neurons each of two columns needs outside the other's for their agreement to count.
MIN_OWN = 5


def sign_agreement(columns: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise signed agreement of ``(f, m)`` columns on their common ``active`` neurons.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(f, f)`` agreement in ``[-1, 1]`` (the mean of ``sign_i * sign_j`` over the common
        neurons: 1 same signs, -1 opposite ones, i.e. the same up to orientation; 0 where either
        column has fewer than :data:`MIN_OWN` active neurons outside the other's) and ``(f, f)``
        the number of common neurons.
    """
    signs = torch.sign(columns) * active.to(columns.dtype)
    common = active.to(columns.dtype) @ active.to(columns.dtype).T
    agreement = (signs @ signs.T) / common.clamp_min(1.0)
    # a positive mixture of a sample and another agrees with that sample wherever it dominates;
    # its active neurons contain the sample's: such nested pairs are no evidence of classes
    sizes = active.sum(dim=1).to(columns.dtype)
    own = torch.minimum(sizes[:, None], sizes[None, :]) - common
    agreement = torch.where(own >= MIN_OWN, agreement, torch.zeros_like(agreement))
    return agreement, common


def class_groups(agreement: torch.Tensor, common: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Directions linked (transitively) by same-class pairs, with each member's orientation.

    Empty when no pair is linked: then nothing shows the output-layer structure. Otherwise
    every direction is in one group, a direction linked to none in a group of its own (the
    one sample found so far of its class).
    """
    count = agreement.shape[0]
    linked = (agreement.abs() >= 2.0 * SAME_CLASS_AGREEMENT - 1.0) & (common >= MIN_COMMON)
    linked.fill_diagonal_(False)
    if not bool(linked.any()):
        return []
    seen = [False] * count
    groups: list[tuple[list[int], list[float]]] = []
    for root in range(count):
        if seen[root]:
            continue
        seen[root] = True
        members, orientation, queue = [root], [1.0], [(root, 1.0)]
        while queue:
            node, sign = queue.pop()
            for other in torch.nonzero(linked[node]).flatten().tolist():
                if not seen[other]:
                    seen[other] = True
                    other_sign = sign * (1.0 if float(agreement[node, other]) > 0 else -1.0)
                    members.append(other)
                    orientation.append(other_sign)
                    queue.append((other, other_sign))
        groups.append((members, orientation))
    return groups


def _consistent(
    members: torch.Tensor, active: torch.Tensor, others: torch.Tensor, others_active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``others`` columns (pool candidates, sparse mixtures) oriented to agree in sign with a group.

    A positive combination of same-class samples carries the class signs on the union of their
    active neurons: it widens the neurons whose sign the group knows. Such a column agrees with
    every group member it overlaps; one that disagrees with any (a difference of samples, another
    class) is left out.
    """
    if others.shape[0] == 0:
        return others, others_active
    signs = torch.sign(members) * active.to(members.dtype)
    other_signs = torch.sign(others) * others_active.to(others.dtype)
    common = others_active.to(others.dtype) @ active.to(others.dtype).T  # (k, f)
    agreement = (other_signs @ signs.T) / common.clamp_min(1.0)
    counted = common >= MIN_COMMON
    threshold = 2.0 * SAME_CLASS_AGREEMENT - 1.0
    positive = (counted & (agreement < threshold)).any(dim=1)
    negative = (counted & (agreement > -threshold)).any(dim=1)
    overlaps = counted.any(dim=1)
    keep_plus, keep_minus = overlaps & ~positive, overlaps & ~negative
    orientation = torch.where(keep_plus, 1.0, -1.0).to(others.dtype)
    keep = keep_plus | keep_minus
    return others[keep] * orientation[keep, None], others_active[keep]


def estimate_head_prior(directions: torch.Tensor, *, pool: CandidatePool) -> HeadPrior | None:
    """Class signs from trusted ``(f, b)`` directions; None without a same-class pair among them.

    Parameters
    ----------
    directions
        Directions taken for samples (the best selection's well-matching ones): a sparse
        mixture among them would link classes.
    pool
        The attack's candidate pool: its factors (restricted to the informative rows, so the
        prior covers the same neurons as :meth:`HeadPrior.from_head_weight` with ``rows``) and
        zero tolerance.

    Returns
    -------
    HeadPrior or None
        One sign row per group of same-class directions (:func:`class_groups`); None when no
        two directions agree as same-class samples do.
    """
    if directions.shape[0] < 2:
        return None
    unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    columns = unit @ pool.factors.left.T
    active = ~zero_masks(pool.factors, unit, pool.tolerance)
    agreement, common = sign_agreement(columns, active)
    groups = class_groups(agreement, common)
    if not groups:
        return None
    others = torch.cat([pool.directions, pool.mixtures])
    others = others / others.norm(dim=1, keepdim=True).clamp_min(1e-300)
    other_columns = others @ pool.factors.left.T
    other_active = ~zero_masks(pool.factors, others, pool.tolerance)
    rows = []
    for members, orientation in groups:
        index = torch.tensor(members, device=columns.device)
        oriented = (
            columns[index] * torch.tensor(orientation, dtype=columns.dtype, device=columns.device)[:, None]
        )
        extra, extra_active = _consistent(oriented, active[index], other_columns, other_active)
        oriented = torch.cat([oriented, extra])
        oriented = oriented / oriented.norm(dim=1, keepdim=True).clamp_min(1e-300)
        prototype = oriented.sum(dim=0)
        covered = active[index].any(dim=0) | extra_active.any(dim=0)
        rms = prototype[covered].pow(2).mean().sqrt()
        confident = covered & (prototype.abs() >= CONFIDENT_FRACTION * rms)
        rows.append(torch.sign(prototype) * confident.to(prototype.dtype))
    return HeadPrior(signs=torch.stack(rows).to(torch.float64))


def interleave_estimated_head(
    base: Iterator[torch.Tensor],
    *,
    trusted: Callable[[], torch.Tensor],
    pool: CandidatePool,
    generator: torch.Generator,
    deadline: Deadline,
    stats: dict[str, Any],
    patience: int = HEAD_PATIENCE,
) -> Iterator[torch.Tensor]:
    """Yield the ``base`` rounds, each followed by head rounds once the found samples show classes.

    After each round (which the caller adds to ``pool`` and selects from) the class signs are
    estimated from ``trusted()`` (:func:`estimate_head_prior`). With an estimate, a head round
    (:class:`~fl_attack.pipeline.side_information.output_layer.HeadRounds`) runs before the next
    base round, until ``patience`` head rounds in a row added nothing to the pool; a new
    estimate (more samples found, so more neurons' signs known) starts them again. Where no
    estimate ever forms (no output layer after the attacked one) the rounds are exactly
    ``base``'s. Clean gradients only: the caller does not use it under noise.
    """
    head: HeadRounds | None = None
    searches = initializations = idle = 0
    signs: torch.Tensor | None = None
    try:
        for proposals in base:
            yield proposals
            while not deadline.expired():
                prior = estimate_head_prior(trusted(), pool=pool)
                if prior is None:
                    break
                if signs is None or not torch.equal(prior.signs, signs):
                    if head is not None:
                        searches, initializations = (
                            searches + head.searches,
                            initializations + head.initializations,
                        )
                    signs, idle = prior.signs, 0
                    head = HeadRounds.for_pool(
                        pool, prior, generator=generator, deadline=deadline, noisy=False
                    )
                    stats["estimated_head_classes"] = prior.num_classes
                if head is None or idle >= patience:
                    break
                before = len(pool)
                yield head.propose(pool.directions, avoid=pool.mixtures)
                idle = 0 if len(pool) > before else idle + 1
    finally:
        if head is not None:
            stats["head_searches"] = searches + head.searches
            stats["head_initializations"] = initializations + head.initializations
