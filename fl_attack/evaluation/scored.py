"""What every scorer returns (:class:`Scored`) and what every scorer offers (:class:`Scorer`).

A scorer turns the attacked layer's reconstructed inputs into something a person can judge:
images scored by PSNR, table rows scored feature by feature, or feature vectors scored by
relative error. The :class:`fl_attack.audit.Auditor` only calls the three methods of
:class:`Scorer`, so any of them (or a user's own) plugs in alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fl_attack.audit.observations import GroundTruth

#: The attacked layer's inputs are images (the model's first layer on pixels).
KIND_IMAGES = "images"
#: The inputs are encoded table rows (categorical and continuous features).
KIND_TABULAR = "tabular"
#: The inputs are plain feature vectors (e.g. ``fc1``'s inputs after convolutions).
KIND_FEATURES = "features"
SCORER_KINDS: tuple[str, ...] = (KIND_IMAGES, KIND_TABULAR, KIND_FEATURES)

#: Per-sample metric of each kind, as named in :attr:`Scored.per_sample_metric`.
PER_SAMPLE_METRICS: dict[str, str] = {
    KIND_IMAGES: "psnr_db",
    KIND_TABULAR: "features_recovered",
    KIND_FEATURES: "relative_error",
}

#: Key of the ground-truth-free figures in every :attr:`Scored.quality`.
PLAUSIBILITY_KEY = "plausibility"


@dataclass(frozen=True)
class Scored:
    """A reconstruction rendered and, when ground truth exists, scored.

    Attributes
    ----------
    reconstructed_images : numpy.ndarray or None
        ``(k, C, H, W)`` images in ``[0, 1]`` for the PNG grid (images only; None for other
        kinds). Matched to ``reference_images`` row by row when those are present.
    reference_images : numpy.ndarray or None
        ``(k, C, H, W)`` ground-truth images in ``[0, 1]`` (images only, when scored).
    quality : dict[str, Any]
        Scalar quality. Scored: ``kind``, ``num_reference``, ``num_matched``,
        ``exact_fraction``, ``approx_fraction``, ``batch_exact`` and the kind's own keys.
        Always: ``kind`` and ``plausibility`` (figures from the reconstruction alone).
    psnr : list[float] or None
        PSNR (dB) of every ground-truth image against its match; None for other kinds.
    kind : str
        One of :data:`SCORER_KINDS`.
    per_sample : list[float] or None
        The kind's per-sample score of every ground-truth sample (PSNR in dB, share of
        table features recovered, or relative error); None when not scored.
    per_sample_metric : str or None
        What ``per_sample`` measures (:data:`PER_SAMPLE_METRICS`); None when not scored.
    """

    reconstructed_images: np.ndarray | None
    reference_images: np.ndarray | None
    quality: dict[str, Any]
    psnr: list[float] | None
    kind: str = KIND_IMAGES
    per_sample: list[float] | None = None
    per_sample_metric: str | None = None


@runtime_checkable
class Scorer(Protocol):
    """What the auditor needs of a scorer (images, tabular rows, features, or a user's own)."""

    kind: str

    def references(self, truth: GroundTruth) -> np.ndarray:
        """The ``(k, n)`` true layer inputs of one client, from the ground truth it sent."""
        ...

    def score_against(self, reconstruction: np.ndarray | torch.Tensor, reference: np.ndarray) -> Scored:
        """Match the ``(b, n)`` reconstruction to the ``(k, n)`` reference and score it."""
        ...

    def render(self, reconstruction: np.ndarray | torch.Tensor) -> Scored:
        """The reconstruction without ground truth: rendered, with plausibility figures only."""
        ...

    def plausibility(self, reconstruction: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """Figures computed from the reconstruction alone (no ground truth)."""
        ...


def as_rows(values: np.ndarray | torch.Tensor, *, name: str) -> np.ndarray:
    """``values`` as a float64 ``(B, n)`` numpy array (trailing dimensions flattened).

    Raises
    ------
    ValueError
        If ``values`` is not a batch of at least one dimension besides the first, or not real.
    """
    if isinstance(values, torch.Tensor):
        if values.is_complex():
            raise ValueError(f"{name} must be real, got dtype {values.dtype}")
        array = values.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        array = np.asarray(values)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{name} must be a real numeric array, got dtype {array.dtype}")
        array = array.astype(np.float64)
    if array.ndim < 2:
        raise ValueError(f"{name} must be a batch of shape (B, n), got shape {tuple(array.shape)}")
    width = int(np.prod(array.shape[1:]))
    return np.ascontiguousarray(array.reshape(array.shape[0], width))


def check_pair(reconstruction: np.ndarray, reference: np.ndarray) -> None:
    """Raise a ValueError unless ``reference`` is non-empty and both have the same row width."""
    if reference.shape[0] == 0:
        raise ValueError("ground truth must hold at least one sample, got none")
    if reconstruction.shape[1] != reference.shape[1]:
        raise ValueError(
            f"reconstruction rows have {reconstruction.shape[1]} features, the ground truth "
            f"{reference.shape[1]}"
        )


def fractions(exact: np.ndarray, approx: np.ndarray) -> dict[str, Any]:
    """The shared quality keys from per-sample exact / approximate flags."""
    return {
        "exact_fraction": float(np.mean(exact)),
        "approx_fraction": float(np.mean(approx)),
        "batch_exact": bool(np.all(exact)),
    }


def unscored(*, kind: str, plausibility: dict[str, Any], images: np.ndarray | None = None) -> Scored:
    """A reconstruction rendered without ground truth: its images (if any) and plausibility figures.

    What every scorer's ``render`` returns.
    """
    return Scored(
        reconstructed_images=images,
        reference_images=None,
        quality={"kind": kind, PLAUSIBILITY_KEY: plausibility},
        psnr=None,
        kind=kind,
    )


def rows_at_indices(
    dataset: np.ndarray | torch.Tensor | None, indices: Sequence[int] | None, *, no_dataset: str
) -> np.ndarray:
    """The ``(k, n)`` rows of ``dataset`` at the ground truth's ``indices`` (duplicates once, in order).

    What every scorer's ``references`` looks up when a client sent indices instead of inputs.

    Raises
    ------
    ValueError
        ``no_dataset`` when there is no dataset; when there are no indices; on indices outside
        the dataset.
    """
    unique = list(dict.fromkeys(int(index) for index in indices or []))
    if dataset is None:
        raise ValueError(no_dataset)
    if not unique:
        raise ValueError("no ground-truth indices to score against")
    if min(unique) < 0 or max(unique) >= dataset.shape[0]:
        raise ValueError(
            f"ground-truth indices must lie in [0, {dataset.shape[0]}), got {min(unique)}..{max(unique)}"
        )
    return np.asarray(dataset[unique])


class SampleScorer(ABC):
    """What every scorer shares: rendering without ground truth, and looking up the true samples.

    A subclass sets ``kind``, ``dataset`` (the rows that ground truth sent as indices refers to,
    or None) and ``dataset_hint`` (what to do when it has none), and implements
    :meth:`plausibility`; it overrides :meth:`images` when it renders pictures and
    :meth:`sent_rows` when a client's sent inputs need more than :func:`as_rows`.
    """

    kind: str
    dataset: np.ndarray | None = None
    dataset_hint: str = ""

    @abstractmethod
    def plausibility(self, reconstruction: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """Figures computed from the reconstruction alone (no ground truth)."""

    def images(self, flat: np.ndarray | torch.Tensor) -> np.ndarray | None:
        """The reconstruction as pictures for the PNG grid; None for a kind without pictures."""
        return None

    def sent_rows(self, inputs: np.ndarray | torch.Tensor) -> np.ndarray:
        """The ``(k, n)`` rows of the inputs a client sent as its ground truth."""
        return as_rows(inputs, name="ground truth")

    def render(self, reconstruction: np.ndarray | torch.Tensor) -> Scored:
        """The reconstruction without ground truth: its pictures (if any) and plausibility figures."""
        return unscored(
            kind=self.kind, plausibility=self.plausibility(reconstruction), images=self.images(reconstruction)
        )

    def references(self, truth: GroundTruth) -> np.ndarray:
        """The ``(k, n)`` true samples of a client: the inputs it sent, or its dataset indices looked up.

        Raises
        ------
        ValueError
            On sent inputs of the wrong shape, indices without a dataset, or indices outside it.
        """
        if truth.inputs is not None:
            return self.sent_rows(truth.inputs)
        name = type(self).__name__
        return rows_at_indices(
            self.dataset,
            truth.indices,
            no_dataset=f"the client sent dataset indices but this {name} has no dataset: {self.dataset_hint}",
        )
