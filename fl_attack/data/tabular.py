"""Tabular data for the victims' clients: the UCI Adult census data set.

SPEAR (Table 2) and Tableak attack clients that train on UCI Adult ("census income"): 14
features of a person, the label being whether the yearly income exceeds 50K USD. Every discrete
feature is one-hot encoded (one column per category, in the order of ``adult.names``), every
continuous feature standardized with the mean and standard deviation of the training split.
(Tableak's code goes one step further and standardizes the one-hot columns too, with train +
test statistics; an exact attack recovers either encoding alike.)
The attack recovers the encoded rows; :func:`decode_batch` maps them back to records (argmax
per one-hot group, de-standardized continuous values) and :func:`score_reconstruction`
scores them as SPEAR Table 2 does: discrete-feature accuracy (%) and continuous mean absolute
error in the features' original units, after a one-to-one matching of reconstructed rows to
true rows.

The raw files are those of the UCI repository: ``adult.data`` (train), ``adult.test`` (test,
with a first junk line and labels ending in ``.``) and optionally ``adult.names``; values are
comma separated and missing values are ``?``. Like Tableak, rows with a missing value are
dropped by default (this removes every "Never-worked" row, whose occupation is always
missing). They are looked for like the image data of :mod:`fl_attack.data.images`: see
:func:`adult_search_paths`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_attack.data.images import DATA_ENV_VAR, data_search_paths, index_tensor
from fl_attack.evaluation.metrics import match_samples

__all__ = [
    "ADULT_CLASSES",
    "ADULT_FEATURES",
    "ADULT_FILES",
    "CONTINUOUS",
    "DISCRETE",
    "DecodedBatch",
    "TabularData",
    "TabularFeature",
    "TabularSchema",
    "TabularScore",
    "adult_search_paths",
    "decode_batch",
    "load_adult",
    "sample_tabular_batch",
    "score_reconstruction",
]

DISCRETE = "discrete"
CONTINUOUS = "continuous"
_KINDS = (DISCRETE, CONTINUOUS)
MISSING = "?"
"""How the UCI files write a missing value."""

ADULT_FILES: dict[str, str] = {"train": "adult.data", "test": "adult.test"}
"""File of each split, as in the UCI repository."""

ADULT_CLASSES: tuple[str, str] = ("<=50K", ">50K")
"""Label names: label 1 means income above 50K."""

ADULT_FEATURES: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("age", None),
    ("workclass", (
        "Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
        "Without-pay", "Never-worked",
    )),
    ("fnlwgt", None),
    ("education", (
        "Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm", "Assoc-voc",
        "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th",
        "Preschool",
    )),
    ("education-num", None),
    ("marital-status", (
        "Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
        "Married-spouse-absent", "Married-AF-spouse",
    )),
    ("occupation", (
        "Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial",
        "Prof-specialty", "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical",
        "Farming-fishing", "Transport-moving", "Priv-house-serv", "Protective-serv",
        "Armed-Forces",
    )),
    ("relationship", (
        "Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried",
    )),
    ("race", ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black")),
    ("sex", ("Female", "Male")),
    ("capital-gain", None),
    ("capital-loss", None),
    ("hours-per-week", None),
    ("native-country", (
        "United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
        "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba",
        "Iran", "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico",
        "Portugal", "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan",
        "Haiti", "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand",
        "Yugoslavia", "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands",
    )),
)  # fmt: skip
"""The 14 features of ``adult.names`` in file order: ``(name, categories)``, categories None
for a continuous feature. The income label is the 15th field of every row."""

Record = dict[str, "str | float"]


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class TabularFeature:
    """One feature of a tabular data set and where it lives in the encoded rows.

    Attributes
    ----------
    name
        Feature name, e.g. ``"age"``.
    kind
        ``"discrete"`` (one-hot encoded) or ``"continuous"`` (standardized).
    columns
        The encoded columns of the feature: ``len(categories)`` columns for a discrete
        feature, one for a continuous one.
    categories
        Category names of a discrete feature, in column order; empty for a continuous one.
    mean, std
        Standardization of a continuous feature (``z = (x - mean) / std``); 0 and 1 for a
        discrete one.
    integer
        Whether every training value of a continuous feature is an integer (all of Adult's
        are), so that decoded values may be rounded.
    """

    name: str
    kind: str
    columns: slice
    categories: tuple[str, ...] = ()
    mean: float = 0.0
    std: float = 1.0
    integer: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"feature {self.name!r}: kind must be one of {_KINDS}, got {self.kind!r}"
            )
        start, stop = self.columns.start, self.columns.stop
        unit_step = self.columns.step in (None, 1)
        if start is None or stop is None or start < 0 or stop <= start or not unit_step:
            raise ValueError(
                f"feature {self.name!r}: columns must be a slice start:stop, 0 <= start < stop, "
                f"got {self.columns}"
            )
        if self.kind == DISCRETE:
            if len(self.categories) < 1 or len(set(self.categories)) != len(self.categories):
                raise ValueError(
                    f"discrete feature {self.name!r} needs distinct categories, got "
                    f"{self.categories}"
                )
            if self.width != len(self.categories):
                raise ValueError(
                    f"discrete feature {self.name!r} has {len(self.categories)} categories but "
                    f"{self.width} columns"
                )
        else:
            if self.width != 1 or self.categories:
                raise ValueError(
                    f"continuous feature {self.name!r} takes exactly one column and no categories"
                )
            if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
                raise ValueError(
                    f"continuous feature {self.name!r} needs a finite mean and a positive std, "
                    f"got mean={self.mean}, std={self.std}"
                )

    @property
    def width(self) -> int:
        """Number of encoded columns."""
        return int(self.columns.stop - self.columns.start)

    @property
    def is_discrete(self) -> bool:
        """True for a one-hot encoded feature."""
        return self.kind == DISCRETE


@dataclass(frozen=True)
class DecodedBatch:
    """An encoded batch mapped back to feature values, column-wise.

    Attributes
    ----------
    discrete
        ``(B, F_d)`` int64 category index of every discrete feature (argmax of its one-hot
        group), in the order of :attr:`TabularSchema.discrete`.
    continuous
        ``(B, F_c)`` float64 values of every continuous feature in original units, in the
        order of :attr:`TabularSchema.continuous`.
    """

    discrete: np.ndarray
    continuous: np.ndarray


@dataclass(frozen=True)
class TabularSchema:
    """The encoding of a tabular data set: its features and their encoded columns.

    Attributes
    ----------
    features
        Every feature, in column order; their columns tile ``0:input_dim`` without gaps.
    """

    features: tuple[TabularFeature, ...]

    def __post_init__(self) -> None:
        if not self.features:
            raise ValueError("a schema needs at least one feature")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        position = 0
        for feature in self.features:
            if feature.columns.start != position:
                raise ValueError(
                    f"feature {feature.name!r} starts at column {feature.columns.start}, expected "
                    f"{position}: the features' columns must tile the row in order"
                )
            position = feature.columns.stop

    @property
    def input_dim(self) -> int:
        """Width n of an encoded row."""
        return int(self.features[-1].columns.stop)

    @property
    def names(self) -> tuple[str, ...]:
        """Feature names in column order."""
        return tuple(f.name for f in self.features)

    @property
    def discrete(self) -> tuple[TabularFeature, ...]:
        """The discrete (one-hot) features."""
        return tuple(f for f in self.features if f.kind == DISCRETE)

    @property
    def continuous(self) -> tuple[TabularFeature, ...]:
        """The continuous (standardized) features."""
        return tuple(f for f in self.features if f.kind == CONTINUOUS)

    def feature(self, name: str) -> TabularFeature:
        """The feature called ``name``."""
        for feature in self.features:
            if feature.name == name:
                return feature
        raise ValueError(f"no feature {name!r}; features: {list(self.names)}")

    def check_batch(self, x: Any, *, name: str = "x") -> np.ndarray:
        """Validate an encoded batch and return it as a float64 numpy array.

        Raises
        ------
        ValueError
            When ``x`` is not a real ``(B, input_dim)`` batch or holds NaN / Inf.
        """
        if isinstance(x, torch.Tensor):
            if x.is_complex():
                raise ValueError(f"{name} must be real, got dtype {x.dtype}")
            array = x.detach().to(device="cpu", dtype=torch.float64).numpy()
        else:
            array = np.asarray(x)
            if array.dtype.kind not in "biuf":
                raise ValueError(f"{name} must be a real numeric array, got dtype {array.dtype}")
            array = array.astype(np.float64)
        if array.ndim != 2 or array.shape[1] != self.input_dim:
            raise ValueError(
                f"{name} must be an encoded batch of shape (B, {self.input_dim}), got "
                f"{tuple(array.shape)}"
            )
        if not np.isfinite(array).all():
            bad = int((~np.isfinite(array)).any(axis=1).sum())
            raise ValueError(
                f"{name} contains NaN or Inf values (in {bad} of {array.shape[0]} rows)"
            )
        return array

    def encode(self, records: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """Encode records (feature name to value) as ``(B, input_dim)`` float32 rows.

        Parameters
        ----------
        records
            One mapping per row with a value for every feature: a category name (str) for a
            discrete feature, a number for a continuous one. Extra keys are ignored.

        Raises
        ------
        ValueError
            On a missing feature, an unknown category or a non-finite continuous value.
        """
        rows = np.zeros((len(records), self.input_dim), dtype=np.float64)
        for i, record in enumerate(records):
            for feature in self.features:
                if feature.name not in record:
                    raise ValueError(f"record {i} has no value for feature {feature.name!r}")
                value = record[feature.name]
                if feature.kind == DISCRETE:
                    index = _category_index(feature, value, where=f"record {i}")
                    rows[i, feature.columns.start + index] = 1.0
                else:
                    number = _as_number(feature, value, where=f"record {i}")
                    rows[i, feature.columns.start] = (number - feature.mean) / feature.std
        return torch.from_numpy(rows.astype(np.float32))

    def decode_columns(self, x: Any) -> DecodedBatch:
        """Decode an encoded batch column-wise (see :class:`DecodedBatch`)."""
        array = self.check_batch(x)
        discrete = np.stack(
            [array[:, f.columns].argmax(axis=1) for f in self.discrete], axis=1
        ) if self.discrete else np.zeros((array.shape[0], 0), dtype=np.int64)
        continuous = np.stack(
            [array[:, f.columns.start] * f.std + f.mean for f in self.continuous], axis=1
        ) if self.continuous else np.zeros((array.shape[0], 0), dtype=np.float64)
        return DecodedBatch(discrete=discrete.astype(np.int64), continuous=continuous)


def _category_index(feature: TabularFeature, value: Any, *, where: str) -> int:
    try:
        return feature.categories.index(str(value).strip())
    except ValueError:
        raise ValueError(
            f"{where}: unknown category {value!r} of feature {feature.name!r}; known: "
            f"{list(feature.categories)}"
        ) from None


def _as_number(feature: TabularFeature, value: Any, *, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: continuous feature {feature.name!r} needs a number, got {value!r}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{where}: continuous feature {feature.name!r} is not finite ({value!r})")
    return number


def decode_batch(
    x: Any, *, schema: TabularSchema, round_integers: bool = False
) -> list[Record]:
    """Map an encoded ``(B, n)`` batch back to records.

    Parameters
    ----------
    x
        Encoded rows (tensor or array, any real dtype), e.g. an attack's ``Reconstruction.inputs``.
    schema
        The encoding.
    round_integers
        Round continuous features whose training values are all integers (all of Adult's) to
        the nearest integer; otherwise return the de-standardized values as they are.

    Returns
    -------
    list[dict]
        One dict per row, feature name to value: the category name of the largest entry of
        each one-hot group, ``z * std + mean`` (float) for each continuous feature.

    Raises
    ------
    ValueError
        When ``x`` does not have ``schema.input_dim`` columns or holds NaN / Inf.
    """
    decoded = schema.decode_columns(x)
    records: list[Record] = []
    for i in range(decoded.discrete.shape[0]):
        values: dict[str, str | float] = {}
        for j, feature in enumerate(schema.discrete):
            values[feature.name] = feature.categories[int(decoded.discrete[i, j])]
        for j, feature in enumerate(schema.continuous):
            value = float(decoded.continuous[i, j])
            if round_integers and feature.integer:
                value = float(round(value))
            values[feature.name] = value
        records.append({name: values[name] for name in schema.names})
    return records


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class TabularScore:
    """How well one tabular batch was reconstructed (SPEAR Table 2 metrics).

    Attributes
    ----------
    discrete_accuracy
        Percentage of (row, discrete feature) pairs whose category was recovered.
    continuous_mae
        Mean absolute error over (row, continuous feature) pairs, in original units.
    feature_accuracy
        Accuracy (%) of each discrete feature.
    feature_mae
        MAE (original units) of each continuous feature.
    exact_fraction
        Fraction of true rows recovered exactly: every category right and every continuous
        value within ``exact_tolerance`` (0.5 by default: it rounds to the true integer).
    order
        ``(B_ref,)`` int64 matching of :func:`fl_attack.evaluation.metrics.match_samples`:
        ``reconstructed[order[i]]`` is matched to ``reference[i]``, -1 when unmatched.
    num_matched
        True rows that have a reconstructed row.
    """

    discrete_accuracy: float
    continuous_mae: float
    feature_accuracy: dict[str, float]
    feature_mae: dict[str, float]
    exact_fraction: float
    order: torch.Tensor
    num_matched: int = 0

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary: plain floats, ints and dicts."""
        return {
            "discrete_accuracy": float(self.discrete_accuracy),
            "continuous_mae": float(self.continuous_mae),
            "exact_fraction": float(self.exact_fraction),
            "num_reference": int(self.order.numel()),
            "num_matched": int(self.num_matched),
            "feature_accuracy": {k: float(v) for k, v in self.feature_accuracy.items()},
            "feature_mae": {k: float(v) for k, v in self.feature_mae.items()},
        }


def score_reconstruction(
    reconstructed: Any,
    reference: Any,
    *,
    schema: TabularSchema,
    exact_tolerance: float = 0.5,
) -> TabularScore:
    """Score a reconstructed tabular batch against the true one, as SPEAR Table 2 does.

    Rows are first matched one-to-one (Hungarian algorithm on the mean squared error of the
    *encoded* rows, :func:`fl_attack.evaluation.metrics.match_samples`, so that standardized continuous
    features and one-hot groups weigh alike), then decoded (:func:`decode_batch`) and compared
    feature by feature.

    Parameters
    ----------
    reconstructed
        ``(B_rec, n)`` encoded rows in any order, e.g. ``Reconstruction.inputs``.
    reference
        ``(B_ref, n)`` the true encoded rows (B_ref >= 1).
    schema
        The encoding of both.
    exact_tolerance
        Largest absolute error (original units) of a continuous value in an exact row.

    Returns
    -------
    TabularScore
        True rows left without a reconstruction (``B_rec < B_ref``) count as wrong in every
        discrete feature and as the feature mean (a guess without information) in every
        continuous one.

    Raises
    ------
    ValueError
        On a batch of the wrong width, NaN / Inf entries or an empty reference.
    """
    rec = schema.check_batch(reconstructed, name="reconstructed")
    ref = schema.check_batch(reference, name="reference")
    if ref.shape[0] == 0:
        raise ValueError("reference must contain at least one row")
    if not exact_tolerance >= 0:
        raise ValueError(f"exact_tolerance must be >= 0, got {exact_tolerance}")
    order = match_samples(torch.from_numpy(rec), torch.from_numpy(ref))
    matched = (order >= 0).numpy()
    # Unmatched true rows are compared with an all-zero encoded row: the mean of every
    # continuous feature, and a category that is then counted wrong below.
    aligned = np.zeros_like(ref)
    aligned[matched] = rec[order.numpy()[matched]]
    true = schema.decode_columns(ref)
    guess = schema.decode_columns(aligned)

    correct = guess.discrete == true.discrete
    correct[~matched] = False
    errors = np.abs(guess.continuous - true.continuous)
    feature_accuracy = {
        f.name: 100.0 * float(correct[:, j].mean()) for j, f in enumerate(schema.discrete)
    }
    feature_mae = {f.name: float(errors[:, j].mean()) for j, f in enumerate(schema.continuous)}
    exact_rows = correct.all(axis=1) & (errors <= exact_tolerance).all(axis=1) & matched
    return TabularScore(
        discrete_accuracy=100.0 * float(correct.mean()) if correct.size else math.nan,
        continuous_mae=float(errors.mean()) if errors.size else math.nan,
        feature_accuracy=feature_accuracy,
        feature_mae=feature_mae,
        exact_fraction=float(exact_rows.mean()),
        order=order,
        num_matched=int(matched.sum()),
    )


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class TabularData:
    """A labelled tabular data set held in memory, encoded for a fully connected network.

    Attributes
    ----------
    name
        Data set name (``"adult"``).
    features
        ``(N, n)`` float32 encoded rows: one-hot discrete features, standardized continuous
        ones (see :attr:`schema`).
    labels
        ``(N,)`` int64 class labels (Adult: 1 when income > 50K).
    schema
        The encoding; its continuous statistics are those of the training split.
    classes
        Class names, by label.
    split
        ``"train"``, ``"test"`` or ``"all"``.
    """

    name: str
    features: torch.Tensor
    labels: torch.Tensor
    schema: TabularSchema
    classes: tuple[str, ...]
    split: str = "train"

    def __post_init__(self) -> None:
        if self.features.dim() != 2 or self.features.shape[1] != self.schema.input_dim:
            raise ValueError(
                f"features must be (N, {self.schema.input_dim}), got {tuple(self.features.shape)}"
            )
        if self.labels.shape != (self.features.shape[0],):
            raise ValueError(
                f"labels must have shape ({self.features.shape[0]},), got "
                f"{tuple(self.labels.shape)}"
            )
        if len(self.classes) < 2:
            raise ValueError(f"need at least two classes, got {self.classes}")

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def input_dim(self) -> int:
        """Width n of an encoded row (105 for Adult)."""
        return self.schema.input_dim

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    def decode(self, x: Any, *, round_integers: bool = False) -> list[Record]:
        """:func:`decode_batch` with this data set's schema."""
        return decode_batch(x, schema=self.schema, round_integers=round_integers)

    def encode(self, records: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """:meth:`TabularSchema.encode` with this data set's schema."""
        return self.schema.encode(records)

    def score(
        self, reconstructed: Any, reference: Any, *, exact_tolerance: float = 0.5
    ) -> TabularScore:
        """:func:`score_reconstruction` with this data set's schema."""
        return score_reconstruction(
            reconstructed, reference, schema=self.schema, exact_tolerance=exact_tolerance
        )

    def subset(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> TabularData:
        """The rows at ``indices`` (integers or a boolean mask)."""
        idx = index_tensor(indices, len(self), what="rows")
        return TabularData(
            name=self.name,
            features=self.features[idx],
            labels=self.labels[idx],
            schema=self.schema,
            classes=self.classes,
            split=self.split,
        )


def sample_tabular_batch(
    data: TabularData, *, batch_size: int, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a random client batch of rows without replacement.

    Parameters
    ----------
    data
        The data set.
    batch_size
        Number of rows, at most ``len(data)``.
    seed
        Seeds the draw; None uses fresh randomness.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``features`` ``(B, n)`` float32, ``labels`` ``(B,)`` int64 and the row ``indices``.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > len(data):
        raise ValueError(f"batch_size {batch_size} exceeds the {len(data)} rows of {data.name}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    indices = torch.randperm(len(data), generator=generator)[:batch_size].clone()
    return data.features[indices].clone(), data.labels[indices].clone(), indices


# --------------------------------------------------------------------------- Adult files


def adult_search_paths(root: str | Path | None = None) -> list[Path]:
    """Directories searched, in order, for ``adult.data`` / ``adult.test``.

    Parameters
    ----------
    root
        An explicit root: only ``root`` and ``root/adult`` are searched.

    Returns
    -------
    list[Path]
        Each base of :func:`fl_attack.data.images.data_search_paths` (``$FL_ATTACK_DATA``, the
        ``shared/data`` folder found above this package, ``~/.cache/fl_attack/data``) plus
        ``~/data`` and ``./data``, each followed by its ``adult/`` subfolder.
    """
    bases = data_search_paths(root)
    if root is None:
        home_data = Path.home() / "data"
        if home_data not in bases:
            bases.insert(len(bases) - 1, home_data)  # before ./data
    paths: list[Path] = []
    for base in bases:
        for directory in (base, base / "adult"):
            if directory not in paths:
                paths.append(directory)
    return paths


def _find_adult(root: str | Path | None, files: Sequence[str]) -> Path:
    tried = adult_search_paths(root)
    for directory in tried:
        if all((directory / f).is_file() for f in files):
            return directory
    listing = "\n".join(f"  - {p}" for p in tried)
    partial = [d for d in tried if any((d / f).is_file() for f in files)]
    hint = ""
    if partial:
        missing = [f for f in files if not (partial[0] / f).is_file()]
        hint = f" {partial[0]} has only some of them (missing: {', '.join(missing)})."
    raise FileNotFoundError(
        f"adult data ({', '.join(files)}) not found. Looked in:\n{listing}\n"
        f"Provide it by passing root=..., or by setting {DATA_ENV_VAR} to a directory that "
        f"contains adult/.{hint} The files are those of the UCI repository "
        "(https://archive.ics.uci.edu/dataset/2/adult): adult.data, adult.test."
    )


def _read_adult_file(path: Path) -> list[list[str]]:
    """The rows of a UCI Adult file: 15 stripped fields each, label without its trailing dot."""
    rows: list[list[str]] = []
    expected = len(ADULT_FEATURES) + 1
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.strip()
            if not text or text.startswith("|"):  # blank lines, the test file's junk first line
                continue
            fields = [part.strip() for part in text.split(",")]
            if len(fields) != expected:
                raise ValueError(
                    f"{path}:{number}: expected {expected} comma-separated fields (14 features "
                    f"and the income label), got {len(fields)}"
                )
            fields[-1] = fields[-1].rstrip(".")
            rows.append(fields)
    if not rows:
        raise ValueError(f"{path} holds no data rows")
    return rows


def _adult_columns(
    rows: list[list[str]], *, path: Path, drop_missing: bool
) -> tuple[list[list[str]], np.ndarray]:
    """Drop (or keep) rows with missing values; return them and their int64 labels."""
    if drop_missing:
        rows = [row for row in rows if MISSING not in row]
        if not rows:
            raise ValueError(f"{path}: every row has a missing value ('{MISSING}')")
    labels = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        if row[-1] not in ADULT_CLASSES:
            raise ValueError(
                f"{path}: row {i} has income label {row[-1]!r}; expected one of "
                f"{list(ADULT_CLASSES)} (with or without a trailing '.')"
            )
        labels[i] = ADULT_CLASSES.index(row[-1])
    return rows, labels


def _adult_schema(train_rows: list[list[str]], *, path: Path, drop_missing: bool) -> TabularSchema:
    features: list[TabularFeature] = []
    position = 0
    for j, (name, categories) in enumerate(ADULT_FEATURES):
        if categories is None:
            values = _continuous_values(train_rows, j, name=name, path=path)
            mean, std = float(values.mean()), float(values.std())
            features.append(
                TabularFeature(
                    name=name,
                    kind=CONTINUOUS,
                    columns=slice(position, position + 1),
                    mean=mean,
                    std=std if std > 1e-12 else 1.0,  # a constant column stays unscaled
                    integer=bool(np.all(values == np.round(values))),
                )
            )
            position += 1
        else:
            cats = categories if drop_missing else (*categories, MISSING)
            features.append(
                TabularFeature(
                    name=name,
                    kind=DISCRETE,
                    columns=slice(position, position + len(cats)),
                    categories=cats,
                )
            )
            position += len(cats)
    return TabularSchema(tuple(features))


def _continuous_values(rows: list[list[str]], column: int, *, name: str, path: Path) -> np.ndarray:
    values = np.empty(len(rows), dtype=np.float64)
    for i, row in enumerate(rows):
        try:
            values[i] = float(row[column])
        except ValueError:
            raise ValueError(
                f"{path}: row {i} has {row[column]!r} for the continuous feature {name!r}"
                + (" (missing values are dropped only with drop_missing=True)"
                   if row[column] == MISSING else "")
            ) from None
        if not math.isfinite(values[i]):
            raise ValueError(f"{path}: row {i} has a non-finite {name!r} ({row[column]!r})")
    return values


def _encode_rows(rows: list[list[str]], schema: TabularSchema, *, path: Path) -> np.ndarray:
    encoded = np.zeros((len(rows), schema.input_dim), dtype=np.float64)
    for j, feature in enumerate(schema.features):
        if feature.kind == DISCRETE:
            lookup = {c: k for k, c in enumerate(feature.categories)}
            for i, row in enumerate(rows):
                k = lookup.get(row[j])
                if k is None:
                    raise ValueError(
                        f"{path}: row {i} has unknown category {row[j]!r} of feature "
                        f"{feature.name!r}; known: {list(feature.categories)}"
                    )
                encoded[i, feature.columns.start + k] = 1.0
        else:
            values = _continuous_values(rows, j, name=feature.name, path=path)
            encoded[:, feature.columns.start] = (values - feature.mean) / feature.std
    return encoded


def load_adult(
    *,
    root: str | Path | None = None,
    split: str = "train",
    drop_missing: bool = True,
    limit: int | None = None,
) -> TabularData:
    """Load UCI Adult, encoded as in SPEAR / Tableak.

    The 8 discrete features are one-hot encoded in the category order of ``adult.names``
    (:data:`ADULT_FEATURES`), the 6 continuous ones standardized with the mean and the
    (population) standard deviation of the training split ``adult.data`` after missing-value
    handling; the label is 1 for income > 50K. With ``drop_missing`` the encoded row has
    105 columns.

    Parameters
    ----------
    root
        Directory holding ``adult.data`` (and ``adult.test``), or its parent holding
        ``adult/``; searched alone when given, else see :func:`adult_search_paths`.
    split
        ``"train"`` (``adult.data``, 30162 rows after dropping missing values), ``"test"``
        (``adult.test``, 15060) or ``"all"`` (train then test).
    drop_missing
        Drop rows with a missing value (``?``), as Tableak does. When False, every discrete
        feature gets an extra last category ``"?"``.
    limit
        Keep only the first ``limit`` rows of the split.

    Returns
    -------
    TabularData

    Raises
    ------
    FileNotFoundError
        When the files cannot be found; the message lists the directories tried.
    ValueError
        On a bad split or limit, or a malformed file (the message names file and row).
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"unknown split {split!r}; choose one of ['train', 'test', 'all']")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    needed = [ADULT_FILES["train"]] + ([ADULT_FILES["test"]] if split != "train" else [])
    directory = _find_adult(root, needed)

    train_path = directory / ADULT_FILES["train"]
    train_rows, train_labels = _adult_columns(
        _read_adult_file(train_path), path=train_path, drop_missing=drop_missing
    )
    schema = _adult_schema(train_rows, path=train_path, drop_missing=drop_missing)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    if split in ("train", "all"):
        parts.append((_encode_rows(train_rows, schema, path=train_path), train_labels))
    if split in ("test", "all"):
        test_path = directory / ADULT_FILES["test"]
        test_rows, test_labels = _adult_columns(
            _read_adult_file(test_path), path=test_path, drop_missing=drop_missing
        )
        parts.append((_encode_rows(test_rows, schema, path=test_path), test_labels))
    encoded = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if limit is not None:
        encoded, labels = encoded[:limit], labels[:limit]
    return TabularData(
        name="adult",
        features=torch.from_numpy(np.ascontiguousarray(encoded, dtype=np.float32)),
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
        schema=schema,
        classes=ADULT_CLASSES,
        split=split,
    )
