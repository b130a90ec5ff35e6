"""The search's Riemannian optimizers are geoopt's, written out (no torch._dynamo import).

geoopt's ``RiemannianAdam`` imports ``torch._dynamo`` when it is first built: seconds that
no deadline can interrupt. The sphere versions in :mod:`fl_attack.pipeline.search.sphere` must take
exactly geoopt's steps.
"""

from __future__ import annotations

import pytest
import torch

from fl_attack.pipeline.search.sphere import SphereSchedule, get_surrogate, optimize_on_sphere


def _geoopt_minima(
    left: torch.Tensor, start: torch.Tensor, schedule: SphereSchedule, optimizer: str
) -> torch.Tensor:
    geoopt = pytest.importorskip("geoopt")
    point = geoopt.ManifoldParameter(start.clone(), manifold=geoopt.Sphere())
    if optimizer == "radam":
        opt = geoopt.optim.RiemannianAdam([point], lr=schedule.lr)
    else:
        opt = geoopt.optim.RiemannianSGD([point], lr=schedule.lr)
    for step in range(schedule.steps):
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        with torch.no_grad():
            grad = torch.sign(point @ left.T) @ left
            if optimizer == "pgd":
                grad = grad / grad.norm(dim=1, keepdim=True).clamp_min(1e-30)
        point.grad = grad
        opt.step()
    return point.detach()


@pytest.mark.parametrize("optimizer", ["radam", "pgd"])
def test_sphere_optimizers_take_geoopts_steps_exactly(optimizer: str) -> None:
    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(50, 6, generator=generator))
    start = torch.randn(200, 6, generator=generator)
    start = start / start.norm(dim=1, keepdim=True)
    schedule = SphereSchedule(steps=100, lr=0.3, milestones=(40, 80))
    ours = optimize_on_sphere(
        left, start, surrogate=get_surrogate("l1"), optimizer=optimizer, schedule=schedule
    )
    assert torch.equal(ours, _geoopt_minima(left, start, schedule, optimizer))
    assert torch.allclose(ours.norm(dim=1), torch.ones(200), atol=1e-6)


def test_unknown_optimizer_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        optimize_on_sphere(torch.eye(3), torch.eye(3), surrogate=get_surrogate("l1"), optimizer="adam")
