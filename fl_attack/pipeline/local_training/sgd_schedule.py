"""How a client's local SGD steps combine into the update the server sees.

A client trains ``T`` steps of ``torch.optim.SGD`` (momentum ``mu``, weight decay ``wd``, no
dampening or Nesterov) from ``W_0`` and sends ``W_T - W_0``. Writing ``G_s`` for the loss
gradient of step ``s``, every weight on the way is, exactly,

``W_t = a_t W_0 + sum_{s < t} e_{t,s} lr G_s``,

with scalars that depend only on ``mu`` and ``lr * wd`` (not on the data): the recursion of
the optimizer is linear, and weight decay only feeds ``W_t`` back into it. So the update is
``(a_T - 1) W_0`` (a known matrix times one scalar) plus ``sum_s e_{T,s} lr G_s`` (the samples'
rank-``N`` part), and the weights at which step ``t`` took its gradient are ``a_t W_0`` plus the
earlier steps' final contributions each scaled by ``e_{t,s} / e_{T,s}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SgdSchedule", "decay_for_scale", "sgd_schedule"]


@dataclass(frozen=True)
class SgdSchedule:
    """The scalars of ``T`` SGD steps.

    Attributes
    ----------
    start_scale
        ``(T + 1,)``: ``a_t``, the factor of ``W_0`` in ``W_t`` (1 without weight decay).
    share
        ``(T + 1, T)``: ``e_{t,s} / e_{T,s}``, the fraction of step ``s``'s final contribution
        already in ``W_t`` (0 for ``s >= t``; row ``T`` is all ones).
    """

    start_scale: torch.Tensor
    share: torch.Tensor

    @property
    def steps(self) -> int:
        return int(self.share.shape[1])


def sgd_schedule(*, steps: int, momentum: float, decay: float) -> SgdSchedule:
    """The schedule of ``steps`` SGD steps with ``momentum`` and ``decay = lr * weight_decay``.

    Raises
    ------
    ValueError
        If ``steps < 1``, ``momentum`` is outside ``[0, 1)`` or ``decay`` outside ``[0, 1)``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"lr * weight_decay must be in [0, 1), got {decay}")
    dtype = torch.float64
    weight = torch.zeros(steps + 1, dtype=dtype)  # coefficients over (W_0, lr G_0, ..., lr G_{T-1})
    weight[0] = 1.0
    buffer = torch.zeros_like(weight)
    history = [weight.clone()]
    for t in range(steps):
        step = decay * weight
        step[1 + t] += 1.0
        buffer = step if t == 0 else momentum * buffer + step
        weight = weight - buffer
        history.append(weight.clone())
    table = torch.stack(history)  # (T + 1, T + 1)
    final = table[-1, 1:]
    return SgdSchedule(start_scale=table[:, 0].clone(), share=table[:, 1:] / final[None, :])


def decay_for_scale(scale: float, *, steps: int, momentum: float) -> float:
    """The ``lr * weight_decay`` whose ``steps`` steps shrink ``W_0`` by ``a_T - 1 = scale``.

    ``a_T`` falls monotonically with the decay, so it is found by bisection; 0 when
    ``scale >= 0`` (no shrinkage).
    """
    if scale >= 0.0:
        return 0.0
    low, high = 0.0, 0.5
    for _ in range(80):
        middle = 0.5 * (low + high)
        shrink = float(sgd_schedule(steps=steps, momentum=momentum, decay=middle).start_scale[-1]) - 1.0
        if shrink > scale:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)
