"""Score reconstructions against the ground truth, for every kind of data: pick the scorer here.

This is the experimenter's side of the audit. Nothing here is ever passed to the attacker:
the attack sees only the observed update, and its output is scored here afterwards, when
ground truth exists (simulation, or a client that opted in). Without ground truth every
scorer still reports *plausibility* figures computed from the reconstruction alone.

=========  ===============================  ===================================================
kind       scorer                           per sample
=========  ===============================  ===================================================
images     :class:`ReconstructionScorer`    PSNR (dB) of the matched image
tabular    :class:`TabularScorer`           share of the row's features recovered (TabLeak)
features   :class:`FeatureScorer`           relative error of the matched feature vector
=========  ===============================  ===================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fl_attack.data.images import ImageData
from fl_attack.data.tabular_data import TabularData
from fl_attack.data.tabular_schema import TabularSchema
from fl_attack.vocabulary import INPUT_SPACE_FEATURES, INPUT_SPACES

from .scored import (
    KIND_FEATURES,
    KIND_IMAGES,
    KIND_TABULAR,
    PER_SAMPLE_METRICS,
    PLAUSIBILITY_KEY,
    SCORER_KINDS,
    Scored,
    Scorer,
)
from .scoring_features import FeatureScorer
from .scoring_images import ReconstructionScorer
from .scoring_tabular import OrdinalFeature, OrdinalSchema, TabularScorer

__all__ = [
    "KIND_FEATURES",
    "KIND_IMAGES",
    "KIND_TABULAR",
    "PER_SAMPLE_METRICS",
    "PLAUSIBILITY_KEY",
    "SCORER_KINDS",
    "FeatureScorer",
    "OrdinalFeature",
    "OrdinalSchema",
    "ReconstructionScorer",
    "Scored",
    "Scorer",
    "TabularScorer",
    "pick_scorer",
]

#: What ``pick_scorer(kind="auto")`` chooses from.
AUTO = "auto"


def _kind_of(data: Any) -> str:
    if isinstance(data, ImageData):
        return KIND_IMAGES
    if isinstance(data, (TabularData, TabularSchema, OrdinalSchema)):
        return KIND_TABULAR
    if data is None or isinstance(data, (np.ndarray, torch.Tensor)):
        return KIND_FEATURES
    raise TypeError(
        "data must be an ImageData, a TabularData, a TabularSchema, an OrdinalSchema, an array of "
        f"layer inputs or None, got {type(data).__name__}"
    )


def pick_scorer(*, kind: str = AUTO, data: Any = None, input_space: str | None = None) -> Scorer:
    """The scorer for a kind of data, chosen from ``data`` or named by ``kind``.

    Parameters
    ----------
    kind : str (default: "auto")
        ``"images"``, ``"tabular"``, ``"features"``, or ``"auto"``: features when the attacked
        layer's inputs are features (``input_space="features"``: layers precede it, so the
        raw data cannot be scored), else the kind of ``data`` (features when it is None).
    data : ImageData, TabularData, TabularSchema, OrdinalSchema, array or None (default: None)
        What the server knows of the clients' data: an image dataset (normalization and
        shape; its samples serve ground truth sent as indices), a table or its encoding, an
        ``(N, n)`` array of layer inputs (for :class:`FeatureScorer`), or nothing.
    input_space : str or None (default: None)
        ``"inputs"`` or ``"features"`` (:attr:`fl_attack.audit.LayerKeys.input_space`), when known.

    Returns
    -------
    Scorer
        A :class:`ReconstructionScorer`, :class:`TabularScorer` or :class:`FeatureScorer`.

    Raises
    ------
    ValueError
        On an unknown kind or input space, on a kind that ``data`` cannot serve (images need
        an ImageData, tabular a table or schema), or on images or tabular scoring of a layer
        whose inputs are features.
    TypeError
        On ``data`` of an unsupported type.
    """
    if kind != AUTO and kind not in SCORER_KINDS:
        raise ValueError(f"kind must be one of {(AUTO, *SCORER_KINDS)}, got {kind!r}")
    if input_space is not None and input_space not in INPUT_SPACES:
        raise ValueError(f"input_space must be one of {INPUT_SPACES} or None, got {input_space!r}")
    data_kind = _kind_of(data)
    if kind == AUTO:
        kind = KIND_FEATURES if input_space == INPUT_SPACE_FEATURES else data_kind
    if kind != KIND_FEATURES and input_space == INPUT_SPACE_FEATURES:
        raise ValueError(
            f"the attacked layer follows other layers, so its inputs are features, not {kind}: "
            "score them with kind='features'"
        )
    if kind == KIND_FEATURES:
        if isinstance(data, (np.ndarray, torch.Tensor)):
            return FeatureScorer(dataset=data)
        return FeatureScorer()
    if kind == KIND_IMAGES:
        if not isinstance(data, ImageData):
            raise ValueError(
                "kind='images' needs the image dataset (an ImageData: its normalization and image shape), "
                f"got {type(data).__name__}"
            )
        return ReconstructionScorer.from_image_data(data)
    if isinstance(data, TabularData):
        return TabularScorer(data.schema, dataset=data.features)
    if isinstance(data, (TabularSchema, OrdinalSchema)):
        return TabularScorer(data)
    raise ValueError(
        f"kind='tabular' needs a TabularData, a TabularSchema or an OrdinalSchema, got {type(data).__name__}"
    )
