"""What to do about each verdict of a run, chosen from the reasons its attacks gave.

The same verdict calls for different actions: a ``timeout`` with half the batch found wants a
larger time budget, while one whose every sample was found but not confirmed (near-identical
samples that one layer's update cannot tell from blends) would not be settled by more time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fl_attack.vocabulary import (
    VERDICT_APPROXIMATE,
    VERDICT_DROPPED,
    VERDICT_EXACT,
    VERDICT_FAILED,
    VERDICT_NOT_APPLICABLE,
    VERDICT_TIMEOUT,
)

__all__ = ["verdict_advice"]

#: Words of a reason saying every sample was found, and what kept them from being confirmed.
_FOUND_BUT_UNCONFIRMED = ("directions were found but not verified", "near-identical", "look-alike")

_FIXED: dict[str, str] = {
    VERDICT_EXACT: (
        "these updates give the server the client's batch: a defense is needed (see Recommendations)"
    ),
    VERDICT_APPROXIMATE: (
        "treat these updates as leaking: samples were recovered, only exactness is not confirmed"
    ),
    VERDICT_NOT_APPLICABLE: (
        "the exact attack cannot invert these updates (each reason says why); this shows what it could "
        "not do, not that the data is safe: approximate attacks may still recover samples"
    ),
    VERDICT_FAILED: "read each reason: the attack applies to these updates but recovered nothing, or crashed",
    VERDICT_DROPPED: (
        "give the audit more room: more attack-workers, a larger attack-queue-size, or attack-queue=block"
    ),
}


#: Words of a reason saying the whole budget went by without a single sample found.
_NOTHING_FOUND = " with 0 of "


def _timeout_advice(reasons: Sequence[str]) -> str:
    unconfirmed = sum(1 for reason in reasons if any(words in reason for words in _FOUND_BUT_UNCONFIRMED))
    empty = sum(1 for reason in reasons if _NOTHING_FOUND in reason) if reasons else 0
    empty = min(empty, len(reasons) - unconfirmed)
    short = len(reasons) - unconfirmed - empty
    parts = []
    if unconfirmed:
        parts.append(
            f"{unconfirmed} of them had every sample found but not confirmed (near-identical samples, or a "
            "self-check that failed; see each reason): a larger time budget is unlikely to settle these, "
            "treat them as leaking approximately"
        )
    if empty:
        parts.append(
            f"{empty} found no sample at all in the whole budget: such updates (many local steps, an "
            "adaptive optimizer, noise) rarely yield to more time; raise attack-time-budget only for "
            "clients known to send one step (the batch was not shown safe)"
        )
    if short:
        parts.append(
            f"{short} ran out of time before finding the batch: raise attack-time-budget "
            "(the batch was not shown safe)"
        )
    return "; ".join(parts)


def verdict_advice(attacks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{verdict: what to do}`` for every verdict the run's attacks have.

    Parameters
    ----------
    attacks : Sequence[Mapping[str, Any]]
        The summary's ``attack_details`` (``verdict`` and ``verdict_reason`` of each attack).
    """
    reasons: dict[str, list[str]] = {}
    for attack in attacks:
        verdict = attack.get("verdict")
        if isinstance(verdict, str):
            reasons.setdefault(verdict, []).append(str(attack.get("verdict_reason") or ""))
    advice = {}
    for verdict, given in reasons.items():
        if verdict == VERDICT_TIMEOUT:
            advice[verdict] = _timeout_advice(given)
        elif verdict in _FIXED:
            advice[verdict] = _FIXED[verdict]
    return advice
