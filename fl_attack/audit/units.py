"""What the auditor attacks: one unit (a client's update, or a secure-aggregation sum), its name and figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_attack.results.recovery import KIND_FEATURES, KIND_TABULAR, SampleFlags, sample_flags
from fl_attack.simulate.secagg import SecAggPlusQuantization, secagg_observed_sum
from fl_attack.types import LayerUpdate

from .layer import LayerKeys, SentLayer
from .observations import ClientUpdate
from .workers import AttackResult

if TYPE_CHECKING:
    from fl_attack.evaluation.scored import Scored

#: Key of a member's mean per-sample figure, by scorer kind (images: ``mean_psnr``).
_MEAN_KEYS = {KIND_FEATURES: "mean_relative_error", KIND_TABULAR: "mean_features_recovered"}


@dataclass(frozen=True)
class Prepared:
    """One unit's observed update, ready for a worker.

    ``update`` is the observed :class:`fl_attack.LayerUpdate`, or, for one client's single-precision
    update, the :class:`SentLayer` it is computed from: a queued unit then holds the client's
    float32 layer (half the float64 difference) and shares the round's global layer with the
    round's other units. :attr:`delta` is the same :class:`fl_attack.LayerUpdate` either way.
    """

    server_round: int
    members: list[ClientUpdate]
    update: LayerUpdate[np.ndarray] | SentLayer

    @property
    def delta(self) -> LayerUpdate[np.ndarray]:
        """The observed float64 update (computed anew from a :class:`SentLayer` at every access)."""
        update = self.update
        return update.delta() if isinstance(update, SentLayer) else update

    def materialized(self) -> Prepared:
        """This unit with its :class:`fl_attack.LayerUpdate` computed once, for the attack that runs now
        (a spilled update's file is removed: :meth:`SentLayer.take`)."""
        return self if isinstance(self.update, LayerUpdate) else replace(self, update=self.update.take())

    def discard(self) -> None:
        """The unit is never attacked (dropped): remove its spilled file, if any."""
        if isinstance(self.update, SentLayer):
            self.update.discard()


def unit_name(members: Sequence[ClientUpdate]) -> str:
    """Name of an attacked update: the client's, or ``secagg-<a>_<b>...`` for a sum."""
    if len(members) == 1:
        return members[0].identity.name
    return "secagg-" + "_".join(member.identity.name for member in members)


def unit_details(members: Sequence[ClientUpdate], layer: LayerKeys | None) -> dict[str, Any]:
    """``details`` of a unit's record: its members' ids, their training mode and the attacked layer."""
    details: dict[str, Any]
    if len(members) == 1:
        identity = members[0].identity
        details = {"node_id": identity.node_id, "partition_id": identity.partition_id}
    else:
        details = {
            "node_id": [member.identity.node_id for member in members],
            "partition_id": [member.identity.partition_id for member in members],
            "members": [member.identity.name for member in members],
            "secagg_group_size": len(members),
        }
    modes = {member.train_mode for member in members if member.train_mode}
    if len(modes) == 1:
        details["train_mode"] = modes.pop()
    if layer is not None:
        details["layer"] = {"weight": layer.weight, "bias": layer.bias, "input_space": layer.input_space}
    return details


def observed_sum(
    deltas: Sequence[LayerUpdate[np.ndarray]],
    members: Sequence[ClientUpdate],
    *,
    quantization: SecAggPlusQuantization | None,
    seed: tuple[int, ...],
) -> LayerUpdate[np.ndarray]:
    """The layer update the server observes of a unit: its members' deltas summed.

    Parameters
    ----------
    deltas : Sequence[LayerUpdate[np.ndarray]]
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
    LayerUpdate
        The observed change, with the global layer of the first delta.
    """
    if quantization is None:
        delta = deltas[0]
        for other in deltas[1:]:
            delta = delta + other
        return delta
    start = deltas[0]
    weight_sum, bias_sum = secagg_observed_sum(
        [(each.weight_update, each.bias_update) for each in deltas],
        start=(start.weight, start.bias),
        num_examples=[member.num_examples for member in members],
        settings=quantization,
        seed=(*seed, *(member.identity.node_id for member in members)),
    )
    return LayerUpdate(
        weight_update=weight_sum,
        bias_update=bias_sum,
        weight=start.weight,
        bias=start.bias,
        after_layers=start.after_layers,
    )


def total_examples(members: Sequence[ClientUpdate]) -> int | None:
    counts = [member.num_examples for member in members]
    return None if any(count is None for count in counts) else sum(count or 0 for count in counts)


def attack_summary(result: AttackResult) -> dict[str, Any]:
    reconstruction = result.reconstruction
    if reconstruction is None or not hasattr(reconstruction, "summary"):
        return {}
    return dict(reconstruction.summary())


def member_quality(
    members: list[ClientUpdate], sizes: list[int], scored: Scored
) -> dict[str, dict[str, Any]]:
    """Per-client recovery inside a secure-aggregation sum, by the scorer's own criterion.

    The references of the members were concatenated in ``members`` order before scoring, so
    member ``i``'s samples are the next ``sizes[i]`` per-sample figures.

    Parameters
    ----------
    members : list[ClientUpdate]
        The clients whose updates were summed.
    sizes : list[int]
        How many ground-truth samples each member sent.
    scored : Scored
        The score of the summed update's reconstruction against all members' samples.

    Returns
    -------
    dict[str, dict[str, Any]]
        Per member name: ``kind``, ``samples``, ``exact_samples``, ``approximate_samples``,
        ``exact_fraction``, ``approx_fraction``, ``mean_psnr`` (images; None for other kinds)
        and, for features, ``mean_relative_error``, for tables ``mean_features_recovered``.
        The counts and fractions are None when the scorer's flags per sample are unknown
        (a user's own scorer kind).

    Raises
    ------
    ValueError
        When ``sizes`` do not add up to the number of scored samples.
    """
    flags = sample_flags(quality=scored.quality, psnr=scored.psnr)
    if flags is not None and sum(sizes) != len(flags.values):
        raise ValueError(f"the members sent {sum(sizes)} samples but {len(flags.values)} were scored")
    report: dict[str, dict[str, Any]] = {}
    start = 0
    for member, size in zip(members, sizes, strict=True):
        part = slice(start, start + size)
        start += size
        report[member.identity.name] = _member_figures(scored.kind, size, flags, part)
    return report


def _member_figures(kind: str, size: int, flags: SampleFlags | None, part: slice) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "kind": kind,
        "samples": size,
        "exact_samples": None,
        "approximate_samples": None,
        "exact_fraction": None,
        "approx_fraction": None,
        "mean_psnr": None,
    }
    if flags is None or size == 0:
        return figures
    exact, approximate = flags.exact[part], flags.approximate[part]
    values = flags.values[part]
    # a figure stored as None was not finite (inf relative error, NaN): the mean is not finite either
    finite = [value for value in values if value is not None]
    mean = float(np.mean(finite)) if len(finite) == len(values) else None
    figures.update(
        exact_samples=sum(exact),
        approximate_samples=sum(approximate),
        exact_fraction=sum(exact) / size,
        approx_fraction=sum(approximate) / size,
    )
    figures[_MEAN_KEYS.get(flags.kind, "mean_psnr")] = mean
    return figures


def to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)
