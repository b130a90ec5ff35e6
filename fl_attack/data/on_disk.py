"""Image datasets read from disk: CIFAR-10, MNIST and a folder of images.

CIFAR-10 and MNIST are looked for under a data root (see :mod:`fl_attack.data.locate` for the
layout and the search order) and read without torchvision's integrity checks, so that the
offline CIFAR-10 subset, plain or gzipped MNIST files and small test fixtures all load alike.
"""

from __future__ import annotations

import gzip
import math
import pickle
import struct
from pathlib import Path

import numpy as np

from fl_attack.data.locate import (
    CIFAR10_BATCHES,
    MNIST_RAW,
    DatasetNotFoundError,
    locate_dataset,
)
from fl_attack.data.raw_images import RawImages, channel_stats, fixed_split

__all__ = ["CIFAR10_CLASSES", "load_cifar10", "load_folder", "load_mnist", "read_idx"]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
_MNIST_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_UBYTE = 0x08
_FOLDER_SIZE = 32
_IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"})


def _split_parts(split: str) -> list[str]:
    return ["train", "test"] if split == "all" else [split]


# --------------------------------------------------------------------------- CIFAR-10


def _cifar10_classes(meta: Path) -> tuple[str, ...]:
    if meta.is_file():
        with meta.open("rb") as fh:
            names = pickle.load(fh, encoding="latin1").get("label_names")
        if names:
            return tuple(str(n) for n in names)
    return CIFAR10_CLASSES


def _cifar10_npz(directory: Path, split: str) -> RawImages:
    parts = {
        "train": [f"data_batch_{k}_prefix.npz" for k in range(1, 6)],
        "test": ["test_batch_prefix.npz"],
    }
    wanted = [name for part in _split_parts(split) for name in parts[part]]
    files = [directory / f for f in wanted if (directory / f).is_file()]
    if not files:
        raise DatasetNotFoundError(
            "cifar10", [directory], detail=f"no {split} files ({', '.join(wanted)}) in {directory}"
        )
    xs, ys = [], []
    for path in files:
        with np.load(path) as archive:
            xs.append(archive["x"])
            ys.append(archive["y"])
    pixels = np.concatenate(xs).transpose(0, 3, 1, 2)
    labels = np.concatenate(ys).astype(np.int64)
    classes = _cifar10_classes(directory / "batches.meta")
    return RawImages(pixels, labels, CIFAR10_MEAN, CIFAR10_STD, 10, classes)


def _read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as fh:
        entry = pickle.load(fh, encoding="latin1")
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        raise ValueError(f"{path} is not a CIFAR-10 python batch (a dict with 'data' and 'labels')")
    data = np.asarray(entry["data"], dtype=np.uint8)
    labels = np.asarray(entry["labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path}: expected data (N, 3072) and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar10_batches(directory: Path, split: str) -> RawImages:
    """torchvision's ``cifar-10-batches-py/`` (the python pickles), read directly."""
    batches = directory / CIFAR10_BATCHES
    names = {"train": [f"data_batch_{k}" for k in range(1, 6)], "test": ["test_batch"]}
    read = [_read_cifar10_batch(batches / name) for part in _split_parts(split) for name in names[part]]
    pixels = np.concatenate([images for images, _ in read])
    labels = np.concatenate([targets for _, targets in read])
    classes = _cifar10_classes(batches / "batches.meta")
    return RawImages(pixels, labels, CIFAR10_MEAN, CIFAR10_STD, 10, classes)


def load_cifar10(root: Path | None, split: str, limit: int | None) -> RawImages:
    """CIFAR-10 from the ``*_prefix.npz`` offline subset or torchvision's ``cifar-10-batches-py/``."""
    directory = locate_dataset("cifar10", root=root)
    if any(directory.glob("*_prefix.npz")):
        return _cifar10_npz(directory, split)
    return _cifar10_batches(directory, split)


# --------------------------------------------------------------------------- MNIST


def read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte IDX array (the MNIST file format), plain or ``.gz``.

    Raises
    ------
    ValueError
        When the file is not a complete unsigned-byte IDX file.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    if raw[2] != _IDX_UBYTE:
        raise ValueError(f"{path}: IDX element type {raw[2]:#04x} is not unsigned byte (0x08)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    data = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header promises shape {dims} but the file holds {data.size} values")
    return data.reshape(dims)


def _idx_file(raw: Path, name: str) -> Path:
    plain = raw / name
    return plain if plain.is_file() else raw / f"{name}.gz"


def load_mnist(root: Path | None, split: str, limit: int | None) -> RawImages:
    """MNIST in torchvision's layout ``<root>/MNIST/raw`` (IDX files, plain or gzipped)."""
    raw = locate_dataset("mnist", root=root).joinpath(*MNIST_RAW)
    images, labels = [], []
    for part in _split_parts(split):
        image_name, label_name = _MNIST_SPLIT_FILES[part]
        x = read_idx(_idx_file(raw, image_name))
        y = read_idx(_idx_file(raw, label_name))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(
                f"{raw}: {image_name} must be (N, H, W) and {label_name} (N,), got {x.shape} and {y.shape}"
            )
        images.append(x)
        labels.append(y.astype(np.int64))
    classes = tuple(str(d) for d in range(10))
    return RawImages(
        np.concatenate(images)[:, None], np.concatenate(labels), MNIST_MEAN, MNIST_STD, 10, classes
    )


# --------------------------------------------------------------------------- folder


def _read_image(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB")
    width, height = rgb.size
    scale = _FOLDER_SIZE / min(width, height)
    new_w, new_h = max(_FOLDER_SIZE, round(width * scale)), max(_FOLDER_SIZE, round(height * scale))
    rgb = rgb.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = (new_w - _FOLDER_SIZE) // 2, (new_h - _FOLDER_SIZE) // 2
    rgb = rgb.crop((left, top, left + _FOLDER_SIZE, top + _FOLDER_SIZE))
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def _image_files(directory: Path, *, recursive: bool) -> list[Path]:
    pattern = "**/*" if recursive else "*"
    return sorted(p for p in directory.glob(pattern) if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES)


def load_folder(root: Path | None, split: str, limit: int | None) -> RawImages:
    """A directory of images, optionally one subfolder per class (like ``ImageFolder``).

    Images are converted to RGB, resized (bicubic) so the short side is 32 px and center
    cropped to 32x32. With class subfolders, files directly in ``root`` are ignored;
    without, every image gets label 0.
    """
    if root is None:
        raise ValueError("dataset 'folder' needs root=<directory of images>")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist or is not a directory")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and _image_files(d, recursive=True))
    if class_dirs:
        groups = [(d.name, _image_files(d, recursive=True)) for d in class_dirs]
    else:
        groups = [(root.name, _image_files(root, recursive=False))]
    files = [(label, path) for label, (_, paths) in enumerate(groups) for path in paths]
    if not files:
        raise FileNotFoundError(
            f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) found in {root} or its subfolders"
        )
    pixels = np.stack([_read_image(path) for _, path in files])
    labels = np.array([label for label, _ in files], dtype=np.int64)
    classes = tuple(name for name, _ in groups)
    mean, std = channel_stats(pixels)
    whole = RawImages(pixels, labels, mean, std, max(len(classes), 1), classes)
    return fixed_split(whole, split)
