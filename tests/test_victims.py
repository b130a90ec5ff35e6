"""Victim networks and the first-layer updates their clients send."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fl_attack.simulate import victims
from fl_attack.simulate.victims import (
    VICTIMS,
    build_victim,
    client_gradient,
    dp_sgd_gradient,
    fedavg_update,
    fedsgd_update,
    first_linear,
    median_abs_entry,
    noisy_gradient,
)

N, M, C = 12, 16, 4


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 2, 2, generator=gen), torch.randint(0, C, (batch,), generator=gen)


@pytest.fixture()
def model() -> nn.Sequential:
    return build_victim("spear++", input_dim=N, width=M, num_classes=C, seed=0)


def test_spear_plus_plus_layout(model: nn.Sequential) -> None:
    shapes = [(layer.in_features, layer.out_features) for layer in _linears(model)]
    assert shapes == [(N, M), (M, M), (M, M), (M, C)]
    assert isinstance(model[0], nn.Flatten)
    assert [type(m) for m in model[1:]] == [nn.Linear, nn.ReLU] * 3 + [nn.Linear]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_spear_layout_and_depth_override() -> None:
    assert len(_linears(build_victim("spear", input_dim=N, width=M))) == 6
    assert len(_linears(build_victim("spear", input_dim=N, width=M, depth=3))) == 3
    assert len(_linears(build_victim("spear++", input_dim=N, width=M, depth=2))) == 2


def test_seeded_build_is_deterministic_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_victim(input_dim=N, width=M, seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_victim(input_dim=N, width=M, seed=7)
    c = build_victim(input_dim=N, width=M, seed=8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[1].weight, c[1].weight)


def test_registry_errors() -> None:
    assert set(VICTIMS) == {"spear", "spear++"}
    with pytest.raises(ValueError, match=r"available.*spear"):
        build_victim("resnet", input_dim=N, width=M)
    with pytest.raises(ValueError, match="depth"):
        build_victim(input_dim=N, width=M, depth=1)
    with pytest.raises(ValueError, match="width"):
        build_victim(input_dim=N, width=0)


def test_first_linear(model: nn.Sequential) -> None:
    name, layer = first_linear(model)
    assert name == "1" and layer is model[1]
    assert f"{name}.weight" in model.state_dict()
    no_bias = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 2))
    assert first_linear(no_bias)[0] == "1"
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        first_linear(nn.Sequential(nn.ReLU()))


def test_client_gradient_single_sample_is_outer_product(model: nn.Sequential) -> None:
    x, y = _batch(1)
    weight_grad, bias_grad = client_gradient(model, x, y)
    assert weight_grad.shape == (M, N) and bias_grad.shape == (M,)
    # Manual backprop: dL/dZ1 = dL/dA1 * relu'(Z1), dL/dW1 = dL/dZ1 x^T, dL/db1 = dL/dZ1.
    flat = x.flatten(1)
    z1 = model[1](flat).detach().requires_grad_(True)
    out = model[3:](model[2](z1))
    (dz,) = torch.autograd.grad(nn.functional.cross_entropy(out, y), z1)
    assert torch.allclose(bias_grad, dz[0], atol=1e-7)
    assert torch.allclose(weight_grad, torch.outer(dz[0], flat[0]), atol=1e-7)
    dead = model[1](flat)[0] <= 0
    assert dead.any()
    assert torch.all(weight_grad[dead] == 0) and torch.all(bias_grad[dead] == 0)


def test_client_gradient_leaves_model_untouched(model: nn.Sequential) -> None:
    before = copy.deepcopy(model.state_dict())
    x, y = _batch(5)
    client_gradient(model, x, y)
    client_gradient(model, x.flatten(1), y, loss="mse")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_client_gradient_validation(model: nn.Sequential) -> None:
    x, y = _batch(3)
    with pytest.raises(ValueError, match="labels"):
        client_gradient(model, x, y[:2])
    with pytest.raises(ValueError, match="features"):
        client_gradient(model, torch.randn(3, N + 1), y)
    with pytest.raises(ValueError, match="unknown loss"):
        client_gradient(model, x, y, loss="hinge")


def test_fedsgd_update_is_minus_lr_gradient(model: nn.Sequential) -> None:
    x, y = _batch(6)
    weight_grad, bias_grad = client_gradient(model, x, y)
    dw, db = fedsgd_update(model, x, y, lr=0.1)
    assert torch.allclose(dw, -0.1 * weight_grad, atol=1e-7, rtol=1e-5)
    assert torch.allclose(db, -0.1 * bias_grad, atol=1e-7, rtol=1e-5)


def test_fedavg_update_matches_torch_sgd(model: nn.Sequential) -> None:
    x, y = _batch(7)
    dw, db = fedavg_update(model, x, y, lr=0.1, epochs=2, mini_batch_size=4, seed=0)
    local = copy.deepcopy(model)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        order = torch.randperm(7, generator=gen)
        for start in (0, 4):
            idx = order[start : start + 4]
            optimizer.zero_grad()
            nn.functional.cross_entropy(local(x[idx]), y[idx]).backward()
            optimizer.step()
    assert torch.equal(dw, local[1].weight.detach() - model[1].weight.detach())
    assert torch.equal(db, local[1].bias.detach() - model[1].bias.detach())


def test_fedavg_update(model: nn.Sequential) -> None:
    x, y = _batch(8)
    before = copy.deepcopy(model.state_dict())
    weight_grad, _ = client_gradient(model, x, y)
    dw, _ = fedavg_update(model, x, y, lr=0.05, epochs=1)
    assert torch.allclose(dw, -0.05 * weight_grad, atol=1e-7, rtol=1e-5)
    a = fedavg_update(model, x, y, lr=0.05, epochs=3, mini_batch_size=3, seed=1)
    b = fedavg_update(model, x, y, lr=0.05, epochs=3, mini_batch_size=3, seed=1)
    c = fedavg_update(model, x, y, lr=0.05, epochs=3, mini_batch_size=3, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.allclose(a[0], c[0])
    assert not torch.allclose(a[0], dw)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="epochs"):
        fedavg_update(model, x, y, lr=0.05, epochs=0)


def _naive_dp_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip_norm: float) -> list[torch.Tensor]:
    layer = model[1]
    total = [torch.zeros_like(layer.weight), torch.zeros_like(layer.bias)]
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip_norm / (float(norm) + 1e-6))
        total[0] += factor * grads[0]
        total[1] += factor * grads[1]
    return total


def test_dp_sgd_without_clipping_or_noise_is_plain_gradient(model: nn.Sequential) -> None:
    x, y = _batch(5)
    weight_grad, bias_grad = client_gradient(model, x, y)
    dw, db = dp_sgd_gradient(model, x, y, noise_multiplier=0.0, max_grad_norm=1e6)
    assert torch.allclose(dw, weight_grad, atol=1e-7)
    assert torch.allclose(db, bias_grad, atol=1e-7)


@pytest.mark.parametrize("budget", [1 << 26, 1])
def test_dp_sgd_clipping_matches_naive_loop(
    model: nn.Sequential, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(victims, "_PER_SAMPLE_BUDGET", budget)  # 1: one sample per chunk
    x, y = _batch(5)
    clip_norm = 0.05
    dw, db = dp_sgd_gradient(model, x, y, noise_multiplier=0.0, max_grad_norm=clip_norm)
    naive_w, naive_b = _naive_dp_sum(model, x, y, clip_norm)
    assert torch.allclose(dw, naive_w / 5, atol=1e-7)
    assert torch.allclose(db, naive_b / 5, atol=1e-7)
    plain_w, _ = client_gradient(model, x, y)
    assert not torch.allclose(dw, plain_w, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_dp_sgd_matches_opacus(model: nn.Sequential) -> None:
    opacus = pytest.importorskip("opacus")
    from opacus.optimizers import DPOptimizer

    x, y = _batch(6)
    clip_norm = 0.1
    ours_w, ours_b = dp_sgd_gradient(model, x, y, noise_multiplier=0.0, max_grad_norm=clip_norm)
    wrapped = opacus.GradSampleModule(copy.deepcopy(model))
    optimizer = DPOptimizer(
        torch.optim.SGD(wrapped.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=clip_norm,
        expected_batch_size=6,
    )
    optimizer.zero_grad()
    nn.functional.cross_entropy(wrapped(x), y).backward()
    optimizer.pre_step()
    layer = wrapped._module[1]
    assert torch.allclose(ours_w, layer.weight.grad, atol=1e-7)
    assert torch.allclose(ours_b, layer.bias.grad, atol=1e-7)
    assert not torch.allclose(ours_w, client_gradient(model, x, y)[0], atol=1e-6)  # clipping was active


def test_dp_sgd_noise(model: nn.Sequential) -> None:
    x, y = _batch(4)
    clean_w, _ = dp_sgd_gradient(model, x, y, noise_multiplier=0.0, max_grad_norm=1.0)
    a_w, a_b = dp_sgd_gradient(model, x, y, noise_multiplier=2.0, max_grad_norm=1.0, seed=3)
    b_w, _ = dp_sgd_gradient(model, x, y, noise_multiplier=2.0, max_grad_norm=1.0, seed=3)
    assert torch.equal(a_w, b_w)
    # noise std on the averaged gradient: noise_multiplier * C / B = 0.5
    assert float((a_w - clean_w).std()) == pytest.approx(0.5, rel=0.3)
    assert a_b.shape == (M,)
    with pytest.raises(ValueError, match="max_grad_norm"):
        dp_sgd_gradient(model, x, y, noise_multiplier=1.0, max_grad_norm=0.0)


def test_noisy_gradient_and_median() -> None:
    weight = torch.tensor([[0.0, -1.0, 2.0], [3.0, -4.0, 0.5]])
    bias = torch.tensor([1.0, 2.0])
    assert median_abs_entry(weight) == pytest.approx(1.5)
    noisy_w, noisy_b = noisy_gradient(weight, bias, sigma=0.0, seed=0)
    assert torch.equal(noisy_w, weight) and torch.equal(noisy_b, bias)
    big = torch.zeros(200, 300)
    a_w, a_b = noisy_gradient(big, torch.zeros(200), sigma=0.1, seed=5)
    b_w, _ = noisy_gradient(big, torch.zeros(200), sigma=0.1, seed=5)
    assert torch.equal(a_w, b_w)
    assert float(a_w.std()) == pytest.approx(0.1, rel=0.05)
    assert float(a_b.abs().max()) > 0
    assert torch.equal(big, torch.zeros(200, 300))
    with pytest.raises(ValueError, match="sigma"):
        noisy_gradient(weight, bias, sigma=-1.0)
