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
                                               standard deviations (the scorer's per-row flags
                                               ``exact_rows`` / ``approximate_rows``)
=========  ==================================  =====================================================

A tabular row's share of recovered features does not say whether its continuous values are
exact, so rows are counted from the scorer's per-row flags; a quality stored before it had
them is counted from its ``exact_fraction`` / ``approx_fraction`` times the number of scored
rows (both are means of per-row flags, so the product is a whole number).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fl_attack.vocabulary import APPROX_PSNR_DB, APPROX_RELATIVE_ERROR, EXACT_PSNR_DB, EXACT_RELATIVE_ERROR

__all__ = [
    "KIND_FEATURES",
    "KIND_IMAGES",
    "KIND_TABULAR",
    "SampleFlags",
    "SampleRecovery",
    "recovery_criteria",
    "sample_flags",
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


@dataclass(frozen=True)
class SampleFlags:
    """Every scored sample of one attack: its figure and whether it was recovered.

    Attributes
    ----------
    kind : str
        The scorer's kind.
    values : tuple[float or None, ...]
        The kind's per-sample figure (PSNR in dB, relative error, share of a row's features
        recovered); None where it was not a finite number.
    exact, approximate : tuple[bool, ...]
        Whether each sample was recovered exactly, at least approximately.
    """

    kind: str
    values: tuple[float | None, ...]
    exact: tuple[bool, ...]
    approximate: tuple[bool, ...]


def sample_flags(*, quality: Mapping[str, Any], psnr: Sequence[Any] | None) -> SampleFlags | None:
    """Per-sample figures and recovered flags of an attack, from its quality (see the module docstring).

    Parameters
    ----------
    quality : Mapping[str, Any]
        The attack's ``quality`` (``metrics.json``), as its scorer wrote it; a record without a
        ``kind`` is an image record (written before scorers named their kind).
    psnr : Sequence or None
        The record's per-sample PSNR (images); None when not scored by PSNR.

    Returns
    -------
    SampleFlags or None
        None when the attack was not scored, or when its flags per sample are not stored (a
        tabular quality written before it held ``exact_rows`` and ``approximate_rows``). A
        figure that is missing or not a finite number (a stored NaN or infinity reads back as
        ``null``) is a scored sample that was not recovered.
    """
    kind = quality.get("kind")
    if kind is None and psnr is not None:
        kind = KIND_IMAGES
    if kind == KIND_IMAGES:
        values = _numbers(psnr if psnr is not None else quality.get("psnr"))
        if values is None:
            return None
        return _thresholded(
            kind, values, lambda value: value > EXACT_PSNR_DB, lambda value: value > APPROX_PSNR_DB
        )
    if kind == KIND_FEATURES:
        values = _numbers(quality.get(_PER_SAMPLE_KEYS[KIND_FEATURES]))
        if values is None:
            return None
        return _thresholded(
            kind,
            values,
            lambda value: value < EXACT_RELATIVE_ERROR,
            lambda value: value < APPROX_RELATIVE_ERROR,
        )
    if kind == KIND_TABULAR:
        values = _numbers(quality.get(_PER_SAMPLE_KEYS[KIND_TABULAR]))
        exact, approximate = _as_list(quality.get("exact_rows")), _as_list(quality.get("approximate_rows"))
        if values is None or exact is None or approximate is None:
            return None
        if not len(exact) == len(approximate) == len(values):
            return None
        return SampleFlags(
            kind,
            tuple(values),
            tuple(flag is True for flag in exact),
            tuple(flag is True for flag in approximate),
        )
    return None


def sample_recovery(*, quality: Mapping[str, Any], psnr: Sequence[Any] | None) -> SampleRecovery | None:
    """Count an attack's scored and recovered samples from its quality and per-sample figures.

    Parameters
    ----------
    quality : Mapping[str, Any]
        The attack's ``quality`` (``metrics.json``), as its scorer wrote it.
    psnr : Sequence or None
        The record's per-sample PSNR (images); None when not scored by PSNR.

    Returns
    -------
    SampleRecovery or None
        The counts of :func:`sample_flags`; for a tabular quality without flags per row, the
        scorer's ``exact_fraction`` and ``approx_fraction`` of its scored rows. None when the
        attack was not scored.
    """
    tolerance = _finite(quality.get("tolerance_std"))
    tolerance_std = _DEFAULT_TOLERANCE_STD if tolerance is None else tolerance
    flags = sample_flags(quality=quality, psnr=psnr)
    if flags is not None:
        return _counted(
            flags.kind,
            len(flags.values),
            sum(flags.exact),
            sum(flags.approximate),
            tolerance_std=tolerance_std,
        )
    if quality.get("kind") == KIND_TABULAR:
        values = _as_list(quality.get(_PER_SAMPLE_KEYS[KIND_TABULAR]))
        if values is None:
            return None
        scored = len(values)
        return _counted(
            KIND_TABULAR,
            scored,
            _count_of(quality.get("exact_fraction"), scored),
            _count_of(quality.get("approx_fraction"), scored),
            tolerance_std=tolerance_std,
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


def _numbers(values: Any) -> list[float | None] | None:
    listed = _as_list(values)
    return None if listed is None else [_finite(value) for value in listed]


def _thresholded(
    kind: str,
    values: list[float | None],
    exact: Callable[[float], bool],
    approximate: Callable[[float], bool],
) -> SampleFlags:
    return SampleFlags(
        kind,
        tuple(values),
        tuple(value is not None and exact(value) for value in values),
        tuple(value is not None and approximate(value) for value in values),
    )


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
