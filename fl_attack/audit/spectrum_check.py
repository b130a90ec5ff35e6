"""Rule an update out before attacking it, when its spectrum alone shows the attack cannot apply.

SPEAR-family attacks (:class:`fl_attack.attacks.spear.GradientInversionAttack`) start by
estimating the batch size from the update's singular values, with the update's rounding floor
(:func:`fl_attack.pipeline.spectrum.decompose.estimate_batch_size`). When that estimate finds no
low-rank structure at all (a batch at least ``min(m, n)``, many local steps), the attack can
only fail, and its verdict would be ``not-applicable`` from the same spectrum; an update of
near-equal magnitudes (Adam-like steps) is ``not-applicable`` whatever the attack returns. The
check makes that decision from one SVD instead of a worker, a process and a time budget. An
update whose estimate succeeds, or that the attack is told a batch size for, is attacked as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fl_attack.pipeline.spectrum.decompose import estimate_batch_size, rounding_floor
from fl_attack.types import LayerUpdate, ObservedUpdate

from .signature import ADAPTIVE_CONCENTRATION, UpdateSignature, magnitude_concentration
from .verdict import more_samples_than_neurons, not_applicable_reason

__all__ = ["SpectrumCheck", "SpectrumRuling", "check_spectrum", "spectrum_guided"]


def spectrum_guided(attacker: object) -> bool:
    """Whether ``attacker`` needs the low-rank structure the check looks for (the SPEAR family)."""
    from fl_attack.attacks.spear import GradientInversionAttack  # the attacks' modules: only when asked

    return isinstance(attacker, GradientInversionAttack)


@dataclass(frozen=True)
class SpectrumRuling:
    """An update ruled out before its attack.

    Attributes
    ----------
    reason : str
        The ``not-applicable`` reason, as the verdict would give it after the attack.
    batch_size : int or None
        The batch size the spectrum suggests (the attack's own estimate), None when it finds none.
    low_rank : bool
        False when the update was ruled out for showing no low-rank structure at all: then it
        holds no batch of per-sample gradients for a fallback to unmix. True for Adam-like steps
        (ruled out by their magnitudes, whatever their spectrum).
    """

    reason: str
    batch_size: int | None
    low_rank: bool


@dataclass(frozen=True)
class SpectrumCheck:
    """What the spectrum says of an update before its attack.

    Attributes
    ----------
    ruling : SpectrumRuling or None
        Why the update is ruled out; None when it is attacked.
    rank : int or None
        The batch size the spectrum estimates (the attack's own estimate), None when it finds none.
    """

    ruling: SpectrumRuling | None
    rank: int | None


def check_spectrum(
    delta: LayerUpdate[np.ndarray],
    *,
    signature: Callable[[], UpdateSignature],
    train_mode: str | None,
    num_examples: int | None,
) -> SpectrumCheck:
    """The update's estimated rank, and why it cannot be inverted exactly where its spectrum says so.

    Parameters
    ----------
    delta : LayerUpdate[np.ndarray]
        The observed update of the attacked layer.
    signature : Callable[[], UpdateSignature]
        The update's signature, computed on demand (the verdict's wording comes from it).
    train_mode : str or None
        What the client reported about its training (simulation only), to name the cause.
    num_examples : int or None
        The example count the client(s) reported: more samples than the layer has neurons, on
        an update without low-rank structure, is named as the reason.

    Raises
    ------
    ValueError
        On an update that is not a finite ``(m, n)`` matrix with a matching bias.
    """
    update = ObservedUpdate.from_update(delta, device=torch.device("cpu"))
    grad = update.weight_update
    floor = rounding_floor(grad, unit_roundoff=update.unit_roundoff, weight=update.weight)
    shape = (int(grad.shape[0]), int(grad.shape[1]))
    try:
        estimate: int | None = int(
            estimate_batch_size(torch.linalg.svdvals(grad), shape=shape, rounding_floor=floor).batch_size
        )
    except ValueError:
        estimate = None
    if magnitude_concentration(delta.weight_update) > ADAPTIVE_CONCENTRATION:
        # Adam-like steps: the verdict is not-applicable whatever the attack returns
        reason = not_applicable_reason(signature(), train_mode=train_mode, num_examples=num_examples)
        if reason is not None:
            return SpectrumCheck(SpectrumRuling(reason, estimate, low_rank=True), estimate)
    live = int((grad.abs().amax(dim=1) > 0).sum())  # neurons dead at every step send zero rows
    if estimate is not None and estimate > 1 and estimate >= min(live, shape[1]):
        # full rank on the live neurons: a batch at least as large as what the layer separates
        full_rank = f"full rank {estimate} on its {live} live neurons (of {shape[0]}, input width {shape[1]})"
        reason = (
            f"the update has {full_rank}: the batch is at least as large as the layer "
            "can separate, as after many local steps, so no exact attack applies"
        )
        if num_examples is not None and num_examples > shape[0]:
            reason = (
                f"{more_samples_than_neurons(num_examples, shape[0])}; the update agrees: it has {full_rank}"
            )
        # a fallback may still unmix it, unless the client trained on more samples than rows
        unmixable = num_examples is not None and num_examples > min(live, shape[1])
        return SpectrumCheck(SpectrumRuling(reason, estimate, low_rank=not unmixable), estimate)
    if estimate is not None:
        return SpectrumCheck(None, estimate)
    computed = signature()
    if computed.low_rank:  # the two estimates disagree: let the attack decide
        return SpectrumCheck(None, None)
    reason = not_applicable_reason(computed, train_mode=train_mode, num_examples=num_examples)
    return SpectrumCheck(None if reason is None else SpectrumRuling(reason, None, low_rank=False), None)
