"""Image data for the victims' clients: the dataset registry and the in-memory form.

Every dataset is returned as an :class:`ImageData`: normalized float32 images ``(N, C, H, W)``
with the per-channel statistics needed to map attack results back to ``[0, 1]`` pixels.
Three datasets ship with scikit-learn / scikit-image and need no download ("digits", "faces",
"photo-patches", :mod:`fl_attack.data.bundled`); "cifar10", "mnist" (:mod:`fl_attack.data.on_disk`)
and "tiny-imagenet" (:mod:`fl_attack.data.tiny_imagenet`) are read from a data root
(layout and search order: :mod:`fl_attack.data.locate`; ``fl-attack-data fetch NAME`` downloads
them), and "folder" reads any directory of images.

Datasets without a native train/test split ("digits", "faces", "photo-patches", "folder")
use a fixed one: every 5th sample (index 4, 9, 14, ...) is in "test", the rest in "train".
Split "all" returns everything (train then test for the natively split datasets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fl_attack.data.bundled import load_digits, load_faces, load_photo_patches
from fl_attack.data.locate import DATA_ENV_VAR, DatasetNotFoundError, check_dataset, data_search_paths
from fl_attack.data.on_disk import load_cifar10, load_folder, load_mnist
from fl_attack.data.raw_images import DatasetLoader, to_unit
from fl_attack.data.tiny_imagenet import load_tiny_imagenet

__all__ = [
    "DATASETS",
    "DATA_ENV_VAR",
    "SPLITS",
    "DatasetNotFoundError",
    "ImageData",
    "available_datasets",
    "check_dataset",
    "data_search_paths",
    "index_tensor",
    "load_dataset",
    "sample_batch",
]

SPLITS: tuple[str, ...] = ("train", "test", "all")


def index_tensor(
    indices: Sequence[int] | torch.Tensor | np.ndarray, length: int, *, what: str = "samples"
) -> torch.Tensor:
    """Integer indices (``int64``, flat) from integers or a boolean mask over ``length`` items.

    Raises
    ------
    ValueError
        For a mask of the wrong shape or indices out of range.
    """
    idx = torch.as_tensor(indices)
    if idx.dtype == torch.bool:
        if idx.shape != (length,):
            raise ValueError(f"boolean mask must have shape ({length},)")
        idx = idx.nonzero().flatten()
    idx = idx.to(torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < -length or int(idx.max()) >= length):
        raise ValueError(f"subset indices out of range for {length} {what}")
    return idx


@dataclass(frozen=True, eq=False)
class ImageData:
    """A labelled image dataset held in memory, normalized per channel.

    Attributes
    ----------
    name
        Registry name of the dataset.
    images
        ``(N, C, H, W)`` float32 images ``(x - mean) / std`` of pixels ``x`` in ``[0, 1]``.
    labels
        ``(N,)`` int64 class labels in ``[0, num_classes)``.
    mean, std
        Per-channel normalization statistics (length C).
    num_classes
        Number of classes.
    classes
        Class names, when known.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}"
            )
        channels = self.images.shape[1]
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(
                f"mean and std need one value per channel ({channels}), got {len(self.mean)} "
                f"and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    @property
    def input_dim(self) -> int:
        """Flattened input size ``C * H * W``."""
        c, h, w = self.image_shape
        return c * h * w

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        return mean, std

    def _as_images(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        t = torch.as_tensor(x)
        if not t.is_floating_point():
            raise ValueError(f"expected a floating-point tensor, got dtype {t.dtype}")
        if t.dim() == 2 and t.shape[1] == self.input_dim:
            return t.reshape(t.shape[0], *self.image_shape)
        if t.dim() == 4 and tuple(t.shape[1:]) == self.image_shape:
            return t
        c, h, w = self.image_shape
        raise ValueError(
            f"expected a batch of shape (B, {self.input_dim}) or (B, {c}, {h}, {w}) for "
            f"{self.name}, got {tuple(t.shape)}"
        )

    def denormalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Map normalized inputs back to pixel scale.

        Parameters
        ----------
        x
            ``(B, n)`` flat or ``(B, C, H, W)`` normalized inputs, any float dtype.

        Returns
        -------
        torch.Tensor
            ``(B, C, H, W)`` ``x * std + mean`` in x's dtype; in ``[0, 1]`` for real images
            (not clamped, so reconstruction errors stay visible).
        """
        images = self._as_images(x)
        mean, std = self._stats(images)
        return images * std + mean

    def normalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Inverse of :meth:`denormalize`: ``(B, n)`` or ``(B, C, H, W)`` pixels to inputs."""
        images = self._as_images(x)
        mean, std = self._stats(images)
        return (images - mean) / std

    def subset(self, indices: Sequence[int] | torch.Tensor | np.ndarray | slice) -> ImageData:
        """The samples at ``indices`` (integer indices, a boolean mask or a slice)."""
        idx = indices if isinstance(indices, slice) else index_tensor(indices, len(self), what="samples")
        return ImageData(
            name=self.name,
            images=self.images[idx],
            labels=self.labels[idx],
            mean=self.mean,
            std=self.std,
            num_classes=self.num_classes,
            classes=self.classes,
        )


DATASETS: dict[str, DatasetLoader] = {
    "photo-patches": load_photo_patches,
    "digits": load_digits,
    "faces": load_faces,
    "cifar10": load_cifar10,
    "mnist": load_mnist,
    "tiny-imagenet": load_tiny_imagenet,
    "folder": load_folder,
}
"""Dataset loaders by name; each takes ``(root, split, limit)``. Use :func:`load_dataset`."""


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(DATASETS)


def load_dataset(
    name: str,
    *,
    root: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
) -> ImageData:
    """Load a dataset from :data:`DATASETS` as normalized float32 images.

    Parameters
    ----------
    name
        ``"photo-patches"`` (default for the Flower app: 32x32 RGB patches of real photos,
        labelled by photo), ``"digits"`` (8x8 gray), ``"faces"`` (25x25 gray, face or not),
        ``"cifar10"``, ``"mnist"``, ``"tiny-imagenet"`` (64x64 RGB, 200 classes) or ``"folder"``.
    root
        Data root for "cifar10" / "mnist" / "tiny-imagenet" (searched alone when given;
        otherwise see :func:`data_search_paths`); the image directory for "folder"; unused by
        the bundled datasets.
    split
        ``"train"``, ``"test"`` or ``"all"``.
    limit
        Keep only the first ``limit`` samples of the split.

    Returns
    -------
    ImageData

    Raises
    ------
    ValueError
        Unknown name or split, bad limit, or an empty result.
    DatasetNotFoundError
        Data stored on disk that cannot be found: one line naming ``fl-attack-data fetch NAME``
        and the paths tried (a :class:`FileNotFoundError`).
    FileNotFoundError
        A "folder" directory that does not exist or holds no images.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {available_datasets()}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    raw = DATASETS[name](None if root is None else Path(root), split, limit)
    pixels, labels = raw.pixels, raw.labels
    if limit is not None:
        pixels, labels = pixels[:limit], labels[:limit]
    if len(labels) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    unit = torch.from_numpy(np.ascontiguousarray(to_unit(pixels)))
    mean = torch.tensor(raw.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(raw.std, dtype=torch.float32).view(1, -1, 1, 1)
    return ImageData(
        name=name,
        images=((unit - mean) / std).contiguous(),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        mean=tuple(float(v) for v in raw.mean),
        std=tuple(float(v) for v in raw.std),
        num_classes=raw.num_classes,
        classes=raw.classes,
    )


def sample_batch(
    data: ImageData,
    batch_size: int,
    *,
    seed: int | None = None,
    distinct_labels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a random client batch without replacement.

    Parameters
    ----------
    data
        The dataset.
    batch_size
        Number of samples, at most ``len(data)``.
    seed
        Seeds the draw; None uses fresh randomness.
    distinct_labels
        Require every sample to have a different label (at most as many samples as distinct
        labels present).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``inputs`` ``(B, C, H, W)``, ``labels`` ``(B,)`` and the dataset ``indices`` ``(B,)``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > len(data):
        raise ValueError(f"batch_size {batch_size} exceeds the {len(data)} samples of {data.name}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    order = torch.randperm(len(data), generator=generator)
    if distinct_labels:
        distinct = int(torch.unique(data.labels).numel())
        if batch_size > distinct:
            raise ValueError(
                f"batch_size {batch_size} with distinct_labels needs as many labels, but "
                f"{data.name} has {distinct}"
            )
        seen: set[int] = set()
        chosen: list[int] = []
        for index in order.tolist():
            label = int(data.labels[index])
            if label not in seen:
                seen.add(label)
                chosen.append(index)
                if len(chosen) == batch_size:
                    break
        indices = torch.tensor(chosen, dtype=torch.int64)
    else:
        indices = order[:batch_size].clone()
    return data.images[indices].clone(), data.labels[indices].clone(), indices
