"""Score reconstructed table rows feature by feature: categories exact, continuous values within a tolerance.

Two encodings of a row are understood: one-hot categories with standardized continuous
features (:class:`fl_attack.data.tabular.TabularSchema`, UCI Adult as SPEAR and TabLeak
encode it), and one standardized column per feature with categories as integer codes
(:class:`OrdinalSchema`, as Flower's ``fl-tabular`` example encodes Adult). Rows are matched
one-to-one on their encoded values (:func:`fl_attack.evaluation.metrics.match_samples`, as
:func:`fl_attack.data.tabular.score_reconstruction` does), decoded, and compared as TabLeak
does: a category counts when it is right, a continuous value when it lies within
``tolerance_std`` (TabLeak: 0.319) standard deviations of the true one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fl_attack.data.tabular_schema import DecodedBatch, TabularSchema
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR

from .metrics import match_samples
from .scored import (
    KIND_TABULAR,
    PER_SAMPLE_METRICS,
    PLAUSIBILITY_KEY,
    SampleScorer,
    Scored,
    as_rows,
    fractions,
)

#: TabLeak's tolerance: a continuous value is recovered within this many standard deviations.
TABLEAK_TOLERANCE_STD = 0.319
#: A decoded category (a one-hot group, or an integer code) is valid within this distance.
CATEGORY_TOLERANCE = 1e-3


@dataclass(frozen=True)
class OrdinalFeature:
    """One column of an ordinal-encoded table: a category code or a continuous value, standardized.

    Attributes
    ----------
    name : str
        Feature name.
    categories : tuple[str, ...]
        Category names by code (code ``i`` is ``categories[i]``); empty for a continuous feature.
    mean, std : float
        Standardization ``z = (value - mean) / std`` of the code or value.
    """

    name: str
    categories: tuple[str, ...] = ()
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        if not (np.isfinite(self.mean) and np.isfinite(self.std) and self.std > 0):
            raise ValueError(
                f"feature {self.name!r} needs a finite mean and a positive std, got {self.mean}, {self.std}"
            )
        if len(set(self.categories)) != len(self.categories):
            raise ValueError(f"feature {self.name!r} has repeated categories {self.categories}")

    @property
    def is_discrete(self) -> bool:
        """True for a categorical feature (an integer code)."""
        return bool(self.categories)


@dataclass(frozen=True)
class OrdinalSchema:
    """An ordinal-encoded table: one standardized column per feature, in order.

    Attributes
    ----------
    features : tuple[OrdinalFeature, ...]
        Every feature in column order.
    """

    features: tuple[OrdinalFeature, ...]

    def __post_init__(self) -> None:
        if not self.features:
            raise ValueError("a schema needs at least one feature")
        names = [feature.name for feature in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")

    @classmethod
    def fit(
        cls, raw: np.ndarray, *, names: Sequence[str], categories: Mapping[str, Sequence[str]]
    ) -> OrdinalSchema:
        """Standardize each column of ``raw`` ``(N, F)`` (codes for categories) by its mean and std.

        A constant column keeps std 1. ``categories`` names the categories of each
        categorical feature by code; the others are continuous.

        Raises
        ------
        ValueError
            On a shape that does not match ``names``, a non-finite value, an unknown name in
            ``categories``, or a code outside a feature's categories.
        """
        values = np.asarray(raw, dtype=np.float64)
        if values.ndim != 2 or values.shape[1] != len(names) or values.shape[0] == 0:
            raise ValueError(f"raw must be a non-empty (N, {len(names)}) table, got shape {values.shape}")
        if not np.isfinite(values).all():
            raise ValueError("raw holds NaN or Inf values")
        unknown = sorted(set(categories) - set(names))
        if unknown:
            raise ValueError(f"categories given for unknown features {unknown}; features: {list(names)}")
        features = []
        for column, name in enumerate(names):
            labels = tuple(categories.get(name, ()))
            codes = values[:, column]
            if labels and (
                codes.min() < 0 or codes.max() > len(labels) - 1 or (codes != np.round(codes)).any()
            ):
                raise ValueError(f"feature {name!r} needs integer codes in [0, {len(labels) - 1}]")
            std = float(codes.std())
            features.append(OrdinalFeature(name, labels, float(codes.mean()), std if std > 1e-12 else 1.0))
        return cls(tuple(features))

    @property
    def input_dim(self) -> int:
        """Width of an encoded row (one column per feature)."""
        return len(self.features)

    @property
    def names(self) -> tuple[str, ...]:
        """Feature names in column order."""
        return tuple(feature.name for feature in self.features)

    @property
    def discrete(self) -> tuple[OrdinalFeature, ...]:
        """The categorical features."""
        return tuple(feature for feature in self.features if feature.is_discrete)

    @property
    def continuous(self) -> tuple[OrdinalFeature, ...]:
        """The continuous features."""
        return tuple(feature for feature in self.features if not feature.is_discrete)

    def _columns(self, discrete: bool) -> list[int]:
        return [index for index, feature in enumerate(self.features) if feature.is_discrete == discrete]

    def check_batch(self, x: Any, *, name: str = "x") -> np.ndarray:
        """``x`` as a finite float64 ``(B, input_dim)`` array, or a ValueError naming the problem."""
        rows = as_rows(x, name=name)
        if rows.shape[1] != self.input_dim:
            raise ValueError(
                f"{name} must be an encoded batch of shape (B, {self.input_dim}), got {rows.shape}"
            )
        if not np.isfinite(rows).all():
            raise ValueError(f"{name} contains NaN or Inf values")
        return rows

    def encode(self, raw: np.ndarray) -> np.ndarray:
        """``(B, F)`` raw values (codes for categories) as ``(B, F)`` float32 standardized rows."""
        values = np.asarray(raw, dtype=np.float64)
        if values.ndim != 2 or values.shape[1] != self.input_dim:
            raise ValueError(f"raw must have shape (B, {self.input_dim}), got {values.shape}")
        mean = np.array([feature.mean for feature in self.features])
        std = np.array([feature.std for feature in self.features])
        return np.asarray(((values - mean) / std).astype(np.float32))

    def destandardize(self, x: Any) -> np.ndarray:
        """Encoded rows back to raw values: codes (unrounded) and continuous values."""
        rows = self.check_batch(x)
        mean = np.array([feature.mean for feature in self.features])
        std = np.array([feature.std for feature in self.features])
        return np.asarray(rows * std + mean)

    def decode_columns(self, x: Any) -> DecodedBatch:
        """Decode column-wise: each code rounded to the nearest valid category, values de-standardized."""
        raw = self.destandardize(x)
        discrete = self._columns(True)
        highest = np.array([len(feature.categories) - 1 for feature in self.discrete], dtype=np.float64)
        codes = np.clip(np.round(raw[:, discrete]), 0.0, highest) if discrete else raw[:, :0]
        return DecodedBatch(discrete=codes.astype(np.int64), continuous=raw[:, self._columns(False)])

    def category_validity(self, x: Any) -> np.ndarray:
        """``(B, F_d)`` whether each code lies within :data:`CATEGORY_TOLERANCE` of a valid category."""
        raw = self.destandardize(x)[:, self._columns(True)]
        highest = np.array([len(feature.categories) - 1 for feature in self.discrete], dtype=np.float64)
        nearest = np.round(raw)
        return np.asarray(
            (np.abs(raw - nearest) <= CATEGORY_TOLERANCE) & (nearest >= 0) & (nearest <= highest)
        )


def one_hot_validity(schema: TabularSchema, x: Any) -> np.ndarray:
    """``(B, F_d)`` whether each one-hot group is within :data:`CATEGORY_TOLERANCE` of a one-hot vector."""
    rows = schema.check_batch(x)
    valid = []
    for feature in schema.discrete:
        group = rows[:, feature.columns]
        target = np.zeros_like(group)
        target[np.arange(group.shape[0]), group.argmax(axis=1)] = 1.0
        valid.append(np.abs(group - target).max(axis=1) <= CATEGORY_TOLERANCE)
    return np.stack(valid, axis=1) if valid else np.zeros((rows.shape[0], 0), dtype=bool)


class TabularScorer(SampleScorer):
    """Score reconstructed table rows: categories exact, continuous values within a tolerance.

    Parameters
    ----------
    schema : TabularSchema or OrdinalSchema
        How a row is encoded (one-hot, or one column per feature).
    dataset : numpy.ndarray or torch.Tensor or None (default: None)
        ``(N, n)`` encoded rows, to look up ground truth sent as dataset indices.
    tolerance_std : float (default: 0.319, TabLeak's)
        A continuous value is recovered within this many of its feature's standard deviations.
    """

    kind = KIND_TABULAR
    dataset_hint = (
        "pass TabularScorer(schema, dataset=...), or have the client send its rows (attach_ground_truth)"
    )

    def __init__(
        self,
        schema: TabularSchema | OrdinalSchema,
        *,
        dataset: np.ndarray | torch.Tensor | None = None,
        tolerance_std: float = TABLEAK_TOLERANCE_STD,
    ) -> None:
        if not isinstance(schema, (TabularSchema, OrdinalSchema)):
            raise TypeError(
                f"schema must be a TabularSchema or an OrdinalSchema, got {type(schema).__name__}"
            )
        if not (np.isfinite(tolerance_std) and tolerance_std > 0):
            raise ValueError(f"tolerance_std must be a positive number, got {tolerance_std}")
        self.schema = schema
        self.tolerance_std = float(tolerance_std)
        self.dataset = None if dataset is None else schema.check_batch(dataset, name="dataset")

    def plausibility(self, reconstruction: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """Ground-truth-free figures: how many decoded categories are valid codes or one-hot groups.

        Returns
        -------
        dict[str, Any]
            ``valid_category_fraction`` (None without categorical features) and
            ``plausible_rows`` (rows whose every category is valid). An exact recovery scores
            1.0; a mixture of rows rarely lands on valid categories.
        """
        rows = self.schema.check_batch(reconstruction, name="reconstruction")
        if isinstance(self.schema, OrdinalSchema):
            valid = self.schema.category_validity(rows)
        else:
            valid = one_hot_validity(self.schema, rows)
        return {
            "valid_category_fraction": float(valid.mean()) if valid.size else None,
            "plausible_rows": int(valid.all(axis=1).sum()),
        }

    def sent_rows(self, inputs: np.ndarray | torch.Tensor) -> np.ndarray:
        """The encoded rows a client sent, checked against the schema."""
        return self.schema.check_batch(inputs, name="ground truth")

    def score_against(self, reconstruction: np.ndarray | torch.Tensor, reference: np.ndarray) -> Scored:
        """Match the reconstructed rows to the true rows and score every feature.

        A true row without a reconstructed row is compared with an all-zero encoded row (every
        continuous value at its mean; its categories count as wrong). A row is *exact* when
        every category is right and every continuous value lies within
        :data:`fl_attack.vocabulary.EXACT_RELATIVE_ERROR` standard deviations, *approximate*
        when every category is right and every continuous value within ``tolerance_std``.

        Returns
        -------
        Scored
            ``per_sample``: the share of each true row's features recovered (TabLeak's
            criterion). ``quality`` adds ``discrete_accuracy``, ``continuous_accuracy`` and
            ``tableak_accuracy`` (%), ``continuous_mae`` (original units), ``feature_accuracy``
            (%), ``feature_mae``, ``tolerance_std``, ``features_recovered`` and the per-row
            flags ``exact_rows`` and ``approximate_rows``.

        Raises
        ------
        ValueError
            On rows of the wrong width, NaN / Inf, or an empty reference.
        """
        rows = self.schema.check_batch(reconstruction, name="reconstruction")
        truth = self.schema.check_batch(reference, name="ground truth")
        if truth.shape[0] == 0:
            raise ValueError("ground truth must hold at least one row, got none")
        order = match_samples(torch.from_numpy(rows), torch.from_numpy(truth)).numpy()
        matched = order >= 0
        aligned = np.zeros_like(truth)
        aligned[matched] = rows[order[matched]]
        true, guess = self.schema.decode_columns(truth), self.schema.decode_columns(aligned)

        correct = (guess.discrete == true.discrete) & matched[:, None]
        errors = np.abs(guess.continuous - true.continuous)
        std = np.array([feature.std for feature in self.schema.continuous], dtype=np.float64)
        within = errors <= self.tolerance_std * std
        exact_values = errors <= EXACT_RELATIVE_ERROR * std
        recovered = np.concatenate([correct, within], axis=1)
        per_row = recovered.mean(axis=1)
        names_d = [feature.name for feature in self.schema.discrete]
        names_c = [feature.name for feature in self.schema.continuous]
        exact_rows = correct.all(axis=1) & exact_values.all(axis=1) & matched
        approximate_rows = correct.all(axis=1) & within.all(axis=1) & matched
        summary: dict[str, Any] = {
            "kind": self.kind,
            "num_reference": int(truth.shape[0]),
            "num_matched": int(matched.sum()),
            **fractions(exact_rows, approximate_rows),
            "discrete_accuracy": _percent(correct),
            "continuous_accuracy": _percent(within),
            "tableak_accuracy": _percent(recovered),
            "continuous_mae": float(errors.mean()) if errors.size else None,
            "feature_accuracy": {
                **{name: _percent(correct[:, j]) for j, name in enumerate(names_d)},
                **{name: _percent(within[:, j]) for j, name in enumerate(names_c)},
            },
            "feature_mae": {name: float(errors[:, j].mean()) for j, name in enumerate(names_c)},
            "tolerance_std": self.tolerance_std,
            "features_recovered": [float(value) for value in per_row],
            "exact_rows": [bool(flag) for flag in exact_rows],
            "approximate_rows": [bool(flag) for flag in approximate_rows],
            PLAUSIBILITY_KEY: self.plausibility(rows),
        }
        return Scored(
            reconstructed_images=None,
            reference_images=None,
            quality=summary,
            psnr=None,
            kind=self.kind,
            per_sample=[float(value) for value in per_row],
            per_sample_metric=PER_SAMPLE_METRICS[self.kind],
        )


def _percent(flags: np.ndarray) -> float | None:
    return 100.0 * float(np.mean(flags)) if flags.size else None
