"""Image datasets that ship with scikit-learn and scikit-image: no download, no data root.

"digits" (8x8 gray), "faces" (25x25 gray) and "photo-patches" (32x32 RGB patches of the
bundled photos). None has a native split: see :func:`fl_attack.data.raw_images.fixed_split`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_attack.data.raw_images import RawImages, bundled

__all__ = ["load_digits", "load_faces", "load_photo_patches"]

_PATCH = 32
_PATCH_SHORT_SIDE = 256


def load_digits(root: Path | None, split: str, limit: int | None) -> RawImages:
    """scikit-learn's 1797 8x8 handwritten digits (values 0..16), 10 classes."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    pixels = (bunch.images.astype(np.float32) / np.float32(16.0))[:, None]
    return bundled(pixels, bunch.target, tuple(str(d) for d in range(10)), split)


def load_faces(root: Path | None, split: str, limit: int | None) -> RawImages:
    """scikit-image's LFW subset: 200 25x25 gray images, the first 100 faces (label 0)."""
    from skimage import data as skdata

    images: np.ndarray = _call_untyped(skdata.lfw_subset)
    if images.dtype != np.uint8:
        images = np.clip(images, 0.0, 1.0).astype(np.float32)
    labels = (np.arange(images.shape[0]) >= images.shape[0] // 2).astype(np.int64)
    return bundled(images[:, None], labels, ("face", "non-face"), split)


def _call_untyped(function: Any) -> Any:
    # scikit-image's loaders carry no annotations; call them through Any.
    return function()


@lru_cache(maxsize=1)
def _source_photos() -> tuple[tuple[str, np.ndarray], ...]:
    from skimage import data as skdata
    from sklearn.datasets import load_sample_images

    sample = load_sample_images()
    photos = [(Path(path).stem, image) for path, image in zip(sample.filenames, sample.images, strict=True)]
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry"):
        photos.append((name, _call_untyped(getattr(skdata, name))))
    photos.append(("motorcycle", _call_untyped(skdata.stereo_motorcycle)[0]))
    return tuple((name, np.ascontiguousarray(image[..., :3])) for name, image in photos)


def _photo_to_patches(image: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(image.copy()).permute(2, 0, 1)[None].to(torch.float64) / 255.0
    height, width = image.shape[:2]
    scale = _PATCH_SHORT_SIDE / min(height, width)
    new_h, new_w = round(height * scale), round(width * scale)
    x = torch.nn.functional.interpolate(
        x, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False
    )
    rows, cols = new_h // _PATCH, new_w // _PATCH
    top, left = (new_h - rows * _PATCH) // 2, (new_w - cols * _PATCH) // 2
    x = x[0, :, top : top + rows * _PATCH, left : left + cols * _PATCH]
    patches = x.reshape(3, rows, _PATCH, cols, _PATCH).permute(1, 3, 0, 2, 4)
    patches = patches.reshape(rows * cols, 3, _PATCH, _PATCH)
    # Quantize like a stored 8-bit photo, so pixel values are exact multiples of 1/255.
    quantized: np.ndarray = (patches * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()
    return quantized


@lru_cache(maxsize=1)
def _photo_patches_all() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    photos = _source_photos()
    patches = [_photo_to_patches(image) for _, image in photos]
    labels = np.concatenate([np.full(len(p), k, dtype=np.int64) for k, p in enumerate(patches)])
    return np.concatenate(patches), labels, tuple(name for name, _ in photos)


def load_photo_patches(root: Path | None, split: str, limit: int | None) -> RawImages:
    """Non-overlapping 32x32 RGB patches of the photos bundled with scikit-learn / -image.

    Each photo is resized (antialiased bilinear) so its short side is 256 px and center
    cropped to whole patches, which are taken row by row. The label is the source photo.
    """
    pixels, labels, classes = _photo_patches_all()
    return bundled(pixels, labels, classes, split)
