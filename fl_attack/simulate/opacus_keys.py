"""The ``_module.`` prefix Opacus adds to ``state_dict`` keys, and how to strip it.

Opacus' ``GradSampleModule`` wraps a model, so a DP-SGD client's arrays are named
``_module.1.weight`` where the plain model has ``1.weight`` (nested wrappers repeat the
prefix). Both the clients (which send the unwrapped names) and the server (which accepts
either) strip it with :func:`canonical_key`.
"""

from __future__ import annotations

__all__ = ["OPACUS_PREFIX", "canonical_key"]

#: Prefix Opacus' ``GradSampleModule`` adds to every ``state_dict`` key.
OPACUS_PREFIX = "_module."


def canonical_key(key: str) -> str:
    """Strip any leading ``_module.`` prefixes added by Opacus wrappers.

    Parameters
    ----------
    key : str
        A ``state_dict`` key, e.g. ``"_module._module.1.weight"``.

    Returns
    -------
    str
        The key of the unwrapped model, e.g. ``"1.weight"``; keys without the prefix are
        returned unchanged.
    """
    while key.startswith(OPACUS_PREFIX):
        key = key[len(OPACUS_PREFIX) :]
    return key
