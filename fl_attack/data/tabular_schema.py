"""The encoding of a tabular data set: one-hot discrete and standardized continuous features.

A :class:`TabularSchema` lists the features of a row and the encoded columns of each: a
discrete feature takes one column per category (one-hot), a continuous feature one
standardized column. It encodes records to rows and decodes (reconstructed) rows back to
records, see :func:`decode_batch`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "CONTINUOUS",
    "DISCRETE",
    "DecodedBatch",
    "Record",
    "TabularFeature",
    "TabularSchema",
    "decode_batch",
]

DISCRETE = "discrete"
CONTINUOUS = "continuous"
_KINDS = (DISCRETE, CONTINUOUS)

Record = dict[str, "str | float"]


@dataclass(frozen=True)
class TabularFeature:
    """One feature of a tabular data set and where it lives in the encoded rows.

    Attributes
    ----------
    name
        Feature name, e.g. ``"age"``.
    kind
        ``"discrete"`` (one-hot encoded) or ``"continuous"`` (standardized).
    columns
        The encoded columns of the feature: ``len(categories)`` columns for a discrete
        feature, one for a continuous one.
    categories
        Category names of a discrete feature, in column order; empty for a continuous one.
    mean, std
        Standardization of a continuous feature (``z = (x - mean) / std``); 0 and 1 for a
        discrete one.
    integer
        Whether every training value of a continuous feature is an integer (all of Adult's
        are), so that decoded values may be rounded.
    """

    name: str
    kind: str
    columns: slice
    categories: tuple[str, ...] = ()
    mean: float = 0.0
    std: float = 1.0
    integer: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"feature {self.name!r}: kind must be one of {_KINDS}, got {self.kind!r}")
        start, stop = self.columns.start, self.columns.stop
        unit_step = self.columns.step in (None, 1)
        if start is None or stop is None or start < 0 or stop <= start or not unit_step:
            raise ValueError(
                f"feature {self.name!r}: columns must be a slice start:stop, 0 <= start < stop, "
                f"got {self.columns}"
            )
        if self.kind == DISCRETE:
            if len(self.categories) < 1 or len(set(self.categories)) != len(self.categories):
                raise ValueError(
                    f"discrete feature {self.name!r} needs distinct categories, got {self.categories}"
                )
            if self.width != len(self.categories):
                raise ValueError(
                    f"discrete feature {self.name!r} has {len(self.categories)} categories but "
                    f"{self.width} columns"
                )
        else:
            if self.width != 1 or self.categories:
                raise ValueError(
                    f"continuous feature {self.name!r} takes exactly one column and no categories"
                )
            if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
                raise ValueError(
                    f"continuous feature {self.name!r} needs a finite mean and a positive std, "
                    f"got mean={self.mean}, std={self.std}"
                )

    @property
    def width(self) -> int:
        """Number of encoded columns."""
        return int(self.columns.stop - self.columns.start)

    @property
    def is_discrete(self) -> bool:
        """True for a one-hot encoded feature."""
        return self.kind == DISCRETE


@dataclass(frozen=True)
class DecodedBatch:
    """An encoded batch mapped back to feature values, column-wise.

    Attributes
    ----------
    discrete
        ``(B, F_d)`` int64 category index of every discrete feature (argmax of its one-hot
        group), in the order of :attr:`TabularSchema.discrete`.
    continuous
        ``(B, F_c)`` float64 values of every continuous feature in original units, in the
        order of :attr:`TabularSchema.continuous`.
    """

    discrete: np.ndarray
    continuous: np.ndarray


@dataclass(frozen=True)
class TabularSchema:
    """The encoding of a tabular data set: its features and their encoded columns.

    Attributes
    ----------
    features
        Every feature, in column order; their columns tile ``0:input_dim`` without gaps.
    """

    features: tuple[TabularFeature, ...]

    def __post_init__(self) -> None:
        if not self.features:
            raise ValueError("a schema needs at least one feature")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        position = 0
        for feature in self.features:
            if feature.columns.start != position:
                raise ValueError(
                    f"feature {feature.name!r} starts at column {feature.columns.start}, expected "
                    f"{position}: the features' columns must tile the row in order"
                )
            position = feature.columns.stop

    @property
    def input_dim(self) -> int:
        """Width n of an encoded row."""
        return int(self.features[-1].columns.stop)

    @property
    def names(self) -> tuple[str, ...]:
        """Feature names in column order."""
        return tuple(f.name for f in self.features)

    @property
    def discrete(self) -> tuple[TabularFeature, ...]:
        """The discrete (one-hot) features."""
        return tuple(f for f in self.features if f.kind == DISCRETE)

    @property
    def continuous(self) -> tuple[TabularFeature, ...]:
        """The continuous (standardized) features."""
        return tuple(f for f in self.features if f.kind == CONTINUOUS)

    def feature(self, name: str) -> TabularFeature:
        """The feature called ``name``."""
        for feature in self.features:
            if feature.name == name:
                return feature
        raise ValueError(f"no feature {name!r}; features: {list(self.names)}")

    def check_batch(self, x: Any, *, name: str = "x") -> np.ndarray:
        """Validate an encoded batch and return it as a float64 numpy array.

        Raises
        ------
        ValueError
            When ``x`` is not a real ``(B, input_dim)`` batch or holds NaN / Inf.
        """
        if isinstance(x, torch.Tensor):
            if x.is_complex():
                raise ValueError(f"{name} must be real, got dtype {x.dtype}")
            array = x.detach().to(device="cpu", dtype=torch.float64).numpy()
        else:
            array = np.asarray(x)
            if array.dtype.kind not in "biuf":
                raise ValueError(f"{name} must be a real numeric array, got dtype {array.dtype}")
            array = array.astype(np.float64)
        if array.ndim != 2 or array.shape[1] != self.input_dim:
            raise ValueError(
                f"{name} must be an encoded batch of shape (B, {self.input_dim}), got {tuple(array.shape)}"
            )
        if not np.isfinite(array).all():
            bad = int((~np.isfinite(array)).any(axis=1).sum())
            raise ValueError(f"{name} contains NaN or Inf values (in {bad} of {array.shape[0]} rows)")
        return array

    def encode(self, records: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """Encode records (feature name to value) as ``(B, input_dim)`` float32 rows.

        Parameters
        ----------
        records
            One mapping per row with a value for every feature: a category name (str) for a
            discrete feature, a number for a continuous one. Extra keys are ignored.

        Raises
        ------
        ValueError
            On a missing feature, an unknown category or a non-finite continuous value.
        """
        rows = np.zeros((len(records), self.input_dim), dtype=np.float64)
        for i, record in enumerate(records):
            for feature in self.features:
                if feature.name not in record:
                    raise ValueError(f"record {i} has no value for feature {feature.name!r}")
                value = record[feature.name]
                if feature.kind == DISCRETE:
                    index = _category_index(feature, value, where=f"record {i}")
                    rows[i, feature.columns.start + index] = 1.0
                else:
                    number = _as_number(feature, value, where=f"record {i}")
                    rows[i, feature.columns.start] = (number - feature.mean) / feature.std
        return torch.from_numpy(rows.astype(np.float32))

    def decode_columns(self, x: Any) -> DecodedBatch:
        """Decode an encoded batch column-wise (see :class:`DecodedBatch`)."""
        array = self.check_batch(x)
        discrete = (
            np.stack([array[:, f.columns].argmax(axis=1) for f in self.discrete], axis=1)
            if self.discrete
            else np.zeros((array.shape[0], 0), dtype=np.int64)
        )
        continuous = (
            np.stack([array[:, f.columns.start] * f.std + f.mean for f in self.continuous], axis=1)
            if self.continuous
            else np.zeros((array.shape[0], 0), dtype=np.float64)
        )
        return DecodedBatch(discrete=discrete.astype(np.int64), continuous=continuous)


def _category_index(feature: TabularFeature, value: Any, *, where: str) -> int:
    try:
        return feature.categories.index(str(value).strip())
    except ValueError:
        raise ValueError(
            f"{where}: unknown category {value!r} of feature {feature.name!r}; known: "
            f"{list(feature.categories)}"
        ) from None


def _as_number(feature: TabularFeature, value: Any, *, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: continuous feature {feature.name!r} needs a number, got {value!r}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{where}: continuous feature {feature.name!r} is not finite ({value!r})")
    return number


def decode_batch(x: Any, *, schema: TabularSchema, round_integers: bool = False) -> list[Record]:
    """Map an encoded ``(B, n)`` batch back to records.

    Parameters
    ----------
    x
        Encoded rows (tensor or array, any real dtype), e.g. an attack's ``Reconstruction.inputs``.
    schema
        The encoding.
    round_integers
        Round continuous features whose training values are all integers (all of Adult's) to
        the nearest integer; otherwise return the de-standardized values as they are.

    Returns
    -------
    list[dict]
        One dict per row, feature name to value: the category name of the largest entry of
        each one-hot group, ``z * std + mean`` (float) for each continuous feature.

    Raises
    ------
    ValueError
        When ``x`` does not have ``schema.input_dim`` columns or holds NaN / Inf.
    """
    decoded = schema.decode_columns(x)
    records: list[Record] = []
    for i in range(decoded.discrete.shape[0]):
        values: dict[str, str | float] = {}
        for j, feature in enumerate(schema.discrete):
            values[feature.name] = feature.categories[int(decoded.discrete[i, j])]
        for j, feature in enumerate(schema.continuous):
            value = float(decoded.continuous[i, j])
            if round_integers and feature.integer:
                value = float(round(value))
            values[feature.name] = value
        records.append({name: values[name] for name in schema.names})
    return records
