"""Tiny ImageNet loader on a small synthetic folder in the official layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack.data.images import DatasetNotFoundError, ImageData, check_dataset, load_dataset
from fl_attack.data.tiny_imagenet import tiny_imagenet_files
from tests.fake_datasets import TINY_WNIDS, write_tiny_imagenet

SORTED_WNIDS = sorted(TINY_WNIDS)  # n01, n02, n03


def _pixels(data: ImageData) -> np.ndarray:
    unit = data.denormalize(data.images)
    return (unit * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


@pytest.fixture()
def tiny_root(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    written = write_tiny_imagenet(tmp_path / "tiny-imagenet" / "tiny-imagenet-200")
    return tmp_path, written


def test_train_split_round_robin_over_sorted_classes(tiny_root: tuple[Path, dict[str, Any]]) -> None:
    root, written = tiny_root
    data = load_dataset("tiny-imagenet", root=root)
    assert data.image_shape == (3, 64, 64) and len(data) == 9 and data.num_classes == 3
    assert data.classes == ("goldfish", "bullfrog", "n03")  # words.txt's first name, else the wnid
    assert data.labels.tolist() == [0, 1, 2] * 3  # image 0 of every class, then image 1, ...
    expected = np.stack([written["train"][label][rank] for rank in range(3) for label in range(3)])
    assert np.array_equal(_pixels(data), expected)
    assert data.mean == (0.485, 0.456, 0.406) and data.std == (0.229, 0.224, 0.225)


def test_val_is_the_test_split_and_all_is_train_then_val(tiny_root: tuple[Path, dict[str, Any]]) -> None:
    root, written = tiny_root
    test = load_dataset("tiny-imagenet", root=root, split="test")
    assert len(test) == 4
    assert test.labels.tolist() == [SORTED_WNIDS.index(wnid) for _, wnid in written["val"]]
    assert np.array_equal(_pixels(test), np.stack([a for a, _ in written["val"]]))
    both = load_dataset("tiny-imagenet", root=root, split="all")
    assert len(both) == 13 and torch.equal(both.images[9:], test.images)


def test_limit_decodes_only_the_first_images(tiny_root: tuple[Path, dict[str, Any]]) -> None:
    root, _ = tiny_root
    directory = root / "tiny-imagenet" / "tiny-imagenet-200"
    files, wnids = tiny_imagenet_files(directory, "train")
    assert wnids == SORTED_WNIDS and [label for _, label in files[:4]] == [0, 1, 2, 0]
    files[5][0].write_bytes(b"not an image")  # past the limit: never opened
    head = load_dataset("tiny-imagenet", root=root, limit=4)
    assert head.labels.tolist() == [0, 1, 2, 0]
    with pytest.raises(OSError, match="cannot identify image file"):
        load_dataset("tiny-imagenet", root=root, limit=6)


def test_layouts_accepted(tiny_root: tuple[Path, dict[str, Any]]) -> None:
    root, _ = tiny_root
    reference = load_dataset("tiny-imagenet", root=root, limit=3)
    for alternative in (root / "tiny-imagenet", root / "tiny-imagenet" / "tiny-imagenet-200"):
        # the folder that holds tiny-imagenet-200/, and the extracted folder itself
        again = load_dataset("tiny-imagenet", root=alternative, limit=3)
        assert torch.equal(again.images, reference.images)
    check_dataset("tiny-imagenet", root=root)  # raises when missing


def test_bad_files_are_named(tiny_root: tuple[Path, dict[str, Any]]) -> None:
    root, _ = tiny_root
    directory = root / "tiny-imagenet" / "tiny-imagenet-200"
    (directory / "val" / "val_annotations.txt").write_text("val_0.png\tn99\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations\.txt:1: expected .* wnid of wnids\.txt"):
        load_dataset("tiny-imagenet", root=root, split="test")
    from PIL import Image

    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(
        directory / "train" / "n01" / "images" / "n01_0.png"
    )
    with pytest.raises(ValueError, match=r"n01_0\.png is 32x32; Tiny ImageNet images are 64x64"):
        load_dataset("tiny-imagenet", root=root, limit=1)


def test_partial_copy_is_reported(tmp_path: Path) -> None:
    directory = tmp_path / "tiny-imagenet-200"
    write_tiny_imagenet(directory)
    (directory / "val" / "val_annotations.txt").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("tiny-imagenet", root=tmp_path)
    assert str(info.value).startswith("tiny-imagenet is not on this machine: run `fl-attack-data fetch")
    assert str(info.value).endswith(f"({directory} lacks val/val_annotations.txt)")
