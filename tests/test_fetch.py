"""``fl-attack-data``: fetch with torchvision's downloader replaced by fakes, list, path, errors."""

from __future__ import annotations

import socket
import sys
import urllib.error
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchvision.datasets import CIFAR10, MNIST
from torchvision.datasets import utils as tv_utils

from fl_attack.data.adult import load_adult
from fl_attack.data.downloads import fetch_dataset, fetch_plan, staging_dir
from fl_attack.data.fetch import entry_point, main
from fl_attack.data.images import load_dataset
from fl_attack.data.locate import DATA_ENV_VAR, default_data_root
from tests.fake_datasets import ADULT_TEXT, idx_bytes, write_cifar10_batches, write_tiny_imagenet

OFFLINE = urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))


@dataclass
class FakeDownloader:
    """Stands in for torchvision's download functions and writes each dataset's real layout."""

    calls: list[tuple[str, str, Path, str, str | None]] = field(default_factory=list)
    fail: dict[str, BaseException] = field(default_factory=dict)  # URL -> error raised

    def _record(self, kind: str, url: str, root: Any, filename: Any, md5: Any) -> Path:
        self.calls.append((kind, url, Path(root), str(filename), md5))
        if url in self.fail:
            raise self.fail[url]
        directory = Path(root)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / str(filename)).write_bytes(b"archive")  # the download itself
        return directory

    def download_url(self, url: str, root: Any, filename: Any = None, md5: Any = None, **_: Any) -> None:
        directory = self._record("download_url", url, root, filename, md5)
        (directory / str(filename)).write_text(ADULT_TEXT[str(filename)])

    def download_and_extract_archive(
        self, url: str, download_root: Any, extract_root: Any = None, filename: Any = None, md5: Any = None,
        **_: Any,
    ) -> None:  # fmt: skip
        directory = self._record("download_and_extract_archive", url, download_root, filename, md5)
        name = str(filename)
        if name == CIFAR10.filename:
            write_cifar10_batches(directory)
        elif name == "tiny-imagenet-200.zip":
            write_tiny_imagenet(directory / "tiny-imagenet-200")
        elif name.endswith("-ubyte.gz"):  # MNIST: each .gz decompresses next to itself
            count = 5 if name.startswith("train") else 3
            shape = (count, 28, 28) if "images" in name else (count,)
            (directory / name.removesuffix(".gz")).write_bytes(idx_bytes(np.full(shape, 7, dtype=np.uint8)))
        else:
            raise AssertionError(f"unexpected archive {name}")


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDownloader:
    downloader = FakeDownloader()
    monkeypatch.setattr(tv_utils, "download_url", downloader.download_url)
    monkeypatch.setattr(tv_utils, "download_and_extract_archive", downloader.download_and_extract_archive)
    return downloader


def test_fetch_cifar10(tmp_path: Path, fake: FakeDownloader, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fetch", "cifar10", "--root", str(tmp_path)]) == 0
    staging = tmp_path / ".cifar10.partial"
    assert staging_dir("cifar10", tmp_path) == staging
    assert fake.calls == [
        ("download_and_extract_archive", CIFAR10.url, staging, CIFAR10.filename, CIFAR10.tgz_md5)
    ]
    assert not staging.exists()  # the archive is gone once the batches are in place
    assert sorted(p.name for p in (tmp_path / "cifar10").iterdir()) == ["cifar-10-batches-py"]
    out = capsys.readouterr()
    assert out.out == f"cifar10 fetched into {tmp_path / 'cifar10'}; use it with data-root={tmp_path}\n"
    assert out.err == ""
    data = load_dataset("cifar10", root=tmp_path, split="all")
    assert len(data) == 18 and data.classes == tuple(f"k{j}" for j in range(10))


def test_fetch_mnist_uses_torchvision_mirrors_and_md5(tmp_path: Path, fake: FakeDownloader) -> None:
    assert main(["fetch", "mnist", "--root", str(tmp_path)]) == 0
    raw = tmp_path / ".mnist.partial" / "MNIST" / "raw"
    assert fake.calls == [
        ("download_and_extract_archive", MNIST.mirrors[0] + name, raw, name, md5)
        for name, md5 in MNIST.resources
    ]
    assert len(load_dataset("mnist", root=tmp_path)) == 5
    test = load_dataset("mnist", root=tmp_path / "mnist", split="test")
    assert len(test) == 3 and test.labels.tolist() == [7, 7, 7]


def test_fetch_mnist_falls_back_to_the_next_mirror(tmp_path: Path, fake: FakeDownloader) -> None:
    first_file = MNIST.resources[0][0]
    fake.fail[MNIST.mirrors[0] + first_file] = OFFLINE
    assert main(["fetch", "mnist", "--root", str(tmp_path)]) == 0
    assert [call[1] for call in fake.calls[:2]] == [m + first_file for m in MNIST.mirrors[:2]]
    assert len(load_dataset("mnist", root=tmp_path, split="test")) == 3


def test_fetch_adult(tmp_path: Path, fake: FakeDownloader) -> None:
    assert main(["fetch", "adult", "--root", str(tmp_path)]) == 0
    staging = tmp_path / ".adult.partial"
    assert [(c[0], c[2], c[3]) for c in fake.calls] == [
        ("download_url", staging, name) for name in ("adult.data", "adult.test", "adult.names")
    ]
    assert all(c[1].startswith("https://archive.ics.uci.edu/") and c[1].endswith(c[3]) for c in fake.calls)
    assert all(isinstance(c[4], str) and len(c[4]) == 32 for c in fake.calls)  # every file is md5-checked
    data = load_adult(root=tmp_path, split="all")
    assert len(data) == 6 and data.labels.tolist() == [0, 0, 0, 1, 0, 0]


def test_fetch_tiny_imagenet(tmp_path: Path, fake: FakeDownloader) -> None:
    assert main(["fetch", "tiny-imagenet", "--root", str(tmp_path)]) == 0
    ((kind, url, root, filename, md5),) = fake.calls
    assert (kind, url, root, filename) == (
        "download_and_extract_archive",
        "http://cs231n.stanford.edu/tiny-imagenet-200.zip",
        tmp_path / ".tiny-imagenet.partial",
        "tiny-imagenet-200.zip",
    )
    assert md5 == "90528d7ca1a48142e341f4ef8d21d0de"
    assert (tmp_path / "tiny-imagenet" / "tiny-imagenet-200" / "wnids.txt").is_file()
    data = load_dataset("tiny-imagenet", root=tmp_path)
    assert len(data) == 9 and data.image_shape == (3, 64, 64)


def test_fetch_into_default_root_is_found_without_a_root(
    tmp_path: Path, fake: FakeDownloader, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path / "env"))
    assert default_data_root() == tmp_path / "env"
    assert main(["fetch", "adult"]) == 0
    assert (
        capsys.readouterr().out == f"adult fetched into {tmp_path / 'env' / 'adult'}\n"
    )  # searched: no hint
    assert len(load_adult()) == 4
    monkeypatch.delenv(DATA_ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_root() == tmp_path / "home" / ".cache" / "fl_attack" / "data"


def test_fetch_twice_downloads_once(
    tmp_path: Path, fake: FakeDownloader, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fetch_dataset("cifar10", root=tmp_path) == (tmp_path / "cifar10", True)
    assert fetch_dataset("cifar10", root=tmp_path) == (tmp_path / "cifar10", False)
    assert len(fake.calls) == 1
    assert main(["fetch", "cifar10", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"cifar10 already in {tmp_path / 'cifar10'}")
    assert len(fake.calls) == 1


def test_offline_fetch_fails_with_one_line(
    tmp_path: Path, fake: FakeDownloader, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.fail[CIFAR10.url] = OFFLINE
    assert main(["fetch", "cifar10", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        "fl-attack-data: could not fetch cifar10: could not download cifar-10-python.tar.gz "
        f"({CIFAR10.url}: [Errno -2] Name or service not known) (is this machine online?)\n"
    )
    assert not (tmp_path / "cifar10").exists() and not staging_dir("cifar10", tmp_path).exists()
    monkeypatch.setattr(sys, "argv", ["fl-attack-data", "fetch", "cifar10", "--root", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        entry_point()
    assert info.value.code == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_corrupt_download_is_not_blamed_on_the_network(
    tmp_path: Path, fake: FakeDownloader, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
    fake.fail[url] = RuntimeError("File not found or corrupted.")
    assert main(["fetch", "tiny-imagenet", "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "fl-attack-data: could not fetch tiny-imagenet: could not download tiny-imagenet-200.zip "
        f"({url}: File not found or corrupted.)\n"
    )


def test_interrupted_fetch_leaves_no_dataset_and_resumes(tmp_path: Path, fake: FakeDownloader) -> None:
    (test_url,) = [d.urls[0] for d in fetch_plan("adult").downloads if d.filename == "adult.test"]
    fake.fail[test_url] = urllib.error.HTTPError(test_url, 503, "Service Unavailable", Message(), None)
    assert main(["fetch", "adult", "--root", str(tmp_path)]) == 1
    assert not (tmp_path / "adult").exists()  # half a dataset is never in place
    assert (staging_dir("adult", tmp_path) / "adult.data").is_file()  # kept to resume
    del fake.fail[test_url]
    assert main(["fetch", "adult", "--root", str(tmp_path)]) == 0
    assert len(load_adult(root=tmp_path, split="test")) == 2
    assert not staging_dir("adult", tmp_path).exists()


def test_list_and_path(tmp_path: Path, fake: FakeDownloader, capsys: pytest.CaptureFixture[str]) -> None:
    write_cifar10_batches(tmp_path)  # torchvision's own root layout
    fetch_dataset("adult", root=tmp_path)
    assert main(["list", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"searched: {tmp_path} (alone)",
        "photo-patches  bundled (offline, no files needed)",
        "digits         bundled (offline, no files needed)",
        "faces          bundled (offline, no files needed)",
        f"cifar10        {tmp_path} [torchvision cifar-10-batches-py/]",
        "mnist          missing: run `fl-attack-data fetch mnist` (11 MiB)",
        f"adult          {tmp_path / 'adult'} [UCI files adult.data, adult.test]",
        "tiny-imagenet  missing: run `fl-attack-data fetch tiny-imagenet` (237 MiB)",
        "folder         any directory of images: pass data-root=DIR",
    ]
    assert main(["path", "adult", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'adult'}\n"
    assert main(["path", "mnist", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fl-attack-data: mnist is not on this machine: run `fl-attack-data fetch mnist`")
    assert err.count("\n") == 1
    assert main(["path", "digits"]) == 1
    assert "bundled" in capsys.readouterr().err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fetch", "imagenet"])
    assert info.value.code == 2
    assert "invalid choice: 'imagenet'" in capsys.readouterr().err
