"""Turn one unit's replies into what its attack needs, holding as little as possible while it waits.

One client's finite single-precision update is kept as the client sent it (:class:`SentLayer`,
sharing the round's global layer with the round's other units); its float64 difference is
computed when its attack starts. A secure-aggregation sum, or an update in another precision,
is computed at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fl_attack.simulate.secagg import SecAggPlusQuantization

from .layer import (
    SINGLE_PRECISION,
    LayerKeys,
    NamedArrays,
    SentLayer,
    following_weight,
    global_parameters,
    sent_layer,
)
from .observations import ClientUpdate
from .units import Prepared, observed_sum

#: The error of an update whose observed difference is not finite.
NON_FINITE_UPDATE = "unreadable update: it contains NaN or Inf entries"

#: The round's global layer: weight, bias, the head's weight and the following linear layer's
#: weight (each None without one), float64.
GlobalLayer = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def round_layer(global_arrays: NamedArrays, layer: LayerKeys) -> GlobalLayer:
    """The round's :data:`GlobalLayer` from the global arrays it sends."""
    return (*global_parameters(global_arrays, layer), following_weight(global_arrays, layer))


def finite_layer(global_layer: GlobalLayer) -> bool:
    """Whether the global weight and bias are finite (checked once per round)."""
    return bool(np.isfinite(global_layer[0]).all() and np.isfinite(global_layer[1]).all())


def kept_as_sent(sent: SentLayer) -> bool:
    """Whether ``sent`` (from a finite global layer) may wait as sent: single precision and finite.

    The float64 difference of finite float32 (or float16) values and a finite float64 global
    layer is finite, so the check the difference would get is decided here on the sent arrays.
    """
    return (
        sent.weight.dtype in SINGLE_PRECISION
        and sent.bias.dtype in SINGLE_PRECISION
        and bool(np.isfinite(sent.weight).all() and np.isfinite(sent.bias).all())
    )


def prepare_unit(
    server_round: int,
    members: Sequence[ClientUpdate],
    global_layer: GlobalLayer,
    *,
    layer: LayerKeys,
    quantization: SecAggPlusQuantization | None,
    seed: int,
    global_finite: bool | None = None,
) -> Prepared | str:
    """The observed update of one unit, or why it cannot be attacked.

    Parameters
    ----------
    server_round : int
        The round.
    members : Sequence[ClientUpdate]
        One client, or the clients of a secure-aggregation sum.
    global_layer : GlobalLayer
        The round's global layer (:func:`fl_attack.audit.layer.global_parameters`).
    layer : LayerKeys
        The attacked layer.
    quantization : SecAggPlusQuantization or None
        SecAgg+'s sum for a group (:func:`fl_attack.audit.units.observed_sum`).
    seed : int
        The auditor's seed (with the round, it seeds SecAgg+'s rounding).
    global_finite : bool or None (default: None)
        Whether ``global_layer`` is finite (:func:`finite_layer`); None checks it here.

    Returns
    -------
    Prepared or str
        The unit, its members without their arrays; or the error of its record
        (``"unreadable update: ..."``).
    """
    sent: list[SentLayer] = []
    for member in members:
        if member.arrays is None:
            return f"unreadable update: {member.error}"
        try:
            sent.append(
                sent_layer(
                    member.arrays,
                    layer=layer,
                    weight=global_layer[0],
                    bias=global_layer[1],
                    head_weight=global_layer[2],
                    next_weight=global_layer[3],
                )
            )
        except ValueError as error:
            return f"unreadable update: {error}"
    # a queued unit keeps only its layer's update, not every member's whole model
    kept = [dataclasses.replace(member, arrays=None) for member in members]
    if global_finite is None:
        global_finite = finite_layer(global_layer)
    if len(sent) == 1 and quantization is None and global_finite and kept_as_sent(sent[0]):
        return Prepared(server_round=server_round, members=kept, update=sent[0])
    deltas = [each.delta() for each in sent]
    delta = observed_sum(deltas, members, quantization=quantization, seed=(seed, server_round))
    if not (np.isfinite(delta.weight_update).all() and np.isfinite(delta.bias_update).all()):
        return NON_FINITE_UPDATE
    # attackers that take it get the head; one client's update keeps the next layer's (a sum does not)
    following = deltas[0].next_weight_update if len(deltas) == 1 and quantization is None else None
    delta = dataclasses.replace(delta, head_weight=global_layer[2], next_weight_update=following)
    return Prepared(server_round=server_round, members=kept, update=delta)
