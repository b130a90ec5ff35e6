"""SPEAR++ sparse-direction search: many initializations optimized on the sphere at once.

Each initialization is a row ``q`` of a ``(k, b)`` tensor; the loss ``sum_j f((left @ q)_j)``
of all rows is optimized together so that one step costs two matrix products. The
columns of the disaggregation matrix are local minima of the ``l1`` surrogate (SPEAR++ Eq. 2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    deadline: float = math.inf,
) -> torch.Tensor:
    """Minimize ``sum_j f((left @ q)_j)`` over unit ``q`` for every row of ``initial`` at once.

    Parameters
    ----------
    left
        ``(m, b)`` orthonormal left factor.
    initial
        ``(k, b)`` unit starting directions.
    surrogate
        The sparsity surrogate ``f``.
    optimizer
        ``"radam"`` (Riemannian Adam from geoopt) or ``"pgd"`` (projected subgradient descent).
    schedule
        Steps and learning-rate decay.
    smoothing
        Scale of the ``logcosh`` surrogate; defaults to ``0.1 / sqrt(m)``, a tenth of the
        typical entry of a unit gradient column.
    deadline
        ``time.perf_counter()`` value at which to stop early and return the current points.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; available: {list(OPTIMIZERS)}")
    import geoopt  # slow to import (it compiles TorchScript); only the search needs it

    m = left.shape[0]
    mu = smoothing if smoothing is not None else 0.1 / math.sqrt(m)
    left_t = left.T.contiguous()
    point = geoopt.ManifoldParameter(initial.clone(), manifold=geoopt.Sphere())
    if optimizer == "radam":
        opt: torch.optim.Optimizer = geoopt.optim.RiemannianAdam([point], lr=schedule.lr)
    else:
        opt = geoopt.optim.RiemannianSGD([point], lr=schedule.lr)
    # entries of converged directions and Adam's second moments underflow into subnormal
    # floats, which are orders of magnitude slower on CPUs
    flush = torch.set_flush_denormal(True)
    try:
        for step in range(schedule.steps):
            if step % 25 == 0 and time.perf_counter() > deadline:
                break
            for group in opt.param_groups:
                group["lr"] = schedule.lr_at(step)
            with torch.no_grad():
                values = point @ left_t  # (k, m)
                grad = surrogate.derivative(values, mu) @ left  # (k, b)
                if optimizer == "pgd":
                    # normalized subgradient: the step length is set by the schedule alone
                    grad = grad / grad.norm(dim=1, keepdim=True).clamp_min(1e-30)
            point.grad = grad
            opt.step()
    finally:
        if flush:
            torch.set_flush_denormal(False)
    return point.detach().clone()


def sampling_rounding(
    left: torch.Tensor,
    approximate: torch.Tensor,
    *,
    pool_fraction: float,
    samples: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """SPEAR++ Sec. 4.4: round approximate minima by kernels of randomly chosen small rows.

    For each approximate ``q`` the ``pool_fraction * m`` entries of ``left @ q`` closest to
    zero form a pool; ``samples`` random ``(b-1)``-subsets of it each give a proposal
    ``ker(L_A)``. Returns ``(k * samples, b)`` proposals.
    """
    m, b = left.shape
    pool = max(b - 1, min(m, int(round(pool_fraction * m))))
    values = (approximate @ left.T).abs()
    smallest = torch.topk(values, k=pool, dim=1, largest=False).indices  # (k, pool)
    k = approximate.shape[0]
    keys = torch.rand(k, samples, pool, generator=generator, dtype=torch.float64).to(left.device)
    picks = torch.argsort(keys, dim=2)[:, :, : b - 1]  # random (b-1)-subsets of the pool
    rows = torch.gather(smallest.unsqueeze(1).expand(-1, samples, -1), 2, picks)
    submatrices = left[rows.reshape(k * samples, b - 1)]
    q, _ = torch.linalg.qr(submatrices.transpose(1, 2), mode="complete")
    return q[:, :, -1]
