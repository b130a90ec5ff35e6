"""Locate the attacked linear layer in an ArrayRecord and compute its update."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flwr.app import ArrayRecord

#: Prefix Opacus' ``GradSampleModule`` adds to every ``state_dict`` key.
OPACUS_PREFIX = "_module."


class LayerNotFoundError(ValueError):
    """The requested layer is not among the model's arrays."""


def canonical_key(key: str) -> str:
    """Strip any leading ``_module.`` prefixes added by Opacus wrappers."""
    while key.startswith(OPACUS_PREFIX):
        key = key[len(OPACUS_PREFIX) :]
    return key


def canonical_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The record's arrays as numpy, keyed by :func:`canonical_key`, in record order.

    Raises
    ------
    ValueError
        If two keys collide once their ``_module.`` prefixes are stripped.
    """
    arrays: dict[str, np.ndarray] = {}
    for key, array in record.items():
        name = canonical_key(key)
        if name in arrays:
            raise ValueError(f"keys {key!r} and {name!r} collide once '{OPACUS_PREFIX}' is stripped")
        arrays[name] = array.numpy()
    return arrays


@dataclass(frozen=True)
class LayerKeys:
    """Canonical (prefix-free) names of the attacked layer's weight and bias.

    Attributes
    ----------
    weight : str
        Key of the ``(m, n)`` weight matrix, e.g. ``"1.weight"``.
    bias : str
        Key of the ``(m,)`` bias vector, e.g. ``"1.bias"``.
    """

    weight: str
    bias: str


@dataclass(frozen=True)
class LayerUpdate:
    """What the server observes about one client's attacked layer.

    Attributes
    ----------
    weight_delta : numpy.ndarray
        ``(m, n)`` float64 ``W_client - W_global``.
    bias_delta : numpy.ndarray
        ``(m,)`` float64 ``b_client - b_global``.
    weight : numpy.ndarray
        ``(m, n)`` float64 global weight the client started from.
    bias : numpy.ndarray
        ``(m,)`` float64 global bias the client started from.
    """

    weight_delta: np.ndarray
    bias_delta: np.ndarray
    weight: np.ndarray
    bias: np.ndarray


def _default_bias_key(weight_key: str) -> str:
    if weight_key.endswith("weight"):
        return weight_key[: -len("weight")] + "bias"
    return weight_key + ".bias"


def _describe(arrays: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{key} {tuple(value.shape)}" for key, value in arrays.items()) or "(none)"


def select_layer(
    arrays: ArrayRecord,
    *,
    weight_key: str | None = None,
    bias_key: str | None = None,
) -> LayerKeys:
    """Choose the linear layer to attack.

    Parameters
    ----------
    arrays : ArrayRecord
        The model's arrays (keys may carry Opacus' ``_module.`` prefix).
    weight_key : str or None (default: None)
        Name of the weight entry. None picks the first 2-D array whose bias (same
        prefix, ``bias`` instead of ``weight``, shape ``(m,)``) comes right after it.
    bias_key : str or None (default: None)
        Name of the bias entry; None derives it from ``weight_key``.

    Returns
    -------
    LayerKeys
        Canonical keys (without ``_module.``).

    Raises
    ------
    LayerNotFoundError
        If the named entries do not exist or have the wrong shapes, or if no entry
        qualifies; the message lists the available keys and shapes.
    """
    named = canonical_arrays(arrays)
    if weight_key:
        weight = canonical_key(weight_key)
        bias = canonical_key(bias_key) if bias_key else _default_bias_key(weight)
        missing = [key for key in (weight, bias) if key not in named]
        if missing:
            raise LayerNotFoundError(
                f"attacked layer entries {missing} not found in the model; "
                f"available keys: {_describe(named)}"
            )
        weight_shape, bias_shape = named[weight].shape, named[bias].shape
        if len(weight_shape) != 2 or bias_shape != (weight_shape[0],):
            raise LayerNotFoundError(
                f"{weight!r} {weight_shape} and {bias!r} {bias_shape} are not a linear "
                f"layer's (m, n) weight and (m,) bias; available keys: {_describe(named)}"
            )
        return LayerKeys(weight=weight, bias=bias)
    if bias_key:
        raise LayerNotFoundError("a bias key was given without its weight key")
    keys = list(named)
    for position, key in enumerate(keys[:-1]):
        following = keys[position + 1]
        shape = named[key].shape
        if (
            len(shape) == 2
            and following == _default_bias_key(key)
            and named[following].shape == (shape[0],)
        ):
            return LayerKeys(weight=key, bias=following)
    raise LayerNotFoundError(
        "no linear layer (a 2-D weight followed by its 1-D bias) found in the model; "
        f"available keys: {_describe(named)}"
    )


def layer_parameters(arrays: ArrayRecord, layer: LayerKeys) -> tuple[np.ndarray, np.ndarray]:
    """The layer's weight and bias from ``arrays`` as float64 copies."""
    named = canonical_arrays(arrays)
    missing = [key for key in (layer.weight, layer.bias) if key not in named]
    if missing:
        raise LayerNotFoundError(
            f"attacked layer entries {missing} not found; available keys: {_describe(named)}"
        )
    return (
        np.array(named[layer.weight], dtype=np.float64, copy=True),
        np.array(named[layer.bias], dtype=np.float64, copy=True),
    )


def layer_update(
    reply_arrays: ArrayRecord,
    *,
    layer: LayerKeys,
    weight: np.ndarray,
    bias: np.ndarray,
) -> LayerUpdate:
    """Difference between a client's layer and the global layer it started from.

    The subtraction is done in float64, where the difference of two float32 values
    is exact, so no precision is lost beyond what the client's own arithmetic did.

    Parameters
    ----------
    reply_arrays : ArrayRecord
        The arrays a client sent back (``_module.`` prefixes allowed).
    layer : LayerKeys
        The attacked layer.
    weight, bias : numpy.ndarray
        Global layer parameters sent to the client in this round.

    Returns
    -------
    LayerUpdate
    """
    new_weight, new_bias = layer_parameters(reply_arrays, layer)
    if new_weight.shape != weight.shape or new_bias.shape != bias.shape:
        raise ValueError(
            f"client layer shapes {new_weight.shape}/{new_bias.shape} differ from the global "
            f"{weight.shape}/{bias.shape}"
        )
    return LayerUpdate(
        weight_delta=new_weight - weight,
        bias_delta=new_bias - bias,
        weight=weight,
        bias=bias,
    )
