"""What the auditor attacks: one unit (a client's update, or a secure-aggregation sum), its name and figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_attack.simulate.secagg import SecAggPlusQuantization, secagg_observed_sum
from fl_attack.vocabulary import APPROX_PSNR_DB, EXACT_PSNR_DB

from .layer import LayerDelta
from .observations import ClientUpdate
from .workers import AttackResult


@dataclass(frozen=True)
class Prepared:
    """One unit's observed update, ready for a worker."""

    server_round: int
    members: list[ClientUpdate]
    delta: LayerDelta


def unit_name(members: Sequence[ClientUpdate]) -> str:
    """Name of an attacked update: the client's, or ``secagg-<a>_<b>...`` for a sum."""
    if len(members) == 1:
        return members[0].identity.name
    return "secagg-" + "_".join(member.identity.name for member in members)


def observed_sum(
    deltas: Sequence[LayerDelta],
    members: Sequence[ClientUpdate],
    *,
    quantization: SecAggPlusQuantization | None,
    seed: tuple[int, ...],
) -> LayerDelta:
    """The layer update the server observes of a unit: its members' deltas summed.

    Parameters
    ----------
    deltas : Sequence[LayerDelta]
        Each member's change of the attacked layer, all from the same global layer.
    members : Sequence[ClientUpdate]
        The unit's members, in the order of ``deltas`` (their example counts weigh SecAgg+).
    quantization : SecAggPlusQuantization or None
        None adds floats; otherwise the sum Flower's SecAgg+ delivers (clipped, quantized,
        summed modulo and dequantized, :func:`fl_attack.simulate.secagg.secagg_observed_sum`).
    seed : tuple[int, ...]
        Seeds SecAgg+'s stochastic rounding, together with the members' node ids.

    Returns
    -------
    LayerDelta
        The observed change, with the global layer of the first delta.
    """
    if quantization is None:
        delta = deltas[0]
        for other in deltas[1:]:
            delta = delta + other
        return delta
    start = deltas[0]
    weight_sum, bias_sum = secagg_observed_sum(
        [(each.weight_delta, each.bias_delta) for each in deltas],
        start=(start.weight, start.bias),
        num_examples=[member.num_examples for member in members],
        settings=quantization,
        seed=(*seed, *(member.identity.node_id for member in members)),
    )
    return LayerDelta(weight_delta=weight_sum, bias_delta=bias_sum, weight=start.weight, bias=start.bias)


def total_examples(members: Sequence[ClientUpdate]) -> int | None:
    counts = [member.num_examples for member in members]
    return None if any(count is None for count in counts) else sum(count or 0 for count in counts)


def attack_summary(result: AttackResult) -> dict[str, Any]:
    reconstruction = result.reconstruction
    if reconstruction is None or not hasattr(reconstruction, "summary"):
        return {}
    return dict(reconstruction.summary())


def member_quality(
    members: list[ClientUpdate], sizes: list[int], psnr: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Per-client recovery inside a secure-aggregation sum (references were concatenated)."""
    report: dict[str, dict[str, Any]] = {}
    start = 0
    for member, size in zip(members, sizes, strict=True):
        values = [float(value) for value in psnr[start : start + size]]
        start += size
        report[member.identity.name] = {
            "samples": len(values),
            "mean_psnr": float(np.mean(values)) if values else None,
            "exact_fraction": float(np.mean([v > EXACT_PSNR_DB for v in values])) if values else None,
            "approx_fraction": float(np.mean([v > APPROX_PSNR_DB for v in values])) if values else None,
        }
    return report


def to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)
