"""SPEAR++ sparse-direction search: many initializations optimized on the sphere at once.

Each initialization is a row ``q`` of a ``(k, b)`` tensor; the loss ``sum_j f((left @ q)_j)``
of all rows is optimized together so that one step costs two matrix products. The
columns of the disaggregation matrix are local minima of the ``l1`` surrogate (SPEAR++ Eq. 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    chunk_rows,
    elementwise_seconds,
    map_rows,
    matmul_seconds,
    qr_seconds,
)

SurrogateGrad = Callable[[torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class Surrogate:
    """A sparsity surrogate ``f``: its derivative and whether its minima need rounding."""

    name: str
    derivative: SurrogateGrad
    needs_rounding: bool


def _l1(values: torch.Tensor, smoothing: float) -> torch.Tensor:
    return torch.sign(values)


def _logcosh(values: torch.Tensor, smoothing: float) -> torch.Tensor:
    return torch.tanh(values / smoothing)


def _neg_l4(values: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -4.0 * values**3


#: Registry of surrogate losses, keyed by name.
SURROGATES: dict[str, Surrogate] = {
    "l1": Surrogate("l1", _l1, needs_rounding=False),
    "logcosh": Surrogate("logcosh", _logcosh, needs_rounding=True),
    "neg_l4": Surrogate("neg_l4", _neg_l4, needs_rounding=True),
}

OPTIMIZERS = ("radam", "pgd")


def get_surrogate(name: str) -> Surrogate:
    try:
        return SURROGATES[name]
    except KeyError:
        raise ValueError(f"unknown surrogate {name!r}; available: {sorted(SURROGATES)}") from None


@dataclass(frozen=True)
class SphereSchedule:
    """Steps and step sizes of the optimization (SPEAR++ Sec. 5: 500 steps, decays at 200 and 400).

    ``lr`` is multiplied by ``decay`` at each milestone.
    """

    steps: int = 500
    lr: float = 0.05
    milestones: tuple[int, ...] = (200, 400)
    decay: float = 0.1

    def lr_at(self, step: int) -> float:
        return self.lr * self.decay ** sum(step >= milestone for milestone in self.milestones)


def random_directions(
    count: int,
    size: int,
    *,
    generator: torch.Generator,
    avoid: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Uniform unit directions, optionally restricted to the orthogonal complement of ``avoid`` rows.

    Restricting later restarts to the complement of already found directions steers them
    towards the basins of the directions still missing.
    """
    draws = torch.randn(count, size, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    if avoid is not None and 0 < avoid.shape[0] < size:
        basis, _ = torch.linalg.qr(avoid.T.to(dtype))
        draws = draws - (draws @ basis) @ basis.T
    return draws / draws.norm(dim=1, keepdim=True).clamp_min(1e-30)


def optimize_on_sphere(
    left: torch.Tensor,
    initial: torch.Tensor,
    *,
    surrogate: Surrogate,
    optimizer: str = "radam",
    schedule: SphereSchedule = SphereSchedule(),
    smoothing: float | None = None,
    deadline: Deadline = Deadline.never(),
    prune: SettledPruning | None = None,
) -> torch.Tensor:
    """Minimize ``sum_j f((left @ q)_j)`` over unit ``q`` for every row of ``initial`` at once.

    The optimizers are the sphere versions of geoopt's ``RiemannianAdam`` and
    ``RiemannianSGD`` (same update, transport and retraction), written out here: geoopt's
    optimizers import ``torch._dynamo`` on first use, seconds that no deadline can interrupt.

    Parameters
    ----------
    left
        ``(m, b)`` orthonormal left factor.
    initial
        ``(k, b)`` unit starting directions.
    surrogate
        The sparsity surrogate ``f``.
    optimizer
        ``"radam"`` (Riemannian Adam) or ``"pgd"`` (projected subgradient descent).
    schedule
        Steps and learning-rate decay.
    smoothing
        Scale of the ``logcosh`` surrogate; defaults to ``0.1 / sqrt(m)``, a tenth of the
        typical entry of a unit gradient column.
    deadline
        Deadline at which to stop (checked within every step) and return
        the current points.
    prune
        Drop, during the optimization, the points that settled next to a known direction or next
        to another point (:class:`SettledPruning`); the result then has fewer rows than ``initial``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; available: {list(OPTIMIZERS)}")
    m = left.shape[0]
    mu = smoothing if smoothing is not None else 0.1 / math.sqrt(m)
    left_t = left.T.contiguous()
    state = _RiemannianAdam(initial) if optimizer == "radam" else _RiemannianSGD(initial)
    count, size = initial.shape
    # rows are independent: one step runs in chunks so the deadline is checked within it too
    rows = chunk_rows(matmul_seconds(4.0 * m * size) + elementwise_seconds(2.0 * m), device=initial.device)
    # entries of converged directions and Adam's second moments underflow into subnormal
    # floats, which are orders of magnitude slower on CPUs
    flush = torch.set_flush_denormal(True)
    try:
        with torch.no_grad():
            for step in range(schedule.steps):
                if prune is not None and prune.due(step):
                    state.keep(prune.survivors(state.point))
                    count = state.point.shape[0]
                lr = schedule.lr_at(step)
                for start in range(0, count, rows):
                    if deadline.expired():
                        return state.point.clone()
                    part = slice(start, start + rows)
                    values = state.point[part] @ left_t  # (rows, m)
                    grad = surrogate.derivative(values, mu) @ left  # (rows, b)
                    if optimizer == "pgd":
                        # normalized subgradient: the step length is set by the schedule alone
                        grad = grad / grad.norm(dim=1, keepdim=True).clamp_min(1e-30)
                    state.step(grad, lr=lr, rows=part, step=step + 1)
    finally:
        if flush:
            torch.set_flush_denormal(False)
    return state.point.clone()


def _tangent(point: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """Project each row of ``vector`` onto the tangent space of the sphere at that row of ``point``."""
    return vector - (point * vector).sum(dim=-1, keepdim=True) * point


def _retract(point: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    moved = point + step
    return moved / moved.norm(dim=-1, keepdim=True)


@dataclass(frozen=True)
class SettledPruning:
    """Which points of a sphere search stop early: those that settled where a start already went.

    From step ``after`` on, every ``every`` steps, a point whose ``|cos|`` with a ``known``
    direction (exact directions already found) or with an earlier surviving point exceeds
    ``cos`` is dropped: the rest of its optimization would only repeat a minimum (distinct
    samples' directions stay far below it: their ``|cos|`` is below 0.9 on CIFAR-10 at b = 150).
    Not for small batches of look-alike inputs: on 10 face patches at m = 200, points within
    0.999 of each other at step 250 did not all end at one minimum, and the round that completes
    the batch unpruned did not.
    """

    known: torch.Tensor
    after: int = 250
    every: int = 50
    cos: float = 0.999

    def due(self, step: int) -> bool:
        """Whether to prune before ``step`` (from 0)."""
        return step >= self.after and (step - self.after) % self.every == 0

    def survivors(self, points: torch.Tensor) -> torch.Tensor:
        """``(k,)`` bool: the unit ``points`` (rows) that are kept."""
        keep = torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
        if self.known.shape[0]:
            known = self.known.to(points)
            keep &= ((points @ known.T).abs() <= self.cos).all(dim=1)
        index = torch.nonzero(keep).flatten()
        similar = (points[index] @ points[index].T).abs() > self.cos
        # a point repeating an earlier surviving one: the first of each cluster stays
        earlier = torch.tril(similar, diagonal=-1).any(dim=1)
        keep[index[earlier]] = False
        return keep


class _RiemannianSGD:
    """Riemannian gradient descent on the unit sphere, one point per row (no momentum)."""

    def __init__(self, initial: torch.Tensor) -> None:
        self.point = initial.clone()

    def step(self, grad: torch.Tensor, *, lr: float, rows: slice, step: int) -> None:
        """Move ``point[rows]`` along ``-grad`` (Euclidean gradients of those rows)."""
        point = self.point[rows]
        self.point[rows] = _retract(point, -lr * _tangent(point, grad))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the points selected by the ``(k,)`` bool mask ``rows``."""
        self.point = self.point[rows]


class _RiemannianAdam:
    """Riemannian Adam (Becigneul & Ganea, 2019) on the unit sphere, one point per row.

    The second moment is the squared norm of each row's Riemannian gradient, and the first
    moment is transported to the new point by projection, as in geoopt.
    """

    def __init__(
        self, initial: torch.Tensor, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.point = initial.clone()
        self.betas = betas
        self.eps = eps
        self.exp_avg = torch.zeros_like(initial)
        self.exp_avg_sq = torch.zeros_like(initial)

    def step(self, grad: torch.Tensor, *, lr: float, rows: slice, step: int) -> None:
        """Step ``step`` (from 1) of ``point[rows]``, given the Euclidean gradients of those rows."""
        beta1, beta2 = self.betas
        point, exp_avg, exp_avg_sq = self.point[rows], self.exp_avg[rows], self.exp_avg_sq[rows]
        rgrad = _tangent(point, grad)
        exp_avg.mul_(beta1).add_(rgrad, alpha=1 - beta1)
        # one value per row, held per entry like geoopt so that results agree to the last bit
        squared_norm = (rgrad * rgrad).sum(dim=-1, keepdim=True).expand_as(rgrad)
        exp_avg_sq.mul_(beta2).add_(squared_norm, alpha=1 - beta2)
        denom = exp_avg_sq.div(1 - beta2**step).sqrt_().add_(self.eps)
        direction = exp_avg.div(1 - beta1**step) / denom
        moved = _retract(point, -lr * direction)
        self.point[rows] = moved
        self.exp_avg[rows] = _tangent(moved, exp_avg)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the points (and their moments) selected by the ``(k,)`` bool mask ``rows``."""
        self.point, self.exp_avg, self.exp_avg_sq = (
            self.point[rows],
            self.exp_avg[rows],
            self.exp_avg_sq[rows],
        )


#: An entry of a unit gradient column ``left @ q`` below this times ``1/sqrt(m)`` (the typical
#: entry) counts as vanishing at a minimum of the sphere search, before rounding. Measured on
#: CIFAR-10 (b = m/10) at the end of a 500-step search: minima at true directions had 970-2006
#: such entries (about m/2: the sample's inactive neurons), the others at most 292 (m = 2000)
#: and 577 (m = 4000), about b + 50%.
SETTLED_ENTRY = 0.01


def sparse_minima(left: torch.Tensor, minima: torch.Tensor, *, min_small: int) -> torch.Tensor:
    """The rows of ``minima`` whose column ``left @ q`` has at least ``min_small`` vanishing
    entries (see ``SETTLED_ENTRY``): the others are spurious minima that no rounding makes sparse,
    and rounding one costs a ``b x b`` eigendecomposition and QR where this test costs ``O(m b)``.
    """
    m = left.shape[0]
    threshold = SETTLED_ENTRY / math.sqrt(m)
    keep = [
        ((minima[start : start + 1024].to(left.dtype) @ left.T).abs() < threshold).sum(dim=1) >= min_small
        for start in range(0, minima.shape[0], 1024)
    ]
    return minima[torch.cat(keep)] if keep else minima


def sampling_rounding(
    left: torch.Tensor,
    approximate: torch.Tensor,
    *,
    pool_fraction: float,
    samples: int,
    generator: torch.Generator,
    deadline: Deadline = Deadline.never(),
) -> torch.Tensor:
    """SPEAR++ Sec. 4.4: round approximate minima by kernels of randomly chosen small rows.

    For each approximate ``q`` the ``pool_fraction * m`` entries of ``left @ q`` closest to
    zero form a pool; ``samples`` random ``(b-1)``-subsets of it each give a proposal
    ``ker(L_A)``. Returns ``(k * samples, b)`` proposals, or those of the first minima
    processed by ``deadline`` (the work runs in chunks).
    """
    m, b = left.shape
    pool = max(b - 1, min(m, int(round(pool_fraction * m))))

    def rounded(chunk: torch.Tensor) -> torch.Tensor:
        k = chunk.shape[0]
        values = (chunk @ left.T).abs()
        smallest = torch.topk(values, k=pool, dim=1, largest=False).indices  # (k, pool)
        keys = torch.rand(k, samples, pool, generator=generator, dtype=torch.float64).to(left.device)
        picks = torch.argsort(keys, dim=2)[:, :, : b - 1]  # random (b-1)-subsets of the pool
        rows = torch.gather(smallest.unsqueeze(1).expand(-1, samples, -1), 2, picks)
        submatrices = left[rows.reshape(k * samples, b - 1)]
        q, _ = torch.linalg.qr(submatrices.transpose(1, 2), mode="complete")
        return q[:, :, -1]

    seconds = matmul_seconds(2.0 * m * b) + samples * (qr_seconds(b) + elementwise_seconds(8.0 * pool))
    return map_rows(rounded, approximate, seconds_per_row=seconds, deadline=deadline)
