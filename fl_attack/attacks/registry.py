"""The attacks by name: one registry for the plugin, the experiments and the library."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ArrayLike


@runtime_checkable
class LayerAttack(Protocol):
    """An attack on one linear layer's update, as the honest-but-curious server runs it.

    The attacker observes the update of the layer's weight and bias and the parameters at
    which it was taken, and nothing else; it returns the layer's inputs.
    """

    def invert(
        self,
        weight_grad: ArrayLike,
        bias_grad: ArrayLike,
        *,
        weight: ArrayLike,
        bias: ArrayLike,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Recover the batch of inputs behind one observed update."""
        ...


_ATTACKS: dict[str, Callable[..., LayerAttack]] = {}


def register_attack(name: str, factory: Callable[..., LayerAttack]) -> None:
    """Make ``factory`` available as ``get_attack(name)``.

    Raises
    ------
    ValueError
        If ``name`` is already registered.
    """
    if name in _ATTACKS:
        raise ValueError(f"an attack named {name!r} is already registered")
    _ATTACKS[name] = factory


def available_attacks() -> tuple[str, ...]:
    """Names of the registered layer attacks, sorted."""
    return tuple(sorted(_ATTACKS))


def get_attack(name: str, **options: Any) -> LayerAttack:
    """Build the attack registered as ``name`` with keyword ``options``.

    Raises
    ------
    ValueError
        If no attack has that name (the message lists the registered names).
    """
    try:
        factory = _ATTACKS[name]
    except KeyError:
        raise ValueError(f"unknown attack {name!r}; available: {', '.join(available_attacks())}") from None
    return factory(**options)
