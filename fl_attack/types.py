"""What the honest-but-curious server observes, and the attack it runs on it.

:class:`LayerUpdate` is one layer's update as observed (numpy arrays or torch tensors, not yet
validated); :class:`ObservedUpdate` is the same update validated and converted to float64 for
the attack; :class:`LayerAttack` is what every attack on one layer's update provides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.local_training.known import KnownTraining
from fl_attack.reconstruction import Reconstruction
from fl_attack.validation import resolve_device

ArrayLike = np.ndarray | torch.Tensor
#: The array type of a :class:`LayerUpdate`: numpy arrays in the audit, either in ``invert``.
ArrayT = TypeVar("ArrayT", bound=ArrayLike, covariant=True)

#: The optional parts of a :class:`LayerUpdate` an attack may use (:attr:`LayerAttack.uses`).
OPTIONAL_PARTS = frozenset(
    {"head_weight", "next_weight_update", "local_steps", "noise_level", "local_training"}
)

__all__ = [
    "OPTIONAL_PARTS",
    "ArrayLike",
    "LayerAttack",
    "LayerUpdate",
    "ObservedUpdate",
    "as_float64",
    "resolve_device",
]


@dataclass(frozen=True)
class LayerUpdate(Generic[ArrayT]):
    """One linear layer's update and the global layer it started from, as the server observes them.

    Nothing here is validated yet (:meth:`ObservedUpdate.from_update` does that for the attack).
    The update may be the gradient itself or any update proportional to it (``W_new - W_old``
    after a FedSGD step): the exact attacks are invariant to sign and scale.

    Attributes
    ----------
    weight_update, bias_update
        The layer's ``(m, n)`` weight and ``(m,)`` bias update.
    weight, bias
        The ``(m, n)`` and ``(m,)`` global parameters at which the update was taken.
    head_weight
        The global ``(c, m)`` weight of the output layer when it directly follows the layer
        (fed by its ReLU, the model's last weight), else None.
    next_weight_update
        The ``(k, m)`` update of the linear layer that directly follows, from the same step, else None.
    after_layers
        Whether layers precede the attacked one: its inputs are ReLU features, and the next-layer
        route may follow the attack (:mod:`fl_attack.audit.next_layer_stage`).
    local_steps
        Full-batch local SGD steps behind the update when known (FedAvg; 1 for FedSGD), else None.
    noise_level
        Known relative noise ``s_{b+1}/s_b`` of the update (e.g. DP noise), else None.
    local_training
        The client's local training as its server configured it (mini-batch size, momentum,
        weight decay, learning rate, epochs; :class:`fl_attack.pipeline.local_training.known.KnownTraining`),
        else None.
    """

    weight_update: ArrayT
    bias_update: ArrayT
    weight: ArrayT
    bias: ArrayT
    head_weight: ArrayT | None = None
    next_weight_update: ArrayT | None = None
    after_layers: bool = False
    local_steps: int | None = None
    noise_level: float | None = None
    local_training: KnownTraining | None = None

    def __add__(self: LayerUpdate[np.ndarray], other: LayerUpdate[np.ndarray]) -> LayerUpdate[np.ndarray]:
        """The sum of two clients' updates of the same global layer (secure aggregation); the sum's
        ``local_steps``, ``noise_level`` and ``local_training`` are not known (None)."""
        return LayerUpdate(
            weight_update=self.weight_update + other.weight_update,
            bias_update=self.bias_update + other.bias_update,
            weight=self.weight,
            bias=self.bias,
            head_weight=self.head_weight,
            next_weight_update=None
            if self.next_weight_update is None or other.next_weight_update is None
            else self.next_weight_update + other.next_weight_update,
            after_layers=self.after_layers,
        )


@runtime_checkable
class LayerAttack(Protocol):
    """An attack on one linear layer's update, as the honest-but-curious server runs it.

    It observes the layer's update and the parameters at which it was taken, and of the
    update's optional parts (:data:`OPTIONAL_PARTS`) only those it declares in :attr:`uses`:
    the audit hands it an update with the others left out. It returns the layer's inputs.
    """

    #: The optional fields of :class:`LayerUpdate` the attack reads (a subset of :data:`OPTIONAL_PARTS`).
    uses: ClassVar[frozenset[str]]

    def attack(
        self,
        update: LayerUpdate[ArrayLike],
        /,
        *,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Recover the batch of inputs behind ``update`` (``batch_size``: None estimates it;
        ``budget``: the attack's time budget, already started, None for one the attack starts
        from its own seconds)."""
        ...


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
    """A first linear layer's update and parameters, validated: :class:`LayerUpdate`'s float64 form.

    ``weight_update`` may be the gradient itself or any update proportional to it
    (``W_new - W_old`` after a FedSGD step): the attack is invariant to sign and scale.

    Attributes
    ----------
    weight_update, bias_update
        ``(m, n)`` and ``(m,)`` float64 tensors on the attack device.
    weight, bias
        ``(m, n)`` and ``(m,)`` float64 layer parameters at which the update was computed.
    unit_roundoff
        ``eps`` of the precision the update and weights were computed in (float32's for
        float64 arrays holding float32 values), for the rounding floor of the spectrum.
    """

    weight_update: torch.Tensor
    bias_update: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    unit_roundoff: float = float(torch.finfo(torch.float64).eps)

    @property
    def width(self) -> int:
        """``m``: the number of neurons of the attacked layer."""
        return int(self.weight_update.shape[0])

    @property
    def input_dim(self) -> int:
        """``n``: the dimension of one layer input."""
        return int(self.weight_update.shape[1])

    @classmethod
    def from_arrays(
        cls,
        weight_update: ArrayLike,
        bias_update: ArrayLike,
        *,
        weight: ArrayLike,
        bias: ArrayLike,
        device: torch.device,
    ) -> ObservedUpdate:
        """:meth:`from_update` of the update made of these arrays."""
        return cls.from_update(
            LayerUpdate(weight_update, bias_update, weight=weight, bias=bias), device=device
        )

    @classmethod
    def from_update(cls, update: LayerUpdate[ArrayLike], *, device: torch.device) -> ObservedUpdate:
        """Validate the update's shapes and values and convert them to float64 on ``device``.

        The messages name the update and its layer as :meth:`fl_attack.SpearPlusPlus.invert`'s
        arguments do (``weight_grad``, ``bias_grad``, ``weight``, ``bias``).

        Raises
        ------
        ValueError
            On wrong shapes, mismatched ``m``/``n``, NaN/Inf, or an all-zero gradient.
        TypeError
            On inputs that are not real-valued arrays or tensors.
        """
        weight_update = as_float64(update.weight_update, name="weight_grad", device=device)
        bias_update = as_float64(update.bias_update, name="bias_grad", device=device)
        weight = as_float64(update.weight, name="weight", device=device)
        bias = as_float64(update.bias, name="bias", device=device)
        if weight_update.ndim != 2:
            raise ValueError(
                f"weight_grad must be a 2-D (m, n) matrix, got shape {tuple(weight_update.shape)}"
            )
        m, n = weight_update.shape
        if bias_update.shape != (m,):
            raise ValueError(
                f"bias_grad must have shape (m,) = ({m},) to match weight_grad {tuple(weight_update.shape)}, "
                f"got {tuple(bias_update.shape)}"
            )
        if weight.shape != (m, n):
            raise ValueError(
                f"weight must have the shape of weight_grad ({m}, {n}), got {tuple(weight.shape)}"
            )
        if bias.shape != (m,):
            raise ValueError(f"bias must have shape ({m},), got {tuple(bias.shape)}")
        if m < 2 or n < 1:
            raise ValueError(f"the layer is too small to attack: m={m}, n={n}")
        if not torch.any(weight_update != 0):
            raise ValueError("weight_grad is all zeros: the client sent no information about its batch")
        if not torch.any(bias_update != 0):
            raise ValueError(
                "bias_grad is all zeros: the scale of the recovered inputs cannot be fixed (SPEAR Thm. 3.5)"
            )
        roundoff = _unit_roundoff(update.weight_update, update.weight)
        return cls(weight_update, bias_update, weight, bias, roundoff)
