"""Exact first-layer updates of a synthetic linear + ReLU layer, for fast attack tests.

``dL/dW = G X`` and ``dL/db = G 1`` with ``G = dL/dY * [W X^T + bias > 0]``: what a client of
any network whose first layer is followed by a ReLU sends, with a dense random ``dL/dY``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack import LayerUpdate


@dataclass(frozen=True)
class SyntheticUpdate:
    """A layer's update for the batch ``inputs`` (rows), and the layer's parameters."""

    inputs: torch.Tensor  # (b, n) float64
    weight_grad: torch.Tensor  # (m, n)
    bias_grad: torch.Tensor  # (m,)
    weight: torch.Tensor  # (m, n)
    bias: torch.Tensor  # (m,)

    def arrays(self) -> dict[str, torch.Tensor]:
        return {
            "weight_grad": self.weight_grad,
            "bias_grad": self.bias_grad,
            "weight": self.weight,
            "bias": self.bias,
        }

    def layer_update(self) -> LayerUpdate[torch.Tensor]:
        """The update as the server observes it."""
        return LayerUpdate(self.weight_grad, self.bias_grad, weight=self.weight, bias=self.bias)


def relu_layer_update(
    inputs: torch.Tensor,
    *,
    width: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    vanishing: tuple[tuple[int, int], ...] = (),
) -> SyntheticUpdate:
    """The update of a random ``width``-neuron layer (``W ~ N(0, 1/n)``, ``bias ~ N(0, 0.1^2)``).

    Each ``(sample, neuron)`` of ``vanishing`` gets a zero gradient although the sample activates
    the neuron, as when ``dL/dY`` vanishes there by chance.
    """
    x = inputs.to(torch.float64)
    n = x.shape[1]
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(width, n, generator=generator, dtype=torch.float64) / n**0.5
    bias = 0.1 * torch.randn(width, generator=generator, dtype=torch.float64)
    upstream = torch.randn(width, x.shape[0], generator=generator, dtype=torch.float64)
    output_grad = upstream * ((weight @ x.T + bias[:, None]) > 0)
    for sample, neuron in vanishing:
        output_grad[neuron, sample] = 0.0
    return SyntheticUpdate(
        inputs=x,
        weight_grad=(output_grad @ x).to(dtype),
        bias_grad=output_grad.sum(dim=1).to(dtype),
        weight=weight.to(dtype),
        bias=bias.to(dtype),
    )


def next_layer_update(update: SyntheticUpdate, *, width: int, seed: int) -> torch.Tensor:
    """The ``(width, m)`` update of a linear layer fed by ``update``'s ReLU: ``dL/dY' H^T`` with a
    dense random ``dL/dY'`` and the batch's activations ``H = relu(W X^T + bias)``."""
    weight, bias = update.weight.to(torch.float64), update.bias.to(torch.float64)
    activations = torch.relu(weight @ update.inputs.T + bias[:, None])  # (m, b)
    generator = torch.Generator().manual_seed(seed)
    upstream = torch.randn(width, activations.shape[1], generator=generator, dtype=torch.float64)
    return (upstream @ activations.T).to(update.weight_grad.dtype)
