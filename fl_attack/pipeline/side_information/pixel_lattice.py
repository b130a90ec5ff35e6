"""The batch's exact images from the integer points of the update's row space.

An 8-bit image normalized per channel has the values ``offset_c + step_c * k`` for integer pixels
``0 <= k <= 255`` (:mod:`fl_attack.pipeline.selection.pixel_grid`). The update's row space holds
every sample of the batch, whatever the ReLU patterns or the client's local steps did (only the
rank matters). In units of each channel's step, and with the constant image of each channel
added, that space holds a lattice of integer images: the samples and the constants generate it.
Three facts make it useful:

- A basis of it is found from a few hundred features: integer vectors that lie in the row space
  restricted to those features are short vectors of an embedding that lattice reduction (LLL,
  then BKZ, ``fpylll``) finds; lifted to every feature they are integer to a hair's breadth,
  which tells a right step from a wrong one. Only the channels' ratios matter, and they are read
  from the row space itself (:func:`channel_steps`); the bias fixes the common factor.
- It is sparse: its points differ by an image's worth of levels (norms in the thousands), so an
  approximate row of the search, tens of levels off where the patterns drifted over several
  epochs, decodes by Babai's nearest plane to the sample's exact pixels (up to a constant per
  channel, which the row space fixes).
- The samples and the constants are a basis of it, so with some samples known the missing ones
  are a basis of what is left, up to integer combinations of the known ones that the update's
  gradient columns fix (:func:`complete_rows`).

Steps are tried in turn: the grid of a row already on one, the user's ``image_std``, then the
steps read from the row space (colour) or any step (grey). Every row of a batch
made here is left out and must come back from the others and the update (:func:`left_out_rows`);
nothing here decides a claim: the batch goes to the self-check, whose pixel grid certifies it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.selection.pixel_grid import LEVELS, PixelGrid, pixel_grid

if TYPE_CHECKING:
    from fpylll import IntegerMatrix

__all__ = [
    "ClientUpdate",
    "ImageLattice",
    "LatticeBatch",
    "candidate_steps",
    "channel_steps",
    "complete_rows",
    "decode_rows",
    "find_lattice",
    "grid_lattice",
    "image_lattice",
    "lattice_batch",
    "left_out_rows",
]

#: Colour images: three channels, each with its constant, laid out first (torchvision) or last.
COLOURS = 3
COLOUR_LAYOUTS = ("channels-first", "channels-last")

#: Features beyond the lattice's rank in the reduction: each adds a constraint that an accidental
#: integer vector near the restricted row space must meet (measured: 20 extra let combinations
#: with a residual of 5e-4 through at b = 50, 60 separate them by a factor of 5).
EXTRA_FEATURES = 60

#: Fewest features beyond the rank (and at least half the rank) with which a lattice is looked for:
#: with fewer, accidental integer vectors are as short as the images' (Gaussian b = 70 on 100
#: features per channel took 17 s of reductions for nothing).
MIN_EXTRA_FEATURES = 20

#: The lattice's shortest non-constant vector, a small combination of the images, has no entry
#: beyond this many levels; steps whose ratios are off by a fraction ``u / v`` leave only
#: multiples of ``v`` (entries of thousands of levels) to find.
MAX_SHORTEST_LEVELS = 4 * (LEVELS - 1)

#: BKZ block size and tours after LLL in the search for the lattice (see :func:`image_lattice`).
BKZ_BLOCK = 20
BKZ_TOURS = 8

#: A lifted basis vector this far from integer (in levels) means a wrong step or layout.
MAX_LIFT_DEVIATION = 0.05

#: The largest batch the lattice is looked for in. At b = 100 (m = 1000, CIFAR-10) one channel's
#: reduction took 45-61 s, more than a search's share, and fplll's BKZ in double precision failed
#: there ("infinite loop in babai"); at b = 50 it takes about 2 s.
MAX_LATTICE_BATCH = 64

#: Weight of the row-space residual against the integer part in the reduction's embedding: about
#: the inverse of the row space's precision (float32 updates: ``s_{b+1} / s_b`` of 1e-5 to 3e-5).
EMBEDDING_WEIGHT = 1e6

#: A feature whose column is this close (cosine) to the constant one holds the batch's shared value.
SHARED_FEATURE_COS = 1 - 1e-6

#: Scale of the projected basis before rounding it for the reduction that completes rows, and the
#: weight left on its component along the known samples.
QUOTIENT_SCALE = 100.0
QUOTIENT_INSIDE_WEIGHT = 1e-4

#: A reduced vector whose residual off the known samples exceeds this (levels) is a missing one's;
#: the rest lie along the known ones (residuals measured from 1,300 levels up on CIFAR-10).
MIN_RESIDUAL_LEVELS = 1.0

#: While at most this many samples are missing, integer combinations of their residuals with
#: coefficients up to :data:`MAX_COEFFICIENT` are tried too (reduction may return sums).
MAX_ENUMERATED = 4
MAX_COEFFICIENT = 2

#: A fitted coefficient of ``Z`` farther than this from an integer is tried rounded both ways, for
#: at most :data:`MAX_UNSURE` of a row's coefficients (drift leaves a known sample's column off zero
#: on some of its quiet neurons; measured errors up to 0.45).
SURE_FRACTION = 0.2
MAX_UNSURE = 8

#: Of two images in the window, the update picks the one whose ``Z`` lies closer to its fit by
#: at least this factor; otherwise neither is taken.
CLOSER = 0.5

#: Rows the leave-one-out check may replace before the batch is given up.
MAX_REPLACED = 4

#: A completed batch's ``Q^{-1}`` beyond this condition number is not inverted.
MAX_CONDITION = 1e10

#: Share of the neurons, those a known sample leaves most negative at ``W_0``, on which its
#: gradient column is taken to vanish (they stay inactive through the local steps).
INACTIVE_SHARE = 0.25

#: A completed row's bias ``p . rho`` must be this close to 1 in magnitude.
BIAS_TOLERANCE = 1e-3

#: Two decoded inputs closer than this (largest entry, the inputs' units) are one sample.
SAME_INPUT = 1e-6

#: Slack (levels) of the 256-level window: spans are whole numbers of levels, so half a level keeps
#: the float32 rows' rounding (measured up to 0.0013) in and any level too many out.
WINDOW_TOLERANCE = 0.5

#: A basis vector's bias below this share of the largest is a difference of samples (bias 0, up to
#: rounding); reduced basis vectors combine few samples, so whole multiples stay far above it.
ZERO_BIAS = 1e-3

#: Relative precision of the greatest common divisor of the basis' biases (see ``_calibrated``).
GCD_TOLERANCE = 1e-4

#: A decoded row this far from the row space (in levels, largest entry) is no sample.
MAX_ROW_DEVIATION = 0.05


@dataclass(frozen=True)
class ImageLattice:
    """The integer images of a row space, for one per-channel step and layout.

    Attributes
    ----------
    layout
        ``"grey"``, ``"channels-first"`` or ``"channels-last"``.
    steps
        The step of each channel, in the inputs' units.
    basis
        ``(r, n)`` LLL-reduced integer basis (float64 with integer values), ``r = b + channels``.
    """

    layout: str
    steps: tuple[float, ...]
    basis: np.ndarray
    scale: np.ndarray  # (n,) each feature's step
    channels: np.ndarray  # (count, n) each channel's indicator
    row_space: np.ndarray  # (b, n) orthonormal rows

    def rescaled(self, factor: float) -> ImageLattice:
        """The same lattice with every step times ``factor``: the integer images, and so the
        lattice, are the same for any common scale of the steps (only the channels' ratios
        matter), but the inputs they stand for are not."""
        return replace(self, steps=tuple(factor * step for step in self.steps), scale=factor * self.scale)

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """The lattice points nearest (Babai's nearest plane) to ``(k, n)`` rows in the inputs' units."""
        q, r = np.linalg.qr(self.basis.T)
        target = (rows / self.scale) @ q  # (k, r) coordinates in the Gram-Schmidt frame
        coefficients = np.zeros((rows.shape[0], r.shape[0]))
        for i in range(r.shape[0] - 1, -1, -1):
            coefficients[:, i] = np.rint((target[:, i] - coefficients[:, i + 1 :] @ r[i, i + 1 :]) / r[i, i])
        return coefficients @ self.basis

    def inputs(self, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(k, n)`` inputs in the row space with the pixels ``levels`` (a constant per channel
        added to fit the row space) and each one's largest distance from it, in levels."""
        scaled = levels * self.scale
        outside = scaled - (scaled @ self.row_space.T) @ self.row_space
        constants = self.channels - (self.channels @ self.row_space.T) @ self.row_space
        shift = np.linalg.lstsq(constants.T, -outside.T, rcond=None)[0]  # (count, k)
        fitted = scaled + shift.T @ self.channels
        residual = fitted - (fitted @ self.row_space.T) @ self.row_space
        return fitted - residual, np.abs(residual / self.scale).max(axis=1)


def channel_indicators(features: int, count: int, layout: str) -> np.ndarray:
    """``(count, features)`` 0/1 rows: which features belong to each channel."""
    index = np.arange(features)
    channel = index % count if layout == "channels-last" else index // (features // count)
    return (channel[None, :] == np.arange(count)[:, None]).astype(np.float64)


def candidate_steps(
    rows: torch.Tensor, *, image_std: Sequence[float] | None = None, right: torch.Tensor | None = None
) -> list[tuple[str, tuple[float, ...]]]:
    """Layouts and per-channel steps to try first for ``(k, n)`` approximate rows: the grid of any
    row already on one, then the user's ``image_std``. Given the ``(b, n)`` factors ``right``, the
    row's steps are refined in their row space (:func:`steps_in_row_space`).

    A common factor of the steps changes nothing (the integer images are the same, see
    :meth:`ImageLattice.rescaled`), so steps with the same ratios are tried once; one ``std`` for
    every channel is tried as grey and, where ``n`` splits into three, as colour with a constant
    per channel (the means differ)."""
    n = rows.shape[1]
    found: list[tuple[str, tuple[float, ...]]] = []
    seen: set[tuple[str, tuple[float, ...]]] = set()

    def add(layout: str, steps: tuple[float, ...]) -> None:
        key = (layout, tuple(round(step / steps[0], 6) for step in steps))
        if key not in seen and (layout == "grey" or n % len(steps) == 0):
            seen.add(key)
            found.append((layout, steps))

    def add_stds(stds: Sequence[float]) -> None:
        steps = tuple(1.0 / ((LEVELS - 1) * float(s)) for s in stds)
        if len(steps) == 1:
            add("grey", steps)
            steps = steps * COLOURS
        for layout in COLOUR_LAYOUTS:
            add(layout, steps)

    for row, grid in _rows_on_grids(rows):
        refined = None if right is None else steps_in_row_space(right, row, grid)
        if refined is not None:
            add(grid.layout, refined)
        add(grid.layout, tuple(channel.step for channel in grid.channels))
    if image_std is not None:
        add_stds(image_std)
    return found


def _rows_on_grids(rows: torch.Tensor) -> list[tuple[np.ndarray, PixelGrid]]:
    """The first of ``rows`` that lies on an 8-bit grid, with its grid (none: empty)."""
    for row in rows.detach().to(device="cpu", dtype=torch.float64):
        grid = pixel_grid(row[None, :])
        if grid is not None:
            return [(row.numpy(), grid)]
    return []


def steps_in_row_space(right: torch.Tensor, row: np.ndarray, grid: PixelGrid) -> tuple[float, ...] | None:
    """The per-channel steps of the sample that ``row`` (approximately on ``grid``) stands for,
    read from the row space of ``(b, n)`` ``right``; None where that gives no positive steps.

    Steps read from an approximate row carry its error (2e-4 relative on CIFAR-10 after ten
    epochs at lr 0.01, enough to put no lattice there). Its integer levels ``k_c`` are right
    where it is within a fraction of a level, and the sample ``sum_c (o_c 1_c + a_c k_c)`` lies in
    the row space: the combination of those ``2C`` vectors closest to the row space gives the
    ``a_c``, there to 6e-7 (the next combination lies 1e5 times farther). A few wrong levels
    barely move it; :func:`image_lattice` judges the steps either way."""
    factors = right.detach().to(device="cpu", dtype=torch.float64).numpy()
    n = factors.shape[1]
    row_q, _ = np.linalg.qr(factors.T)  # (n, b)
    channels = channel_indicators(n, len(grid.channels), grid.layout)
    columns = []
    for indicator, lattice in zip(channels, grid.channels, strict=True):
        levels = np.where(indicator > 0, np.rint((row - lattice.offset) / lattice.step), 0.0)
        columns += [indicator, levels]
    design = np.stack(columns, axis=1)  # (n, 2C)
    norms = np.linalg.norm(design, axis=0)
    if not bool((norms > 0).all()):
        return None
    outside = design - row_q @ (row_q.T @ design)  # what the row space does not hold
    _, _, vt = np.linalg.svd(outside / norms, full_matrices=False)
    steps = (vt[-1] / norms)[1::2]
    steps = steps * np.sign(steps[0])
    if not bool((steps > 0).all()):
        return None
    return tuple(float(v) for v in steps / steps[0] * grid.channels[0].step)


def image_lattice(
    right: torch.Tensor,
    *,
    layout: str,
    steps: tuple[float, ...],
    generator: np.random.Generator,
    constant: torch.Tensor | None = None,
    deadline: Deadline | None = None,
) -> ImageLattice | None:
    """The lattice of integer images in the row space of ``(b, n)`` ``right`` for one layout and
    per-channel step, or None where these steps put no such lattice there (or there are too few
    features to tell one; BKZ stops at ``deadline``).

    ``constant`` (``(b,)``, the factors' ``L^T db``) is the column of a feature that holds one
    value for the whole batch (a shared background): such features tell the lattice nothing and
    are left out of the reduction."""
    factors = right.detach().to(device="cpu", dtype=torch.float64).numpy()
    b, n = factors.shape
    count = len(steps)
    channels = channel_indicators(n, count, layout)
    scale = np.asarray(steps, dtype=np.float64) @ channels
    row_q, _ = np.linalg.qr(factors.T)
    row_space = row_q.T  # (b, n)
    spanning = np.vstack([row_space / scale, channels])
    span_q, span_r = np.linalg.qr(spanning.T)
    diagonal = np.abs(np.diag(span_r))
    if not float(diagonal.min()) > 1e-9 * float(diagonal.max()):
        return None  # a channel's constant image lies in the row space
    span = span_q.T  # (r, n) orthonormal
    rank = span.shape[0]
    width = rank + max(EXTRA_FEATURES, rank)
    informative = np.arange(n)
    if constant is not None:
        direction = constant.detach().to(device="cpu", dtype=torch.float64).numpy()
        cosine = np.abs(direction @ factors) / (
            np.linalg.norm(direction) * np.linalg.norm(factors, axis=0) + 1e-300
        )
        informative = np.flatnonzero(cosine < SHARED_FEATURE_COS)
    width = min(width, informative.size)
    if width < rank + max(MIN_EXTRA_FEATURES, rank // 2):
        return None  # too few features for the constraints that keep accidental vectors out
    chosen = np.sort(generator.choice(informative, width, replace=False))
    restricted = span[:, chosen]  # (r, width)
    _, _, vt = np.linalg.svd(restricted)
    complement = vt[rank:].T  # (width, width - r): the restricted span's orthogonal complement
    embedding = np.hstack([np.eye(width), np.rint(EMBEDDING_WEIGHT * complement)]).astype(np.int64)
    fp = _fpylll()
    reduced = fp.IntegerMatrix.from_matrix(embedding.tolist())
    try:
        fp.LLL.reduction(reduced)
        # LLL alone lets accidental near-integer vectors through where float32 rounding blurs the
        # row space (s_b / s_{b+1} ~ 4e4); a few block-20 BKZ tours put the images' combinations first
        seconds = deadline.remaining() if deadline is not None else math.inf
        if seconds >= 1:  # fpylll counts whole seconds, and 0 means no limit
            limit = {"max_time": int(seconds)} if math.isfinite(seconds) else {}
            fp.BKZ.reduction(
                reduced, fp.BKZ.Param(block_size=min(BKZ_BLOCK, width), max_loops=BKZ_TOURS, **limit)
            )
    except RuntimeError:
        return None  # fplll gave up (its abort, turned into this error by cysignals): no lattice
    short = _values(reduced)[:rank, :width]
    coefficients = np.linalg.lstsq(restricted.T, short.T, rcond=None)[0]  # (r, r)
    lifted = coefficients.T @ span
    integer = np.rint(lifted)
    if float(np.abs(lifted - integer).max()) > MAX_LIFT_DEVIATION:
        return None
    if np.linalg.matrix_rank(integer) < rank:
        return None
    basis = fp.IntegerMatrix.from_matrix(integer.astype(np.int64).tolist())
    try:
        fp.LLL.reduction(basis)
    except RuntimeError:
        return None
    values = _values(basis)
    varying = values[
        np.abs(values - values @ channels.T @ channels / (channels.sum(axis=1) @ channels)).max(axis=1) > 0
    ]
    shortest = varying[np.argmin(np.linalg.norm(varying, axis=1))] if varying.shape[0] else None
    if shortest is None or float(np.abs(shortest).max()) > MAX_SHORTEST_LEVELS:
        return None  # multiples of the images (steps off by a fraction): no difference of two images
    return ImageLattice(layout, steps, values, scale, channels, row_space)


def find_lattice(
    right: torch.Tensor,
    approximate: torch.Tensor,
    *,
    image_std: Sequence[float] | None = None,
    generator: np.random.Generator,
    deadline: Deadline,
    constant: torch.Tensor | None = None,
) -> ImageLattice | None:
    """The first steps that put a lattice of integer images in the row space of ``right``
    (:func:`image_lattice`), or None (none do, ``deadline`` passed first, or the batch is larger
    than :data:`MAX_LATTICE_BATCH`). Tried in turn: a
    row's own grid and the user's ``image_std`` (:func:`candidate_steps`), the colour channels'
    steps read from the row space (:func:`channel_steps`), then grey (one channel: any step).
    Nothing else is tried: where no channel holds a lattice of its own, no guessed ratio does
    either, and on inputs that are not 8-bit images every attempt costs a reduction.

    Steps whose ratios are off by a simple fraction (``6 / 5``) put a lattice of multiples of the
    images there, which :func:`image_lattice` passes over (its shortest vector is too long)."""
    if right.shape[0] > MAX_LATTICE_BATCH:
        return None
    tried: set[tuple[str, tuple[float, ...]]] = set()

    def attempt(layout: str, steps: tuple[float, ...]) -> ImageLattice | None:
        key = (layout, tuple(round(step / steps[0], 6) for step in steps))
        if key in tried:
            return None
        tried.add(key)
        lattice = image_lattice(
            right, layout=layout, steps=steps, generator=generator, constant=constant, deadline=deadline
        )
        if lattice is not None and constant is not None:
            lattice = _calibrated(lattice, right, constant)
        return lattice

    for layout, steps in candidate_steps(approximate, image_std=image_std, right=right):
        if deadline.expired():
            return None
        if (found := attempt(layout, steps)) is not None:
            return found
    if right.shape[1] % COLOURS == 0:
        for layout in COLOUR_LAYOUTS:
            if deadline.expired():
                return None
            derived = channel_steps(
                right, layout=layout, generator=generator, constant=constant, deadline=deadline
            )
            if derived is not None and (found := attempt(layout, derived)) is not None:
                return found
    if deadline.expired():
        return None
    return attempt("grey", (1.0,))


@dataclass(frozen=True)
class ClientUpdate:
    """What the lattice reads of a client's update, on the host in float64.

    Attributes
    ----------
    left, right
        The update's factors, ``dW = left @ right`` (``(m, b)`` and ``(b, n)``).
    bias_direction
        ``left^T db``: a sample's row ``p`` of ``Q^{-1}`` has ``p . bias_direction = 1``.
    weight, bias
        The global layer ``W_0``, ``b_0`` on the same ``m`` neurons.
    """

    left: np.ndarray
    right: np.ndarray
    bias_direction: np.ndarray
    weight: np.ndarray
    bias: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.right.shape[0])

    @cached_property
    def pseudo(self) -> np.ndarray:
        """``right``'s pseudo-inverse: inputs times it are rows of ``Q^{-1}``."""
        return np.linalg.pinv(self.right)


@dataclass(frozen=True)
class LatticeBatch:
    """Every sample's exact input, from the lattice.

    Attributes
    ----------
    inputs
        ``(b, n)`` the inputs, in the row space and on the pixel grid.
    decoded
        How many were decoded from the search's approximate rows.
    completed
        How many were completed from the others through the update (:func:`complete_rows`).
    """

    inputs: np.ndarray
    decoded: int
    completed: int


def decode_rows(lattice: ImageLattice, approximate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct images ``(k, n)`` that ``approximate`` rows decode to, as lattice points and
    as inputs in the row space, keeping only those that share one 256-level window per channel."""
    rows = approximate[np.isfinite(approximate).all(axis=1)]
    levels = lattice.decode(rows)
    inputs, deviation = lattice.inputs(levels)
    kept: list[int] = []
    for index in range(levels.shape[0]):
        if deviation[index] > MAX_ROW_DEVIATION or not _fits_levels(levels[index], lattice.channels):
            continue
        if any(float(np.abs(inputs[index] - inputs[other]).max()) < SAME_INPUT for other in kept):
            continue
        kept.append(index)
    levels, inputs = levels[kept], inputs[kept]
    inside = _one_window(inputs / lattice.scale, lattice.channels)
    return levels[inside], inputs[inside]


def complete_rows(
    lattice: ImageLattice,
    known_levels: np.ndarray,
    known_inputs: np.ndarray,
    update: ClientUpdate,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``b - k`` missing samples' lattice points and inputs, given ``k`` known ones; None where
    the lattice and the update do not single them all out.

    The missing samples with the known ones and the channels' constants form a basis of the
    lattice, so, projected away from the known ones, they form a basis of the projection; while
    few are missing their residuals are nearly orthogonal and reduction returns them (up to sign).
    A residual fixes its sample up to an integer combination ``Z`` of the known samples, and ``Z``
    is where the update comes in: completing ``Q^{-1}`` with any lifts leaves the missing samples'
    columns of ``Q`` as they are and turns each known sample's column ``q_k`` into
    ``q_k - sum_m Z_mk q_m``. A known sample's gradient column vanishes on the neurons its input
    leaves well inactive at ``W_0``, so a least-squares fit there gives ``Z``'s column ``k``,
    rounded. A completed row must have the bias ``p . rho = 1`` (an integer for any lift: a
    combination of two residuals shows as 0 or 2, a wrong sign as -1) and fit the 256-level window
    of the others; rows that do join the known ones and the rest are reduced again.
    """
    b = update.batch_size
    levels, inputs = known_levels, known_inputs
    while 0 < levels.shape[0] < b:
        found = _completion_round(
            lattice,
            levels,
            inputs,
            update,
        )
        if found is None:
            return None
        levels, inputs = np.vstack([levels, found[0]]), np.vstack([inputs, found[1]])
    if levels.shape[0] != b:
        return None
    known = known_levels.shape[0]
    return levels[known:], inputs[known:]


def _completion_round(
    lattice: ImageLattice,
    known_levels: np.ndarray,
    known_inputs: np.ndarray,
    update: ClientUpdate,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One round of :func:`complete_rows`: the missing samples it singles out, or None (none)."""
    known = known_levels.shape[0]
    missing = update.batch_size - known
    residuals = _beyond(lattice.basis, np.vstack([known_levels, lattice.channels]))
    if residuals.shape[0] != missing:
        return None
    return _lifted(
        lattice,
        known_levels,
        known_inputs,
        residuals,
        update,
    )


def _lifted(
    lattice: ImageLattice,
    known_levels: np.ndarray,
    known_inputs: np.ndarray,
    residuals: np.ndarray,
    update: ClientUpdate,
    *,
    keep_lift: bool = False,
    pre_activations: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The samples that ``residuals`` (lattice points, one per missing sample, known only up to
    integer combinations of the known samples) single out (see :func:`complete_rows`), or None.
    ``keep_lift`` also tries each residual as it is; ``pre_activations`` are the known inputs'
    ``(known, m)`` pre-activations at ``W_0`` where the caller has them already."""
    known = known_levels.shape[0]
    missing = residuals.shape[0]
    lifts = lattice.inputs(residuals)[0] @ update.pseudo  # (missing, b) rows of Q^{-1}, up to Z and sign
    knowns = known_inputs @ update.pseudo
    start = np.vstack([knowns, lifts])
    if np.linalg.cond(start) > MAX_CONDITION:
        return None
    columns = update.left @ np.linalg.inv(start)  # (m, b)
    combination = np.zeros((missing, known))  # Z, as fitted (rounded per row below)
    if pre_activations is None:
        pre_activations = known_inputs @ update.weight.T + update.bias
    count = max(missing + 1, int(INACTIVE_SHARE * pre_activations.shape[1]))
    for k in range(known):
        quiet = np.argsort(pre_activations[k])[:count]
        combination[:, k] = np.linalg.lstsq(columns[quiet][:, known:], columns[quiet, k], rcond=None)[0]
    lift_bias, known_bias = lifts @ update.bias_direction, knowns @ update.bias_direction
    absolute = known_inputs / lattice.scale
    masks = lattice.channels.astype(bool)
    low = np.array([absolute[:, mask].min() for mask in masks])
    high = np.array([absolute[:, mask].max() for mask in masks])
    accepted_levels: list[np.ndarray] = []
    accepted_inputs: list[np.ndarray] = []
    for mix in _small_combinations(missing):
        found: list[tuple[np.ndarray, np.ndarray, float]] = []
        fitted = mix @ combination
        options = _roundings(fitted)
        if keep_lift and not any(not option.any() for option in options):
            options.append(np.zeros(known))
        for coefficients in options:
            total = float(mix @ lift_bias + coefficients @ known_bias)
            if abs(abs(total) - 1.0) >= BIAS_TOLERANCE:
                continue
            level = np.sign(total) * (mix @ residuals + coefficients @ known_levels)
            row, deviation = lattice.inputs(level[None, :])
            if float(deviation[0]) > MAX_ROW_DEVIATION:
                continue
            values = row[0] / lattice.scale
            fits = all(
                max(high[c], values[mask].max()) - min(low[c], values[mask].min())
                <= LEVELS - 1 + WINDOW_TOLERANCE
                for c, mask in enumerate(masks)
            )
            if fits:
                found.append((level, row[0], float(np.linalg.norm(coefficients - fitted))))
        if not found:
            continue
        found.sort(key=lambda option: option[2])
        if len(found) > 1 and not found[0][2] < CLOSER * found[1][2]:
            continue  # two images in the window that the update's fit cannot tell apart
        level, row, _ = found[0]
        if any(float(np.abs(row - other).max()) < SAME_INPUT for other in accepted_inputs):
            continue
        values = row / lattice.scale
        for c, mask in enumerate(masks):
            low[c], high[c] = min(low[c], values[mask].min()), max(high[c], values[mask].max())
        accepted_levels.append(level)
        accepted_inputs.append(row)
    if not accepted_levels or len(accepted_levels) > missing:
        return None  # none, or more images in the window than samples missing: ambiguous
    return np.stack(accepted_levels), np.stack(accepted_inputs)


def _beyond(basis: np.ndarray, fixed: np.ndarray) -> np.ndarray:
    """Lattice points that, with the lattice's points along ``fixed`` (rows), make a basis of the
    lattice of ``basis``: its reduction with the ``fixed`` directions weighted down."""
    fixed_q, _ = np.linalg.qr(fixed.T)
    inside = (basis @ fixed_q) @ fixed_q.T
    outside = basis - inside
    weighted = np.rint(QUOTIENT_SCALE * (outside + QUOTIENT_INSIDE_WEIGHT * inside)).astype(np.int64)
    fp = _fpylll()
    reduced = fp.IntegerMatrix.from_matrix(weighted.tolist())
    transform = fp.IntegerMatrix.identity(basis.shape[0])
    try:
        fp.LLL.reduction(reduced, transform)
    except RuntimeError:
        return np.zeros((0, basis.shape[1]))  # fplll gave up: no points
    points = _values(transform) @ basis
    residual = np.linalg.norm(points - (points @ fixed_q) @ fixed_q.T, axis=1)
    return points[residual > MIN_RESIDUAL_LEVELS]


def _calibrated(
    lattice: ImageLattice, right: torch.Tensor, bias_direction: torch.Tensor
) -> ImageLattice | None:
    """``lattice`` at the steps of the inputs' own units.

    Steps right up to a common factor ``f`` give inputs ``f`` times too small, whose rows of
    ``Q^{-1}`` have the bias ``p . rho = sum_i z_i / f`` for the integer combination ``z`` of the
    samples; over a basis the greatest common divisor of those biases is ``1 / f``."""
    factors = right.detach().to(device="cpu", dtype=torch.float64).numpy()
    direction = bias_direction.detach().to(device="cpu", dtype=torch.float64).numpy()
    biases = np.abs(lattice.inputs(lattice.basis)[0] @ np.linalg.pinv(factors) @ direction)
    unit = _real_gcd(biases[biases > ZERO_BIAS * float(biases.max())])
    if unit is None:
        return None
    return lattice.rescaled(1.0 / unit)


def _real_gcd(values: np.ndarray) -> float | None:
    """The largest ``g`` of which every value is an integer multiple (to 1e-3), or None."""
    if values.size == 0:
        return None
    ordered = np.sort(values)
    unit = float(ordered[0])
    for value in ordered[1:]:
        high, low = float(value), unit
        while low > GCD_TOLERANCE * unit:
            high, low = low, high % low
            if low > high - GCD_TOLERANCE * unit:
                low = 0.0  # a remainder of a hair below the divisor is a whole multiple
        unit = high
    multiples = np.rint(values / unit)
    if float(np.abs(values / unit - multiples).max()) > 1e-3:
        return None
    return float(values @ multiples / (multiples @ multiples))  # least squares over every value


def channel_steps(
    right: torch.Tensor,
    *,
    layout: str,
    generator: np.random.Generator,
    constant: torch.Tensor | None = None,
    deadline: Deadline | None = None,
) -> tuple[float, ...] | None:
    """The three channels' steps, up to a common factor, read from the row space alone.

    Within one channel the step does not matter (the integer images of a channel are the same for
    any step), so each channel's lattice is found on its own features. Its points, as rows of
    ``Q^{-1}`` at a unit step, form a lattice ``L_c`` that the samples' rows, ``a_c`` times those
    of their pixels, fill exactly: ``a_c L_c`` is the same lattice for every channel, so
    ``a_c`` goes as ``vol(L_c) ** (-1 / b)``. None where a channel holds no lattice.
    """
    factors = right.detach().to(device="cpu", dtype=torch.float64)
    b, n = factors.shape
    if n % COLOURS:
        return None
    masks = channel_indicators(n, COLOURS, layout).astype(bool)
    logs: list[float] = []
    for mask in masks:
        part = factors[:, torch.from_numpy(mask)]
        lattice = image_lattice(
            part, layout="grey", steps=(1.0,), generator=generator, constant=constant, deadline=deadline
        )
        if lattice is None:
            return None
        images = _beyond(lattice.basis, lattice.channels)
        if images.shape[0] != b:
            return None
        rows = lattice.inputs(images)[0] @ np.linalg.pinv(part.numpy())
        sign, log_volume = np.linalg.slogdet(rows)
        if sign == 0:
            return None
        logs.append(float(log_volume))
    return tuple(float(np.exp(-(value - logs[0]) / b)) for value in logs)


def _roundings(fitted: np.ndarray) -> list[np.ndarray]:
    """Integer vectors near ``fitted``: each entry rounded, and both ways for the few entries
    (at most :data:`MAX_UNSURE`, the farthest from an integer) that the fit leaves in doubt."""
    base = np.rint(fitted)
    doubt = np.abs(fitted - base)
    unsure = np.flatnonzero(doubt > SURE_FRACTION)
    if unsure.size > MAX_UNSURE:
        return []
    options = [base]
    for index in unsure:
        other = base[index] + (1.0 if fitted[index] > base[index] else -1.0)
        flipped = [option.copy() for option in options]
        for option in flipped:
            option[index] = other
        options += flipped
    return options


def _small_combinations(count: int) -> list[np.ndarray]:
    """Integer combinations of ``count`` residuals to try as one sample: each alone, then (for a
    few) those with coefficients up to :data:`MAX_COEFFICIENT`, fewest terms first; one per sign."""
    single = [np.eye(count)[i] for i in range(count)]
    if count > MAX_ENUMERATED:
        return single
    values = np.arange(-MAX_COEFFICIENT, MAX_COEFFICIENT + 1)
    grid = np.stack(np.meshgrid(*([values] * count), indexing="ij"), axis=-1).reshape(-1, count)
    grid = grid[np.abs(grid).sum(axis=1) > 1]
    first_nonzero = grid[np.arange(grid.shape[0]), (grid != 0).argmax(axis=1)]
    grid = grid[first_nonzero > 0]  # c and -c are one sample up to the sign the bias fixes
    order = np.argsort(np.abs(grid).sum(axis=1), kind="stable")
    return single + [row.astype(np.float64) for row in grid[order]]


def lattice_batch(
    lattice: ImageLattice,
    approximate: np.ndarray,
    update: ClientUpdate,
) -> LatticeBatch | None:
    """The whole batch from a complete selection's approximate rows (``(b, n)``): the rows that
    decode, then the rest completed from them (:func:`complete_rows`); None where neither gives
    every sample."""
    b = update.batch_size
    pseudo = update.pseudo
    levels, inputs = decode_rows(lattice, approximate)
    if levels.shape[0] == 0:
        return None
    # a sample's row of Q^{-1} has the bias p . rho = 1; rows decoded at a common multiple of the
    # true steps come out scaled by it, so their bias gives the steps
    row_bias = inputs @ pseudo @ update.bias_direction
    factor = 1.0 / float(np.median(row_bias))
    if not np.isfinite(factor) or factor <= 0:
        return None
    lattice = lattice.rescaled(factor)
    inputs = lattice.inputs(levels)[0]
    affine = np.abs(inputs @ pseudo @ update.bias_direction - 1.0) < BIAS_TOLERANCE
    levels, inputs = levels[affine], inputs[affine]
    decoded = levels.shape[0]
    if decoded == 0 or decoded > b:
        return None
    if decoded < b:
        completion = complete_rows(
            lattice,
            levels,
            inputs,
            update,
        )
        if completion is None:
            return None
        levels, inputs = np.vstack([levels, completion[0]]), np.vstack([inputs, completion[1]])
    confirmed = left_out_rows(
        lattice,
        levels,
        inputs,
        update,
        replace_at_most=MAX_REPLACED,
    )
    if confirmed is None:
        return None
    return LatticeBatch(inputs=confirmed[1], decoded=decoded, completed=b - decoded)


def left_out_rows(
    lattice: ImageLattice,
    levels: np.ndarray,
    inputs: np.ndarray,
    update: ClientUpdate,
    *,
    replace_at_most: int = 0,
) -> tuple[np.ndarray, np.ndarray] | None:
    """A whole batch's ``(b, n)`` pixels (lattice points) and inputs once each row, left out, came
    back as the one image in the window that the others and the update allow (as in
    :func:`complete_rows`, the row itself among the candidates); None where one does not.

    A row that comes back as another image held other samples (a lattice point in the window that
    is no sample, such as a low-contrast image plus the difference of two others): up to
    ``replace_at_most`` such rows are replaced and every row is judged again."""
    b = update.batch_size
    pseudo = update.pseudo
    levels, inputs = levels.copy(), inputs.copy()
    rows = inputs @ pseudo
    if np.linalg.matrix_rank(rows) < b or np.linalg.cond(rows) > MAX_CONDITION:
        return None
    pre_activations = inputs @ update.weight.T + update.bias
    replaced = 0
    index = 0
    while index < b:
        others = np.arange(b) != index
        again = _lifted(
            lattice,
            levels[others],
            inputs[others],
            levels[index][None, :],
            update,
            keep_lift=True,
            pre_activations=pre_activations[others],
        )
        if again is None or again[1].shape[0] != 1:
            return None
        if float(np.abs(again[1][0] - inputs[index]).max()) >= SAME_INPUT:
            replaced += 1
            if replaced > replace_at_most:
                return None
            levels[index], inputs[index] = again[0][0], again[1][0]
            pre_activations[index] = update.weight @ inputs[index] + update.bias
            index = 0  # every row is judged again beside the new one
            continue
        index += 1
    if replaced and np.linalg.matrix_rank(inputs @ pseudo) < b:
        return None
    return levels, inputs


def grid_lattice(layout: str, steps: tuple[float, ...], right: torch.Tensor) -> ImageLattice:
    """The lattice's frame (no basis) for rows already read on a pixel grid of ``layout`` and
    per-channel ``steps``: enough to leave rows out (:func:`left_out_rows`)."""
    factors = right.detach().to(device="cpu", dtype=torch.float64).numpy()
    n = factors.shape[1]
    channels = channel_indicators(n, len(steps), layout)
    row_q, _ = np.linalg.qr(factors.T)
    scale = np.asarray(steps, dtype=np.float64) @ channels
    return ImageLattice(layout, steps, np.zeros((0, n)), scale, channels, row_q.T)


def _one_window(levels: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """``(k,)`` which of ``(k, n)`` rows (absolute levels) fit, in every channel, the one 256-level
    window that holds the most of them."""
    keep = np.ones(levels.shape[0], dtype=bool)
    for mask in channels.astype(bool):
        low, high = levels[:, mask].min(axis=1), levels[:, mask].max(axis=1)
        best = np.zeros_like(keep)
        for start in low:
            fits = (low >= start - WINDOW_TOLERANCE) & (high <= start + LEVELS - 1 + WINDOW_TOLERANCE)
            if fits.sum() > best.sum():
                best = fits
        keep &= best
    return keep


def _fits_levels(levels: np.ndarray, channels: np.ndarray) -> bool:
    """Whether each channel of one decoded image spans at most 256 levels and not a single one."""
    for mask in channels.astype(bool):
        values = levels[mask]
        extent = float(values.max() - values.min())
        if not 0 < extent <= LEVELS - 1:
            return False
    return True


def _fpylll() -> ModuleType:
    """fpylll, imported on first use. Its cysignals installs signal handlers when imported, which
    only the main thread may do; Flower loads a ServerApp (and the audit runs attacks) in other
    threads, so there the import goes ahead without installing them."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        import fpylll

        return fpylll
    installing = signal.signal

    def keep(signalnum: Any, handler: Any) -> Any:
        return signal.getsignal(signalnum)

    signal.signal = keep
    try:
        import fpylll
    finally:
        signal.signal = installing
    return fpylll


def _values(matrix: IntegerMatrix) -> np.ndarray:
    rows: list[list[int]] = [[0] * matrix.ncols for _ in range(matrix.nrows)]
    matrix.to_matrix(rows)
    return np.array(rows, dtype=np.float64)
