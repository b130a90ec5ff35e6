"""Tabular data in memory (:class:`TabularData`), client batches, and reconstruction scores."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fl_attack.data.images import index_tensor
from fl_attack.data.tabular_schema import Record, TabularSchema, decode_batch
from fl_attack.evaluation.metrics import match_samples

__all__ = ["TabularData", "TabularScore", "sample_tabular_batch", "score_reconstruction"]


@dataclass(frozen=True)
class TabularScore:
    """How well one tabular batch was reconstructed (SPEAR Table 2 metrics).

    Attributes
    ----------
    discrete_accuracy
        Percentage of (row, discrete feature) pairs whose category was recovered.
    continuous_mae
        Mean absolute error over (row, continuous feature) pairs, in original units.
    feature_accuracy
        Accuracy (%) of each discrete feature.
    feature_mae
        MAE (original units) of each continuous feature.
    exact_fraction
        Fraction of true rows recovered exactly: every category right and every continuous
        value within ``exact_tolerance`` (0.5 by default: it rounds to the true integer).
    order
        ``(B_ref,)`` int64 matching of :func:`fl_attack.evaluation.metrics.match_samples`:
        ``reconstructed[order[i]]`` is matched to ``reference[i]``, -1 when unmatched.
    num_matched
        True rows that have a reconstructed row.
    """

    discrete_accuracy: float
    continuous_mae: float
    feature_accuracy: dict[str, float]
    feature_mae: dict[str, float]
    exact_fraction: float
    order: torch.Tensor
    num_matched: int = 0

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary: plain floats, ints and dicts."""
        return {
            "discrete_accuracy": float(self.discrete_accuracy),
            "continuous_mae": float(self.continuous_mae),
            "exact_fraction": float(self.exact_fraction),
            "num_reference": int(self.order.numel()),
            "num_matched": int(self.num_matched),
            "feature_accuracy": {k: float(v) for k, v in self.feature_accuracy.items()},
            "feature_mae": {k: float(v) for k, v in self.feature_mae.items()},
        }


def score_reconstruction(
    reconstructed: Any,
    reference: Any,
    *,
    schema: TabularSchema,
    exact_tolerance: float = 0.5,
) -> TabularScore:
    """Score a reconstructed tabular batch against the true one, as SPEAR Table 2 does.

    Rows are first matched one-to-one (Hungarian algorithm on the mean squared error of the
    *encoded* rows, :func:`fl_attack.evaluation.metrics.match_samples`, so that standardized continuous
    features and one-hot groups weigh alike), then decoded (:func:`decode_batch`) and compared
    feature by feature.

    Parameters
    ----------
    reconstructed
        ``(B_rec, n)`` encoded rows in any order, e.g. ``Reconstruction.inputs``.
    reference
        ``(B_ref, n)`` the true encoded rows (B_ref >= 1).
    schema
        The encoding of both.
    exact_tolerance
        Largest absolute error (original units) of a continuous value in an exact row.

    Returns
    -------
    TabularScore
        True rows left without a reconstruction (``B_rec < B_ref``) count as wrong in every
        discrete feature and as the feature mean (a guess without information) in every
        continuous one.

    Raises
    ------
    ValueError
        On a batch of the wrong width, NaN / Inf entries or an empty reference.
    """
    rec = schema.check_batch(reconstructed, name="reconstructed")
    ref = schema.check_batch(reference, name="reference")
    if ref.shape[0] == 0:
        raise ValueError("reference must contain at least one row")
    if not exact_tolerance >= 0:
        raise ValueError(f"exact_tolerance must be >= 0, got {exact_tolerance}")
    order = match_samples(torch.from_numpy(rec), torch.from_numpy(ref))
    matched = (order >= 0).numpy()
    # Unmatched true rows are compared with an all-zero encoded row: the mean of every
    # continuous feature, and a category that is then counted wrong below.
    aligned = np.zeros_like(ref)
    aligned[matched] = rec[order.numpy()[matched]]
    true = schema.decode_columns(ref)
    guess = schema.decode_columns(aligned)

    correct = guess.discrete == true.discrete
    correct[~matched] = False
    errors = np.abs(guess.continuous - true.continuous)
    feature_accuracy = {f.name: 100.0 * float(correct[:, j].mean()) for j, f in enumerate(schema.discrete)}
    feature_mae = {f.name: float(errors[:, j].mean()) for j, f in enumerate(schema.continuous)}
    exact_rows = correct.all(axis=1) & (errors <= exact_tolerance).all(axis=1) & matched
    return TabularScore(
        discrete_accuracy=100.0 * float(correct.mean()) if correct.size else math.nan,
        continuous_mae=float(errors.mean()) if errors.size else math.nan,
        feature_accuracy=feature_accuracy,
        feature_mae=feature_mae,
        exact_fraction=float(exact_rows.mean()),
        order=order,
        num_matched=int(matched.sum()),
    )


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class TabularData:
    """A labelled tabular data set held in memory, encoded for a fully connected network.

    Attributes
    ----------
    name
        Data set name (``"adult"``).
    features
        ``(N, n)`` float32 encoded rows: one-hot discrete features, standardized continuous
        ones (see :attr:`schema`).
    labels
        ``(N,)`` int64 class labels (Adult: 1 when income > 50K).
    schema
        The encoding; its continuous statistics are those of the training split.
    classes
        Class names, by label.
    split
        ``"train"``, ``"test"`` or ``"all"``.
    """

    name: str
    features: torch.Tensor
    labels: torch.Tensor
    schema: TabularSchema
    classes: tuple[str, ...]
    split: str = "train"

    def __post_init__(self) -> None:
        if self.features.dim() != 2 or self.features.shape[1] != self.schema.input_dim:
            raise ValueError(
                f"features must be (N, {self.schema.input_dim}), got {tuple(self.features.shape)}"
            )
        if self.labels.shape != (self.features.shape[0],):
            raise ValueError(
                f"labels must have shape ({self.features.shape[0]},), got {tuple(self.labels.shape)}"
            )
        if len(self.classes) < 2:
            raise ValueError(f"need at least two classes, got {self.classes}")

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def input_dim(self) -> int:
        """Width n of an encoded row (105 for Adult)."""
        return self.schema.input_dim

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    def decode(self, x: Any, *, round_integers: bool = False) -> list[Record]:
        """:func:`decode_batch` with this data set's schema."""
        return decode_batch(x, schema=self.schema, round_integers=round_integers)

    def encode(self, records: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """:meth:`TabularSchema.encode` with this data set's schema."""
        return self.schema.encode(records)

    def score(self, reconstructed: Any, reference: Any, *, exact_tolerance: float = 0.5) -> TabularScore:
        """:func:`score_reconstruction` with this data set's schema."""
        return score_reconstruction(
            reconstructed, reference, schema=self.schema, exact_tolerance=exact_tolerance
        )

    def subset(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> TabularData:
        """The rows at ``indices`` (integers or a boolean mask)."""
        idx = index_tensor(indices, len(self), what="rows")
        return TabularData(
            name=self.name,
            features=self.features[idx],
            labels=self.labels[idx],
            schema=self.schema,
            classes=self.classes,
            split=self.split,
        )


def sample_tabular_batch(
    data: TabularData, *, batch_size: int, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a random client batch of rows without replacement.

    Parameters
    ----------
    data
        The data set.
    batch_size
        Number of rows, at most ``len(data)``.
    seed
        Seeds the draw; None uses fresh randomness.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``features`` ``(B, n)`` float32, ``labels`` ``(B,)`` int64 and the row ``indices``.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > len(data):
        raise ValueError(f"batch_size {batch_size} exceeds the {len(data)} rows of {data.name}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    indices = torch.randperm(len(data), generator=generator)[:batch_size].clone()
    return data.features[indices].clone(), data.labels[indices].clone(), indices
