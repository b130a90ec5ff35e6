"""Each sample's loss gradient at the attacked layer, from its recovered input and the layer's update.

The attacked layer ``Z = W f + b`` is followed by a known head (the rest of the global model)
ending in logits trained with cross-entropy. Once a sample's input ``f_i`` is recovered, the
server can run the head forward and backward for every candidate label ``c``, which gives
``dL/dZ_i`` as it would be with that label. The observed weight gradient
``dW = (1/B) sum_j dL/dZ_j f_j^T`` has the batch's output gradients as its column space, so the
true label is the one whose ``dL/dZ_i`` lies in that space. This needs neither the other
samples' inputs nor any ground truth, so it works for the recovered part of a batch too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fl_attack.types import ArrayLike

__all__ = ["HeadGradients", "feature_gradients_from_head"]


@dataclass(frozen=True)
class HeadGradients:
    """Per-sample gradients at the attacked layer, with the labels that explain the observed update.

    Attributes
    ----------
    labels
        ``(B,)`` int64: the label whose output gradient lies closest to the observed column space.
    output_grads
        ``(B, m)`` float64 ``dL_i/dZ_i``: the gradient of sample ``i``'s own cross-entropy loss
        at the layer's outputs.
    feature_grads
        ``(B, n)`` float64 ``dL_i/df_i = W^T dL_i/dZ_i``.
    residuals
        ``(B,)`` float64: the chosen output gradient's relative distance from the observed
        column space (near the update's relative rounding noise when the label is right; 0 for a
        sample whose layer outputs are all inactive, which has no gradient whatever its label).
    runner_up
        ``(B,)`` float64: the same distance for the second-best label (large when the choice is clear).
    """

    labels: torch.Tensor
    output_grads: torch.Tensor
    feature_grads: torch.Tensor
    residuals: torch.Tensor
    runner_up: torch.Tensor


def _as_float64(value: ArrayLike, *, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value).detach().to(device="cpu", dtype=torch.float64)
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ValueError(f"{name} contains {bad} NaN or Inf entries")
    return tensor


def feature_gradients_from_head(
    *,
    features: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike,
    head: Callable[[torch.Tensor], torch.Tensor],
    observed_weight_grad: ArrayLike,
    batch_size: int,
) -> HeadGradients:
    """Labels and ``dL_i/df_i`` of recovered samples, from the attacked layer's observed gradient.

    Parameters
    ----------
    features
        ``(k, n)`` recovered inputs of the attacked layer (any ``k`` of the batch's samples).
    weight, bias
        The attacked layer's global ``(m, n)`` weight and ``(m,)`` bias.
    head
        Maps the layer's ``(k, m)`` outputs ``Z`` to ``(k, C)`` logits (the activation after the
        layer included), in float64; the client's loss is cross-entropy on these logits.
    observed_weight_grad
        ``(m, n)`` the layer's observed weight gradient (any positive multiple of it, e.g. the
        update divided by ``-lr``), from the whole batch.
    batch_size
        The client's batch size ``B`` (the rank of the observed gradient), e.g. the attack's estimate.

    Returns
    -------
    HeadGradients
        Labels, output and feature gradients of the ``k`` samples, and how well each fits.

    Raises
    ------
    ValueError
        On shapes that disagree, NaN/Inf, a batch size outside ``[1, min(m, n)]``, or a head
        whose logits are not ``(k, C)`` with at least two classes.
    """
    f = _as_float64(features, name="features")
    w = _as_float64(weight, name="weight")
    b = _as_float64(bias, name="bias")
    observed = _as_float64(observed_weight_grad, name="observed_weight_grad")
    if w.dim() != 2:
        raise ValueError(f"weight must be (m, n), got shape {tuple(w.shape)}")
    m, n = w.shape
    if f.dim() != 2 or f.shape[1] != n or f.shape[0] < 1:
        raise ValueError(f"features must be (k, {n}) with k >= 1 to match weight, got shape {tuple(f.shape)}")
    if b.shape != (m,):
        raise ValueError(f"bias must have shape ({m},) to match weight, got {tuple(b.shape)}")
    if observed.shape != (m, n):
        raise ValueError(
            f"observed_weight_grad must have weight's shape ({m}, {n}), got {tuple(observed.shape)}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= min(m, n):
        raise ValueError(f"batch_size must be an integer in [1, {min(m, n)}], got {batch_size!r}")
    outputs = (f @ w.T + b).requires_grad_(True)
    logits = head(outputs)
    if logits.dim() != 2 or logits.shape[0] != f.shape[0] or logits.shape[1] < 2:
        raise ValueError(
            f"head must map ({f.shape[0]}, {m}) outputs to ({f.shape[0]}, C >= 2) logits, got "
            f"shape {tuple(logits.shape)}"
        )
    classes = int(logits.shape[1])
    # With one label per sample, the per-sample gradient of CE is linear in the one-hot target:
    # dL/dlogits = softmax - onehot(c), so one backward per class gives every candidate.
    probabilities = torch.softmax(logits.detach(), dim=1)
    candidates = []
    for label in range(classes):
        upstream = probabilities - F.one_hot(torch.full((f.shape[0],), label), classes).to(torch.float64)
        (grad,) = torch.autograd.grad(logits, outputs, grad_outputs=upstream, retain_graph=True)
        candidates.append(grad)
    stacked = torch.stack(candidates, dim=1)  # (k, C, m)
    basis = torch.linalg.svd(observed, full_matrices=False)[0][:, :batch_size]  # (m, B)
    norms = stacked.norm(dim=2)
    outside = (stacked - (stacked @ basis) @ basis.T).norm(dim=2)
    distance = torch.where(norms > 0, outside / norms.clamp_min(1e-300), torch.zeros_like(norms))
    ranked = distance.sort(dim=1)
    labels = ranked.indices[:, 0]
    chosen = stacked[torch.arange(f.shape[0]), labels]
    return HeadGradients(
        labels=labels,
        output_grads=chosen,
        feature_grads=chosen @ w,
        residuals=ranked.values[:, 0],
        runner_up=ranked.values[:, 1],
    )
