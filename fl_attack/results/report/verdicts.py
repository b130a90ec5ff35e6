"""Verdicts for runs stored before the audit recorded them, derived from status and ground-truth scores.

A derived verdict is always labelled as such in the report and in ``report.json``. It is
conservative: "exact" is only derived from ground-truth scores (every scored sample exact by
its scorer's criterion, e.g. above :data:`~fl_attack.vocabulary.EXACT_PSNR_DB` for images),
never from the attacker's own claim, because old runs have no self-check to back that claim.
"""

from __future__ import annotations

from fl_attack.vocabulary import (
    APPROX_PSNR_DB,
    EXACT_PSNR_DB,
    STATUS_DROPPED,
    STATUS_OK,
    STATUS_TIMEOUT,
    VERDICT_APPROXIMATE,
    VERDICT_DROPPED,
    VERDICT_EXACT,
    VERDICT_FAILED,
    VERDICT_TIMEOUT,
)

__all__ = ["derive_verdict"]


def derive_verdict(
    *,
    status: str,
    error: str,
    scored: int,
    exact: int,
    approximate: int,
    complete: bool | None,
    criteria: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """The verdict of an attack whose run recorded none, and one sentence saying why.

    Parameters
    ----------
    status : str
        The attack's status (:data:`fl_attack.vocabulary.STATUSES`).
    error : str
        Its error message, empty when none.
    scored : int
        Ground-truth samples scored (0: not scored).
    exact : int
        Scored samples recovered exactly (images: above ``EXACT_PSNR_DB``).
    approximate : int
        Scored samples recovered at least approximately (images: above ``APPROX_PSNR_DB``;
        exact ones included).
    complete : bool or None
        The attacker's own completeness claim (None when the attack did not return).
    criteria : tuple[str, str] or None (default: None)
        The scorer's exact and approximate criteria in words
        (:attr:`fl_attack.results.recovery.SampleRecovery.exact_rule`, ...), named in the
        reason; None: PSNR (images).

    Returns
    -------
    tuple[str, str]
        ``(verdict, reason)``.

    Raises
    ------
    ValueError
        When the counts are inconsistent (negative, or more recovered than scored).
    """
    if not 0 <= exact <= approximate <= scored:
        raise ValueError(
            f"inconsistent sample counts: exact {exact}, approximate {approximate}, scored {scored} "
            "(need 0 <= exact <= approximate <= scored)"
        )
    detail = f": {error}" if error else ""
    if status == STATUS_DROPPED:
        return VERDICT_DROPPED, f"derived from status {status}: the attack was never run{detail}"
    if status == STATUS_TIMEOUT:
        return VERDICT_TIMEOUT, f"derived from status {status}: the attack was stopped at its limit{detail}"
    if status != STATUS_OK:
        return VERDICT_FAILED, f"derived from status {status}: the attack returned no reconstruction{detail}"
    if scored:
        if criteria is None:
            source = "ground-truth PSNR"
            counts = (
                f"{exact} of {scored} scored samples above {EXACT_PSNR_DB:g} dB, "
                f"{approximate} above {APPROX_PSNR_DB:g} dB"
            )
        else:
            source = "ground-truth scores"
            counts = (
                f"{exact} of {scored} scored samples with {criteria[0]}, {approximate} with {criteria[1]}"
            )
        if exact == scored:
            return VERDICT_EXACT, f"derived from {source}: {counts}"
        if approximate:
            return VERDICT_APPROXIMATE, f"derived from {source}: {counts}"
        return VERDICT_FAILED, f"derived from {source}: {counts}"
    if complete:
        return VERDICT_APPROXIMATE, (
            "derived: the attacker reported a complete reconstruction, but this run records no "
            "self-check verdict and no ground truth, so an exact recovery is not confirmed"
        )
    return VERDICT_FAILED, (
        "derived: the attacker reported an incomplete reconstruction and no ground truth scored it"
    )
