"""UCI Adult ("census income"): the UCI files read and encoded as in SPEAR (Table 2) and Tableak.

The raw files are those of the UCI repository: ``adult.data`` (train), ``adult.test`` (test,
with a first junk line and labels ending in ``.``) and optionally ``adult.names``; values are
comma separated and missing values are ``?``. Like Tableak, rows with a missing value are
dropped by default (this removes every "Never-worked" row, whose occupation is always
missing). They are looked for in ``<root>/adult/`` or ``<root>`` (see
:mod:`fl_attack.data.locate` and :func:`adult_search_paths`); ``fl-attack-data fetch adult``
downloads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fl_attack.data.locate import adult_presence, adult_search_paths, find_dataset
from fl_attack.data.tabular_data import TabularData
from fl_attack.data.tabular_schema import CONTINUOUS, DISCRETE, TabularFeature, TabularSchema

__all__ = [
    "ADULT_CLASSES",
    "ADULT_FEATURES",
    "ADULT_FILES",
    "MISSING",
    "adult_search_paths",
    "load_adult",
]

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


# --------------------------------------------------------------------------- Adult files


def _find_adult(root: str | Path | None, files: Sequence[str]) -> Path:
    """The first directory of :func:`adult_search_paths` holding every one of ``files``."""
    return find_dataset("adult", root=root, probe=lambda directory: adult_presence(directory, files))


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
                + (
                    " (missing values are dropped only with drop_missing=True)"
                    if row[column] == MISSING
                    else ""
                )
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
    DatasetNotFoundError
        When the files cannot be found (a :class:`FileNotFoundError`): one line naming
        ``fl-attack-data fetch adult`` and the directories tried.
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
