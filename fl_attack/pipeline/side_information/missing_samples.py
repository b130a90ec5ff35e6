"""The samples still missing from a selection, as vertices of the input side's narrowed cone.

With ``b - d`` columns of the disaggregation matrix known, the rows of ``Q^{-1}`` of the ``d``
missing samples are orthogonal to every known column, so (as in
:mod:`fl_attack.pipeline.search.last_direction`) the missing inputs lie in a known ``d``-dimensional
space. When the inputs are non-negative (:mod:`fl_attack.pipeline.side_information.input_cone`), the part of the
cone of non-negative inputs in that space is spanned by the missing samples themselves: a sparse
sample is one of its extreme rays, and one linear programme with random positive feature weights
reaches one of them, for any ``d``, where the gradient-side scans handle only ``d <= 2``. Each
vertex is turned into its gradient-side direction by the ReLU-pattern scan of
:func:`fl_attack.pipeline.side_information.input_cone.gradient_directions`, which then joins the known columns, so
the next programme is steered to a sample not found yet: ``d`` missing samples cost about ``d``
small programmes. With no column known (``d = b``) the same programmes sweep the whole cone
(:func:`fl_attack.pipeline.side_information.input_rounds.sweep_proposals`, before the attack's first round).

Known columns that are wrong (a sparse mixture selected in a sample's place) narrow the cone to
a space the missing samples do not span; its vertices are then dense, mixed or absent, and the
candidate pool's filters, the selection and the self-check reject what comes out, as they do for
every proposal.
"""

from __future__ import annotations

import math

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.candidates import is_member
from fl_attack.pipeline.search.last_direction import scan_missing_directions
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.side_information.input_cone import (
    InputSide,
    SearchContext,
    gradient_directions,
    live_features,
)
from fl_attack.pipeline.side_information.onehot_rounds import onehot_missing
from fl_attack.pipeline.side_information.onehot_rows import check_known

#: Linear programmes allowed beyond one per missing sample (a vertex may turn out dense, or
#: repeat a sample whose gradient-side direction the scan did not pin).
EXTRA_PROGRAMMES = 2

#: One call of :func:`missing_direction_proposals` spends at most this share of the search time
#: left on its programmes (at least ``MIN_SECONDS``): on thousands of live features and large
#: batches one programme takes seconds, and the sphere search must keep its time.
TIME_SHARE = 0.25
MIN_SECONDS = 0.2


def reach_samples(
    side: InputSide,
    known: torch.Tensor,
    *,
    left: torch.Tensor,
    pre_activation_basis: torch.Tensor,
    bias: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    generator: torch.Generator,
    deadline: Deadline = Deadline.never(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient-side proposals for the samples missing from ``known`` directions, and the samples reached.

    Parameters
    ----------
    side
        The input side of the attack's factors (non-negative inputs).
    known
        ``(b - d, b)`` directions believed correct, ``1 <= d <= b``: with none known (``d = b``)
        the programmes sweep the whole cone, each steered away from the samples reached before it.
    left
        ``(m', b)`` orthonormal left factor on the informative neurons.
    pre_activation_basis
        ``(m', b)`` ``W R^T`` on the same neurons.
    bias
        ``(m',)`` the layer's bias on those neurons.
    tolerance
        Zero tolerance of unit gradient columns.
    min_zeros
        Patterns with fewer inactive neurons are not considered by the scan.
    generator
        Draws the random positive feature weights.
    deadline
        Deadline after which no further programme starts.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(j, b)`` unit directions: for each vertex reached, the kernels of its ReLU patterns
        (smallest residual first, as :func:`~fl_attack.pipeline.side_information.input_cone.gradient_directions`
        returns them); and ``(r, b)``: the first kernel of each vertex reached, the one that
        steered the later programmes.

    Raises
    ------
    ValueError
        When ``known`` is not ``(k, b)`` with ``0 <= k < b``.
    """
    b = side.batch_size
    check_known(known, b)
    missing = b - known.shape[0]
    constraints = known
    proposals: list[torch.Tensor] = []
    reached = 0
    for programme in range(missing + EXTRA_PROGRAMMES):
        if reached >= missing or deadline.expired():
            break
        if reached == 0 and programme > EXTRA_PROGRAMMES:
            break  # no vertex so far was a sample: the cone's vertices are not the inputs
        weights = torch.rand(side.basis.shape[0], generator=generator, dtype=torch.float64).numpy()
        vertex = side.vertex(
            weights,
            orthogonal_to=constraints.detach().cpu().numpy() if constraints.shape[0] else None,
            seconds=deadline.remaining(),
        )
        if vertex is None:  # no non-negative input left: the known columns cut every sample off
            break
        refined, _ = side.refine(torch.from_numpy(vertex).to(side.basis)[None])
        if refined.shape[0] == 0:
            continue  # a dense or mixed vertex: another weighting may reach a sample
        directions = gradient_directions(
            side,
            refined,
            left=left,
            pre_activation_basis=pre_activation_basis,
            bias=bias,
            tolerance=tolerance,
            min_zeros=min_zeros,
            deadline=deadline,
        )
        if directions.shape[0] == 0:
            continue
        proposals.append(directions)
        reached += 1
        # the best kernel stands for this sample from now on: the next vertex is another one
        constraints = torch.cat([constraints, directions[:1].to(constraints)], dim=0)
        if constraints.shape[0] >= b:
            break
    reached_directions = constraints[known.shape[0] :]
    if not proposals:
        return left.new_zeros(0, b), reached_directions
    return torch.cat(proposals, dim=0), reached_directions


def missing_sample_directions(
    side: InputSide,
    known: torch.Tensor,
    *,
    left: torch.Tensor,
    pre_activation_basis: torch.Tensor,
    bias: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    generator: torch.Generator,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Gradient-side proposals for the samples missing from ``known`` directions.

    The proposals of :func:`reach_samples` (same parameters and errors): ``(j, b)`` unit directions.
    """
    proposals, _ = reach_samples(
        side,
        known,
        left=left,
        pre_activation_basis=pre_activation_basis,
        bias=bias,
        tolerance=tolerance,
        min_zeros=min_zeros,
        generator=generator,
        deadline=deadline,
    )
    return proposals


def trusted_directions(state: SearchContext, selection: Selection, *, accept_matching: float) -> torch.Tensor:
    """The ``(k, b)`` directions of ``selection`` that :func:`missing_direction_proposals` may build on.

    Those found and in the pool's confident candidates (with a matching of at least
    ``accept_matching`` in a complete selection). Where the input side's sweep reached samples,
    its programmes reach the missing ones, so directions chosen among weak candidates (the
    sweep's, on deep layers) are trusted too; elsewhere (Adult: the sweep reaches none) they
    would only start gradient-side line scans, seconds each at ``d = 2``.
    """
    candidates = state.pool.directions
    if state.input_side is not None and state.input_side.swept_samples > 0:
        candidates = torch.cat([candidates, state.pool.weak()[0]], dim=0)
    trusted = selection.found & is_member(selection.directions, candidates)
    if selection.complete:
        trusted &= selection.per_sample >= accept_matching
    return selection.directions[trusted]


def missing_direction_proposals(
    state: SearchContext, scorer: SparsityMatchingScorer, trusted: torch.Tensor
) -> torch.Tensor:
    """Proposals for the samples missing from a selection's ``trusted`` ``(k, b)`` directions.

    Where the input side applies (``state.input_side`` set and usable) and at least half the
    directions are trusted, :func:`missing_sample_directions` runs once per set of trusted
    directions (a repeated run would reach the same samples). The gradient-side scans of
    :func:`~fl_attack.pipeline.search.last_direction.scan_missing_directions` run for ``d`` in
    ``{1, 2}`` only where the input side proposed nothing: at ``d = 2`` they cost seconds. The
    programmes of one call stop after ``TIME_SHARE`` of the search time left.
    ``state.stats`` counts ``missing_sample_proposals`` and ``scan_proposals``. Before the attack's
    first round is over the input side is set up here only when some feature is zero for the whole
    batch (the cheap sign of sparse inputs): the set-up's emptiness probe, one linear programme,
    costs up to a second on thousands of dense features. Nothing is proposed while the search,
    deflated by the next layer's update (:mod:`fl_attack.pipeline.side_information.next_layer`), still certifies samples.
    """
    b = state.factors.batch_size
    if state.deflation is not None and state.deflation.progressing:
        return state.factors.left.new_zeros(0, b)  # the deflated search still finds samples
    missing = b - trusted.shape[0]
    pre_activation_basis = scorer.pre_activation_basis[state.active]
    bias = scorer.update.bias[state.active]
    slot = state.input_side
    wanted = slot is not None and 1 <= missing <= b // 2 and (slot.ready or some_feature_dead(state, scorer))
    side = slot.get(state) if slot is not None and wanted else None
    if (
        slot is not None
        and side is not None
        and not any(
            previous.shape == trusted.shape and bool(is_member(trusted, previous).all())
            for previous in slot.tried
        )
    ):
        slot.tried.append(trusted)
        proposals = missing_sample_directions(
            side,
            trusted,
            left=state.factors.left,
            pre_activation_basis=pre_activation_basis,
            bias=bias,
            tolerance=state.pool.tolerance,
            min_zeros=state.pool.weak_min_zeros,
            generator=state.generator,
            deadline=state.deadline.within(max(MIN_SECONDS, TIME_SHARE * state.deadline.remaining())),
        )
        state.stats["input_side"] = "used"
        count = state.stats.get("missing_sample_proposals", 0) + int(proposals.shape[0])
        state.stats["missing_sample_proposals"] = count
        if proposals.shape[0]:
            return proposals
    onehot = onehot_missing(state, trusted)
    if onehot.shape[0]:
        return onehot
    if missing not in (1, 2):
        return state.factors.left.new_zeros(0, b)
    proposals = scan_missing_directions(
        state.factors,
        trusted,
        pre_activation_basis=pre_activation_basis,
        bias=bias,
        tolerance=state.pool.tolerance,
        min_zeros=state.pool.weak_min_zeros,
        deadline=state.deadline,
    )
    state.stats["scan_proposals"] = state.stats.get("scan_proposals", 0) + int(proposals.shape[0])
    return proposals


def some_feature_dead(state: SearchContext, scorer: SparsityMatchingScorer) -> bool:
    """Whether some input feature is zero for the whole batch (a zero column of the right factor)."""
    tolerance = state.pool.tolerance
    relative_zero = tolerance.absolute * math.sqrt(scorer.update.width)
    return not bool(live_features(state.factors, relative_zero=relative_zero).all())


__all__ = [
    "EXTRA_PROGRAMMES",
    "MIN_SECONDS",
    "TIME_SHARE",
    "missing_direction_proposals",
    "missing_sample_directions",
    "reach_samples",
    "some_feature_dead",
]
