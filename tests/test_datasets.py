"""Offline image datasets: shapes, normalization, splits, on-disk layouts and sampling."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_attack.data.images import (
    DATA_ENV_VAR,
    DATASETS,
    DatasetNotFoundError,
    ImageData,
    available_datasets,
    check_dataset,
    data_search_paths,
    load_dataset,
    sample_batch,
)
from tests.fake_datasets import write_cifar10_batches, write_mnist_raw

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _check_normalized(data: ImageData) -> None:
    assert data.images.dtype == torch.float32 and data.labels.dtype == torch.int64
    assert data.images.shape == (len(data), *data.image_shape)
    pixels = data.denormalize(data.images)
    assert pixels.dtype == torch.float32 and pixels.shape == data.images.shape
    assert float(pixels.min()) >= -1e-5 and float(pixels.max()) <= 1 + 1e-5
    assert int(data.labels.min()) >= 0 and int(data.labels.max()) < data.num_classes


def test_registry_lists_datasets() -> None:
    names = available_datasets()
    assert names == list(DATASETS)
    assert {"photo-patches", "digits", "faces", "cifar10", "mnist", "tiny-imagenet", "folder"} <= set(names)


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError, match=r"available.*digits"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="split"):
        load_dataset("digits", split="validation")
    with pytest.raises(ValueError, match="limit"):
        load_dataset("digits", limit=0)


def test_digits() -> None:
    data = load_dataset("digits", split="all")
    assert len(data) == 1797 and data.image_shape == (1, 8, 8) and data.input_dim == 64
    assert data.num_classes == 10
    _check_normalized(data)
    from sklearn.datasets import load_digits

    expected = torch.from_numpy(load_digits().images[:3] / 16.0).float()
    assert torch.allclose(data.denormalize(data.images[:3])[:, 0], expected, atol=1e-6)
    # Normalized with whole-dataset statistics.
    assert abs(float(data.images.mean())) < 1e-3 and float(data.images.std()) == pytest.approx(1, abs=1e-2)


def test_fixed_split_every_fifth_sample() -> None:
    whole = load_dataset("faces", split="all")
    train = load_dataset("faces")
    test = load_dataset("faces", split="test")
    assert len(train) == 160 and len(test) == 40
    assert torch.equal(test.images, whole.images[4::5])
    assert torch.equal(train.images[:4], whole.images[:4])
    assert train.mean == whole.mean == test.mean


def test_faces_labels() -> None:
    data = load_dataset("faces", split="all")
    assert data.image_shape == (1, 25, 25) and data.classes == ("face", "non-face")
    assert data.labels[:100].eq(0).all() and data.labels[100:].eq(1).all()
    _check_normalized(data)


def test_photo_patches() -> None:
    data = load_dataset("photo-patches")
    again = load_dataset("photo-patches")
    assert data.image_shape == (3, 32, 32) and data.input_dim == 3072
    assert data.classes is not None and data.num_classes == len(data.classes) >= 6
    assert len(data) >= 400
    assert torch.equal(data.images, again.images)
    _check_normalized(data)
    # 8-bit photos: de-normalized pixels sit on the 1/255 grid.
    pixels = data.denormalize(data.images[:20].double()) * 255
    assert torch.allclose(pixels, pixels.round(), atol=1e-3)
    assert set(data.labels.tolist()) == set(range(data.num_classes))
    assert float(data.images.flatten(1).std(dim=1).median()) > 0.1  # real content, not blank


def test_limit_keeps_first_samples() -> None:
    full = load_dataset("digits")
    head = load_dataset("digits", limit=7)
    assert len(head) == 7 and torch.equal(head.images, full.images[:7])


def test_denormalize_accepts_flat_and_keeps_dtype() -> None:
    data = load_dataset("digits", limit=4)
    flat = data.images.flatten(1).double()
    out = data.denormalize(flat)
    assert out.dtype == torch.float64 and out.shape == (4, 1, 8, 8)
    assert torch.allclose(data.normalize(out).float(), data.images, atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        data.denormalize(torch.zeros(4, 63))
    with pytest.raises(ValueError, match="floating"):
        data.denormalize(torch.zeros(4, 64, dtype=torch.int64))


def test_subset() -> None:
    data = load_dataset("digits", limit=10)
    sub = data.subset([3, 1])
    assert len(sub) == 2 and torch.equal(sub.images[1], data.images[1])
    assert sub.num_classes == data.num_classes and sub.mean == data.mean
    assert len(data.subset(slice(0, 5))) == 5
    assert torch.equal(data.subset(data.labels == data.labels[0]).labels.unique(), data.labels[:1])
    with pytest.raises(ValueError, match="out of range"):
        data.subset([10])


def test_sample_batch() -> None:
    data = load_dataset("digits", limit=50)
    x, y, idx = sample_batch(data, 8, seed=0)
    x2, _, idx2 = sample_batch(data, 8, seed=0)
    assert x.shape == (8, 1, 8, 8) and torch.equal(x, x2) and torch.equal(idx, idx2)
    assert len(set(idx.tolist())) == 8
    assert torch.equal(x, data.images[idx]) and torch.equal(y, data.labels[idx])
    _, labels, _ = sample_batch(data, 10, seed=1, distinct_labels=True)
    assert sorted(labels.tolist()) == list(range(10))
    with pytest.raises(ValueError, match="exceeds"):
        sample_batch(data, 51)
    with pytest.raises(ValueError, match="distinct"):
        sample_batch(data, 11, distinct_labels=True)


def _fake_cifar_npz(directory: Path) -> None:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, size in [(f"data_batch_{k}_prefix.npz", 3) for k in range(1, 6)] + [
        ("test_batch_prefix.npz", 2)
    ]:
        np.savez(
            directory / name,
            x=rng.integers(0, 256, size=(size, 32, 32, 3), dtype=np.uint8),
            y=rng.integers(0, 10, size=size).astype(np.int64),
        )
    with (directory / "batches.meta").open("wb") as fh:
        pickle.dump({"label_names": [f"c{k}" for k in range(10)]}, fh)


def test_cifar10_npz_layout(tmp_path: Path) -> None:
    _fake_cifar_npz(tmp_path / "cifar10")
    train = load_dataset("cifar10", root=tmp_path)
    test = load_dataset("cifar10", root=tmp_path / "cifar10", split="test")
    assert len(train) == 15 and len(test) == 2
    assert train.image_shape == (3, 32, 32) and train.classes == tuple(f"c{k}" for k in range(10))
    _check_normalized(train)
    with np.load(tmp_path / "cifar10" / "test_batch_prefix.npz") as archive:
        expected = torch.from_numpy(archive["x"]).permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(test.denormalize(test.images), expected, atol=1e-6)
    assert len(load_dataset("cifar10", root=tmp_path, split="all", limit=16)) == 16


def test_env_var_root_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    paths = data_search_paths()
    assert paths[0] == tmp_path
    assert paths[-1] == Path.cwd() / "data"
    _fake_cifar_npz(tmp_path / "cifar10")
    assert len(load_dataset("cifar10", split="test")) == 2
    assert data_search_paths(tmp_path / "x") == [tmp_path / "x"]


def test_missing_data_error_is_one_line_naming_the_command(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("cifar10", root=tmp_path)
    message = str(info.value)
    assert message == (
        "cifar10 is not on this machine: run `fl-attack-data fetch cifar10` (or pass data-root=DIR); "
        f"looked in: {tmp_path}, {tmp_path / 'cifar10'}"
    )
    assert isinstance(info.value, FileNotFoundError) and info.value.looked_in == (
        tmp_path,
        tmp_path / "cifar10",
    )
    with pytest.raises(
        DatasetNotFoundError, match=r"^mnist is not on this machine: run `fl-attack-data fetch mnist`"
    ):
        load_dataset("mnist", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="fl-attack-data fetch tiny-imagenet"):
        load_dataset("tiny-imagenet", root=tmp_path)


def test_check_dataset_raises_without_loading(tmp_path: Path) -> None:
    for name in ("cifar10", "mnist", "adult", "tiny-imagenet"):
        with pytest.raises(DatasetNotFoundError) as info:
            check_dataset(name, root=tmp_path)
        assert str(info.value).startswith(f"{name} is not on this machine: run `fl-attack-data fetch {name}`")
        assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    for name in ("digits", "faces", "photo-patches"):
        check_dataset(name, root=tmp_path)  # bundled: nothing to look for, no error
    with pytest.raises(ValueError, match=r"unknown dataset 'imagenet'; available: \['photo-patches'"):
        check_dataset("imagenet")
    with pytest.raises(ValueError, match="needs root"):
        check_dataset("folder")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_dataset("folder", root=tmp_path / "missing")
    _fake_cifar_npz(tmp_path / "cifar10")
    check_dataset("cifar10", root=tmp_path)  # now present: no error


def test_check_dataset_names_a_partial_copy(tmp_path: Path) -> None:
    write_cifar10_batches(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        check_dataset("cifar10", root=tmp_path)
    assert str(info.value).endswith(f"({tmp_path / 'cifar-10-batches-py'} lacks test_batch)")


def test_dataset_not_found_error_survives_pickling(tmp_path: Path) -> None:
    error = DatasetNotFoundError("mnist", [tmp_path, tmp_path / "mnist"], detail="half there")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is DatasetNotFoundError and str(copy) == str(error)
    assert (copy.dataset, copy.looked_in, copy.detail) == (
        "mnist",
        (tmp_path, tmp_path / "mnist"),
        "half there",
    )


def test_torchvision_cifar10_root_is_accepted(tmp_path: Path) -> None:
    written = write_cifar10_batches(tmp_path)  # <root>/cifar-10-batches-py, torchvision's own root
    train = load_dataset("cifar10", root=tmp_path)
    test = load_dataset("cifar10", root=tmp_path, split="test")
    assert len(train) == 15 and len(test) == 3 and train.classes == tuple(f"k{j}" for j in range(10))
    expected = torch.from_numpy(written["test_batch"]).float() / 255
    assert torch.allclose(test.denormalize(test.images), expected, atol=1e-6)
    nested = tmp_path / "data"
    write_cifar10_batches(nested / "cifar10")  # the fetch layout <root>/cifar10/cifar-10-batches-py
    assert len(load_dataset("cifar10", root=nested, split="all")) == 18


@pytest.mark.parametrize("gz", [False, True])
def test_torchvision_mnist_root_is_accepted(tmp_path: Path, gz: bool) -> None:
    written = write_mnist_raw(tmp_path / "MNIST" / "raw", gz=gz)  # torchvision's own root
    test = load_dataset("mnist", root=tmp_path, split="test")
    assert test.image_shape == (1, 28, 28) and len(test) == 3
    images, labels = written["test"]
    assert torch.allclose(
        test.denormalize(test.images)[:, 0], torch.from_numpy(images).float() / 255, atol=1e-6
    )
    assert test.labels.tolist() == labels.tolist()
    assert len(load_dataset("mnist", root=tmp_path, split="all")) == 8
    write_mnist_raw(tmp_path / "nested" / "mnist" / "MNIST" / "raw")
    assert len(load_dataset("mnist", root=tmp_path / "nested")) == 5


def test_mnist_truncated_file_is_named(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    write_mnist_raw(raw)
    path = raw / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: header promises shape \(3, 28, 28\)"):
        load_dataset("mnist", root=tmp_path, split="test")


def test_folder_dataset(tmp_path: Path) -> None:
    from PIL import Image

    pictures = tmp_path / "pictures"
    rng = np.random.default_rng(1)
    for cls, count in (("cats", 3), ("dogs", 2)):
        (pictures / cls).mkdir(parents=True)
        for k in range(count):
            array = rng.integers(0, 256, size=(40 + k, 50, 3), dtype=np.uint8)
            Image.fromarray(array).save(pictures / cls / f"{k}.png")
    data = load_dataset("folder", root=pictures, split="all")
    assert len(data) == 5 and data.image_shape == (3, 32, 32)
    assert data.classes == ("cats", "dogs") and data.labels.tolist() == [0, 0, 0, 1, 1]
    _check_normalized(data)
    flat = load_dataset("folder", root=pictures / "dogs", split="all")
    assert len(flat) == 2 and flat.classes == ("dogs",) and flat.labels.tolist() == [0, 0]
    with pytest.raises(ValueError, match="root"):
        load_dataset("folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        load_dataset("folder", root=tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("folder", root=tmp_path / "missing")


@pytest.mark.skipif(not (SHARED_DATA / "cifar10").is_dir(), reason="shared CIFAR-10 subset not present")
def test_shared_cifar10_subset() -> None:
    data = load_dataset("cifar10", root=SHARED_DATA, split="test", limit=64)
    assert len(data) == 64 and data.classes is not None and data.classes[0] == "airplane"
    _check_normalized(data)


@pytest.mark.skipif(not (SHARED_DATA / "mnist").is_dir(), reason="shared MNIST not present")
def test_shared_mnist() -> None:
    data = load_dataset("mnist", root=SHARED_DATA, split="test", limit=32)
    assert data.image_shape == (1, 28, 28) and len(data) == 32
    _check_normalized(data)
