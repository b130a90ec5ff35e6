"""Offline image data for the victims' clients.

Every dataset is returned as an :class:`ImageData`: normalized float32 images ``(N, C, H, W)``
with the per-channel statistics needed to map attack results back to ``[0, 1]`` pixels.
Three datasets ship with scikit-learn / scikit-image and need no download ("digits", "faces",
"photo-patches"); "cifar10" and "mnist" are read from a local data root, and "folder" reads
any directory of images.

Datasets without a native train/test split ("digits", "faces", "photo-patches", "folder")
use a fixed one: every 5th sample (index 4, 9, 14, ...) is in "test", the rest in "train".
Split "all" returns everything (train then test for the natively split datasets).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DATASETS",
    "DATA_ENV_VAR",
    "SPLITS",
    "ImageData",
    "available_datasets",
    "data_search_paths",
    "load_dataset",
    "sample_batch",
]

DATA_ENV_VAR = "FL_ATTACK_DATA"
"""Environment variable naming a data root that holds ``cifar10/``, ``mnist/``, ..."""

SPLITS: tuple[str, ...] = ("train", "test", "all")

_TEST_EVERY = 5
_PATCH = 32
_PATCH_SHORT_SIDE = 256
_FOLDER_SIZE = 32
_IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}
)

_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_MNIST_MEAN = (0.1307,)
_MNIST_STD = (0.3081,)


def index_tensor(
    indices: Sequence[int] | torch.Tensor | np.ndarray, length: int, *, what: str = "samples"
) -> torch.Tensor:
    """Integer indices (``int64``, flat) from integers or a boolean mask over ``length`` items.

    Raises
    ------
    ValueError
        For a mask of the wrong shape or indices out of range.
    """
    idx = torch.as_tensor(indices)
    if idx.dtype == torch.bool:
        if idx.shape != (length,):
            raise ValueError(f"boolean mask must have shape ({length},)")
        idx = idx.nonzero().flatten()
    idx = idx.to(torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < -length or int(idx.max()) >= length):
        raise ValueError(f"subset indices out of range for {length} {what}")
    return idx


@dataclass(frozen=True, eq=False)
class ImageData:
    """A labelled image dataset held in memory, normalized per channel.

    Attributes
    ----------
    name
        Registry name of the dataset.
    images
        ``(N, C, H, W)`` float32 images ``(x - mean) / std`` of pixels ``x`` in ``[0, 1]``.
    labels
        ``(N,)`` int64 class labels in ``[0, num_classes)``.
    mean, std
        Per-channel normalization statistics (length C).
    num_classes
        Number of classes.
    classes
        Class names, when known.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}"
            )
        channels = self.images.shape[1]
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(
                f"mean and std need one value per channel ({channels}), got {len(self.mean)} "
                f"and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    @property
    def input_dim(self) -> int:
        """Flattened input size ``C * H * W``."""
        c, h, w = self.image_shape
        return c * h * w

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        return mean, std

    def _as_images(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        t = torch.as_tensor(x)
        if not t.is_floating_point():
            raise ValueError(f"expected a floating-point tensor, got dtype {t.dtype}")
        if t.dim() == 2 and t.shape[1] == self.input_dim:
            return t.reshape(t.shape[0], *self.image_shape)
        if t.dim() == 4 and tuple(t.shape[1:]) == self.image_shape:
            return t
        c, h, w = self.image_shape
        raise ValueError(
            f"expected a batch of shape (B, {self.input_dim}) or (B, {c}, {h}, {w}) for "
            f"{self.name}, got {tuple(t.shape)}"
        )

    def denormalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Map normalized inputs back to pixel scale.

        Parameters
        ----------
        x
            ``(B, n)`` flat or ``(B, C, H, W)`` normalized inputs, any float dtype.

        Returns
        -------
        torch.Tensor
            ``(B, C, H, W)`` ``x * std + mean`` in x's dtype; in ``[0, 1]`` for real images
            (not clamped, so reconstruction errors stay visible).
        """
        images = self._as_images(x)
        mean, std = self._stats(images)
        return images * std + mean

    def normalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Inverse of :meth:`denormalize`: ``(B, n)`` or ``(B, C, H, W)`` pixels to inputs."""
        images = self._as_images(x)
        mean, std = self._stats(images)
        return (images - mean) / std

    def subset(self, indices: Sequence[int] | torch.Tensor | np.ndarray | slice) -> ImageData:
        """The samples at ``indices`` (integer indices, a boolean mask or a slice)."""
        idx = indices if isinstance(indices, slice) else index_tensor(indices, len(self), what="samples")
        return ImageData(
            name=self.name,
            images=self.images[idx],
            labels=self.labels[idx],
            mean=self.mean,
            std=self.std,
            num_classes=self.num_classes,
            classes=self.classes,
        )


@dataclass(frozen=True, eq=False)
class _Pixels:
    """Un-normalized data as a loader returns it: ``pixels`` uint8 or float in ``[0, 1]``."""

    pixels: np.ndarray  # (N, C, H, W)
    labels: np.ndarray  # (N,)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    classes: tuple[str, ...] | None


def _to_unit(pixels: np.ndarray) -> np.ndarray:
    if pixels.dtype == np.uint8:
        return pixels.astype(np.float32) / np.float32(255.0)
    return pixels.astype(np.float32)


def _channel_stats(pixels: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    unit = _to_unit(pixels).astype(np.float64)
    mean = unit.mean(axis=(0, 2, 3))
    std = unit.std(axis=(0, 2, 3))
    std = np.where(std > 1e-6, std, 1.0)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)


def _fixed_split(data: _Pixels, split: str) -> _Pixels:
    """Every 5th sample to "test"; statistics stay those of the whole dataset."""
    if split == "all":
        return data
    is_test = np.arange(len(data.labels)) % _TEST_EVERY == _TEST_EVERY - 1
    keep = is_test if split == "test" else ~is_test
    return _Pixels(
        data.pixels[keep], data.labels[keep], data.mean, data.std, data.num_classes, data.classes
    )


def _bundled(
    pixels: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], split: str
) -> _Pixels:
    mean, std = _channel_stats(pixels)
    whole = _Pixels(pixels, labels.astype(np.int64), mean, std, len(classes), classes)
    return _fixed_split(whole, split)


# --------------------------------------------------------------------------- bundled datasets


def _load_digits(root: Path | None, split: str) -> _Pixels:
    """scikit-learn's 1797 8x8 handwritten digits (values 0..16), 10 classes."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = (bunch.images.astype(np.float32) / np.float32(16.0))[:, None]
    return _bundled(pixels, bunch.target, tuple(str(d) for d in range(10)), split)


def _load_faces(root: Path | None, split: str) -> _Pixels:
    """scikit-image's LFW subset: 200 25x25 gray images, the first 100 faces (label 0)."""
    from skimage.data import lfw_subset

    images = lfw_subset()
    if images.dtype != np.uint8:
        images = np.clip(images, 0.0, 1.0).astype(np.float32)
    labels = (np.arange(images.shape[0]) >= images.shape[0] // 2).astype(np.int64)
    return _bundled(images[:, None], labels, ("face", "non-face"), split)


@lru_cache(maxsize=1)
def _source_photos() -> tuple[tuple[str, np.ndarray], ...]:
    from skimage import data as skdata
    from sklearn.datasets import load_sample_images

    sample = load_sample_images()
    photos = [
        (Path(path).stem, image)
        for path, image in zip(sample.filenames, sample.images, strict=True)
    ]
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry"):
        photos.append((name, getattr(skdata, name)()))
    photos.append(("motorcycle", skdata.stereo_motorcycle()[0]))
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
    return (patches * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()


@lru_cache(maxsize=1)
def _photo_patches_all() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    photos = _source_photos()
    patches = [_photo_to_patches(image) for _, image in photos]
    labels = np.concatenate([np.full(len(p), k, dtype=np.int64) for k, p in enumerate(patches)])
    return np.concatenate(patches), labels, tuple(name for name, _ in photos)


def _load_photo_patches(root: Path | None, split: str) -> _Pixels:
    """Non-overlapping 32x32 RGB patches of the photos bundled with scikit-learn / -image.

    Each photo is resized (antialiased bilinear) so its short side is 256 px and center
    cropped to whole patches, which are taken row by row. The label is the source photo.
    """
    pixels, labels, classes = _photo_patches_all()
    return _bundled(pixels, labels, classes, split)


# --------------------------------------------------------------------------- data on disk


def _shared_data_dir() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return here.parents[1].parent / "shared" / "data"


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
    paths += [
        _shared_data_dir(),
        Path.home() / ".cache" / "fl_attack" / "data",
        Path.cwd() / "data",
    ]
    return paths


def _not_found(dataset: str, tried: list[Path], how: str) -> FileNotFoundError:
    listing = "\n".join(f"  - {p}" for p in tried)
    return FileNotFoundError(
        f"{dataset} data not found. Looked in:\n{listing}\n"
        f"Provide it by passing root=..., or by setting {DATA_ENV_VAR} to a directory that "
        f"contains {dataset}/. {how}"
    )


def _cifar10_npz(directory: Path, split: str) -> _Pixels:
    parts = {
        "train": [f"data_batch_{k}_prefix.npz" for k in range(1, 6)],
        "test": ["test_batch_prefix.npz"],
    }
    wanted = parts["train"] + parts["test"] if split == "all" else parts[split]
    files = [directory / f for f in wanted if (directory / f).is_file()]
    if not files:
        raise FileNotFoundError(f"no CIFAR-10 {split} files ({', '.join(wanted)}) in {directory}")
    xs, ys = [], []
    for path in files:
        with np.load(path) as archive:
            xs.append(archive["x"])
            ys.append(archive["y"])
    pixels = np.concatenate(xs).transpose(0, 3, 1, 2)
    classes = _CIFAR10_CLASSES
    meta = directory / "batches.meta"
    if meta.is_file():
        with meta.open("rb") as fh:
            names = pickle.load(fh, encoding="latin1").get("label_names")
        if names:
            classes = tuple(names)
    return _Pixels(
        pixels, np.concatenate(ys).astype(np.int64), _CIFAR10_MEAN, _CIFAR10_STD, 10, classes
    )


def _cifar10_torchvision(directory: Path, split: str) -> _Pixels:
    from torchvision.datasets import CIFAR10

    trains = [True, False] if split == "all" else [split == "train"]
    sets = [CIFAR10(str(directory), train=train, download=False) for train in trains]
    pixels = np.concatenate([s.data for s in sets]).transpose(0, 3, 1, 2)
    labels = np.concatenate([np.asarray(s.targets, dtype=np.int64) for s in sets])
    return _Pixels(pixels, labels, _CIFAR10_MEAN, _CIFAR10_STD, 10, tuple(sets[0].classes))


def _load_cifar10(root: Path | None, split: str) -> _Pixels:
    """CIFAR-10 from the ``*_prefix.npz`` offline subset or torchvision's layout."""
    tried: list[Path] = []
    for base in data_search_paths(root):
        for directory in (base, base / "cifar10"):
            tried.append(directory)
            if (directory / "test_batch_prefix.npz").is_file() or any(
                directory.glob("data_batch_*_prefix.npz")
            ):
                return _cifar10_npz(directory, split)
            if (directory / "cifar-10-batches-py").is_dir():
                return _cifar10_torchvision(directory, split)
    raise _not_found(
        "cifar10",
        tried,
        "Expected data_batch_{1..5}_prefix.npz / test_batch_prefix.npz or torchvision's "
        "cifar-10-batches-py/; when online, torchvision.datasets.CIFAR10(root, download=True) "
        "creates the latter.",
    )


def _load_mnist(root: Path | None, split: str) -> _Pixels:
    """MNIST in torchvision's layout ``<root>/MNIST/raw``."""
    tried: list[Path] = []
    for base in data_search_paths(root):
        for directory in (base, base / "mnist"):
            tried.append(directory)
            if (directory / "MNIST" / "raw").is_dir():
                from torchvision.datasets import MNIST

                trains = [True, False] if split == "all" else [split == "train"]
                sets = [MNIST(str(directory), train=train, download=False) for train in trains]
                pixels = torch.cat([s.data for s in sets]).numpy()[:, None]
                labels = torch.cat([s.targets for s in sets]).numpy().astype(np.int64)
                classes = tuple(str(d) for d in range(10))
                return _Pixels(pixels, labels, _MNIST_MEAN, _MNIST_STD, 10, classes)
    raise _not_found(
        "mnist",
        tried,
        "Expected MNIST/raw/ with the IDX files; when online, "
        "torchvision.datasets.MNIST(root, download=True) creates it.",
    )


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
    return sorted(
        p for p in directory.glob(pattern) if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES
    )


def _load_folder(root: Path | None, split: str) -> _Pixels:
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
    mean, std = _channel_stats(pixels)
    whole = _Pixels(pixels, labels, mean, std, max(len(classes), 1), classes)
    return _fixed_split(whole, split)


DATASETS: dict[str, Callable[[Path | None, str], _Pixels]] = {
    "photo-patches": _load_photo_patches,
    "digits": _load_digits,
    "faces": _load_faces,
    "cifar10": _load_cifar10,
    "mnist": _load_mnist,
    "folder": _load_folder,
}
"""Dataset loaders by name; each takes ``(root, split)``. Use :func:`load_dataset`."""


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(DATASETS)


def load_dataset(
    name: str,
    *,
    root: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
) -> ImageData:
    """Load a dataset from :data:`DATASETS` as normalized float32 images.

    Parameters
    ----------
    name
        ``"photo-patches"`` (default for the Flower app: 32x32 RGB patches of real photos,
        labelled by photo), ``"digits"`` (8x8 gray), ``"faces"`` (25x25 gray, face or not),
        ``"cifar10"``, ``"mnist"`` or ``"folder"``.
    root
        Data root for "cifar10" / "mnist" (searched alone when given; otherwise see
        :func:`data_search_paths`); the image directory for "folder"; unused by the bundled
        datasets.
    split
        ``"train"``, ``"test"`` or ``"all"``.
    limit
        Keep only the first ``limit`` samples of the split.

    Returns
    -------
    ImageData

    Raises
    ------
    ValueError
        Unknown name or split, bad limit, or an empty result.
    FileNotFoundError
        Data stored on disk that cannot be found; the message lists the paths tried.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {available_datasets()}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    raw = DATASETS[name](None if root is None else Path(root), split)
    pixels, labels = raw.pixels, raw.labels
    if limit is not None:
        pixels, labels = pixels[:limit], labels[:limit]
    if len(labels) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    unit = torch.from_numpy(np.ascontiguousarray(_to_unit(pixels)))
    mean = torch.tensor(raw.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(raw.std, dtype=torch.float32).view(1, -1, 1, 1)
    return ImageData(
        name=name,
        images=((unit - mean) / std).contiguous(),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
        mean=tuple(float(v) for v in raw.mean),
        std=tuple(float(v) for v in raw.std),
        num_classes=raw.num_classes,
        classes=raw.classes,
    )


def sample_batch(
    data: ImageData,
    batch_size: int,
    *,
    seed: int | None = None,
    distinct_labels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a random client batch without replacement.

    Parameters
    ----------
    data
        The dataset.
    batch_size
        Number of samples, at most ``len(data)``.
    seed
        Seeds the draw; None uses fresh randomness.
    distinct_labels
        Require every sample to have a different label (at most as many samples as distinct
        labels present).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``inputs`` ``(B, C, H, W)``, ``labels`` ``(B,)`` and the dataset ``indices`` ``(B,)``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > len(data):
        raise ValueError(f"batch_size {batch_size} exceeds the {len(data)} samples of {data.name}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    order = torch.randperm(len(data), generator=generator)
    if distinct_labels:
        distinct = int(torch.unique(data.labels).numel())
        if batch_size > distinct:
            raise ValueError(
                f"batch_size {batch_size} with distinct_labels needs as many labels, but "
                f"{data.name} has {distinct}"
            )
        seen: set[int] = set()
        chosen: list[int] = []
        for index in order.tolist():
            label = int(data.labels[index])
            if label not in seen:
                seen.add(label)
                chosen.append(index)
                if len(chosen) == batch_size:
                    break
        indices = torch.tensor(chosen, dtype=torch.int64)
    else:
        indices = order[:batch_size].clone()
    return data.images[indices].clone(), data.labels[indices].clone(), indices
