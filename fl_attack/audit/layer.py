"""Locate the attacked linear layer among a model's named arrays and compute its update.

The arrays are plain numpy (a Flower ``ArrayRecord`` is converted by the strategy), so the
same code serves any framework. Keys may carry Opacus' ``_module.`` prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fl_attack.simulate.opacus_keys import OPACUS_PREFIX as OPACUS_PREFIX
from fl_attack.simulate.opacus_keys import canonical_key as canonical_key
from fl_attack.vocabulary import INPUT_SPACE_FEATURES, INPUT_SPACE_INPUTS

#: Named arrays of a model, in the model's order.
NamedArrays = Mapping[str, np.ndarray]


class LayerNotFoundError(ValueError):
    """The requested layer is not among the model's arrays."""


def canonical_arrays(arrays: NamedArrays) -> dict[str, np.ndarray]:
    """The arrays keyed by :func:`canonical_key`, in their order.

    Raises
    ------
    ValueError
        If two keys collide once their ``_module.`` prefixes are stripped.
    """
    named: dict[str, np.ndarray] = {}
    for key, array in arrays.items():
        name = canonical_key(key)
        if name in named:
            raise ValueError(f"keys {key!r} and {name!r} collide once '{OPACUS_PREFIX}' is stripped")
        named[name] = np.asarray(array)
    return named


@dataclass(frozen=True)
class LayerKeys:
    """Canonical (prefix-free) names of the attacked layer's weight and bias, and its place.

    Attributes
    ----------
    weight : str
        Key of the ``(m, n)`` weight matrix, e.g. ``"1.weight"``.
    bias : str
        Key of the ``(m,)`` bias vector, e.g. ``"1.bias"``.
    preceding : tuple[str, ...]
        Keys of the parameterised arrays that come before the layer in the model (empty
        when the layer is the model's first, so its inputs are the client's data).
    """

    weight: str
    bias: str
    preceding: tuple[str, ...] = ()

    @property
    def input_space(self) -> str:
        """``"inputs"`` for the model's first layer, ``"features"`` when layers precede it."""
        return INPUT_SPACE_FEATURES if self.preceding else INPUT_SPACE_INPUTS


def _default_bias_key(weight_key: str) -> str:
    if weight_key.endswith("weight"):
        return weight_key[: -len("weight")] + "bias"
    return weight_key + ".bias"


def _describe(arrays: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{key} {tuple(value.shape)}" for key, value in arrays.items()) or "(none)"


def _preceding(keys: list[str], weight: str, named: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """Parameter arrays (at least 1-D, not buffers such as counters) before ``weight``."""
    before = keys[: keys.index(weight)]
    return tuple(key for key in before if named[key].ndim >= 2)


def select_layer(
    arrays: NamedArrays,
    *,
    weight_key: str | None = None,
    bias_key: str | None = None,
) -> LayerKeys:
    """Choose the linear layer to attack.

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray]
        The model's arrays in model order (keys may carry Opacus' ``_module.`` prefix).
    weight_key : str or None (default: None)
        Name of the weight entry. None picks the first 2-D array whose bias (same
        prefix, ``bias`` instead of ``weight``, shape ``(m,)``) comes right after it.
    bias_key : str or None (default: None)
        Name of the bias entry; None derives it from ``weight_key``.

    Returns
    -------
    LayerKeys
        Canonical keys (without ``_module.``) and the layers that precede it.

    Raises
    ------
    LayerNotFoundError
        If the named entries do not exist or have the wrong shapes, or if no entry
        qualifies; the message lists the available keys and shapes.
    """
    named = canonical_arrays(arrays)
    keys = list(named)
    if weight_key:
        weight = canonical_key(weight_key)
        bias = canonical_key(bias_key) if bias_key else _default_bias_key(weight)
        missing = [key for key in (weight, bias) if key not in named]
        if missing:
            raise LayerNotFoundError(
                f"attacked layer entries {missing} not found in the model; available keys: {_describe(named)}"
            )
        weight_shape, bias_shape = named[weight].shape, named[bias].shape
        if len(weight_shape) != 2 or bias_shape != (weight_shape[0],):
            raise LayerNotFoundError(
                f"{weight!r} {weight_shape} and {bias!r} {bias_shape} are not a linear "
                f"layer's (m, n) weight and (m,) bias; available keys: {_describe(named)}"
            )
        return LayerKeys(weight=weight, bias=bias, preceding=_preceding(keys, weight, named))
    if bias_key:
        raise LayerNotFoundError("a bias key was given without its weight key")
    for position, key in enumerate(keys[:-1]):
        following = keys[position + 1]
        shape = named[key].shape
        if len(shape) == 2 and following == _default_bias_key(key) and named[following].shape == (shape[0],):
            return LayerKeys(weight=key, bias=following, preceding=_preceding(keys, key, named))
    raise LayerNotFoundError(
        "no linear layer (a 2-D weight followed by its 1-D bias) found in the model; "
        f"available keys: {_describe(named)}"
    )


def layer_parameters(arrays: NamedArrays, layer: LayerKeys) -> tuple[np.ndarray, np.ndarray]:
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


@dataclass(frozen=True)
class LayerDelta:
    """A client's change of the attacked layer and the global layer it started from (float64 numpy).

    This is what the server observes before any validation; :meth:`observed` turns it into
    the attack's :class:`fl_attack.types.ObservedUpdate`.
    """

    weight_delta: np.ndarray
    bias_delta: np.ndarray
    weight: np.ndarray
    bias: np.ndarray

    def __add__(self, other: LayerDelta) -> LayerDelta:
        """The sum of two clients' changes of the same global layer (secure aggregation)."""
        return LayerDelta(
            weight_delta=self.weight_delta + other.weight_delta,
            bias_delta=self.bias_delta + other.bias_delta,
            weight=self.weight,
            bias=self.bias,
        )


def layer_delta(
    reply_arrays: NamedArrays,
    *,
    layer: LayerKeys,
    weight: np.ndarray,
    bias: np.ndarray,
) -> LayerDelta:
    """Difference between a client's layer and the global layer it started from.

    The subtraction is done in float64, where the difference of two float32 values is
    exact, so no precision is lost beyond what the client's own arithmetic did.

    Raises
    ------
    LayerNotFoundError
        If the reply lacks the layer.
    ValueError
        If the reply's layer has another shape than the global one.
    """
    new_weight, new_bias = layer_parameters(reply_arrays, layer)
    if new_weight.shape != weight.shape or new_bias.shape != bias.shape:
        raise ValueError(
            f"client layer shapes {new_weight.shape}/{new_bias.shape} differ from the global "
            f"{weight.shape}/{bias.shape}"
        )
    return LayerDelta(weight_delta=new_weight - weight, bias_delta=new_bias - bias, weight=weight, bias=bias)
