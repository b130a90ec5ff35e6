"""What a server running Flower's SecAgg+ observes: clipping, quantization, modular sum, dequantization.

Flower's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow`` on the server, the
``secaggplus_mod`` on every client) never adds floats. This module redoes its arithmetic
(Flower 1.41: ``secaggplus_mod._collect_masked_vectors``, ``quantization.quantize`` /
``dequantize`` and ``SecAggPlusWorkflow.unmask_stage``) without the cryptography, whose masks
cancel exactly in the modular sum, so that a simulated secure aggregation delivers what the
real protocol delivers.

Client ``i`` holds its model *parameters* ``p_i`` after training (not the update) and its
example count ``n_i``. With clipping range ``c``, quantization range ``Q``, modulus ``M`` and
``max_weight``, it uploads (masked) the integers::

    r_i = round(n_i / max_weight * Q)                          # its weight, an integer
    s_i = p_i * (r_i / Q)                                      # in the parameters' dtype (float32)
    x_i = stochastic_round((clip(s_i, -c, c) + c) * Q / (2 c))  # integers in [0, Q]

The server unmasks ``R = sum r_i mod M`` and ``X = sum x_i mod M`` over the ``k`` clients
and computes, in float64, ::

    A = ((X * 2c / Q - c) - (k - 1) c) * Q / R
      = sum_i r_i p_i / R  +  (2c / R) * sum_i e_i     (nothing clipped, nothing wrapped mod M)

where ``e_i`` in ``(-1, 1)`` is client ``i``'s rounding error in quantization units. ``A``, the
``r``-weighted *mean* of the parameters, is what ``Strategy.aggregate_fit`` receives as the
parameters of every client's ``FitRes``. The attacked update is the sum of the members' changes
``k (A - W0)`` (:func:`sum_of_changes`): ``sum_i (r_i / mean(r)) (p_i - W0)`` plus ``k (2c / R)
sum_i e_i``. With equal example counts that is the plain sum of the changes; otherwise each
member's change is scaled by its relative weight, which leaves every sample's rank-one term of
the layer's update (and so what an exact attack recovers) unchanged. The noise is the price
of the protocol: with Flower's defaults and 32 examples in all it is about 1e-4 per entry
of ``A``, the size of a FedSGD update at learning rate 0.1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "FLOWER_DEFAULTS",
    "SecAggPlusQuantization",
    "client_vector",
    "dequantize",
    "modular_sum",
    "quantize",
    "secagg_observed_sum",
    "secagg_plus_aggregate",
    "server_aggregate",
    "stochastic_round",
    "sum_of_changes",
    "weight_factor",
]


@dataclass(frozen=True)
class SecAggPlusQuantization:
    """The numeric settings of SecAgg+ (``SecAggPlusWorkflow``'s keyword arguments of the same names).

    Attributes
    ----------
    clipping_range : float
        Every weighted parameter is clipped to ``[-clipping_range, clipping_range]``.
    quantization_range : int
        Clipped values are mapped to integers in ``[0, quantization_range]``.
    modulus_range : int
        The masked sum is taken modulo this power of two.
    max_weight : float
        Example count that maps to the weight ``quantization_range``.

    Raises
    ------
    ValueError
        On a non-positive or non-finite range or weight, a non-integer quantization or
        modulus range, or a modulus that is not a power of two larger than the quantization
        range (Flower's own checks, plus a positive finite clipping range).
    """

    clipping_range: float = 8.0
    quantization_range: int = 4194304
    modulus_range: int = 4294967296
    max_weight: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("clipping_range", "max_weight"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"SecAgg+ {name} must be a positive finite number, got {value!r}")
        quantization = self.quantization_range
        if isinstance(quantization, bool) or not isinstance(quantization, int) or quantization <= 0:
            raise ValueError(f"SecAgg+ quantization_range must be a positive integer, got {quantization!r}")
        modulus = self.modulus_range
        if isinstance(modulus, bool) or not isinstance(modulus, int) or modulus <= quantization:
            raise ValueError(
                f"SecAgg+ modulus_range must be an integer larger than quantization_range "
                f"({quantization}), got {modulus!r}"
            )
        if modulus & (modulus - 1):
            raise ValueError(f"SecAgg+ modulus_range must be a power of 2, got {modulus}")

    @classmethod
    def from_workflow(cls, workflow: Any) -> SecAggPlusQuantization:
        """The settings of a ``flwr.server.workflow.SecAggPlusWorkflow`` (read from its attributes)."""
        try:
            return cls(
                clipping_range=workflow.clipping_range,
                quantization_range=workflow.quantization_range,
                modulus_range=workflow.modulus_range,
                max_weight=workflow.max_weight,
            )
        except AttributeError as error:
            raise TypeError(
                f"expected a SecAggPlusWorkflow with clipping_range, quantization_range, "
                f"modulus_range and max_weight, got {type(workflow).__name__}"
            ) from error


#: ``SecAggPlusWorkflow``'s defaults in Flower 1.41.
FLOWER_DEFAULTS = SecAggPlusQuantization()


def weight_factor(num_examples: int, *, max_weight: float, quantization_range: int) -> int:
    """A client's integer weight ``round(num_examples / max_weight * quantization_range)``.

    Raises
    ------
    ValueError
        If ``num_examples`` is not a non-negative integer.
    """
    if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)) or num_examples < 0:
        raise ValueError(f"num_examples must be a non-negative integer, got {num_examples!r}")
    return round(int(num_examples) / max_weight * quantization_range)


def stochastic_round(values: np.ndarray, *, rng: np.random.RandomState) -> np.ndarray:
    """Round up or down at random, down with probability ``ceil(v) - v``, to int32.

    One uniform draw per entry is taken from ``rng`` (``rng.random_sample(values.shape)``), as
    Flower takes them from ``np.random``; the same state gives the same integers.
    """
    values = np.asarray(values)
    rounded = np.asarray(np.ceil(values)).astype(np.int32)
    draws = rng.random_sample(values.shape)
    down = draws < rounded - values
    result: np.ndarray = rounded - down.astype(np.int32)
    return result


def quantize(
    arrays: Sequence[np.ndarray],
    *,
    clipping_range: float,
    quantization_range: int,
    rng: np.random.RandomState,
) -> list[np.ndarray]:
    """Clip each entry to ``[-c, c]``, map it to ``[0, Q]`` and round it stochastically.

    The arithmetic stays in each array's dtype (float32 for PyTorch models), as in Flower.
    """
    quantizer = quantization_range / (2 * clipping_range)
    quantized = []
    for array in arrays:
        shifted = (np.clip(np.asarray(array), -clipping_range, clipping_range) + clipping_range) * quantizer
        quantized.append(stochastic_round(shifted, rng=rng))
    return quantized


def dequantize(
    arrays: Sequence[np.ndarray], *, clipping_range: float, quantization_range: int
) -> list[np.ndarray]:
    """Map integers back to floats: ``q * 2c / Q - c`` in float64 (the inverse of :func:`quantize`)."""
    step = (2 * clipping_range) / quantization_range
    shift = -clipping_range
    return [np.asarray(array).astype(float) * step + shift for array in arrays]


def client_vector(
    parameters: Sequence[np.ndarray],
    *,
    num_examples: int,
    settings: SecAggPlusQuantization = FLOWER_DEFAULTS,
    rng: np.random.RandomState,
) -> list[np.ndarray]:
    """What one client adds to the secure sum (before its masks): its weight, then its quantized parameters.

    Returns
    -------
    list[numpy.ndarray]
        ``[array([r_i]), x_i per parameter array]`` (see the module docstring).
    """
    factor = weight_factor(
        num_examples, max_weight=settings.max_weight, quantization_range=settings.quantization_range
    )
    ratio = factor / settings.quantization_range
    scaled = [np.asarray(array) * ratio for array in parameters]
    quantized = quantize(
        scaled,
        clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range,
        rng=rng,
    )
    return [np.array([factor]), *quantized]


def modular_sum(vectors: Sequence[Sequence[np.ndarray]], *, modulus_range: int) -> list[np.ndarray]:
    """The clients' vectors summed entry by entry modulo ``modulus_range`` (a power of two), as int64.

    This is what unmasking yields: the pairwise masks cancel and the private masks are
    removed, modulo ``modulus_range``.

    Raises
    ------
    ValueError
        Without vectors, or when their shapes differ.
    """
    if not vectors:
        raise ValueError("secure aggregation needs at least one client vector")
    shapes = [tuple(np.shape(array) for array in vector) for vector in vectors]
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise ValueError(f"client vectors differ in shape: {shapes}")
    mask = modulus_range - 1
    totals = [np.zeros(shape, dtype=np.int64) for shape in shapes[0]]
    for vector in vectors:
        totals = [
            (total + np.asarray(array, dtype=np.int64)) & mask
            for total, array in zip(totals, vector, strict=True)
        ]
    return totals


def server_aggregate(
    summed: Sequence[np.ndarray], *, num_clients: int, settings: SecAggPlusQuantization = FLOWER_DEFAULTS
) -> list[np.ndarray]:
    """Turn the unmasked modular sum into the parameters Flower hands to ``aggregate_fit``.

    Parameters
    ----------
    summed : Sequence[numpy.ndarray]
        :func:`modular_sum` of the clients' :func:`client_vector`: the total weight first.
    num_clients : int
        Clients in the sum (Flower's active clients at unmasking).
    settings : SecAggPlusQuantization
        The workflow's settings.

    Returns
    -------
    list[numpy.ndarray]
        ``A`` per parameter array, float64. As in Flower, a 0-d array is only dequantized: the
        workflow's in-place offset and rescaling do not reach numpy scalars.

    Raises
    ------
    ValueError
        If the total weight is zero (every client reported zero examples).
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    total_weight = summed[0].reshape(-1)[0]
    if total_weight == 0:
        raise ValueError("the clients' total SecAgg+ weight is zero: every client reported 0 examples")
    rescale = settings.quantization_range / total_weight
    offset = -(num_clients - 1) * settings.clipping_range
    dequantized = dequantize(
        summed[1:], clipping_range=settings.clipping_range, quantization_range=settings.quantization_range
    )
    aggregate = []
    for array in dequantized:
        if isinstance(array, np.ndarray):
            array += offset
            array *= rescale
        aggregate.append(np.asarray(array))
    return aggregate


def secagg_plus_aggregate(
    parameters: Sequence[Sequence[np.ndarray]],
    *,
    num_examples: Sequence[int],
    settings: SecAggPlusQuantization = FLOWER_DEFAULTS,
    rng: np.random.RandomState,
) -> list[np.ndarray]:
    """The whole protocol: every client's vector (in order, drawing from ``rng``), their sum, the server's ``A``.

    Parameters
    ----------
    parameters : Sequence[Sequence[numpy.ndarray]]
        Per client, its parameter arrays after training, in their own dtype.
    num_examples : Sequence[int]
        Per client, the example count it reports (its weight).
    settings : SecAggPlusQuantization
        The workflow's settings.
    rng : numpy.random.RandomState
        Source of the stochastic rounding.

    Raises
    ------
    ValueError
        On no clients, counts that do not match the clients, or a zero total weight.
    """
    if not parameters:
        raise ValueError("secure aggregation needs at least one client")
    if len(num_examples) != len(parameters):
        raise ValueError(f"{len(num_examples)} example counts for {len(parameters)} clients")
    vectors = [
        client_vector(arrays, num_examples=count, settings=settings, rng=rng)
        for arrays, count in zip(parameters, num_examples, strict=True)
    ]
    summed = modular_sum(vectors, modulus_range=settings.modulus_range)
    return server_aggregate(summed, num_clients=len(parameters), settings=settings)


def sum_of_changes(
    aggregate: Sequence[np.ndarray], *, start: Sequence[np.ndarray], num_clients: int
) -> list[np.ndarray]:
    """``num_clients * (A - W0)``: the members' summed changes as the server can derive them, float64."""
    return [
        num_clients * (np.asarray(mean, dtype=np.float64) - np.asarray(origin, dtype=np.float64))
        for mean, origin in zip(aggregate, start, strict=True)
    ]


def secagg_observed_sum(
    changes: Sequence[Sequence[np.ndarray]],
    *,
    start: Sequence[np.ndarray],
    num_examples: Sequence[int | None],
    settings: SecAggPlusQuantization = FLOWER_DEFAULTS,
    seed: int | Sequence[int] = 0,
    dtype: type[np.floating[Any]] = np.float32,
) -> list[np.ndarray]:
    """The members' summed changes of some arrays as a server running SecAgg+ sees them.

    Parameters
    ----------
    changes : Sequence[Sequence[numpy.ndarray]]
        Per member, its change of each array (e.g. the attacked layer's weight and bias).
    start : Sequence[numpy.ndarray]
        The global arrays the members started from.
    num_examples : Sequence[int or None]
        Per member, the example count it reports.
    settings : SecAggPlusQuantization (default: Flower's defaults)
        The workflow's settings.
    seed : int or Sequence[int] (default: 0)
        Seeds the stochastic rounding (Flower's clients draw from an unseeded ``np.random``);
        any integers, taken modulo 2**64.
    dtype : numpy floating type (default: numpy.float32)
        The dtype of the parameters the clients send: each member's parameters are rebuilt
        as ``start + change`` in float64 and cast to it (exact when the client sent that dtype).

    Returns
    -------
    list[numpy.ndarray]
        :func:`sum_of_changes` of :func:`secagg_plus_aggregate`, one float64 array per array.

    Raises
    ------
    ValueError
        On no members, a member without an example count, mismatched arrays, or a zero
        total weight.
    """
    if not changes:
        raise ValueError("secure aggregation needs at least one member")
    if len(num_examples) != len(changes):
        raise ValueError(f"{len(num_examples)} example counts for {len(changes)} members")
    counts: list[int] = []
    for position, count in enumerate(num_examples):
        if count is None:
            raise ValueError(
                f"member {position} reported no example count: SecAgg+ weights each update by it"
            )
        counts.append(count)
    origins = [np.asarray(array, dtype=np.float64) for array in start]
    parameters = []
    for member in changes:
        if len(member) != len(origins):
            raise ValueError(f"a member changed {len(member)} arrays, the start has {len(origins)}")
        arrays = []
        for origin, change in zip(origins, member, strict=True):
            if np.shape(change) != origin.shape:
                raise ValueError(f"a change of shape {np.shape(change)} for an array of shape {origin.shape}")
            arrays.append((origin + np.asarray(change, dtype=np.float64)).astype(dtype))
        parameters.append(arrays)
    entropy = [int(value) % (1 << 64) for value in ([seed] if isinstance(seed, int) else seed)]
    rng = np.random.RandomState(np.random.SeedSequence(entropy).generate_state(4))
    aggregate = secagg_plus_aggregate(parameters, num_examples=counts, settings=settings, rng=rng)
    return sum_of_changes(aggregate, start=origins, num_clients=len(changes))
