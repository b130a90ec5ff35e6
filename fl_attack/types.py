"""What the honest-but-curious server observes, validated and converted for the attack."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fl_attack.validation import resolve_device

ArrayLike = np.ndarray | torch.Tensor

__all__ = ["ArrayLike", "ObservedUpdate", "as_float64", "resolve_device"]


def _unit_roundoff(*values: ArrayLike) -> float:
    """``eps`` of the precision the arrays were computed in: that of the narrowest float dtype
    among them, and float32's when float64 arrays hold only float32 values (an update that a
    server differenced in float64 from a float32 model)."""
    eps = torch.finfo(torch.float64).eps
    for value in values:
        tensor = torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else value
        if not tensor.is_floating_point():
            continue
        if tensor.dtype == torch.float64:
            tensor = tensor.detach()
            finite = torch.isfinite(tensor)
            # no boolean-mask copy of the finite entries (a full copy, and a host sync on a GPU)
            if bool(finite.any()) and bool(((tensor.float().double() == tensor) | ~finite).all()):
                eps = max(eps, torch.finfo(torch.float32).eps)
        else:
            eps = max(eps, torch.finfo(tensor.dtype).eps)
    return float(eps)


def as_float64(value: ArrayLike, *, name: str, device: torch.device) -> torch.Tensor:
    """``value`` as a float64 tensor on ``device``.

    Raises
    ------
    TypeError
        If it is not a real numpy array or torch tensor.
    ValueError
        If it holds NaN or Inf entries (naming ``name`` and how many).
    """
    if isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.floating) and not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
        tensor = value.detach()
    else:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")
    tensor = tensor.to(device=device, dtype=torch.float64)
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{name} contains {bad} NaN or Inf entries")
    return tensor


@dataclass(frozen=True)
class ObservedUpdate:
    """A first linear layer's update and parameters, as the server sees them.

    ``weight_grad`` may be the gradient itself or any update proportional to it
    (``W_new - W_old`` after a FedSGD step): the attack is invariant to sign and scale.

    Attributes
    ----------
    weight_grad, bias_grad
        ``(m, n)`` and ``(m,)`` float64 tensors on the attack device.
    weight, bias
        ``(m, n)`` and ``(m,)`` float64 layer parameters at which the update was computed.
    unit_roundoff
        ``eps`` of the precision the update and weights were computed in (float32's for
        float64 arrays holding float32 values), for the rounding floor of the spectrum.
    """

    weight_grad: torch.Tensor
    bias_grad: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    unit_roundoff: float = float(torch.finfo(torch.float64).eps)

    @property
    def width(self) -> int:
        """``m``: the number of neurons of the attacked layer."""
        return int(self.weight_grad.shape[0])

    @property
    def input_dim(self) -> int:
        """``n``: the dimension of one layer input."""
        return int(self.weight_grad.shape[1])

    @classmethod
    def from_arrays(
        cls,
        weight_grad: ArrayLike,
        bias_grad: ArrayLike,
        *,
        weight: ArrayLike,
        bias: ArrayLike,
        device: torch.device,
    ) -> ObservedUpdate:
        """Validate shapes and values and convert everything to float64 on ``device``.

        Raises
        ------
        ValueError
            On wrong shapes, mismatched ``m``/``n``, NaN/Inf, or an all-zero gradient.
        TypeError
            On inputs that are not real-valued arrays or tensors.
        """
        weight_grad_t = as_float64(weight_grad, name="weight_grad", device=device)
        bias_grad_t = as_float64(bias_grad, name="bias_grad", device=device)
        weight_t = as_float64(weight, name="weight", device=device)
        bias_t = as_float64(bias, name="bias", device=device)
        if weight_grad_t.ndim != 2:
            raise ValueError(
                f"weight_grad must be a 2-D (m, n) matrix, got shape {tuple(weight_grad_t.shape)}"
            )
        m, n = weight_grad_t.shape
        if bias_grad_t.shape != (m,):
            raise ValueError(
                f"bias_grad must have shape (m,) = ({m},) to match weight_grad {tuple(weight_grad_t.shape)}, "
                f"got {tuple(bias_grad_t.shape)}"
            )
        if weight_t.shape != (m, n):
            raise ValueError(
                f"weight must have the shape of weight_grad ({m}, {n}), got {tuple(weight_t.shape)}"
            )
        if bias_t.shape != (m,):
            raise ValueError(f"bias must have shape ({m},), got {tuple(bias_t.shape)}")
        if m < 2 or n < 1:
            raise ValueError(f"the layer is too small to attack: m={m}, n={n}")
        if not torch.any(weight_grad_t != 0):
            raise ValueError("weight_grad is all zeros: the client sent no information about its batch")
        if not torch.any(bias_grad_t != 0):
            raise ValueError(
                "bias_grad is all zeros: the scale of the recovered inputs cannot be fixed (SPEAR Thm. 3.5)"
            )
        return cls(weight_grad_t, bias_grad_t, weight_t, bias_t, _unit_roundoff(weight_grad, weight))
