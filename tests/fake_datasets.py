"""Tiny datasets written in the real on-disk formats, for tests that must run offline."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

CIFAR_BATCHES = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]
MNIST_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
TINY_WNIDS = ("n02", "n01", "n03")  # deliberately unsorted, like the real wnids.txt
ADULT_ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, "
    "2174, 0, 40, United-States, <=50K",
    "50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, "
    "Male, 0, 0, 13, United-States, <=50K",
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, Male, 0, 0, "
    "40, United-States, <=50K",
    "31, Private, 45781, Masters, 14, Never-married, Prof-specialty, Not-in-family, White, Female, "
    "14084, 0, 50, United-States, >50K",
]


def write_cifar10_batches(directory: Path, *, per_batch: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """torchvision's ``cifar-10-batches-py/`` under ``directory``; returns the images per batch."""
    batches = directory / "cifar-10-batches-py"
    batches.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for name in CIFAR_BATCHES:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with (batches / name).open("wb") as fh:
            pickle.dump({"batch_label": name, "data": data, "labels": labels}, fh)
        written[name] = data.reshape(-1, 3, 32, 32)
    with (batches / "batches.meta").open("wb") as fh:
        pickle.dump({"label_names": [f"k{j}" for j in range(10)]}, fh)
    return written


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_mnist_raw(
    raw: Path, *, train: int = 5, test: int = 3, gz: bool = False, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four MNIST IDX files in ``raw`` (``<root>/MNIST/raw``); returns (images, labels) per split."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for split, count in (("train", train), ("test", test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        for name, array in zip(MNIST_NAMES[split], (images, labels), strict=True):
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(array)))
            else:
                (raw / name).write_bytes(idx_bytes(array))
        written[split] = (images, labels)
    return written


def write_tiny_imagenet(
    directory: Path, *, per_class: int = 3, val: int = 4, seed: int = 0
) -> dict[str, Any]:
    """A Tiny-ImageNet-format folder (``tiny-imagenet-200``) with the classes of :data:`TINY_WNIDS`.

    Returns the pixel arrays (H, W, 3) per class for "train" (a list per sorted wnid) and the
    ``(array, wnid)`` pairs of "val" in annotation order.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "wnids.txt").write_text("\n".join(TINY_WNIDS) + "\n")
    (directory / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tbullfrog\nn09\tother\n")
    train: list[list[np.ndarray]] = []
    for wnid in sorted(TINY_WNIDS):
        images = directory / "train" / wnid / "images"
        images.mkdir(parents=True)
        (directory / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        arrays = []
        for k in range(per_class):
            array = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
            Image.fromarray(array).save(images / f"{wnid}_{k}.png")  # lossless stand-in for JPEG
            arrays.append(array)
        train.append(arrays)
    (directory / "val" / "images").mkdir(parents=True)
    annotations, val_items = [], []
    for k in range(val):
        wnid = TINY_WNIDS[k % len(TINY_WNIDS)]
        array = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
        Image.fromarray(array).save(directory / "val" / "images" / f"val_{k}.png")
        annotations.append(f"val_{k}.png\t{wnid}\t0\t0\t63\t63")
        val_items.append((array, wnid))
    (directory / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
    return {"train": train, "val": val_items}


ADULT_TEXT = {
    "adult.data": "\n".join(ADULT_ROWS) + "\n",
    "adult.test": "|1x3 Cross validator\n" + "\n".join(row + "." for row in ADULT_ROWS[:2]),
    "adult.names": "| fake names file\n",
}
"""File contents: 4 training rows, 2 test rows (UCI's junk first line and '.' labels), a names file."""


def write_adult(directory: Path) -> None:
    """The three UCI Adult files of :data:`ADULT_TEXT` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in ADULT_TEXT.items():
        (directory / name).write_text(text)
