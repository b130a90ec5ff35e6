"""Un-normalized images as the dataset loaders return them, and the helpers they share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["TEST_EVERY", "DatasetLoader", "RawImages", "bundled", "channel_stats", "fixed_split", "to_unit"]

TEST_EVERY = 5
"""Datasets without a native split put every 5th sample (index 4, 9, ...) in "test"."""


@dataclass(frozen=True, eq=False)
class RawImages:
    """Images before normalization.

    Attributes
    ----------
    pixels
        ``(N, C, H, W)`` uint8, or float in ``[0, 1]``.
    labels
        ``(N,)`` int64 class labels.
    mean, std
        Per-channel normalization statistics of the dataset (pixel scale ``[0, 1]``).
    num_classes
        Number of classes.
    classes
        Class names, when known.
    """

    pixels: np.ndarray
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    classes: tuple[str, ...] | None


class DatasetLoader(Protocol):
    """A dataset loader of the registry: ``loader(root, split, limit)``.

    ``root`` is the data root (None: search), ``split`` one of "train", "test", "all";
    ``limit`` (or None) may be used to read only the first samples, the caller cuts anyway.
    """

    def __call__(self, root: Path | None, split: str, limit: int | None) -> RawImages: ...


def to_unit(pixels: np.ndarray) -> np.ndarray:
    """float32 pixels in ``[0, 1]`` (uint8 divided by 255)."""
    if pixels.dtype == np.uint8:
        return pixels.astype(np.float32) / np.float32(255.0)
    return pixels.astype(np.float32)


def channel_stats(pixels: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of ``(N, C, H, W)`` pixels, rounded to 4 digits (std 1 if flat)."""
    unit = to_unit(pixels).astype(np.float64)
    mean = unit.mean(axis=(0, 2, 3))
    std = unit.std(axis=(0, 2, 3))
    std = np.where(std > 1e-6, std, 1.0)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)


def fixed_split(data: RawImages, split: str) -> RawImages:
    """Every 5th sample to "test"; statistics stay those of the whole dataset."""
    if split == "all":
        return data
    is_test = np.arange(len(data.labels)) % TEST_EVERY == TEST_EVERY - 1
    keep = is_test if split == "test" else ~is_test
    return RawImages(
        data.pixels[keep], data.labels[keep], data.mean, data.std, data.num_classes, data.classes
    )


def bundled(pixels: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], split: str) -> RawImages:
    """A dataset without a native split: whole-dataset statistics, then :func:`fixed_split`."""
    mean, std = channel_stats(pixels)
    whole = RawImages(pixels, labels.astype(np.int64), mean, std, len(classes), classes)
    return fixed_split(whole, split)
