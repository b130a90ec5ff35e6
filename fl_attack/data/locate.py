"""Where datasets stored on disk are looked for, and the error when one is missing.

Data-root layout
----------------
A data root holds one folder per dataset; ``fl-attack-data fetch NAME`` writes exactly this::

    <root>/
      cifar10/         cifar-10-batches-py/ (torchvision's python batches), or the offline
                       subset data_batch_{1..5}_prefix.npz + test_batch_prefix.npz (+ batches.meta)
      mnist/           MNIST/raw/ (torchvision's layout: train-images-idx3-ubyte,
                       train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte,
                       each plain or .gz)
      adult/           adult.data, adult.test (and adult.names), the UCI archive files
      tiny-imagenet/   tiny-imagenet-200/ (the official zip, extracted: wnids.txt, words.txt,
                       train/<wnid>/images/*.JPEG, val/images/*.JPEG, val/val_annotations.txt)

A root may also hold the data directly, as torchvision's own roots do: a directory that contains
``cifar-10-batches-py/``, ``MNIST/raw/``, ``adult.data`` or ``tiny-imagenet-200/`` (or is the
extracted ``tiny-imagenet-200`` folder itself) is accepted as the root of that dataset.

Search order
------------
An explicit root (``root=...``, the app's ``data-root``) is the only place searched. Otherwise
:func:`data_search_paths`: ``$FL_ATTACK_DATA`` (when set), the ``shared/data`` folder found by
walking up from this package, ``~/.cache/fl_attack/data`` and ``./data``; UCI Adult also looks in
``~/data``. ``fl-attack-data fetch`` writes to :func:`default_data_root`: ``$FL_ATTACK_DATA``,
else ``~/.cache/fl_attack/data``, which are both searched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUNDLED_DATASETS",
    "DATASET_FOLDERS",
    "DATA_ENV_VAR",
    "DatasetNotFoundError",
    "Presence",
    "adult_presence",
    "adult_search_paths",
    "check_dataset",
    "data_search_paths",
    "dataset_candidates",
    "default_data_root",
    "find_dataset",
    "locate_dataset",
    "probe_dataset",
]

DATA_ENV_VAR = "FL_ATTACK_DATA"
"""Environment variable naming a data root that holds ``cifar10/``, ``mnist/``, ..."""

BUNDLED_DATASETS: tuple[str, ...] = ("photo-patches", "digits", "faces")
"""Datasets that ship with scikit-learn / scikit-image and need no files of their own."""

DATASET_FOLDERS: dict[str, str] = {
    "cifar10": "cifar10",
    "mnist": "mnist",
    "adult": "adult",
    "tiny-imagenet": "tiny-imagenet",
}
"""Datasets stored on disk and their folder under a data root."""

CIFAR10_BATCHES = "cifar-10-batches-py"
CIFAR10_BATCH_FILES: tuple[str, ...] = (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch")
MNIST_RAW = ("MNIST", "raw")
MNIST_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
ADULT_FILE_NAMES: tuple[str, str] = ("adult.data", "adult.test")
TINY_IMAGENET_DIR = "tiny-imagenet-200"
_TINY_IMAGENET_PARTS: tuple[str, ...] = ("wnids.txt", "train", "val/images", "val/val_annotations.txt")


class DatasetNotFoundError(FileNotFoundError):
    """A dataset stored on disk is not where it was looked for.

    The message is one line that names the command fetching it and every directory searched,
    e.g. ``cifar10 is not on this machine: run `fl-attack-data fetch cifar10` (or pass
    data-root=DIR); looked in: a, b``.

    Attributes
    ----------
    dataset
        Dataset name.
    looked_in
        The directories searched, in order.
    detail
        What was wrong where something was found (e.g. a file missing), or "".
    """

    def __init__(self, dataset: str, looked_in: Sequence[Path], *, detail: str = "") -> None:
        self.dataset = dataset
        self.looked_in = tuple(Path(p) for p in looked_in)
        self.detail = detail
        places = ", ".join(str(p) for p in self.looked_in) or "nowhere"
        message = (
            f"{dataset} is not on this machine: run `fl-attack-data fetch {dataset}` "
            f"(or pass data-root=DIR); looked in: {places}"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from the fields, so it survives pickling (worker processes, Ray).
        return (_rebuild_error, (self.dataset, self.looked_in, self.detail))


def _rebuild_error(dataset: str, looked_in: tuple[Path, ...], detail: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(dataset, looked_in, detail=detail)


@dataclass(frozen=True)
class Presence:
    """What one directory holds of one dataset.

    Attributes
    ----------
    found
        The dataset can be read from the directory.
    form
        When found, which form it has (e.g. ``"torchvision cifar-10-batches-py/"``).
    problem
        When not found but part of it is there, what is missing; "" otherwise.
    """

    found: bool
    form: str = ""
    problem: str = ""


def default_data_root() -> Path:
    """Where ``fl-attack-data fetch`` writes: ``$FL_ATTACK_DATA``, else ``~/.cache/fl_attack/data``."""
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fl_attack" / "data"


def _shared_data_dir() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return here.parents[2].parent / "shared" / "data"


def data_search_paths(root: str | Path | None = None) -> list[Path]:
    """Data roots searched, in order, for datasets stored on disk.

    Parameters
    ----------
    root
        An explicit root: when given, it is the only place searched.

    Returns
    -------
    list[Path]
        ``[root]``, or when None: ``$FL_ATTACK_DATA`` (if set), the ``shared/data`` folder
        found by walking up from this package (``<repo>/../shared/data``),
        ``~/.cache/fl_attack/data`` and ``./data``.
    """
    if root is not None:
        return [Path(root).expanduser()]
    paths: list[Path] = []
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        paths.append(Path(env).expanduser())
    for path in (_shared_data_dir(), Path.home() / ".cache" / "fl_attack" / "data", Path.cwd() / "data"):
        if path not in paths:
            paths.append(path)
    return paths


def _search_bases(name: str, root: str | Path | None) -> list[Path]:
    bases = data_search_paths(root)
    if name == "adult" and root is None:
        home_data = Path.home() / "data"
        if home_data not in bases:
            bases.insert(len(bases) - 1, home_data)  # before ./data
    return bases


def _candidates_under(name: str, base: Path) -> tuple[Path, ...]:
    if name == "tiny-imagenet":
        return (base, base / TINY_IMAGENET_DIR, base / DATASET_FOLDERS[name] / TINY_IMAGENET_DIR)
    return (base, base / DATASET_FOLDERS[name])


def dataset_candidates(name: str, *, root: str | Path | None = None) -> list[Path]:
    """Every directory searched for dataset ``name``, in order (see the module docstring)."""
    _check_on_disk_name(name)
    paths: list[Path] = []
    for base in _search_bases(name, root):
        for directory in _candidates_under(name, base):
            if directory not in paths:
                paths.append(directory)
    return paths


def adult_search_paths(root: str | Path | None = None) -> list[Path]:
    """Directories searched, in order, for ``adult.data`` / ``adult.test``.

    Parameters
    ----------
    root
        An explicit root: only ``root`` and ``root/adult`` are searched.

    Returns
    -------
    list[Path]
        Each base of :func:`data_search_paths` (``$FL_ATTACK_DATA``, the ``shared/data``
        folder found above this package, ``~/.cache/fl_attack/data``) plus ``~/data`` and
        ``./data``, each followed by its ``adult/`` subfolder.
    """
    return dataset_candidates("adult", root=root)


# --------------------------------------------------------------------------- probes


def _missing_files(directory: Path, names: Sequence[str], *, gz_ok: bool = False) -> list[str]:
    return [
        n for n in names if not ((directory / n).is_file() or (gz_ok and (directory / f"{n}.gz").is_file()))
    ]


def _probe_cifar10(directory: Path) -> Presence:
    if any(directory.glob("*_prefix.npz")):
        return Presence(True, form="offline subset (*_prefix.npz)")
    batches = directory / CIFAR10_BATCHES
    if batches.is_dir():
        missing = _missing_files(batches, CIFAR10_BATCH_FILES)
        if missing:
            return Presence(False, problem=f"{batches} lacks {', '.join(missing)}")
        return Presence(True, form=f"torchvision {CIFAR10_BATCHES}/")
    return Presence(False)


def _probe_mnist(directory: Path) -> Presence:
    raw = directory.joinpath(*MNIST_RAW)
    if not raw.is_dir():
        return Presence(False)
    missing = _missing_files(raw, MNIST_FILES, gz_ok=True)
    if missing:
        return Presence(False, problem=f"{raw} lacks {', '.join(missing)}")
    return Presence(True, form="torchvision MNIST/raw/")


def adult_presence(directory: Path, files: Sequence[str] = ADULT_FILE_NAMES) -> Presence:
    """Whether ``directory`` holds the UCI Adult ``files``."""
    missing = _missing_files(directory, files)
    if not missing:
        return Presence(True, form="UCI files " + ", ".join(files))
    if len(missing) < len(files):
        return Presence(False, problem=f"{directory} has only some of them (missing: {', '.join(missing)})")
    return Presence(False)


def _probe_adult(directory: Path) -> Presence:
    return adult_presence(directory)


def _probe_tiny_imagenet(directory: Path) -> Presence:
    missing = [part for part in _TINY_IMAGENET_PARTS if not (directory / part).exists()]
    if not missing:
        return Presence(True, form=f"extracted {TINY_IMAGENET_DIR}/")
    # Only a folder that looks like the extracted zip counts as a partial copy.
    if (directory / "wnids.txt").is_file():
        return Presence(False, problem=f"{directory} lacks {', '.join(missing)}")
    return Presence(False)


_PROBES: dict[str, Callable[[Path], Presence]] = {
    "cifar10": _probe_cifar10,
    "mnist": _probe_mnist,
    "adult": _probe_adult,
    "tiny-imagenet": _probe_tiny_imagenet,
}


def _check_on_disk_name(name: str) -> None:
    if name not in DATASET_FOLDERS:
        raise ValueError(f"{name!r} is not a dataset stored on disk; those are {list(DATASET_FOLDERS)}")


def probe_dataset(name: str, directory: Path) -> Presence:
    """What ``directory`` holds of dataset ``name`` (one of :data:`DATASET_FOLDERS`)."""
    _check_on_disk_name(name)
    return _PROBES[name](directory)


def find_dataset(
    name: str, *, root: str | Path | None = None, probe: Callable[[Path], Presence] | None = None
) -> Path:
    """The first directory that holds dataset ``name``, with an optional stricter ``probe``.

    Raises
    ------
    DatasetNotFoundError
        When no searched directory holds it; names every directory tried and the first
        partial copy found.
    """
    _check_on_disk_name(name)
    check = probe or _PROBES[name]
    tried = dataset_candidates(name, root=root)
    problems: list[str] = []
    for directory in tried:
        presence = check(directory)
        if presence.found:
            return directory
        if presence.problem:
            problems.append(presence.problem)
    raise DatasetNotFoundError(name, tried, detail=problems[0] if problems else "")


def locate_dataset(name: str, *, root: str | Path | None = None) -> Path:
    """The directory a loader reads dataset ``name`` from.

    Parameters
    ----------
    name
        One of :data:`DATASET_FOLDERS`: ``"cifar10"``, ``"mnist"``, ``"adult"``,
        ``"tiny-imagenet"``.
    root
        An explicit data root, searched alone; None searches :func:`data_search_paths`.

    Raises
    ------
    ValueError
        For a name that is not stored on disk.
    DatasetNotFoundError
        When the data is not found.
    """
    _check_on_disk_name(name)
    return find_dataset(name, root=root)


def check_dataset(name: str, *, root: str | Path | None = None) -> None:
    """Raise unless dataset ``name`` can be loaded, without loading it.

    Parameters
    ----------
    name
        A dataset of :func:`fl_attack.data.images.load_dataset` or ``"adult"``.
    root
        As for the loader: an explicit data root, or the image directory for ``"folder"``.

    Raises
    ------
    ValueError
        For an unknown name, or ``"folder"`` without a root.
    DatasetNotFoundError
        For a dataset stored on disk that is missing (one line naming the fetch command).
    FileNotFoundError
        For ``"folder"`` when the directory does not exist.
    """
    if name in BUNDLED_DATASETS:
        return
    if name == "folder":
        if root is None:
            raise ValueError("dataset 'folder' needs root=<directory of images> (data-root=DIR)")
        folder = Path(root).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"image folder {folder} does not exist or is not a directory")
        return
    if name not in DATASET_FOLDERS:
        known = [*BUNDLED_DATASETS, *DATASET_FOLDERS, "folder"]
        raise ValueError(f"unknown dataset {name!r}; available: {known}")
    find_dataset(name, root=root)
