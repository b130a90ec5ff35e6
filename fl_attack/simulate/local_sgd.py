"""Plain SGD steps on a client's model: the one update loop of FedSGD and FedAvg.

Both the victim updates (:func:`fl_attack.simulate.victims.fedavg_update`) and the Flower
client's training (:func:`fl_attack.simulate.training.train_fedavg`) step through this loop;
they differ only in how they choose the mini-batches, which the caller passes in.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .gradients import LOSSES, LossFn

__all__ = ["sgd_steps"]


def sgd_steps(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batches: Iterable[torch.Tensor],
    lr: float,
    loss_fn: LossFn = LOSSES["ce"],
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> list[float]:
    """Train ``model`` in place with one SGD step per mini-batch.

    Each step takes the gradient ``g`` of ``loss_fn`` (default: mean cross-entropy) on
    ``inputs[batch]`` and ``labels[batch]``, adds ``weight_decay * param``, keeps the momentum
    buffer ``buf = momentum * buf + g`` (``buf = g`` at the first step) and moves every
    trainable parameter by ``-lr * buf``: the same update as
    ``torch.optim.SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)`` (no dampening, no
    Nesterov), including that a parameter the loss does not reach is left alone, but without
    building an optimizer (whose construction alone costs seconds on first use, as it imports
    ``torch._dynamo``). The model's train/eval mode is left as it is.

    Parameters
    ----------
    model
        The model to train; its parameters change in place, its ``.grad`` are not touched.
    inputs, labels
        All samples the batches index into, ``(N, ...)`` and ``(N,)``.
    batches
        Index tensors into ``inputs``, one per step, in order.
    lr
        Learning rate.
    loss_fn
        ``(logits, labels) -> scalar`` loss.
    momentum
        Momentum factor in ``[0, 1)``; 0 is plain SGD.
    weight_decay
        L2 penalty ``>= 0`` added to every parameter's gradient.

    Returns
    -------
    list[float]
        The loss of every step, taken before that step's update.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    params = [param for param in model.parameters() if param.requires_grad]
    buffers: list[torch.Tensor | None] = [None] * len(params)
    losses: list[float] = []
    with torch.enable_grad():
        for batch in batches:
            value = loss_fn(model(inputs[batch]), labels[batch])
            grads = torch.autograd.grad(value, params, allow_unused=True)
            with torch.no_grad():
                for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
                    if grad is None:
                        continue
                    step = grad.add(param, alpha=weight_decay) if weight_decay else grad
                    if momentum:
                        previous = buffers[index]
                        step = step.clone() if previous is None else previous.mul_(momentum).add_(step)
                        buffers[index] = step
                    param.add_(step, alpha=-lr)
            losses.append(float(value.detach()))
    return losses
