"""Directions from the input side: vertices of the cone of non-negative inputs.

SPEAR searches the gradient side ``dW = L R``: a sample's column ``L q`` is sparse because of
the attacked layer's own ReLU. The input side is sparse too when the layer's inputs are
non-negative with exact zeros (pooled ReLU features of a CNN, one-hot columns, pixel
backgrounds). With ``R = S V^T`` (``V`` orthonormal, ``(n, b)``) every input is ``x = V u``
for some ``u``, and the cone ``C = {u : V u >= 0}`` holds every sample's ``u``. A sample whose
zeros pin ``b - 1`` independent rows of ``V`` is an extreme ray of ``C``: a vertex of the
linear programme ``min w^T V u`` subject to ``V u >= 0`` and ``1^T V u = 1``, reached by
random positive feature weights ``w`` (a weighted l1 norm, linear on the cone). Directions
already in the pool narrow the search: a row of ``Q^{-1}`` is orthogonal to every other
sample's column of ``Q``. A mixture with coefficients of both signs leaves the cone, one with
positive coefficients is zero only on the intersection of its samples' zeros: it has fewer
zeros than its samples and is ranked below them.

An input ``x`` is turned into its gradient-side direction by the layer's known weight and
bias: along ``alpha x`` the ReLU pattern of ``alpha W x + bias`` changes at ``m`` breakpoints,
and at the sample's true scale the inactive rows of ``L`` share a kernel, ``q``
(as :mod:`fl_attack.pipeline.search.last_direction` scans its lines). Those directions enter the candidate
pool like any other proposal: the same filters, selection and self-check decide.

The input side is used only where it applies (see
:func:`fl_attack.pipeline.side_information.input_rounds.interleave_input_side`, which schedules its rounds): when
the cone is empty (inputs of both signs) one small linear programme says so, and the search goes
on as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from scipy.optimize import linprog

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.noise.one_at_a_time import uses_trusted_selection
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.pattern_scan import line_pattern_kernels
from fl_attack.pipeline.search.sparsity import ZeroTolerance, refine_on_zeros
from fl_attack.pipeline.selection.select import SparsityMatchingScorer
from fl_attack.pipeline.side_information.next_layer import Deflation
from fl_attack.pipeline.side_information.onehot_groups import detect_onehot_groups
from fl_attack.pipeline.side_information.onehot_rows import OneHotSide
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, SpectrumEstimate

#: A vertex is kept when it has at least this many input zeros beyond the ``b - 1`` any
#: vertex has: a real sparse input has tens to hundreds more.
MIN_EXTRA_ZEROS = 2

#: Smallest singular value per row below which a pattern's rows count as sharing a kernel
#: (the pool re-checks every proposal's zeros at the attack's own tolerance).
KERNEL_FLOOR = 1e-6

#: Kernels proposed per input: the patterns around a sample's own have kernels too.
MAX_KERNELS_PER_INPUT = 8

#: Flops of the Gram matrices built at once while scanning one input's patterns.
PATTERN_CHUNK_FLOPS = 5e7

#: The input side is tried only with at least this many live features per sample.
MIN_FEATURES_PER_SAMPLE = 2

#: An input-side round may always spend this long, even after a faster round of the attack.
MIN_ROUND_SECONDS = 0.2

#: The emptiness probe (one LP) may spend at most this fraction of the remaining search time
#: (and at least ``MIN_ROUND_SECONDS``); a probe that does not finish counts as empty.
PROBE_FRACTION = 0.02


class SearchContext(Protocol):
    """What the input-side rounds read from the attack's search state."""

    factors: LowRankFactors
    pool: CandidatePool
    generator: torch.Generator
    deadline: Deadline
    stats: dict[str, Any]
    active: torch.Tensor
    noisy: bool
    input_side: InputSideSlot | None
    deflation: Deflation | None


@dataclass(frozen=True)
class InputSide:
    """The input side of a low-rank update, restricted to the features that vary in the batch.

    Attributes
    ----------
    basis
        ``(n', b)`` orthonormal ``V`` on the live features: every input is ``basis @ u`` there.
    scales
        ``(b,)`` singular values ``S``: ``u = S p`` for a row ``p`` of ``Q^{-1}``.
    tolerance
        Zero tolerance for the entries of a unit input ``basis @ u``.
    live
        ``(n,)`` bool: features not zero for the whole batch.
    """

    basis: torch.Tensor
    scales: torch.Tensor
    tolerance: ZeroTolerance
    live: torch.Tensor

    @classmethod
    def from_factors(
        cls, factors: LowRankFactors, *, relative_noise: float, relative_zero: float
    ) -> InputSide:
        """The input side of ``factors`` (``right = S V^T``).

        ``relative_zero`` is the gradient side's zero tolerance times the square root of its
        width: the same tolerance relative to a typical entry is used for unit inputs.
        """
        b = factors.batch_size
        scales = factors.singular_values[:b].to(factors.right.dtype)
        basis = (factors.right / scales[:, None]).T
        live = live_features(factors, relative_zero=relative_zero)  # zero for every sample: pins nothing
        count = max(int(live.sum()), 1)
        tolerance = ZeroTolerance(absolute=relative_zero / math.sqrt(count), relative_noise=relative_noise)
        return cls(basis=basis[live].contiguous(), scales=scales, tolerance=tolerance, live=live)

    @property
    def batch_size(self) -> int:
        return int(self.basis.shape[1])

    def vertex(
        self,
        weights: np.ndarray,
        *,
        orthogonal_to: np.ndarray | None = None,
        seconds: float = math.inf,
        objective: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """``u`` minimising ``weights^T V u`` over ``V u >= -tol / sqrt(n')``, ``1^T V u = 1``.

        None when no such ``u`` exists or the solver did not finish within ``seconds`` (at
        ``(n, b) = (3072, 150)`` one programme takes seconds, at ``(3072, 400)`` minutes).

        The slack keeps the true inputs feasible when rounding or noise makes their zeros
        slightly negative. ``tol`` (``tolerance.absolute``) applies to unit inputs, while the
        programme's inputs have unit sum: a non-negative input of ``n'`` features has
        ``||x|| <= 1^T x <= sqrt(n') ||x||``, so the slack ``tol / sqrt(n')`` leaves the vertex, once
        scaled to unit norm, within ``tol`` of the cone, where :meth:`refine` counts its zeros
        (a slack of ``tol`` put the active zeros of a sparse input at ``-tol`` times its
        ``1^T x / ||x||``, about 14 at 200 non-zero features, and every vertex was refused as
        mixed), and shrinks a true zero's rounding by ``1^T x / ||x||`` at least.
        ``orthogonal_to`` (``(k, b)`` gradient-side directions ``q``)
        adds ``(q / S)^T u = 0``: a row ``p`` of ``Q^{-1}`` is orthogonal to the columns of
        ``Q`` of every other sample, so the samples not among the ``q`` (and not mixed into
        them) stay feasible while the others are cut off. ``objective`` (``(b,)``, on ``u`` itself)
        replaces ``weights^T V`` where the programme is steered by something other than the features.
        """
        matrix = self.basis.detach().cpu().numpy()
        b = matrix.shape[1]
        equalities = matrix.sum(axis=0)[None, :]
        targets = np.ones(1)
        if orthogonal_to is not None and orthogonal_to.shape[0]:
            rows = orthogonal_to / self.scales.detach().cpu().numpy()
            rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
            equalities = np.concatenate([equalities, rows])
            targets = np.concatenate([targets, np.zeros(rows.shape[0])])
        result = linprog(
            weights @ matrix if objective is None else objective,
            A_ub=-matrix,
            b_ub=np.full(matrix.shape[0], self.tolerance.absolute / math.sqrt(matrix.shape[0])),
            A_eq=equalities,
            b_eq=targets,
            bounds=[(None, None)] * b,
            method="highs",
            options={"time_limit": max(seconds, 1e-3)} if math.isfinite(seconds) else None,
        )
        if result.status != 0 or result.x is None:
            return None
        vertex: np.ndarray = result.x
        return vertex

    def is_empty(self, *, seconds: float = math.inf) -> bool:
        """Whether no non-negative input lies in the span (inputs of both signs): one LP.

        An LP that does not finish within ``seconds`` counts as empty.
        """
        return self.vertex(np.zeros(self.basis.shape[0]), seconds=seconds) is None

    def inputs(self, directions: torch.Tensor) -> torch.Tensor:
        """``(k, n')`` unit inputs ``V u`` of ``(k, b)`` directions (any norm)."""
        unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
        return unit @ self.basis.T

    def refine(self, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Polish ``(k, b)`` vertices on their input zeros and orient them non-negative.

        Returns the unit directions of the vertices that are non-negative up to the tolerance
        with at least ``b - 1 + MIN_EXTRA_ZEROS`` zeros, and those zero counts.
        """
        b = self.batch_size
        _check_directions(directions, b)
        as_factors = _input_side_factors(self)
        refined = refine_on_zeros(as_factors, directions, self.tolerance)
        refined = refined / refined.norm(dim=1, keepdim=True).clamp_min(1e-300)
        values = self.inputs(refined)
        refined = refined * torch.where(values.sum(dim=1, keepdim=True) < 0, -1.0, 1.0).to(refined.dtype)
        values = self.inputs(refined)
        limit = self.tolerance.absolute
        zeros = (values.abs() <= limit).sum(dim=1)
        # both signs beyond the noise: a mixture with coefficients of opposite signs
        one_signed = (values >= -limit).all(dim=1)
        keep = one_signed & (zeros >= b - 1 + MIN_EXTRA_ZEROS)
        return refined[keep], zeros[keep]


def live_features(factors: LowRankFactors, *, relative_zero: float) -> torch.Tensor:
    """``(n,)`` bool: the features not zero for the whole batch (rows of ``V`` above ``relative_zero / sqrt(n)``).

    A cheap look at the right factor, without setting up the input side.
    """
    b = factors.batch_size
    scales = factors.singular_values[:b].to(factors.right.dtype)
    norms = (factors.right / scales[:, None]).norm(dim=0)
    return norms > relative_zero / math.sqrt(norms.shape[0])


def _check_directions(directions: torch.Tensor, size: int) -> None:
    if directions.ndim != 2 or directions.shape[1] != size:
        raise ValueError(f"directions must have shape (k, {size}), got {tuple(directions.shape)}")


def _input_side_factors(side: InputSide) -> LowRankFactors:
    """``side.basis`` as the left factor, so that the gradient side's kernel tools apply to it."""
    spectrum = SpectrumEstimate(side.batch_size, math.inf, side.tolerance.relative_noise, False)
    return LowRankFactors(left=side.basis, right=side.basis.T, singular_values=side.scales, spectrum=spectrum)


def cone_vertices(
    side: InputSide,
    *,
    count: int,
    generator: torch.Generator,
    known: torch.Tensor | None = None,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Up to ``count`` vertices ``u`` of the cone of non-negative inputs.

    Each minimises a random positive weighting of the features (an l1 norm with random
    weights, linear on the cone). With ``known`` ``(k, b)`` gradient-side directions, each
    programme is also restricted to the inputs orthogonal to a random subset of at most
    ``b - 2`` of them (:meth:`InputSide.vertex`), which steers it to samples not yet found.
    Stops at ``deadline`` (after the linear programme in progress).
    """
    n, b = side.basis.shape
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if known is not None:
        _check_directions(known, b)
    found: list[torch.Tensor] = []
    pool = known.detach().cpu().numpy() if known is not None else np.zeros((0, b))
    for _ in range(count):
        if deadline.expired():
            break
        weights = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
        size = min(pool.shape[0], b - 2)
        chosen = None
        if size > 0:
            size = int(torch.randint(0, size + 1, (1,), generator=generator))
            chosen = pool[torch.randperm(pool.shape[0], generator=generator)[:size].numpy()]
        vertex = side.vertex(weights, orthogonal_to=chosen, seconds=deadline.remaining())
        if vertex is not None:
            found.append(torch.from_numpy(vertex).to(side.basis.dtype))
    if not found:
        return side.basis.new_zeros(0, side.batch_size)
    return torch.stack(found).to(side.basis.device)


def gradient_directions(
    side: InputSide,
    directions: torch.Tensor,
    *,
    left: torch.Tensor,
    pre_activation_basis: torch.Tensor,
    bias: torch.Tensor,
    tolerance: ZeroTolerance,
    min_zeros: int,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """Gradient-side directions ``q`` of ``(k, b)`` input-side directions ``u`` (oriented non-negative).

    The input ``x = R^T (u / S)`` has pre-activations ``alpha (W R^T)(u / S) + bias`` at its
    unknown scale ``alpha > 0``; the scan over ``alpha`` finds the ReLU pattern whose inactive
    rows of ``left`` share a kernel.

    Parameters
    ----------
    side
        The input side the directions belong to.
    directions
        ``(k, b)`` input-side directions.
    left
        ``(m', b)`` orthonormal left factor on the informative neurons.
    pre_activation_basis
        ``(m', b)`` ``W R^T`` on the same neurons.
    bias
        ``(m',)`` the layer's bias on those neurons.
    tolerance
        Zero tolerance of unit gradient columns.
    min_zeros
        Patterns with fewer inactive neurons are not considered.
    deadline
        Deadline after which no further input is scanned.

    Returns
    -------
    torch.Tensor
        ``(j, b)`` unit directions: for each input, the kernels of up to
        ``MAX_KERNELS_PER_INPUT`` of its patterns, smallest residual first.
    """
    m, b = left.shape
    _check_directions(directions, side.batch_size)
    if side.batch_size != b or pre_activation_basis.shape != (m, b) or bias.shape != (m,):
        raise ValueError(
            f"left {tuple(left.shape)}, pre_activation_basis {tuple(pre_activation_basis.shape)} and bias "
            f"{tuple(bias.shape)} must be (m, b), (m, b) and (m,) with b = {side.batch_size}"
        )
    slopes = pre_activation_basis @ (directions / side.scales).T  # (m', k)
    chunk = max(1, min(256, int(PATTERN_CHUNK_FLOPS // max(1, m * b * b))))
    found: list[torch.Tensor] = []
    for index in range(directions.shape[0]):
        if deadline.expired():
            break
        hits = line_pattern_kernels(
            left,
            slopes[:, index],
            bias,
            minimum=max(min_zeros, b - 1),
            limit=max(10.0 * tolerance.absolute, KERNEL_FLOOR),
            chunk=chunk,
            deadline=deadline,
            positive_only=True,
            fresh_grams=True,
        )
        # every pattern with a kernel: a smaller one around the sample's own can leave a look-alike's
        # near-kernel with a smaller residual; the pool's filters and the selection tell them apart
        hits.sort(key=lambda item: item[0])
        found.extend(vector for _, vector in hits[:MAX_KERNELS_PER_INPUT])
    if not found:
        return left.new_zeros(0, b)
    return torch.stack(found)


#: ``stats["input_side"]`` of an attack that finished in its first round, before any set-up.
NOT_NEEDED = "not needed: the first round finished"


@dataclass
class InputSideSlot:
    """The input side of one attack, set up on first use, at most once (``get``: None where it does not apply)."""

    scorer: SparsityMatchingScorer
    side: InputSide | None = None
    ready: bool = False
    tried: list[torch.Tensor] = field(default_factory=list)  # known sets of the missing-sample programmes
    swept_samples: int = 0  # samples the sweep before the first round reached (each a vertex with a kernel)
    onehot: OneHotSide | None = None
    onehot_ready: bool = False
    onehot_tried: list[torch.Tensor] = field(default_factory=list)  # known sets of the one-hot proposals

    def get(self, state: SearchContext) -> InputSide | None:
        if not self.ready:
            self.side, self.ready = _usable_input_side(state, self.scorer), True
        return self.side

    def get_onehot(self, state: SearchContext) -> OneHotSide | None:
        """The factors seen through the one-hot groups the update shows, or None where it shows none.

        ``state.stats["onehot_groups"]`` records how many groups were detected.
        """
        if not self.onehot_ready:
            self.onehot_ready = True
            factors, update = state.factors, self.scorer.update
            if factors.batch_size >= 2 and not state.noisy:
                relative_zero = state.pool.tolerance.absolute * math.sqrt(update.width)
                groups = detect_onehot_groups(
                    update.weight_update,
                    update.bias_update,
                    live=live_features(factors, relative_zero=relative_zero),
                    unit_roundoff=update.unit_roundoff,
                )
                state.stats["onehot_groups"] = len(groups)
                if len(groups):
                    self.onehot = OneHotSide(
                        right=factors.right,
                        groups=groups.groups,
                        left=factors.left,
                        pre_activation_basis=self.scorer.pre_activation_basis[state.active],
                        bias=update.bias[state.active],
                    )
        return self.onehot


def _usable_input_side(state: SearchContext, scorer: SparsityMatchingScorer) -> InputSide | None:
    """The input side of the attack's factors, or None (``state.stats`` says why) where it does not apply."""
    factors = state.factors
    b = factors.batch_size
    if b < 2 or state.deadline.expired():
        return None
    if uses_trusted_selection(noisy=state.noisy, width=factors.left.shape[0], batch_size=b):
        # CIFAR-10 (150, 4000), DP 0.5x: as long as the first round spent, no vertex
        state.stats["input_side"] = "heavy noise on a wide layer: no exact cone vertex"
        return None
    gradient_zero = state.pool.tolerance
    side = InputSide.from_factors(
        factors,
        relative_noise=gradient_zero.relative_noise,
        relative_zero=gradient_zero.absolute * math.sqrt(scorer.update.width),
    )
    if side.basis.shape[0] < MIN_FEATURES_PER_SAMPLE * b:
        state.stats["input_side"] = f"fewer than {MIN_FEATURES_PER_SAMPLE} live features per sample"
        return None
    remaining = max(0.0, state.deadline.remaining())
    # features zero for the whole batch (dead channels, unused categories, background pixels)
    # are the cheap sign of exact zeros: only then may the probe take MIN_ROUND_SECONDS
    floor = 0.0 if bool(side.live.all()) else MIN_ROUND_SECONDS
    if side.is_empty(seconds=min(remaining, max(floor, PROBE_FRACTION * remaining))):
        state.stats["input_side"] = "no non-negative inputs in the span"
        return None
    return side


__all__ = [
    "InputSide",
    "InputSideSlot",
    "SearchContext",
    "cone_vertices",
    "gradient_directions",
    "live_features",
]
