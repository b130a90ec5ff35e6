"""Locate the attacked linear layer among a model's named arrays and compute its update.

The arrays are plain numpy (a Flower ``ArrayRecord`` is converted by the strategy), so the
same code serves any framework. Keys may carry Opacus' ``_module.`` prefix.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fl_attack.simulate.opacus_keys import OPACUS_PREFIX as OPACUS_PREFIX
from fl_attack.simulate.opacus_keys import canonical_key as canonical_key
from fl_attack.types import LayerUpdate
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
    head : str or None
        Key of the output layer's ``(c, m)`` weight when it directly follows the layer (the
        next array after the layer's bias, ``c >= 1`` outputs, and the model's last weight:
        a one-hidden-layer model); None otherwise. Its global value guides the exact attack
        (:attr:`fl_attack.LayerUpdate.head_weight`).
    following : str or None
        Key of the next linear layer's ``(k, m)`` weight when it directly follows the layer
        (the next array after the layer's bias); None otherwise. Its update lets the exact attack
        certify samples (:attr:`fl_attack.LayerUpdate.next_weight_update`) and, when
        layers precede the layer, the audit run the next-layer route
        (:mod:`fl_attack.audit.next_layer_stage`), which needs inputs with exact zeros (ReLU
        features), not a model's raw inputs.
    """

    weight: str
    bias: str
    preceding: tuple[str, ...] = ()
    head: str | None = None
    following: str | None = None

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


def _head(keys: list[str], weight: str, bias: str, named: Mapping[str, np.ndarray]) -> str | None:
    """The output layer's weight if it directly follows the layer (see :attr:`LayerKeys.head`)."""
    rest = [key for key in keys[keys.index(weight) + 1 :] if key != bias]
    if not rest:
        return None
    shape, width = named[rest[0]].shape, named[weight].shape[0]
    if len(shape) != 2 or shape[1] != width:
        return None
    # a later weight means more layers follow: the next layer is not the output layer
    return rest[0] if all(named[key].ndim < 2 for key in rest[1:]) else None


def _following(keys: list[str], weight: str, bias: str, named: Mapping[str, np.ndarray]) -> str | None:
    """The next linear layer's weight if it directly follows the layer (see :attr:`LayerKeys.following`)."""
    rest = [key for key in keys[keys.index(weight) + 1 :] if key != bias]
    if not rest:
        return None
    shape = named[rest[0]].shape
    return rest[0] if len(shape) == 2 and shape[1] == named[weight].shape[0] else None


def _layer_keys(keys: list[str], weight: str, bias: str, named: Mapping[str, np.ndarray]) -> LayerKeys:
    return LayerKeys(
        weight=weight,
        bias=bias,
        preceding=_preceding(keys, weight, named),
        head=_head(keys, weight, bias, named),
        following=_following(keys, weight, bias, named),
    )


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
        Canonical keys (without ``_module.``), the layers that precede it and the output layer
        that directly follows it, if any.

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
        return _layer_keys(keys, weight, bias, named)
    if bias_key:
        raise LayerNotFoundError("a bias key was given without its weight key")
    for position, key in enumerate(keys[:-1]):
        following = keys[position + 1]
        shape = named[key].shape
        if len(shape) == 2 and following == _default_bias_key(key) and named[following].shape == (shape[0],):
            return _layer_keys(keys, key, following, named)
    raise LayerNotFoundError(
        "no linear layer (a 2-D weight followed by its 1-D bias) found in the model; "
        f"available keys: {_describe(named)}"
    )


def _canonical_keys(arrays: NamedArrays) -> dict[str, str]:
    """Canonical key -> the key in ``arrays``, without reading any array (a lazy mapping stays lazy)."""
    keys: dict[str, str] = {}
    for key in arrays:
        name = canonical_key(key)
        if name in keys:
            raise ValueError(f"keys {key!r} and {name!r} collide once '{OPACUS_PREFIX}' is stripped")
        keys[name] = key
    return keys


def layer_arrays(arrays: NamedArrays, layer: LayerKeys) -> tuple[np.ndarray, np.ndarray]:
    """The layer's weight and bias from ``arrays`` as they are (their dtype), reading no other array.

    An array that is a view into a larger buffer is copied, so that keeping the result never
    keeps that buffer (a view of an ``.npy`` payload, behind its header, is kept as it is).

    Raises
    ------
    LayerNotFoundError
        If ``arrays`` lack the layer.
    """
    keys = _canonical_keys(arrays)
    missing = [key for key in (layer.weight, layer.bias) if key not in keys]
    if missing:
        raise LayerNotFoundError(
            f"attacked layer entries {missing} not found; available keys: {_describe(canonical_arrays(arrays))}"
        )
    return _owned(arrays[keys[layer.weight]]), _owned(arrays[keys[layer.bias]])


#: Bytes an immutable ``bytes`` buffer may hold beyond the array kept from it: an ``.npy``
#: payload's header (a Flower reply's array read in place, 128 bytes as ``numpy.save`` writes it).
HEADER_BYTES = 4096


def _owned(values: np.ndarray) -> np.ndarray:
    """``values``, or a copy when it is a view into a larger buffer (a slice of a whole state dict);
    an ``.npy`` payload's ``bytes``, larger only by their header (:data:`HEADER_BYTES`), are kept."""
    array = np.asarray(values)
    root: object = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    try:
        size = root.nbytes if isinstance(root, np.ndarray) else memoryview(root).nbytes  # type: ignore[arg-type]
    except TypeError:  # a base without a buffer: its size is unknown
        return array.copy()
    header = HEADER_BYTES if isinstance(root, bytes) else 0
    return array if size <= array.nbytes + header else array.copy()


def layer_parameters(arrays: NamedArrays, layer: LayerKeys) -> tuple[np.ndarray, np.ndarray]:
    """The layer's weight and bias from ``arrays`` as float64 copies."""
    weight, bias = layer_arrays(arrays, layer)
    return np.array(weight, dtype=np.float64, copy=True), np.array(bias, dtype=np.float64, copy=True)


def global_parameters(
    arrays: NamedArrays, layer: LayerKeys
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The layer's weight and bias and the head's weight (None without a head), float64 copies.

    Raises
    ------
    LayerNotFoundError
        If ``arrays`` lack the layer or its head.
    """
    weight, bias = layer_parameters(arrays, layer)
    if layer.head is None:
        return weight, bias, None
    named = canonical_arrays(arrays)
    if layer.head not in named:
        raise LayerNotFoundError(f"head entry {layer.head!r} not found; available keys: {_describe(named)}")
    return weight, bias, np.array(named[layer.head], dtype=np.float64, copy=True)


def following_weight(arrays: NamedArrays, layer: LayerKeys) -> np.ndarray | None:
    """The global weight of the layer that directly follows (:attr:`LayerKeys.following`) as a
    float64 copy; None without one, or when ``arrays`` lack it."""
    keys = _canonical_keys(arrays)
    if layer.following is None or layer.following not in keys:
        return None
    return np.array(arrays[keys[layer.following]], dtype=np.float64, copy=True)


@dataclass(eq=False)
class SentLayer:
    """A client's attacked layer as it sent it, and the global layer of its round: an update not
    yet subtracted.

    A queued attack keeps this instead of a :class:`fl_attack.LayerUpdate`: the client's float32 arrays take
    half the memory of their float64 difference, and the global arrays are shared by all the
    round's updates. While it waits, its weight may move to a file (:meth:`spill`); :meth:`take`
    gives the exact :class:`fl_attack.LayerUpdate` of :func:`layer_delta` and removes that file.

    Attributes
    ----------
    weight, bias : numpy.ndarray
        The layer the client sent, in its dtype (float32 or float16); ``weight`` is a read-only
        memory map once spilled.
    global_weight, global_bias : numpy.ndarray
        The float64 global layer of the round.
    head_weight : numpy.ndarray or None
        The global head weight (:attr:`fl_attack.LayerUpdate.head_weight`).
    next_weight, global_next_weight : numpy.ndarray or None
        The following linear layer's weight as the client sent it, and its global value
        (:attr:`LayerKeys.following`; never spilled); None without one.
    after_layers : bool
        Whether layers precede the attacked one (:attr:`fl_attack.LayerUpdate.after_layers`).
    """

    weight: np.ndarray
    bias: np.ndarray
    global_weight: np.ndarray
    global_bias: np.ndarray
    head_weight: np.ndarray | None = None
    next_weight: np.ndarray | None = None
    global_next_weight: np.ndarray | None = None
    after_layers: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _file: Path | None = field(default=None, repr=False)
    _taken: bool = field(default=False, repr=False)

    def delta(self) -> LayerUpdate[np.ndarray]:
        """The float64 difference, bit for bit what :func:`layer_delta` returns for the same arrays."""
        return LayerUpdate(
            weight_update=np.asarray(self.weight, dtype=np.float64) - self.global_weight,
            bias_update=np.asarray(self.bias, dtype=np.float64) - self.global_bias,
            weight=self.global_weight,
            bias=self.global_bias,
            head_weight=self.head_weight,
            next_weight_update=None
            if self.next_weight is None or self.global_next_weight is None
            else np.asarray(self.next_weight, dtype=np.float64) - self.global_next_weight,
            after_layers=self.after_layers,
        )

    def spill(self, path: Path) -> bool:
        """Move the weight to a new file ``path`` (mode 0600), memory-mapped read-only.

        Returns
        -------
        bool
            False when nothing was written: the attack already took the update, or it is spilled.

        Raises
        ------
        OSError
            When the file cannot be written (the weight then stays in memory).
        """
        with self._lock:
            if self._taken or self._file is not None:
                return False
            weight = np.ascontiguousarray(self.weight)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(descriptor, "wb") as file:
                    weight.tofile(file)
                self.weight = np.memmap(path, dtype=weight.dtype, mode="r", shape=weight.shape)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            self._file = path
            return True

    def take(self) -> LayerUpdate[np.ndarray]:
        """The float64 update for the attack that starts now; the file, if any, is removed."""
        with self._lock:
            self._taken = True
            delta = self.delta()
            self._remove_file()
        return delta

    def discard(self) -> None:
        """Forget the update (its attack was dropped): remove its file, never spill it."""
        with self._lock:
            self._taken = True
            self._remove_file()

    def _remove_file(self) -> None:
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None


#: Dtypes whose difference of finite values is finite in float64: such an update is kept as sent.
SINGLE_PRECISION = (np.dtype(np.float32), np.dtype(np.float16))


def sent_layer(
    reply_arrays: NamedArrays,
    *,
    layer: LayerKeys,
    weight: np.ndarray,
    bias: np.ndarray,
    head_weight: np.ndarray | None = None,
    next_weight: np.ndarray | None = None,
) -> SentLayer:
    """A client's layer as it sent it, with the global layer it started from (nothing subtracted yet).

    ``next_weight`` is the global weight of the following linear layer (:func:`following_weight`):
    the reply's one is kept beside the layer when it has that weight's shape, else neither is.

    Raises
    ------
    LayerNotFoundError
        If the reply lacks the layer.
    ValueError
        If the reply's layer has another shape than the global one.
    """
    new_weight, new_bias = layer_arrays(reply_arrays, layer)
    if new_weight.shape != weight.shape or new_bias.shape != bias.shape:
        raise ValueError(
            f"client layer shapes {new_weight.shape}/{new_bias.shape} differ from the global "
            f"{weight.shape}/{bias.shape}"
        )
    sent_next = _following_sent(reply_arrays, layer, next_weight)
    return SentLayer(
        weight=new_weight,
        bias=new_bias,
        global_weight=weight,
        global_bias=bias,
        head_weight=head_weight,
        next_weight=sent_next,
        global_next_weight=None if sent_next is None else next_weight,
        after_layers=bool(layer.preceding),
    )


def _following_sent(
    reply_arrays: NamedArrays, layer: LayerKeys, next_weight: np.ndarray | None
) -> np.ndarray | None:
    """The reply's following-layer weight, when it has the global one's shape."""
    keys = _canonical_keys(reply_arrays)
    if next_weight is None or layer.following is None or layer.following not in keys:
        return None
    sent = _owned(reply_arrays[keys[layer.following]])
    return sent if sent.shape == next_weight.shape else None


def layer_delta(
    reply_arrays: NamedArrays,
    *,
    layer: LayerKeys,
    weight: np.ndarray,
    bias: np.ndarray,
) -> LayerUpdate[np.ndarray]:
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
    return sent_layer(reply_arrays, layer=layer, weight=weight, bias=bias).delta()
