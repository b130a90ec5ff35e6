"""A layer's inputs from its own update and the next layer's: the next-layer route.

In FedSGD the server sees every layer's update. For a linear layer ``z = W x + b`` followed by
a ReLU and a second linear layer, the second layer's weight update ``dW2 = sum_i d2_i a_i^T``
has the batch's activations ``a_i = relu(W x_i + b)`` as its row space ``U2`` (rank b), and the
first layer's update has the batch's inputs as its row space ``V``. With ``x = V u`` every sample
satisfies ``relu(W V u + b) in U2``: ``m - b`` conditions on ``b`` unknowns whose scale is fixed by
the bias, linear once the ReLU pattern is fixed. SPEAR's gradient-side search needs ``b - 1``
zeros of one column guessed at once and fails at ``m / b = 120 / 32``; this route does not guess.

The search, in rounds of random starts:

1. smooth start: Adam on ``|P_perp softplus(A u + b)|^2 / |softplus(A u + b)|^2`` from random
   non-negative inputs projected on ``V`` (softplus sharpened from beta 5 to 200);
2. pattern iteration: ReLU pattern of ``A u + b`` -> least squares of ``P_perp D_S (A u + b)``
   -> pattern, until the pattern repeats (first in the deflated space, then in the whole one);
3. a pattern is accepted when the residual outside ``U2`` is small and the first layer's gradient
   side agrees: its rows of ``L`` (``dW = L R``) at the inactive neurons share a kernel ``q``;
4. deflation: another sample's ``u`` is orthogonal to every accepted ``q`` (``X^T = Q^-1 R``),
   so later rounds search the complement (only directions with a clean kernel deflate);
5. the input: the zeros of the approximate input pin it in the row space of ``[dW db]`` (the
   bias column fixes the scale); zeros that the kernel contradicts are dropped and it is
   solved again.

A sample is *verified* when that input-side kernel is small against the gap to the next
singular value; how often a verified sample is still off by more than the float32 rounding
allows is measured, not assumed (``examples/quickstart_cnn/next_layer_route.md``).
Inputs must be non-negative with exact zeros (pooled ReLU features); the route uses only
what the server observes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.types import LayerUpdate

__all__ = ["NextLayerResult", "RecoveredSample", "checked_next_layer", "recover_from_next_layer"]

#: Pattern-iteration results with a relative residual outside ``U2`` above this are dropped.
MAX_RESIDUAL = 3e-3
#: Looser bound in the deflated space, before the polish in the whole row space (deflating by
#: noisy directions moves the other samples out of the deflated space by up to a few percent).
MAX_DEFLATED_RESIDUAL = 3e-2
#: The inactive rows of ``L`` must share a kernel this clean (relative singular value).
MAX_PATTERN_KERNEL = 1e-3
#: Only directions whose kernel is this clean deflate the search space.
DEFLATE_KERNEL = 1e-5
#: Entries of the approximate input below this fraction of its largest count as zeros.
ZERO_THRESHOLD = 1e-3
#: Two recovered inputs with a larger cosine are the same sample.
DUPLICATE_COSINE = 0.999


def checked_next_layer(observed: LayerUpdate[np.ndarray]) -> np.ndarray:
    """The ``(k, m)`` next-layer update of ``observed``, once its arrays are checked for the route.

    Raises
    ------
    ValueError
        If it has no next-layer update, an array has the wrong shape, or holds NaN or Inf entries.
    """
    following = observed.next_weight_update
    if following is None:
        raise ValueError("the route needs the next layer's update: next_weight_update is None")
    m, n = observed.weight.shape
    expected = {
        "bias": (m,),
        "weight_update": (m, n),
        "bias_update": (m,),
    }
    for name, shape in expected.items():
        if getattr(observed, name).shape != shape:
            raise ValueError(f"{name} has shape {getattr(observed, name).shape}, expected {shape}")
    if following.ndim != 2 or following.shape[1] != m:
        raise ValueError(f"next_weight_update has shape {following.shape}, expected (k, {m})")
    for name in ("weight", "bias", "weight_update", "bias_update", "next_weight_update"):
        if not np.isfinite(getattr(observed, name)).all():
            raise ValueError(f"{name} contains NaN or Inf entries")
    return following


@dataclass(frozen=True)
class RecoveredSample:
    """One sample found by the route.

    Attributes
    ----------
    inputs
        ``(n,)`` the input pinned by its zeros in the update's row space, at the bias's scale.
    approximate
        ``(n,)`` the pattern iteration's input (precise to the next layer's rounding only).
    residual
        Relative part of ``relu(W x + b)`` outside the next update's row space.
    pattern_kernel
        Relative smallest singular value of the gradient side's rows at the inactive neurons.
    input_kernel, input_gap
        Relative smallest and second-smallest singular values of the input-side solve.
    verified
        Whether the input-side solve is clean and separated (the route's own check).
    seconds
        When it was found, from the start of the search.
    """

    inputs: np.ndarray
    approximate: np.ndarray
    residual: float
    pattern_kernel: float
    input_kernel: float
    input_gap: float
    verified: bool
    seconds: float


@dataclass(frozen=True)
class NextLayerResult:
    """All samples the route found, in the order found, with the rounds run and the time taken."""

    samples: tuple[RecoveredSample, ...]
    batch_size: int
    rounds: int
    seconds: float

    @property
    def inputs(self) -> np.ndarray:
        """``(k, n)`` the found samples' inputs (``k`` may be below the batch size)."""
        if not self.samples:
            return np.zeros((0, 0))
        return np.array([sample.inputs for sample in self.samples])

    @property
    def verified(self) -> np.ndarray:
        """``(k,)`` bool: which found samples passed the route's own check."""
        return np.array([sample.verified for sample in self.samples], dtype=bool)


def top_factors(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``L = U S`` (``(m, rank)``) and ``V`` (``(n, rank)``) of the top ``rank`` singular triplets."""
    left, values, right = np.linalg.svd(matrix, full_matrices=False)
    return left[:, :rank] * values[:rank], right[:rank].T


def complement(directions: list[np.ndarray], size: int) -> np.ndarray:
    """Orthonormal basis of the vectors in ``R^size`` orthogonal to every one of ``directions``."""
    if not directions:
        return np.eye(size)
    stacked = np.array(directions).T
    left = np.linalg.svd(stacked, full_matrices=True)[0]
    return np.asarray(left[:, stacked.shape[1] :])


def smooth_starts(
    inputs_map: np.ndarray,
    bias: np.ndarray,
    outside: np.ndarray,
    starts: np.ndarray,
    *,
    steps: int = 300,
    deadline: Deadline = Deadline.never(),
) -> np.ndarray:
    """Adam on the softplus relaxation of ``|P_perp relu(A u + b)| / |relu(A u + b)|`` from every start.

    At ``deadline`` the points reached so far are returned.
    """
    matrix, shift, projector = (torch.from_numpy(item) for item in (inputs_map, bias, outside))
    points = torch.from_numpy(starts.copy()).requires_grad_(True)
    optimizer = torch.optim.Adam([points], lr=0.05)
    for step in range(steps):
        if step % 10 == 0 and deadline.expired():
            break
        beta = 5.0 * 40.0 ** (step / max(steps - 1, 1))
        active = torch.nn.functional.softplus(points @ matrix.T + shift, beta=beta)
        loss = ((active @ projector) ** 2).sum(1) / (active**2).sum(1).clamp_min(1e-300)
        optimizer.zero_grad()
        loss.sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return np.asarray(points.detach().numpy())


def pattern_iteration(
    point: np.ndarray, inputs_map: np.ndarray, bias: np.ndarray, outside: np.ndarray, *, iterations: int = 30
) -> tuple[np.ndarray, float]:
    """ReLU pattern -> least squares of the part outside ``U2`` -> pattern; the point and its residual."""
    previous: np.ndarray | None = None
    for _ in range(iterations):
        active = inputs_map @ point + bias > 0
        if not active.any() or (previous is not None and (active == previous).all()):
            break
        previous = active
        system = outside[:, active] @ inputs_map[active]
        point = np.linalg.lstsq(system, -outside[:, active] @ bias[active])[0]
    outputs = np.maximum(inputs_map @ point + bias, 0.0)
    norm = float(np.linalg.norm(outputs))
    return point, float(np.linalg.norm(outside @ outputs)) / norm if norm > 0 else math.inf


def exact_from_zeros(
    augmented_basis: np.ndarray,
    approximate: np.ndarray,
    *,
    threshold: float = ZERO_THRESHOLD,
    passes: int = 3,
) -> tuple[np.ndarray, float, float]:
    """The row-space vector of ``[dW db]`` vanishing on ``approximate``'s zeros, scaled by the bias.

    ``augmented_basis`` is ``(n + 1, b)``, orthonormal columns spanning the row space of
    ``[dW db]``. Zeros are entries of ``approximate`` below ``threshold`` times its largest; after
    each solve the zeros the kernel fits worst (beyond 5 times the median misfit) are dropped.
    Returns the input, the kernel's relative singular value and the next one (1.0 and 1.0, with
    a zero input, when fewer zeros than ``b`` remain or the bias coordinate vanishes).
    """
    rows = augmented_basis[:-1]
    size = augmented_basis.shape[1]
    zeros = approximate <= threshold * float(np.abs(approximate).max())
    kernel: np.ndarray | None = None
    values = np.ones(1)
    for _ in range(passes):
        if zeros.sum() < size:
            break
        _, values, right = np.linalg.svd(rows[zeros], full_matrices=False)
        kernel = right[-1]
        misfit = np.abs(rows @ kernel)
        keep = zeros & (misfit <= 5.0 * float(np.median(misfit[zeros])))
        if (keep == zeros).all():
            break
        zeros = keep
    if kernel is None or values.size < size or values[0] == 0:
        return np.zeros(rows.shape[0]), 1.0, 1.0
    vector = augmented_basis @ kernel
    if vector[-1] == 0:
        return np.zeros(rows.shape[0]), 1.0, 1.0
    return vector[:-1] / vector[-1], float(values[-1] / values[0]), float(values[-2] / values[0])


def _cosine(first: np.ndarray, second: np.ndarray) -> float:
    norms = float(np.linalg.norm(first) * np.linalg.norm(second))
    return abs(float(first @ second)) / norms if norms > 0 else 0.0


def _same_sample(inputs: np.ndarray, approximate: np.ndarray, other: RecoveredSample) -> bool:
    """Whether a solution repeats ``other``: by the exact inputs, or by the approximate ones where an
    exact step failed (its input is zero; approximate inputs cannot tell look-alike samples apart)."""
    if np.any(inputs) and np.any(other.inputs):
        return _cosine(inputs, other.inputs) > DUPLICATE_COSINE
    return _cosine(approximate, other.approximate) > DUPLICATE_COSINE


def _random_starts(
    rng: np.random.Generator, space: np.ndarray, inputs_map: np.ndarray, bias: np.ndarray, count: int
) -> np.ndarray:
    """Random non-negative inputs projected on ``space``, scaled so ``A u`` spreads 0.5-8 times the bias."""
    noise = np.maximum(rng.standard_normal((count, space.shape[0])), 0.0)
    points = (noise * rng.exponential(size=noise.shape)) @ space
    ratio = np.exp(rng.uniform(math.log(0.5), math.log(8.0), size=(count, 1)))
    spread = (points @ inputs_map.T).std(1, keepdims=True)
    return np.asarray(points * ratio * max(float(bias.std()), 1e-12) / np.maximum(spread, 1e-300))


def recover_from_next_layer(
    observed: LayerUpdate[np.ndarray],
    *,
    batch_size: int,
    time_budget: float,
    starts: int = 100,
    seed: int = 0,
    max_rounds: int | None = None,
    min_rounds: int = 0,
    verify_ratio: float = 1e-4,
) -> NextLayerResult:
    """Find the batch's inputs of the attacked layer from its update and the next layer's.

    Parameters
    ----------
    observed
        The attacked layer, its update and the next layer's weight update.
    batch_size
        The batch size ``b`` (the rank of the updates; ``b < m``).
    time_budget
        Seconds of search; ``math.inf`` with ``max_rounds`` for a fixed amount of work.
    starts
        Random starts per round.
    seed
        Fixes the starts.
    max_rounds
        Stop after this many rounds (None: only the budget or a full batch stops the search).
    min_rounds
        Finish this many rounds even past the budget (a fixed amount of work: the first
        round's result does not depend on the machine's speed).
    verify_ratio
        A sample is verified when its input-side kernel over the gap to the next singular value
        (the perturbation bound on the solved direction's error, up to the noise's scale) is
        below this. The default was calibrated on the quickstart CNN at batch 32 (lr 0.1, float32
        rounding), where it separated inputs exact to 1e-4 from the rest; it is not a proof.

    Returns
    -------
    NextLayerResult
        The samples found (possibly fewer than ``b``, possibly none).

    Raises
    ------
    ValueError
        If ``observed`` fails :func:`checked_next_layer`, ``batch_size`` is not below the layer's
        width and the next layer's output count, or ``starts``, ``time_budget`` or ``max_rounds``
        is not positive.
    """
    next_weight_update = checked_next_layer(observed)
    m = observed.weight.shape[0]
    if not 1 <= batch_size < m:
        raise ValueError(f"batch_size must be in [1, {m - 1}] for a layer of width {m}, got {batch_size}")
    if starts < 1 or not time_budget > 0 or (max_rounds is not None and max_rounds < 1) or min_rounds < 0:
        raise ValueError(
            f"starts, time_budget and max_rounds must be positive and min_rounds non-negative, got {starts}, "
            f"{time_budget}, {max_rounds}, {min_rounds}"
        )
    following = next_weight_update.shape[0]
    if batch_size >= following:
        raise ValueError(
            f"batch_size {batch_size} is not below the next layer's {following} outputs: its update's "
            "row space cannot single out the batch's activations"
        )
    rng = np.random.default_rng(seed)
    left, basis = top_factors(observed.weight_update, batch_size)
    _, next_rows = top_factors(next_weight_update, batch_size)
    outside = np.eye(m) - next_rows @ next_rows.T
    augmented_update = np.hstack([observed.weight_update, observed.bias_update[:, None]])
    augmented = np.linalg.svd(augmented_update, full_matrices=False)[2][:batch_size].T
    full_map = observed.weight @ basis
    samples: list[RecoveredSample] = []
    deflating: list[np.ndarray] = []
    rounds = 0
    started = time.perf_counter()
    deadline = Deadline.in_seconds(time_budget)

    def out_of_time() -> bool:
        return rounds > min_rounds and deadline.expired()

    while (rounds < min_rounds or not deadline.expired()) and len(samples) < batch_size:
        if max_rounds is not None and rounds >= max_rounds:
            break
        rounds += 1
        reduced = complement(deflating, batch_size)
        inputs_map = full_map @ reduced
        points = _random_starts(rng, basis @ reduced, inputs_map, observed.bias, starts)
        smoothing = deadline if rounds > min_rounds else Deadline.never()
        for point in smooth_starts(inputs_map, observed.bias, outside, points, deadline=smoothing):
            if out_of_time() or len(samples) == batch_size:
                break
            solved, residual = pattern_iteration(point, inputs_map, observed.bias, outside)
            if residual > MAX_DEFLATED_RESIDUAL:
                continue
            # deflating by noisy directions moves the other samples out of the deflated space:
            # polish in the whole row space
            solved, residual = pattern_iteration(reduced @ solved, full_map, observed.bias, outside)
            inactive = full_map @ solved + observed.bias <= 0
            if residual > MAX_RESIDUAL or inactive.sum() < batch_size:
                continue
            _, values, right = np.linalg.svd(left[inactive], full_matrices=False)
            pattern_kernel = float(values[-1] / values[0])
            if pattern_kernel > MAX_PATTERN_KERNEL:
                continue
            approximate = basis @ solved
            inputs, input_kernel, gap = exact_from_zeros(augmented, approximate)
            if any(_same_sample(inputs, approximate, other) for other in samples):
                continue
            if pattern_kernel < DEFLATE_KERNEL:
                deflating.append(right[-1])
            samples.append(
                RecoveredSample(
                    inputs=inputs,
                    approximate=approximate,
                    residual=residual,
                    pattern_kernel=pattern_kernel,
                    input_kernel=input_kernel,
                    input_gap=gap,
                    verified=input_kernel < verify_ratio * gap,
                    seconds=time.perf_counter() - started,
                )
            )
    return NextLayerResult(
        samples=tuple(samples), batch_size=batch_size, rounds=rounds, seconds=time.perf_counter() - started
    )
