"""Download the datasets stored on disk into a data root (``fl-attack-data fetch NAME``).

CIFAR-10 and MNIST come from the URLs and checksums of torchvision's own dataset classes,
UCI Adult from the UCI archive (``adult.data``, ``adult.test``, ``adult.names``) and Tiny
ImageNet from the official CS231n zip; every file is checked against its MD5 sum. All go
through torchvision's downloader (:mod:`torchvision.datasets.utils`). The files land in a
staging folder ``<root>/.<dataset>.partial`` first and are moved into ``<root>/<dataset>/``
(the layout of :mod:`fl_attack.data.locate`) only when complete, so an interrupted fetch
never looks like a dataset; a new fetch resumes from the verified archives left there.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import tarfile
import urllib.error
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fl_attack.data.locate import (
    CIFAR10_BATCHES,
    DATASET_FOLDERS,
    TINY_IMAGENET_DIR,
    default_data_root,
    probe_dataset,
)

__all__ = [
    "FETCHABLE",
    "Download",
    "FetchError",
    "FetchPlan",
    "fetch_dataset",
    "fetch_plan",
    "is_fetched",
    "staging_dir",
]

FETCHABLE: tuple[str, ...] = tuple(DATASET_FOLDERS)
"""Datasets ``fl-attack-data fetch`` can download."""

SOCKET_TIMEOUT_S = 60.0
"""A connection that stays silent this long fails instead of hanging the command."""

_UCI_ADULT = "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"
_ADULT_MD5 = {
    "adult.data": "5d7c39d7b8804f071cdd1f2a7c460872",
    "adult.test": "35238206dfdf7f1fe215bbb874adecdc",
    "adult.names": "1a7cdb3ff7a1b709968b1c7a11def63e",
}
_TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


class FetchError(RuntimeError):
    """A download failed or did not produce the expected files; the message is one line."""


@dataclass(frozen=True)
class Download:
    """One file to download (from the first of ``urls`` that works) into a staging folder.

    Attributes
    ----------
    urls
        Mirrors, tried in order.
    filename
        Name of the downloaded file.
    md5
        Its MD5 sum.
    extract
        Unpack the archive (tar.gz, zip, gz) where it was downloaded.
    into
        Subfolder of the staging folder that receives the file.
    """

    urls: tuple[str, ...]
    filename: str
    md5: str
    extract: bool = False
    into: str = ""


@dataclass(frozen=True)
class FetchPlan:
    """How to fetch one dataset.

    Attributes
    ----------
    name
        Dataset name.
    downloads
        The files to download.
    products
        Entries of the staging folder moved into ``<root>/<dataset>/`` once every download
        succeeded (e.g. ``cifar-10-batches-py``); the rest (archives) is deleted.
    size
        Approximate download size, for the user.
    read_from
        Subfolder of ``<root>/<dataset>/`` the loader reads ("" for the folder itself).
    """

    name: str
    downloads: tuple[Download, ...]
    products: tuple[str, ...]
    size: str
    read_from: str = ""


def fetch_plan(name: str) -> FetchPlan:
    """The downloads of dataset ``name`` (one of :data:`FETCHABLE`)."""
    if name == "cifar10":
        from torchvision.datasets import CIFAR10

        archive = Download((CIFAR10.url,), CIFAR10.filename, CIFAR10.tgz_md5, extract=True)
        return FetchPlan(name, (archive,), (CIFAR10_BATCHES,), "163 MiB")
    if name == "mnist":
        from torchvision.datasets import MNIST

        files = tuple(
            Download(
                tuple(m + filename for m in MNIST.mirrors), filename, md5, extract=True, into="MNIST/raw"
            )
            for filename, md5 in MNIST.resources
        )
        return FetchPlan(name, files, ("MNIST",), "11 MiB")
    if name == "adult":
        files = tuple(Download((_UCI_ADULT + f,), f, md5) for f, md5 in _ADULT_MD5.items())
        return FetchPlan(name, files, tuple(_ADULT_MD5), "6 MiB")
    if name == "tiny-imagenet":
        archive = Download((_TINY_IMAGENET_URL,), "tiny-imagenet-200.zip", _TINY_IMAGENET_MD5, extract=True)
        return FetchPlan(name, (archive,), (TINY_IMAGENET_DIR,), "237 MiB", read_from=TINY_IMAGENET_DIR)
    raise ValueError(f"cannot fetch {name!r}; fetchable datasets: {list(FETCHABLE)}")


def staging_dir(name: str, root: Path) -> Path:
    """Where the files of ``name`` are downloaded before they are moved into place."""
    return root / f".{DATASET_FOLDERS[name]}.partial"


def is_fetched(name: str, directory: Path) -> bool:
    """Whether ``directory`` (``<root>/<dataset>``) already holds everything a fetch would put there."""
    plan = fetch_plan(name)
    readable = probe_dataset(name, directory / plan.read_from).found
    return all((directory / p).exists() for p in plan.products) and readable


def _one_line(error: BaseException) -> str:
    reason = getattr(error, "reason", None)  # URLError keeps the cause in .reason
    text = str(reason if reason is not None else error) or type(error).__name__
    return " ".join(text.split())


def _is_unreachable(error: BaseException) -> bool:
    """A failure to reach the server at all, as opposed to an answer (HTTP error, bad file)."""
    if isinstance(error, urllib.error.HTTPError):
        return False
    return isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError, socket.gaierror))


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _download(item: Download, staging: Path) -> None:
    from torchvision.datasets import utils as tv_utils

    target = staging / item.into if item.into else staging
    failures: list[str] = []
    unreachable = True
    for url in item.urls:
        try:
            # torchvision prints "Downloading ..." lines to stdout; its progress bar (stderr) stays.
            with contextlib.redirect_stdout(io.StringIO()):
                if item.extract:
                    tv_utils.download_and_extract_archive(
                        url, download_root=str(target), filename=item.filename, md5=item.md5
                    )
                else:
                    tv_utils.download_url(url, root=str(target), filename=item.filename, md5=item.md5)
            return
        except (OSError, RuntimeError, ValueError, zipfile.BadZipFile, tarfile.TarError) as error:
            failures.append(f"{url}: {_one_line(error)}")
            unreachable = unreachable and _is_unreachable(error)
    hint = " (is this machine online?)" if unreachable else ""
    raise FetchError(f"could not download {item.filename} ({'; '.join(failures)}){hint}")


def _remove_if_empty(staging: Path) -> None:
    """Drop a staging folder that holds no file (a fetch that failed before any download)."""
    if not any(p.is_file() for p in staging.rglob("*")):
        shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(source: Path, destination: Path) -> None:
    if destination.is_dir() and not destination.is_symlink():
        shutil.rmtree(destination)
    elif destination.exists() or destination.is_symlink():
        destination.unlink()
    os.replace(source, destination)


def fetch_dataset(name: str, *, root: str | Path | None = None) -> tuple[Path, bool]:
    """Download dataset ``name`` into ``<root>/<dataset>/`` unless it is already there.

    Parameters
    ----------
    name
        One of :data:`FETCHABLE`: ``"cifar10"``, ``"mnist"``, ``"adult"``, ``"tiny-imagenet"``.
    root
        Data root; None: :func:`fl_attack.data.locate.default_data_root`.

    Returns
    -------
    tuple[Path, bool]
        The dataset directory, and whether anything was downloaded (False: already there).

    Raises
    ------
    ValueError
        For a name that cannot be fetched.
    FetchError
        When a download fails (no network, bad checksum) or lacks the expected files.
    OSError
        When the data root cannot be written.
    """
    plan = fetch_plan(name)
    base = (Path(root).expanduser() if root is not None else default_data_root()).absolute()
    directory = base / DATASET_FOLDERS[name]
    if is_fetched(name, directory):
        return directory, False
    staging = staging_dir(name, base)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with _socket_timeout(SOCKET_TIMEOUT_S):
            for item in plan.downloads:
                _download(item, staging)
    except FetchError:
        _remove_if_empty(staging)
        raise
    missing = [p for p in plan.products if not (staging / p).exists()]
    if missing:
        raise FetchError(f"the download of {name} in {staging} does not contain {', '.join(missing)}")
    directory.mkdir(parents=True, exist_ok=True)
    for product in plan.products:
        _move_into_place(staging / product, directory / product)
    shutil.rmtree(staging)
    presence = probe_dataset(name, directory / plan.read_from)
    if not presence.found:
        raise FetchError(f"{name} was downloaded to {directory} but cannot be read: {presence.problem}")
    return directory, True
