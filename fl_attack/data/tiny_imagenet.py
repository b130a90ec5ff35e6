"""Tiny ImageNet (CS231n): 64x64 RGB images of 200 ImageNet classes.

The official ``tiny-imagenet-200.zip``, extracted (``fl-attack-data fetch tiny-imagenet``)::

    tiny-imagenet-200/
      wnids.txt                      the class ids (WordNet ids), one per line
      words.txt                      optional: "<wnid><TAB><name>, <synonym>, ..."
      train/<wnid>/images/*.JPEG     500 training images per class
      val/images/*.JPEG              10,000 validation images
      val/val_annotations.txt        "<file><TAB><wnid><TAB><box>" per validation image

Labels follow the sorted class ids; class names are the first name of ``words.txt`` (the id
where it has none). Split "train" is ``train/``, split "test" the labelled ``val/`` (the
official test images carry no labels). Training images are ordered round-robin over the
classes (first image of every class, then the second, ...), so the first ``limit`` samples
cover the classes evenly, and only those files are decoded. Images are normalized with
ImageNet's channel statistics, the usual choice for this subset of ImageNet.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fl_attack.data.locate import locate_dataset
from fl_attack.data.raw_images import RawImages

__all__ = ["TINY_IMAGENET_SIZE", "load_tiny_imagenet", "tiny_imagenet_files"]

TINY_IMAGENET_SIZE = 64
TINY_IMAGENET_MEAN = (0.485, 0.456, 0.406)
TINY_IMAGENET_STD = (0.229, 0.224, 0.225)
_SUFFIXES = frozenset({".jpeg", ".jpg", ".png"})


def _class_ids(directory: Path) -> list[str]:
    lines = (directory / "wnids.txt").read_text(encoding="utf-8").split()
    wnids = sorted(set(lines))
    if not wnids:
        raise ValueError(f"{directory / 'wnids.txt'} lists no class ids")
    return wnids


def _class_names(directory: Path, wnids: list[str]) -> tuple[str, ...]:
    names = {wnid: wnid for wnid in wnids}
    words = directory / "words.txt"
    if words.is_file():
        for line in words.read_text(encoding="utf-8").splitlines():
            wnid, _, text = line.partition("\t")
            if wnid in names and text.strip():
                names[wnid] = text.split(",")[0].strip()
    return tuple(names[wnid] for wnid in wnids)


def _train_files(directory: Path, wnids: list[str]) -> list[tuple[Path, int]]:
    per_class: list[list[Path]] = []
    for wnid in wnids:
        images = directory / "train" / wnid / "images"
        if not images.is_dir():
            raise FileNotFoundError(f"tiny-imagenet class {wnid} of wnids.txt has no folder {images}")
        per_class.append(sorted(p for p in images.iterdir() if p.suffix.lower() in _SUFFIXES))
    ordered: list[tuple[Path, int]] = []
    for rank in range(max((len(files) for files in per_class), default=0)):
        for label, files in enumerate(per_class):
            if rank < len(files):
                ordered.append((files[rank], label))
    return ordered


def _val_files(directory: Path, wnids: list[str]) -> list[tuple[Path, int]]:
    label_of = {wnid: k for k, wnid in enumerate(wnids)}
    annotations = directory / "val" / "val_annotations.txt"
    files: list[tuple[Path, int]] = []
    for number, line in enumerate(annotations.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise ValueError(
                f"{annotations}:{number}: expected '<file>\\t<wnid>...' with a wnid of wnids.txt, "
                f"got {line!r}"
            )
        files.append((directory / "val" / "images" / fields[0], label_of[fields[1]]))
    return files


def tiny_imagenet_files(directory: Path, split: str) -> tuple[list[tuple[Path, int]], list[str]]:
    """The ``(image file, label)`` pairs of a split in load order, and the sorted class ids.

    Parameters
    ----------
    directory
        The extracted ``tiny-imagenet-200`` folder.
    split
        ``"train"``, ``"test"`` (the labelled validation images) or ``"all"`` (train then test).
    """
    wnids = _class_ids(directory)
    files: list[tuple[Path, int]] = []
    if split in ("train", "all"):
        files += _train_files(directory, wnids)
    if split in ("test", "all"):
        files += _val_files(directory, wnids)
    return files, wnids


def _read_rgb64(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB")  # a few Tiny ImageNet JPEGs are gray
    if rgb.size != (TINY_IMAGENET_SIZE, TINY_IMAGENET_SIZE):
        raise ValueError(
            f"{path} is {rgb.size[0]}x{rgb.size[1]}; Tiny ImageNet images are "
            f"{TINY_IMAGENET_SIZE}x{TINY_IMAGENET_SIZE}"
        )
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def load_tiny_imagenet(root: Path | None, split: str, limit: int | None) -> RawImages:
    """Tiny ImageNet as uint8 ``(N, 3, 64, 64)``; decodes only the first ``limit`` images."""
    directory = locate_dataset("tiny-imagenet", root=root)
    files, wnids = tiny_imagenet_files(directory, split)
    if limit is not None:
        files = files[:limit]
    shape = (3, TINY_IMAGENET_SIZE, TINY_IMAGENET_SIZE)
    pixels = np.empty((len(files), *shape), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        pixels[i] = _read_rgb64(path)
    labels = np.array([label for _, label in files], dtype=np.int64)
    classes = _class_names(directory, wnids)
    return RawImages(pixels, labels, TINY_IMAGENET_MEAN, TINY_IMAGENET_STD, len(wnids), classes)
