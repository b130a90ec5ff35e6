"""Ground truth for scoring reconstructions: read from replies, looked up, compared.

This is the experimenter's side of the audit. Nothing here is ever passed to the
attacker: the attack sees only the observed update (see :mod:`strategies.attack_runner`),
and its output is scored here afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clients.protocol import AUDIT_KEY, PARTITION_ID_KEY, SAMPLE_INDICES_KEY
from flwr.app import ConfigRecord, RecordDict


@dataclass(frozen=True)
class ClientIdentity:
    """Who sent a reply, as far as the server can tell.

    Attributes
    ----------
    node_id : int
        Flower node id of the sender.
    partition_id : int or None
        Data partition the client reported (simulation only).
    """

    node_id: int
    partition_id: int | None

    @property
    def name(self) -> str:
        """Directory-safe client name: ``partition-<id>`` or ``node-<id>``."""
        if self.partition_id is not None:
            return f"partition-{self.partition_id}"
        return f"node-{self.node_id}"


def audit_record(content: RecordDict, key: str = AUDIT_KEY) -> ConfigRecord | None:
    """The reply's audit ConfigRecord, or None when the client sent none."""
    record = content.get(key)
    return record if isinstance(record, ConfigRecord) else None


def client_identity(content: RecordDict, node_id: int, key: str = AUDIT_KEY) -> ClientIdentity:
    """Identify the sender of a reply from its metadata and optional audit record."""
    record = audit_record(content, key)
    partition = None if record is None else record.get(PARTITION_ID_KEY)
    if isinstance(partition, bool) or not isinstance(partition, int):
        partition = None
    return ClientIdentity(node_id=node_id, partition_id=partition)


def sample_indices(content: RecordDict, key: str = AUDIT_KEY) -> list[int] | None:
    """Dataset indices the client reports it trained on, or None when not reported."""
    record = audit_record(content, key)
    if record is None or SAMPLE_INDICES_KEY not in record:
        return None
    values = record[SAMPLE_INDICES_KEY]
    if isinstance(values, int) and not isinstance(values, bool):
        return [values]
    if not isinstance(values, list) or not all(
        isinstance(value, int) and not isinstance(value, bool) for value in values
    ):
        raise ValueError(f"'{SAMPLE_INDICES_KEY}' must be a list of ints, got {values!r}")
    return list(values)


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

    def score(self, reconstruction: np.ndarray | torch.Tensor, indices: list[int]) -> Scored:
        """Match a reconstruction to the samples ``indices`` and compute its quality.

        Parameters
        ----------
        reconstruction : numpy.ndarray or torch.Tensor
            ``(b, n)`` reconstructed inputs in any order.
        indices : list[int]
            Dataset indices of the samples the client trained on (duplicates are
            scored once).

        Returns
        -------
        Scored
        """
        from fl_attack.evaluation.metrics import (  # pylint: disable=import-outside-toplevel
            evaluate_reconstruction,
        )

        unique = list(dict.fromkeys(int(index) for index in indices))
        if not unique:
            raise ValueError("no ground-truth indices to score against")
        if min(unique) < 0 or max(unique) >= self._inputs.shape[0]:
            raise ValueError(
                f"ground-truth indices must lie in [0, {self._inputs.shape[0]}), "
                f"got {min(unique)}..{max(unique)}"
            )
        reference = self._inputs[unique]
        reconstructed = torch.as_tensor(reconstruction).detach().to("cpu", torch.float64)
        quality = evaluate_reconstruction(
            reconstructed,
            reference,
            denormalize=self._denormalize,
            image_shape=self.image_shape,
        )
        order = quality.order
        matched = order >= 0
        summary = {
            key: value for key, value in quality.summary().items() if key != "psnr"
        }
        return Scored(
            reconstructed_images=self.images(reconstructed[order[matched]]),
            reference_images=self.images(reference[matched]),
            quality=summary,
            psnr=[float(value) for value in quality.psnr],
        )
