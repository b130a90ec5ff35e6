"""Score reconstructions against the ground truth: render, match, measure.

This is the experimenter's side of the audit. Nothing here is ever passed to the
attacker: the attack sees only the observed update, and its output is scored here
afterwards, when ground truth exists (simulation, or a client that opted in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fl_attack.audit.observations import GroundTruth
@dataclass(frozen=True)
class Scored:
    """A reconstruction rendered as images and, when possible, scored.

    Attributes
    ----------
    reconstructed_images : numpy.ndarray
        ``(k, C, H, W)`` images in ``[0, 1]``; matched to ``reference_images`` row by
        row when those are present (unmatched references have no column).
    reference_images : numpy.ndarray or None
        ``(k, C, H, W)`` ground-truth images in ``[0, 1]``.
    quality : dict[str, Any]
        Scalar quality (mean PSNR, exact fraction, ...); empty when not scored.
    psnr : list[float] or None
        PSNR of every ground-truth sample against its match.
    """

    reconstructed_images: np.ndarray
    reference_images: np.ndarray | None
    quality: dict[str, Any]
    psnr: list[float] | None


class ReconstructionScorer:
    """Turn reconstructions into images and score them against the client's samples.

    Parameters
    ----------
    inputs : numpy.ndarray or torch.Tensor
        ``(N, ...)`` the whole dataset as the model sees it (normalized); flattened to
        ``(N, n)``. Sample ``i`` is the one clients report as index ``i``.
    denormalize : Callable
        Maps a ``(B, n)`` normalized batch to ``(B, C, H, W)`` images in ``[0, 1]``
        (e.g. ``ImageData.denormalize``).
    image_shape : tuple[int, ...]
        ``(C, H, W)`` of one sample.
    """

    def __init__(
        self,
        inputs: np.ndarray | torch.Tensor,
        *,
        denormalize: Callable[[torch.Tensor], torch.Tensor],
        image_shape: tuple[int, ...],
    ) -> None:
        values = torch.as_tensor(inputs).detach().to(device="cpu", dtype=torch.float64)
        self._inputs = values.reshape(values.shape[0], -1)
        self._denormalize = denormalize
        self.image_shape = tuple(int(size) for size in image_shape)

    @classmethod
    def from_image_data(cls, data: Any) -> ReconstructionScorer:
        """Build from a :class:`fl_attack.data.images.ImageData`."""
        return cls(data.images, denormalize=data.denormalize, image_shape=tuple(data.image_shape))

    def images(self, flat: np.ndarray | torch.Tensor) -> np.ndarray:
        """``(B, n)`` model inputs as ``(B, C, H, W)`` float64 images clipped to ``[0, 1]``."""
        values = torch.as_tensor(flat).detach().to(device="cpu", dtype=torch.float64)
        if values.shape[0] == 0:
            return np.zeros((0, *self.image_shape))
        pictures = torch.as_tensor(self._denormalize(values)).detach().to("cpu", torch.float64)
        pictures = pictures.reshape(values.shape[0], *self.image_shape)
        return np.clip(np.nan_to_num(pictures.numpy(), nan=0.0), 0.0, 1.0)

    def render(self, reconstruction: np.ndarray | torch.Tensor) -> Scored:
        """Images of a reconstruction without ground truth (nothing is scored)."""
        return Scored(
            reconstructed_images=self.images(reconstruction),
            reference_images=None,
            quality={},
            psnr=None,
        )

    def references(self, truth: GroundTruth) -> np.ndarray:
        """The ``(k, n)`` true samples of a client: its sent inputs, or its dataset indices looked up.

        Raises
        ------
        ValueError
            On indices outside the dataset, or inputs whose width differs from the dataset's.
        """
        if truth.inputs is not None:
            reference = np.asarray(truth.inputs, dtype=np.float64)
            return reference.reshape(reference.shape[0], -1)
        unique = list(dict.fromkeys(int(index) for index in truth.indices or []))
        if not unique:
            raise ValueError("no ground-truth indices to score against")
        if min(unique) < 0 or max(unique) >= self._inputs.shape[0]:
            raise ValueError(
                f"ground-truth indices must lie in [0, {self._inputs.shape[0]}), got {min(unique)}..{max(unique)}"
            )
        return np.asarray(self._inputs[unique].numpy())

    def score(self, reconstruction: np.ndarray | torch.Tensor, indices: list[int]) -> Scored:
        """Score a reconstruction against the dataset samples ``indices`` (duplicates scored once)."""
        return self.score_against(reconstruction, self.references(GroundTruth(indices=list(indices))))

    def score_against(self, reconstruction: np.ndarray | torch.Tensor, reference: np.ndarray) -> Scored:
        """Match a reconstruction to the ``(k, n)`` true samples and compute its quality.

        Parameters
        ----------
        reconstruction : numpy.ndarray or torch.Tensor
            ``(b, n)`` reconstructed inputs in any order.
        reference : numpy.ndarray
            ``(k, n)`` the samples the client trained on.

        Returns
        -------
        Scored
        """
        from fl_attack.evaluation.metrics import evaluate_reconstruction

        reference_t = torch.as_tensor(np.asarray(reference, dtype=np.float64))
        if reference_t.ndim != 2 or reference_t.shape[0] == 0:
            raise ValueError(f"ground truth must be a non-empty (k, n) array, got shape {tuple(reference_t.shape)}")
        reconstructed = torch.as_tensor(reconstruction).detach().to("cpu", torch.float64)
        if reconstructed.shape[1:] != reference_t.shape[1:]:
            raise ValueError(
                f"reconstruction rows have {reconstructed.shape[1]} features, the ground truth {reference_t.shape[1]}"
            )
        quality = evaluate_reconstruction(
            reconstructed,
            reference_t,
            denormalize=self._denormalize,
            image_shape=self.image_shape,
        )
        order = quality.order
        matched = order >= 0
        summary = {key: value for key, value in quality.summary().items() if key != "psnr"}
        return Scored(
            reconstructed_images=self.images(reconstructed[order[matched]]),
            reference_images=self.images(reference_t[matched]),
            quality=summary,
            psnr=[float(value) for value in quality.psnr],
        )
