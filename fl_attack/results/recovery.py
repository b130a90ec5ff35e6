"""How many of an attack's scored samples were recovered, by the criterion of the scorer that scored them.

Every scorer (:mod:`fl_attack.evaluation.scoring`) writes its kind and its own per-sample
figures into the attack's ``quality``; this module counts from them:

=========  ==================================  =====================================================
kind       per-sample figure                   exact / approximate
=========  ==================================  =====================================================
images     PSNR (the record's ``psnr``)        above ``EXACT_PSNR_DB`` / above ``APPROX_PSNR_DB``
features   ``quality["relative_error"]``       below ``EXACT_RELATIVE_ERROR`` / ``APPROX_RELATIVE_ERROR``
tabular    ``quality["features_recovered"]``   every category right and every continuous value
                                               within ``EXACT_RELATIVE_ERROR`` / ``tolerance_std``
                                               standard deviations (the scorer's ``exact_fraction``
                                               / ``approx_fraction`` of the scored rows)
=========  ==================================  =====================================================

A tabular row's share of recovered features does not say whether its continuous values are
exact, so its counts are the scorer's fractions times the number of scored rows: both are
means of per-row flags, so the product is a whole number.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fl_attack.vocabulary import APPROX_PSNR_DB, APPROX_RELATIVE_ERROR, EXACT_PSNR_DB, EXACT_RELATIVE_ERROR

__all__ = [
    "KIND_FEATURES",
    "KIND_IMAGES",
    "KIND_TABULAR",
    "SampleRecovery",
    "recovery_criteria",
    "sample_recovery",
]

# The scorers' kinds as they write them into ``quality["kind"]`` (fl_attack.evaluation.scored,
# which cannot be imported here: it imports the auditor, which imports the store).
KIND_IMAGES = "images"
KIND_TABULAR = "tabular"
KIND_FEATURES = "features"

#: What each kind's per-sample figure is called in ``quality`` (images: the record's ``psnr``).
_PER_SAMPLE_KEYS = {KIND_FEATURES: "relative_error", KIND_TABULAR: "features_recovered"}
#: TabLeak's tolerance, when a tabular quality does not name its own.
_DEFAULT_TOLERANCE_STD = 0.319


@dataclass(frozen=True)
class SampleRecovery:
    """The scored samples of one attack and how many of them were recovered.

    Attributes
    ----------
    kind : str
        The scorer's kind: ``"images"``, ``"features"`` or ``"tabular"``.
    scored : int
        Ground-truth samples scored.
    exact : int
        Samples recovered exactly, by the kind's criterion (:attr:`exact_rule`).
    approximate : int
        Samples recovered at least approximately (exact ones included).
    exact_rule, approximate_rule : str
        The criteria in words, e.g. ``"PSNR > 90 dB"``.
    """

    kind: str
    scored: int
    exact: int
    approximate: int
    exact_rule: str
    approximate_rule: str


def recovery_criteria(kind: str, *, tolerance_std: float = _DEFAULT_TOLERANCE_STD) -> tuple[str, str]:
    """``(exact, approximate)`` criteria of a kind in words.

    Raises
    ------
    ValueError
        On an unknown kind.
    """
    if kind == KIND_IMAGES:
        return f"PSNR > {EXACT_PSNR_DB:g} dB", f"PSNR > {APPROX_PSNR_DB:g} dB"
    if kind == KIND_FEATURES:
        return f"relative error < {EXACT_RELATIVE_ERROR:g}", f"relative error < {APPROX_RELATIVE_ERROR:g}"
    if kind == KIND_TABULAR:
        return (
            f"every category right, every continuous value within {EXACT_RELATIVE_ERROR:g} std",
            f"every category right, every continuous value within {tolerance_std:g} std",
        )
    raise ValueError(f"unknown scorer kind {kind!r}; known: {(KIND_IMAGES, KIND_FEATURES, KIND_TABULAR)}")


def sample_recovery(*, quality: Mapping[str, Any], psnr: Sequence[Any] | None) -> SampleRecovery | None:
    """Count an attack's scored and recovered samples from its quality and per-sample figures.

    Parameters
    ----------
    quality : Mapping[str, Any]
        The attack's ``quality`` (``metrics.json``), as its scorer wrote it; a record without a
        ``kind`` is an image record (written before scorers named their kind).
    psnr : Sequence or None
        The record's per-sample PSNR (images); None when not scored by PSNR.

    Returns
    -------
    SampleRecovery or None
        None when the attack was not scored (no per-sample figures). A per-sample figure that
        is missing or not a finite number (a stored NaN or infinity reads back as ``null``)
        counts as scored and not recovered.
    """
    kind = quality.get("kind")
    if kind is None and psnr is not None:
        kind = KIND_IMAGES
    if kind == KIND_IMAGES:
        values = _as_list(psnr if psnr is not None else quality.get("psnr"))
        if values is None:
            return None
        numbers = [_finite(value) for value in values]
        exact = sum(1 for value in numbers if value is not None and value > EXACT_PSNR_DB)
        approximate = sum(1 for value in numbers if value is not None and value > APPROX_PSNR_DB)
        return _counted(KIND_IMAGES, len(numbers), exact, approximate)
    if kind == KIND_FEATURES:
        values = _as_list(quality.get(_PER_SAMPLE_KEYS[KIND_FEATURES]))
        if values is None:
            return None
        numbers = [_finite(value) for value in values]
        exact = sum(1 for value in numbers if value is not None and value < EXACT_RELATIVE_ERROR)
        approximate = sum(1 for value in numbers if value is not None and value < APPROX_RELATIVE_ERROR)
        return _counted(KIND_FEATURES, len(numbers), exact, approximate)
    if kind == KIND_TABULAR:
        values = _as_list(quality.get(_PER_SAMPLE_KEYS[KIND_TABULAR]))
        if values is None:
            return None
        scored = len(values)
        tolerance = _finite(quality.get("tolerance_std"))
        return _counted(
            KIND_TABULAR,
            scored,
            _count_of(quality.get("exact_fraction"), scored),
            _count_of(quality.get("approx_fraction"), scored),
            tolerance_std=_DEFAULT_TOLERANCE_STD if tolerance is None else tolerance,
        )
    return None


def _counted(
    kind: str, scored: int, exact: int, approximate: int, *, tolerance_std: float = _DEFAULT_TOLERANCE_STD
) -> SampleRecovery:
    exact_rule, approximate_rule = recovery_criteria(kind, tolerance_std=tolerance_std)
    # an exact sample is also an approximate one, whatever a damaged file says
    approximate = min(scored, max(approximate, exact))
    return SampleRecovery(kind, scored, min(exact, scored), approximate, exact_rule, approximate_rule)


def _as_list(values: Any) -> list[Any] | None:
    """Per-sample figures as a list; None when there are none (not a sequence)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return None
    return list(values)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _count_of(fraction: Any, scored: int) -> int:
    """The number of flagged rows behind a mean of ``scored`` per-row flags (0 when unknown)."""
    share = _finite(fraction)
    if share is None:
        return 0
    return int(round(min(1.0, max(0.0, share)) * scored))
