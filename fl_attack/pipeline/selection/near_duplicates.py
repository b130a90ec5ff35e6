"""Near-identical samples: their directions from a blend's zeros, and whether they are unique.

Two samples whose ReLU patterns differ on only a few neurons (near-identical inputs, such as
neighbouring patches of one photo or their pooled features) have gradient columns that vanish
together on almost all of their zeros. Every combination ``q = a q_x + c q_y`` vanishes on
their common zeros ``Z``, so the search converges to such blends, and the samples' own
directions stand out from them by only the few neurons where one sample is active and the
other is not.

* :func:`twin_plane_proposals`: when neither direction was found,
  :mod:`fl_attack.pipeline.search.mixtures` has no plane to split; the blend's zeros give it all the
  same: the rows ``Z`` of the left factor have a two-dimensional kernel, spanned exactly by
  ``q_x`` and ``q_y`` (a sample's own direction leaves a one-dimensional one). In that plane
  every other neuron vanishes at one angle, and ``q_x`` and ``q_y`` lie at the angles where the
  neurons of their own extra zeros vanish. Each angle is proposed, those shared by the most
  neurons first; the selection decides.
* :func:`twin_self_check`: the same planes can hold *another* batch that explains the update as
  well as the one selected (near such twins a direction off by a few percent can keep a
  consistent ReLU pattern within the rounding). A complete batch is only claimed when, for
  every pair of rows with nearly one pattern, no other direction of their plane matches the
  update at the acceptance level in place of either.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.mixtures import split_mixtures
from fl_attack.pipeline.search.sparsity import ZeroTolerance, deduplicate, zero_masks
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.selection.self_check import SelfCheck, passes_but_for_nesting, self_check
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

__all__ = ["PLANE_FLOPS", "split_blends", "twin_ambiguity", "twin_plane_proposals", "twin_self_check"]

#: Upper bound on the flops of the kernel tests (``m b^2`` per direction): larger layers skip them.
PLANE_FLOPS = 2e8
#: A kernel's singular value counts as zero below this multiple of the zero tolerance (per row).
KERNEL_FACTOR = 10.0
#: A plane is exact when its second-smallest singular value is this far below the next one.
KERNEL_GAP = 1e-3
#: Most rows dropped from a blend's zeros before its plane is given up.
MAX_TRIMMED = 16
#: Most planes split in one attack (``seen``): the README's default audit has a batch of
#: look-alikes whose planes, split round after round, flooded the pool with equally sparse
#: blends (7 of 8 rows exact in 1.9 s before the twin planes, 0 in 30 s with no limit).
MAX_PLANES = 2
#: Rows whose ReLU patterns differ on at most this many neurons are tested for another batch.
TWIN_PATTERN_DIFFERENCE = 8
#: Upper bound on the flops of scoring the other batches of all near-identical pairs; beyond it
#: every such pair counts as ambiguous (a claim is withheld rather than left untested).
AMBIGUITY_FLOPS = 5e10
#: Most batches of one pair's plane that match the update and are self-checked; a plane with
#: more counts as ambiguous (untested, so never claimed).
MAX_PLANE_CHECKS = 256
#: Batches scored at once in the twin test (bounds its memory: ``m b`` floats each).
SCORE_CHUNK = 512


def _plane_proposals(
    left: torch.Tensor, zero: torch.Tensor, plane: torch.Tensor, *, width: float, limit: int
) -> torch.Tensor:
    """Directions of ``plane`` (``(2, b)``, orthonormal rows) vanishing on the other neurons.

    Neurons whose vanishing angles lie within ``width`` of each other form one proposal
    (least-squares fit over the group); the groups with the most neurons come first.
    """
    coordinates = left[~zero] @ plane.T  # (k, 2): each neuron's column in plane coordinates
    coordinates = coordinates[coordinates.norm(dim=1) > 0]
    if coordinates.shape[0] == 0:
        return plane.new_zeros(0, plane.shape[1])
    # the plane direction (cos t, sin t) vanishing on neuron j is perpendicular to its coordinates
    angles = torch.remainder(torch.atan2(coordinates[:, 0], -coordinates[:, 1]), math.pi)
    order = torch.argsort(angles)
    angles, coordinates = angles[order], coordinates[order]
    breaks = torch.nonzero(torch.diff(angles) > width).flatten() + 1
    bounds = [0, *breaks.tolist(), angles.numel()]
    groups = sorted(zip(bounds[:-1], bounds[1:], strict=True), key=lambda item: item[0] - item[1])
    proposals = []
    for start, stop in groups[:limit]:
        group = coordinates[start:stop]
        _, vectors = torch.linalg.eigh(group.T @ group)
        proposals.append(vectors[:, 0] @ plane)
    return torch.stack(proposals)


def _trimmed_plane(left: torch.Tensor, zero: torch.Tensor) -> torch.Tensor | None:
    """The exact two-dimensional kernel of the rows ``zero``, after dropping rows that are no zeros.

    A blend's detected zeros can include a few small entries that are not common zeros of the
    pair (the zero tolerance is loose where the pair's difference is weak); they tilt the
    kernel. The row farthest from the current kernel is dropped until the kernel stands
    :data:`KERNEL_GAP` below the next singular value (None when that does not happen within
    :data:`MAX_TRIMMED` rows or before ``b`` rows are left).
    """
    rows = torch.nonzero(zero).flatten()
    b = left.shape[1]
    for _ in range(MAX_TRIMMED + 1):
        if rows.numel() < b:
            return None
        _, values, vh = torch.linalg.svd(left[rows], full_matrices=False)
        if float(values[-2]) <= KERNEL_GAP * float(values[-3]):
            return vh[-2:]
        distance = (left[rows] @ vh[-2:].T).norm(dim=1)
        rows = rows[torch.arange(rows.numel(), device=rows.device) != distance.argmax()]
    return None


def _angle_width(tolerance: ZeroTolerance, width: int) -> float:
    return float(min(0.05, max(1e-7, KERNEL_FACTOR * tolerance.absolute * math.sqrt(width))))


def twin_plane_proposals(
    factors: LowRankFactors,
    directions: torch.Tensor,
    tolerance: ZeroTolerance,
    *,
    max_per_plane: int = 64,
    deadline: Deadline = Deadline.never(),
    seen: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Propose the directions of near-identical samples hidden behind blends among ``directions``.

    Parameters
    ----------
    factors
        Low-rank factors (orthonormal ``left``, ``(m, b)``).
    directions
        ``(k, b)`` directions to test (typically the selection's): a blend of two samples'
        directions has a two-dimensional kernel on its zeros.
    tolerance
        Zero tolerance of unit gradient columns (a clean gradient: one threshold for all).
    max_per_plane
        Most proposals from one plane.
    deadline
        Deadline after which no further direction is tested.
    seen
        ``(2, b)`` planes already split in this attack: skipped, and the new ones appended (a
        batch of look-alikes gives the same planes round after round).

    Returns
    -------
    torch.Tensor
        ``(p, b)`` unit proposals (not yet filtered), none when no blend was found, the
        gradient is noisy (per-direction tolerances) or the layer exceeds :data:`PLANE_FLOPS`.
    """
    left = factors.left
    m, b = left.shape
    none = left.new_zeros(0, b)
    if directions.shape[0] == 0 or b < 3 or tolerance.per_direction:
        return none
    if directions.shape[0] * m * b * b > PLANE_FLOPS:
        return none
    width = _angle_width(tolerance, m)
    masks = zero_masks(factors, directions, tolerance)
    proposals: list[torch.Tensor] = []
    planes: list[torch.Tensor] = [] if seen is None else seen
    for zero in masks:
        if deadline.expired():
            break
        count = int(zero.sum())
        if count < b or count == m:
            continue
        values = torch.linalg.svdvals(left[zero])
        if float(values[-2]) > KERNEL_FACTOR * tolerance.absolute * math.sqrt(count):
            continue
        plane = _trimmed_plane(left, zero)
        if plane is None:
            continue
        if any(float(torch.linalg.svdvals(plane @ known.T).min()) > 1.0 - 1e-9 for known in planes):
            continue  # the same plane from another blend, or split before
        if len(planes) >= MAX_PLANES:
            break  # a batch of many look-alikes: its planes would flood the pool
        planes.append(plane)
        proposals.append(_plane_proposals(left, zero, plane, width=width, limit=max_per_plane))
    if not proposals:
        return none
    stacked = torch.cat(proposals, dim=0)
    return stacked[deduplicate(stacked)]


def split_blends(
    factors: LowRankFactors,
    mixtures: torch.Tensor,
    pool: CandidatePool,
    selected: torch.Tensor,
    deadline: Deadline,
) -> torch.Tensor:
    """Proposals from blends of samples' directions: mixtures split in the planes they span with
    the ``pool``'s directions (:func:`fl_attack.pipeline.search.mixtures.split_mixtures`), then the twin
    planes behind the ``selected`` directions not split before (:func:`twin_plane_proposals`)."""
    proposals = split_mixtures(factors, mixtures, pool.directions, pool.tolerance, deadline=deadline)
    twins = twin_plane_proposals(factors, selected, pool.tolerance, deadline=deadline, seen=pool.twin_planes)
    return torch.cat([proposals, twins], dim=0)


def _near_pairs(active: torch.Tensor, masks: torch.Tensor) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of rows that may be near-identical samples or blends of them.

    A pair counts when the ReLU patterns of its inputs (``active``, ``(b, m)``) differ on 1 to
    :data:`TWIN_PATTERN_DIFFERENCE` neurons, or when the zeros of its gradient columns
    (``masks``) do: a row that is a blend of two twins has its inputs' pattern pulled away
    from its partner's, but its zeros are the twins' common ones, a few short of the partner's.
    """
    on, off = active.to(torch.float64), (~active).to(torch.float64)
    pattern = on @ off.T + off @ on.T  # (b, b): neurons where the two patterns differ
    zero, nonzero = masks.to(torch.float64), (~masks).to(torch.float64)
    zeros = zero @ nonzero.T + nonzero @ zero.T  # (b, b): neurons where one column vanishes alone
    near = ((pattern > 0) & (pattern <= TWIN_PATTERN_DIFFERENCE)) | (zeros <= TWIN_PATTERN_DIFFERENCE)
    return [(int(i), int(j)) for i, j in torch.nonzero(torch.triu(near, diagonal=1)).tolist()]


def _plane_batches(
    directions: torch.Tensor, candidates: torch.Tensor, first: int, second: int
) -> torch.Tensor:
    """Every batch with rows ``first`` and ``second`` taken from ``candidates`` (their own directions
    included), other than ``directions`` itself: one or both rows replaced, ``(k, b, b)``."""
    own = directions[[first, second]]
    options = torch.cat([own, candidates], dim=0)
    count = options.shape[0]
    index = torch.arange(count, device=options.device)
    a, c = torch.meshgrid(index, index, indexing="ij")
    keep = (a != c) & ~((a == 0) & (c == 1)) & ~((a == 1) & (c == 0))
    a, c = a[keep], c[keep]
    sets = directions.expand(a.numel(), *directions.shape).clone()
    sets[:, first] = options[a]
    sets[:, second] = options[c]
    return sets


def twin_ambiguity(
    scorer: SparsityMatchingScorer, selection: Selection, *, accept_matching: float, max_per_plane: int = 64
) -> int:
    """Pairs of near-identical rows of a complete ``selection`` whose plane holds another batch.

    For each pair of rows that may be twins (:func:`_near_pairs`: their inputs' ReLU patterns or
    their columns' zeros differ on at most :data:`TWIN_PATTERN_DIFFERENCE` neurons), every
    direction of the pair's plane at which some neuron vanishes is put in place of either row's
    direction, and every two of them in place of both (a search stopped early can select two
    wrong blends of one plane, which no single replacement turns into a consistent batch); the
    pair counts when such a batch matches the update at ``accept_matching`` for every sample and
    passes the same self-check (:func:`fl_attack.pipeline.selection.self_check.self_check`), as the selected
    one does. The test depends only on the selection, never on how far the search got. Where
    testing every pair would exceed :data:`AMBIGUITY_FLOPS`, every such pair counts; so does a
    pair with more than :data:`MAX_PLANE_CHECKS` matching batches left to self-check.
    """
    directions = selection.directions
    b = directions.shape[0]
    left, tolerance = scorer.factors.left, scorer.tolerance
    inputs = scorer.inputs(directions)
    active = (inputs @ scorer.update.weight.T + scorer.update.bias) > 0  # (b, m)
    masks = zero_masks(scorer.factors, directions, tolerance)
    unit = directions / directions.norm(dim=1, keepdim=True)
    width = _angle_width(tolerance, left.shape[0])
    pairs = _near_pairs(active, masks)
    if len(pairs) * (max_per_plane + 2) ** 2 * left.shape[0] * b * b > AMBIGUITY_FLOPS:
        return len(pairs)  # too costly to test here: counted as ambiguous, never claimed
    ambiguous = 0
    for first, second in pairs:
        plane, _ = torch.linalg.qr(torch.stack([unit[first], unit[second]]).T)
        common = masks[first] & masks[second]
        candidates = _plane_proposals(left, common, plane.T, width=width, limit=max_per_plane)
        candidates = candidates / candidates.norm(dim=1, keepdim=True)
        other = ((candidates @ unit[[first, second]].T).abs() < 1.0 - 1e-6).all(dim=1)
        candidates = candidates[other]
        if candidates.shape[0] == 0:
            continue
        matching = torch.cat(
            [
                sets[scorer.score(sets)[0].min(dim=1).values >= accept_matching]
                for sets in torch.split(_plane_batches(unit, candidates, first, second), SCORE_CHUNK)
            ]
        )
        if matching.shape[0] > MAX_PLANE_CHECKS or any(
            _passes_self_check(scorer, other) for other in matching
        ):
            ambiguous += 1
    return ambiguous


def _passes_self_check(scorer: SparsityMatchingScorer, directions: torch.Tensor) -> bool:
    """Whether the batch of ``directions`` passes the same self-check as a claimed batch, nested
    patterns aside (a batch with nested patterns explains the update as well: it makes the plane
    ambiguous all the same)."""
    update = scorer.update
    check = self_check(
        scorer.inputs(directions),
        factors=scorer.factors,
        weight=update.weight,
        bias=update.bias,
        bias_grad=update.bias_update,
        relative_noise=scorer.tolerance.relative_noise,
        exact=True,
        pre_activation_basis=scorer.pre_activation_basis,
    )
    return passes_but_for_nesting(check)


def twin_self_check(
    check: SelfCheck, *, scorer: SparsityMatchingScorer, selection: Selection, accept: float
) -> SelfCheck:
    """``check`` failed with a reason where :func:`twin_ambiguity` finds another batch as good.

    Only a passed check of a complete selection on a clean update is tested (that is what
    could be claimed); any other ``check`` is returned as it is. ``accept`` is the matching a
    sample needs to be accepted (the attack's ``accept_matching``).
    """
    if not (check.passed and check.exact and selection.complete):
        return check
    pairs = twin_ambiguity(scorer, selection, accept_matching=accept)
    if not pairs:
        return check
    reason = (
        f"{pairs} pair{'' if pairs == 1 else 's'} of near-identical samples: another batch "
        "explains the update as well"
    )
    return replace(check, passed=False, reasons=(*check.reasons, reason), ambiguous_twins=pairs)
