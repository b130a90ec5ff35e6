"""Score reconstructed feature vectors by relative error (e.g. ``fc1``'s inputs after convolutions).

When layers precede the attacked one, the attack recovers that layer's inputs, not the
client's raw data: a vector of features per sample. They are matched one-to-one to the true
features (Hungarian algorithm on the relative error) and each is exact below
:data:`fl_attack.vocabulary.EXACT_RELATIVE_ERROR`, approximate below
:data:`fl_attack.vocabulary.APPROX_RELATIVE_ERROR`. No dataset is needed, so
:class:`FeatureScorer` is the scorer for any app whose data the server does not know.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fl_attack.vocabulary import APPROX_RELATIVE_ERROR, EXACT_RELATIVE_ERROR

from .scored import (
    KIND_FEATURES,
    PER_SAMPLE_METRICS,
    PLAUSIBILITY_KEY,
    SampleScorer,
    Scored,
    as_rows,
    check_pair,
    fractions,
)

#: A reference row shorter than this share of the batch's longest row is scored against that
#: floor instead of its own norm (an all-zero feature vector has no relative error).
NORM_FLOOR = 1e-3
#: Entries within this share of the batch's largest magnitude count as zero (ReLU zeros): the
#: exactness threshold, since a float32 update leaves ~1e-6 residues where the truth is 0.
ZERO_TOLERANCE = EXACT_RELATIVE_ERROR
#: Relative error given to a true sample that no reconstructed row was matched to (the
#: error of guessing the zero vector).
UNMATCHED_ERROR = 1.0


def relative_error_matrix(reconstructed: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``(b, k)`` relative errors ``||r_i - x_j|| / max(||x_j||, floor)`` of every pair.

    ``floor`` is :data:`NORM_FLOOR` times the largest reference norm (1 when every reference
    row is zero). Non-finite reconstructed rows get an infinite error.
    """
    norms = np.linalg.norm(reference, axis=1)
    largest = float(norms.max()) if norms.size else 0.0
    floor = NORM_FLOOR * largest if largest > 0 else 1.0
    denominators = np.maximum(norms, floor)
    with np.errstate(invalid="ignore", over="ignore"):
        distances = np.linalg.norm(reconstructed[:, None, :] - reference[None, :, :], axis=2)
    errors = distances / denominators[None, :]
    return np.where(np.isfinite(errors), errors, np.inf)


def match_by_relative_error(
    reconstructed: np.ndarray, reference: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One-to-one matching of reconstructed rows to true rows minimising the total relative error.

    Returns
    -------
    tuple[numpy.ndarray, numpy.ndarray]
        ``order`` ``(k,)`` int64: ``reconstructed[order[j]]`` is matched to ``reference[j]``
        (-1 when unmatched, if ``b < k``), and ``errors`` ``(k,)`` float64: the relative error of
        every true row (:data:`UNMATCHED_ERROR` when unmatched).
    """
    k = reference.shape[0]
    order = np.full(k, -1, dtype=np.int64)
    errors = np.full(k, UNMATCHED_ERROR, dtype=np.float64)
    if reconstructed.shape[0] == 0:
        return order, errors
    matrix = relative_error_matrix(reconstructed, reference)
    finite = np.isfinite(matrix)
    worst = float(matrix[finite].max()) if finite.any() else 1.0
    cost = np.where(finite, matrix, max(worst, 1.0) * 1e6)
    rows, columns = linear_sum_assignment(cost)
    order[columns] = rows
    errors[columns] = matrix[rows, columns]
    return order, errors


def feature_plausibility(rows: np.ndarray) -> dict[str, Any]:
    """Ground-truth-free figures of reconstructed feature rows.

    Features after a ReLU (and max-pooling) are non-negative with many exact zeros; an exact
    recovery keeps both, while a mixture of samples usually has negative entries and fewer
    zeros. The figures mean nothing for features that can be negative.

    Returns
    -------
    dict[str, Any]
        ``non_negative_fraction`` (entries >= minus the zero tolerance), ``zero_fraction``
        (entries within :data:`ZERO_TOLERANCE` of the batch's largest magnitude from 0),
        ``non_negative_rows`` (rows without a negative entry) and ``finite_fraction``.
    """
    values = np.asarray(rows, dtype=np.float64)
    if values.size == 0:
        return {
            "non_negative_fraction": 0.0,
            "zero_fraction": 0.0,
            "non_negative_rows": 0,
            "finite_fraction": 0.0,
        }
    finite = np.isfinite(values)
    safe = np.where(finite, values, 0.0)
    scale = float(np.abs(safe).max())
    tolerance = ZERO_TOLERANCE * scale
    non_negative = finite & (safe >= -tolerance)
    return {
        "non_negative_fraction": float(non_negative.mean()),
        "zero_fraction": float((finite & (np.abs(safe) <= tolerance)).mean()),
        "non_negative_rows": int(non_negative.all(axis=1).sum()),
        "finite_fraction": float(finite.mean()),
    }


class FeatureScorer(SampleScorer):
    """Score reconstructed feature vectors by relative error; needs no dataset.

    Parameters
    ----------
    dataset : numpy.ndarray or torch.Tensor or None (default: None)
        ``(N, n)`` the attacked layer's inputs of a whole dataset, to look up ground truth
        sent as dataset indices; None accepts only ground truth sent as inputs (what
        :func:`clients.ground_truth.attach_ground_truth` sends).
    """

    kind = KIND_FEATURES
    dataset_hint = (
        "pass FeatureScorer(dataset=...), or have the client send its layer inputs (attach_ground_truth)"
    )

    def __init__(self, *, dataset: np.ndarray | torch.Tensor | None = None) -> None:
        self.dataset = None if dataset is None else as_rows(dataset, name="dataset")

    def plausibility(self, reconstruction: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """:func:`feature_plausibility` of the reconstruction (no ground truth)."""
        return feature_plausibility(as_rows(reconstruction, name="reconstruction"))

    def score_against(self, reconstruction: np.ndarray | torch.Tensor, reference: np.ndarray) -> Scored:
        """Match the ``(b, n)`` reconstruction to the ``(k, n)`` true features and score each.

        Returns
        -------
        Scored
            ``per_sample`` holds the relative error of every true sample; ``quality`` adds
            ``mean_relative_error``, ``median_relative_error``, ``max_relative_error`` and
            ``relative_error`` (the list) to the shared keys.

        Raises
        ------
        ValueError
            On an empty reference or rows of different widths.
        """
        rows = as_rows(reconstruction, name="reconstruction")
        truth = as_rows(reference, name="ground truth")
        check_pair(rows, truth)
        order, errors = match_by_relative_error(rows, truth)
        per_sample = [float(value) for value in errors]  # inf for a non-finite reconstructed row
        summary: dict[str, Any] = {
            "kind": self.kind,
            "num_reference": int(truth.shape[0]),
            "num_matched": int((order >= 0).sum()),
            **fractions(errors < EXACT_RELATIVE_ERROR, errors < APPROX_RELATIVE_ERROR),
            "mean_relative_error": float(np.mean(errors)),
            "median_relative_error": float(np.median(errors)),
            "max_relative_error": float(np.max(errors)),
            "relative_error": per_sample,
            PLAUSIBILITY_KEY: feature_plausibility(rows),
        }
        return Scored(
            reconstructed_images=None,
            reference_images=None,
            quality=summary,
            psnr=None,
            kind=self.kind,
            per_sample=per_sample,
            per_sample_metric=PER_SAMPLE_METRICS[self.kind],
        )
