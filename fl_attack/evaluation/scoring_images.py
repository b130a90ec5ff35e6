"""Score reconstructed images: render them, match them to the client's samples, measure PSNR.

This is the experimenter's side of the audit. Nothing here is ever passed to the attacker:
the attack sees only the observed update, and its output is scored here afterwards, when
ground truth exists (simulation, or a client that opted in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fl_attack.audit.observations import GroundTruth

from .scored import (
    KIND_IMAGES,
    PER_SAMPLE_METRICS,
    PLAUSIBILITY_KEY,
    SampleScorer,
    Scored,
    as_rows,
)

#: A denormalized pixel counts as inside ``[0, 1]`` within this margin.
RANGE_MARGIN = 1e-3
#: A pixel lies on the 8-bit grid when within this distance of a multiple of 1/255 (an exact
#: float64 recovery of float32 inputs is ~1e-7 away; a random value lands this close 0.5% of the time).
GRID_TOLERANCE = 1e-5


def image_plausibility(pictures: np.ndarray) -> dict[str, Any]:
    """Ground-truth-free figures of ``(B, C, H, W)`` denormalized (unclipped) reconstructions.

    Returns
    -------
    dict[str, Any]
        ``in_range_fraction``: share of pixels inside ``[0, 1]`` (true photos: 1.0);
        ``on_8bit_grid_fraction``: share of pixels within :data:`GRID_TOLERANCE` of a multiple
        of 1/255 (an exact recovery of 8-bit photos: 1.0; a mixture or noise: about 0.005);
        ``finite_fraction``: share of finite pixels. All 0.0 for an empty batch.
    """
    values = np.asarray(pictures, dtype=np.float64)
    if values.size == 0:
        return {"in_range_fraction": 0.0, "on_8bit_grid_fraction": 0.0, "finite_fraction": 0.0}
    finite = np.isfinite(values)
    safe = np.where(finite, values, -1.0)
    in_range = (safe >= -RANGE_MARGIN) & (safe <= 1.0 + RANGE_MARGIN)
    on_grid = in_range & (np.abs(safe * 255.0 - np.round(safe * 255.0)) <= GRID_TOLERANCE * 255.0)
    return {
        "in_range_fraction": float(in_range.mean()),
        "on_8bit_grid_fraction": float(on_grid.mean()),
        "finite_fraction": float(finite.mean()),
    }


class ReconstructionScorer(SampleScorer):
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

    kind = KIND_IMAGES

    def __init__(
        self,
        inputs: np.ndarray | torch.Tensor,
        *,
        denormalize: Callable[[torch.Tensor], torch.Tensor],
        image_shape: tuple[int, ...],
    ) -> None:
        values = torch.as_tensor(inputs).detach().to(device="cpu", dtype=torch.float64)
        self._inputs = values.reshape(values.shape[0], -1)
        self.dataset = self._inputs.numpy()
        self._denormalize = denormalize
        self.image_shape = tuple(int(size) for size in image_shape)

    @classmethod
    def from_image_data(cls, data: Any) -> ReconstructionScorer:
        """Build from a :class:`fl_attack.data.images.ImageData`."""
        return cls(data.images, denormalize=data.denormalize, image_shape=tuple(data.image_shape))

    def _pictures(self, flat: np.ndarray | torch.Tensor) -> np.ndarray:
        """``(B, n)`` model inputs as ``(B, C, H, W)`` float64 images, not clipped."""
        values = torch.as_tensor(flat).detach().to(device="cpu", dtype=torch.float64)
        if values.shape[0] == 0:
            return np.zeros((0, *self.image_shape))
        pictures = torch.as_tensor(self._denormalize(values)).detach().to("cpu", torch.float64)
        return np.asarray(pictures.reshape(values.shape[0], *self.image_shape).numpy())

    def images(self, flat: np.ndarray | torch.Tensor) -> np.ndarray:
        """``(B, n)`` model inputs as ``(B, C, H, W)`` float64 images clipped to ``[0, 1]``."""
        return np.asarray(np.clip(np.nan_to_num(self._pictures(flat), nan=0.0), 0.0, 1.0))

    def plausibility(self, reconstruction: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """:func:`image_plausibility` of the denormalized reconstruction (no ground truth)."""
        return image_plausibility(self._pictures(as_rows(reconstruction, name="reconstruction")))

    def sent_rows(self, inputs: np.ndarray | torch.Tensor) -> np.ndarray:
        """The samples a client sent, as float64 rows."""
        reference = np.asarray(inputs, dtype=np.float64)
        return reference.reshape(reference.shape[0], -1)

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
            ``psnr`` and ``per_sample`` hold the PSNR of every reference sample.
        """
        from fl_attack.evaluation.metrics import evaluate_reconstruction

        reference_t = torch.as_tensor(np.asarray(reference, dtype=np.float64))
        if reference_t.ndim != 2 or reference_t.shape[0] == 0:
            raise ValueError(
                f"ground truth must be a non-empty (k, n) array, got shape {tuple(reference_t.shape)}"
            )
        reconstructed = torch.as_tensor(reconstruction).detach().to("cpu", torch.float64)
        if reconstructed.shape[1:] != reference_t.shape[1:]:
            raise ValueError(
                f"reconstruction rows have {reconstructed.shape[1]} features, "
                f"the ground truth {reference_t.shape[1]}"
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
        summary["kind"] = self.kind
        summary[PLAUSIBILITY_KEY] = self.plausibility(reconstructed)
        values = [float(value) for value in quality.psnr]
        return Scored(
            reconstructed_images=self.images(reconstructed[order[matched]]),
            reference_images=self.images(reference_t[matched]),
            quality=summary,
            psnr=values,
            kind=self.kind,
            per_sample=list(values),
            per_sample_metric=PER_SAMPLE_METRICS[self.kind],
        )
