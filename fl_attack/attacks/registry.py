"""The attacks by name: one registry for the plugin, the experiments and the library."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fl_attack.types import LayerAttack

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
