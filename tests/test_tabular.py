"""UCI Adult loader: file format, encoding, decoding, scoring, errors, exact recovery by SPEAR++."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import SpearPlusPlus
from fl_attack.data.images import DATA_ENV_VAR, DatasetNotFoundError
from fl_attack.data.tabular import (
    ADULT_CLASSES,
    ADULT_FEATURES,
    CONTINUOUS,
    DISCRETE,
    TabularFeature,
    TabularSchema,
    adult_search_paths,
    decode_batch,
    load_adult,
    sample_tabular_batch,
    score_reconstruction,
)
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear

SHARED_ADULT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "adult"
ADULT_WIDTH = 6 + sum(len(c) for _, c in ADULT_FEATURES if c is not None)  # 105

_RANGES = {
    "age": (17, 90),
    "fnlwgt": (12_000, 1_500_000),
    "education-num": (1, 16),
    "capital-gain": (0, 99_999),
    "capital-loss": (0, 4_356),
    "hours-per-week": (1, 99),
}


def _random_rows(count: int, seed: int) -> list[list[str]]:
    """Rows of UCI Adult's 14 features plus the income label, as strings."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        row = []
        for name, categories in ADULT_FEATURES:
            if categories is None:
                row.append(str(rng.randint(*_RANGES[name])))
            else:
                row.append(rng.choice(categories))
        row.append(rng.choice(ADULT_CLASSES))
        rows.append(row)
    return rows


def _write_adult(directory: Path, *, train: int = 60, test: int = 20, seed: int = 0) -> dict[str, Any]:
    """Write adult.data / adult.test in the UCI format; return the complete rows written."""
    directory.mkdir(parents=True, exist_ok=True)
    train_rows = _random_rows(train, seed)
    test_rows = _random_rows(test, seed + 1)
    missing = _random_rows(2, seed + 2)
    missing[0][1] = "?"  # workclass
    missing[1][13] = "?"  # native-country
    lines = [", ".join(r) for r in train_rows[:10] + missing[:1] + train_rows[10:] + missing[1:]]
    (directory / "adult.data").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    test_lines = ["|1x3 Cross validator"] + [", ".join(r) + "." for r in test_rows + missing]
    (directory / "adult.test").write_text("\n".join(test_lines) + "\n", encoding="utf-8")
    return {"train": train_rows, "test": test_rows, "missing": missing}


def _as_records(rows: list[list[str]]) -> list[dict[str, Any]]:
    records = []
    for row in rows:
        record = {}
        for (name, categories), value in zip(ADULT_FEATURES, row[:-1], strict=True):  # row[-1]: label
            record[name] = value if categories is not None else float(value)
        records.append(record)
    return records


@pytest.fixture()
def adult_dir(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    rows = _write_adult(tmp_path / "adult")
    return tmp_path, rows


# --------------------------------------------------------------------------- loading


def test_load_synthetic_train(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, rows = adult_dir
    data = load_adult(root=root)  # torchvision-style parent of adult/
    assert data.name == "adult" and data.split == "train"
    assert len(data) == len(rows["train"])  # the two rows with '?' are dropped
    assert data.input_dim == ADULT_WIDTH == 105
    assert data.features.dtype == torch.float32 and data.features.shape == (len(data), 105)
    assert data.labels.dtype == torch.int64 and data.num_classes == 2
    expected = [ADULT_CLASSES.index(r[-1]) for r in rows["train"]]
    assert data.labels.tolist() == expected
    schema = data.schema
    assert schema.names == tuple(name for name, _ in ADULT_FEATURES)
    assert len(schema.discrete) == 8 and len(schema.continuous) == 6
    for feature in schema.discrete:  # exactly one hot column per group
        assert torch.all(data.features[:, feature.columns].sum(dim=1) == 1)
    for feature in schema.continuous:  # standardized with the training statistics
        column = data.features[:, feature.columns.start].double()
        assert abs(float(column.mean())) < 1e-5
        assert float(column.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
        raw = np.array([float(r[schema.names.index(feature.name)]) for r in rows["train"]])
        assert feature.mean == pytest.approx(raw.mean()) and feature.std == pytest.approx(raw.std())
        assert feature.integer
    # the directory itself works as a root too
    direct = load_adult(root=root / "adult")
    assert torch.equal(direct.features, data.features)


def test_load_test_and_all_splits(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, rows = adult_dir
    train = load_adult(root=root)
    test = load_adult(root=root, split="test")
    both = load_adult(root=root, split="all", limit=70)
    assert len(test) == len(rows["test"])  # junk first line and '?' rows skipped
    assert test.labels.tolist() == [ADULT_CLASSES.index(r[-1]) for r in rows["test"]]  # '.' gone
    assert test.schema == train.schema  # test rows use the training statistics
    assert test.decode(test.features, round_integers=True) == _as_records(rows["test"])
    assert len(both) == 70 and torch.equal(both.features[:60], train.features)
    assert torch.equal(both.features[60:], test.features[:10])


def test_keep_missing_values(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, rows = adult_dir
    data = load_adult(root=root, drop_missing=False)
    assert len(data) == len(rows["train"]) + 2  # both rows with a '?' are kept
    assert data.input_dim == 105 + 8  # one '?' category per discrete feature
    assert all(f.categories[-1] == "?" for f in data.schema.discrete)
    decoded = data.decode(data.features[10:11])[0]  # the row written with a missing workclass
    assert decoded["workclass"] == "?"


def test_search_paths_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert adult_search_paths(tmp_path) == [tmp_path, tmp_path / "adult"]
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    paths = adult_search_paths()
    assert paths[:2] == [tmp_path, tmp_path / "adult"]
    assert tmp_path / "home" / "data" / "adult" in paths
    assert Path.cwd() / "data" / "adult" in paths
    _write_adult(tmp_path / "adult", train=12, test=3)
    assert len(load_adult()) == 12  # found through $FL_ATTACK_DATA before any other root


# --------------------------------------------------------------------------- encode / decode


def test_round_trip_is_exact(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, rows = adult_dir
    data = load_adult(root=root)
    records = _as_records(rows["train"])
    decoded = data.decode(data.features, round_integers=True)
    assert decoded == records  # categories and integer values recovered exactly
    assert torch.equal(data.encode(records), data.features)  # bit-exact re-encoding
    unrounded = decode_batch(data.features.double(), schema=data.schema)
    for got, want in zip(unrounded, records, strict=True):
        for name, value in want.items():
            if isinstance(value, float):
                assert abs(float(got[name]) - value) < 0.1  # float32 storage of fnlwgt ~ 1e6
            else:
                assert got[name] == value
    # argmax decoding of a noisy one-hot group
    noisy = data.features[:1].clone()
    sex = data.schema.feature("sex")
    noisy[0, sex.columns] = torch.tensor([0.4, 0.6])
    assert data.decode(noisy)[0]["sex"] == "Male"


def test_schema_validation() -> None:
    with pytest.raises(ValueError, match="categories"):
        TabularFeature(name="a", kind=DISCRETE, columns=slice(0, 3), categories=("x", "y"))
    with pytest.raises(ValueError, match="positive std"):
        TabularFeature(name="a", kind=CONTINUOUS, columns=slice(0, 1), std=0.0)
    with pytest.raises(ValueError, match="kind"):
        TabularFeature(name="a", kind="ordinal", columns=slice(0, 1))
    a = TabularFeature(name="a", kind=CONTINUOUS, columns=slice(0, 1))
    b = TabularFeature(name="b", kind=DISCRETE, columns=slice(2, 4), categories=("x", "y"))
    with pytest.raises(ValueError, match="tile"):
        TabularSchema((a, b))
    schema = TabularSchema(
        (a, TabularFeature(name="b", kind=DISCRETE, columns=slice(1, 3), categories=("x", "y")))
    )
    with pytest.raises(ValueError, match="unknown category 'z'"):
        schema.encode([{"a": 1.0, "b": "z"}])
    with pytest.raises(ValueError, match="no value for feature 'b'"):
        schema.encode([{"a": 1.0}])
    with pytest.raises(ValueError, match="needs a number"):
        schema.encode([{"a": "many", "b": "x"}])


# --------------------------------------------------------------------------- scoring


def test_score_perfect_permuted_and_corrupted(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, _ = adult_dir
    data = load_adult(root=root)
    truth, _, _ = sample_tabular_batch(data, batch_size=12, seed=3)

    perfect = data.score(truth.double(), truth)
    assert perfect.discrete_accuracy == 100.0 and perfect.continuous_mae == 0.0
    assert perfect.exact_fraction == 1.0 and perfect.num_matched == 12
    assert perfect.order.tolist() == list(range(12))

    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    permuted = score_reconstruction(truth[perm], truth, schema=data.schema)
    assert permuted.discrete_accuracy == 100.0 and permuted.continuous_mae == 0.0
    assert torch.equal(perm[permuted.order], torch.arange(12))

    corrupted = truth.clone().double()
    race = data.schema.feature("race")
    block = corrupted[0, race.columns]
    corrupted[0, race.columns] = block.roll(1)  # a wrong category in one row
    fnlwgt = data.schema.feature("fnlwgt")
    corrupted[1, fnlwgt.columns.start] += 3000.0 / fnlwgt.std  # +3000 in original units
    score = data.score(corrupted, truth)
    assert score.discrete_accuracy == pytest.approx(100.0 * (1 - 1 / (12 * 8)))
    assert score.feature_accuracy["race"] == pytest.approx(100.0 * 11 / 12)
    assert score.continuous_mae == pytest.approx(3000.0 / (12 * 6), rel=1e-6)
    assert score.feature_mae["fnlwgt"] == pytest.approx(3000.0 / 12, rel=1e-6)
    assert score.exact_fraction == pytest.approx(10 / 12)
    summary = score.summary()
    assert summary["num_matched"] == 12 and set(summary["feature_mae"]) == {
        f.name for f in data.schema.continuous
    }

    partial = data.score(truth[:10], truth)  # two true rows without a reconstruction
    assert partial.num_matched == 10 and (partial.order < 0).sum() == 2
    assert partial.discrete_accuracy == pytest.approx(100.0 * 10 / 12)
    assert partial.continuous_mae > 0 and partial.exact_fraction == pytest.approx(10 / 12)


def test_score_and_decode_errors(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, _ = adult_dir
    data = load_adult(root=root)
    truth = data.features[:4]
    with pytest.raises(ValueError, match=r"shape \(B, 105\), got \(4, 104\)"):
        data.score(truth[:, :-1], truth)
    with pytest.raises(ValueError, match=r"shape \(B, 105\)"):
        data.decode(truth[0])
    bad = truth.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        data.score(bad, truth)
    with pytest.raises(ValueError, match="reference contains NaN"):
        data.score(truth, bad)
    with pytest.raises(ValueError, match="at least one row"):
        data.score(truth, truth[:0])
    with pytest.raises(ValueError, match="batch_size"):
        sample_tabular_batch(data, batch_size=len(data) + 1)
    with pytest.raises(ValueError, match="batch_size"):
        sample_tabular_batch(data, batch_size=0)


# --------------------------------------------------------------------------- file errors


def test_missing_files_give_one_line_naming_the_command(tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    with pytest.raises(DatasetNotFoundError) as info:
        load_adult(root=empty)
    assert str(info.value) == (
        "adult is not on this machine: run `fl-attack-data fetch adult` (or pass data-root=DIR); "
        f"looked in: {empty}, {empty / 'adult'}"
    )
    assert isinstance(info.value, FileNotFoundError)
    only_train = tmp_path / "partial"
    _write_adult(only_train)
    (only_train / "adult.test").unlink()
    assert len(load_adult(root=only_train)) == 60  # the train split needs no test file
    partial = r"partial has only some of them \(missing: adult\.test\)\)$"
    with pytest.raises(DatasetNotFoundError, match=partial):
        load_adult(root=only_train, split="test")


def test_malformed_files(tmp_path: Path) -> None:
    directory = tmp_path / "adult"
    rows = _write_adult(directory)
    text = (directory / "adult.data").read_text().splitlines()
    (directory / "adult.data").write_text("\n".join(text[:3] + ["39, State-gov, 77516"] + text[3:]))
    with pytest.raises(ValueError, match=r"adult\.data:4: expected 15 comma-separated fields"):
        load_adult(root=directory)
    bad_category = [r[:] for r in rows["train"]]
    bad_category[5][3] = "Kindergarten"
    (directory / "adult.data").write_text("\n".join(", ".join(r) for r in bad_category))
    with pytest.raises(ValueError, match="unknown category 'Kindergarten' of feature 'education'"):
        load_adult(root=directory)
    bad_label = [r[:] for r in rows["train"]]
    bad_label[0][-1] = "50K"
    (directory / "adult.data").write_text("\n".join(", ".join(r) for r in bad_label))
    with pytest.raises(ValueError, match="income label '50K'"):
        load_adult(root=directory)
    with pytest.raises(ValueError, match="split"):
        load_adult(root=directory, split="valid")
    with pytest.raises(ValueError, match="limit"):
        load_adult(root=directory, limit=0)


def test_sample_batch_is_seeded(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, _ = adult_dir
    data = load_adult(root=root)
    x1, y1, i1 = sample_tabular_batch(data, batch_size=16, seed=7)
    x2, y2, i2 = sample_tabular_batch(data, batch_size=16, seed=7)
    assert torch.equal(i1, i2) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert len(set(i1.tolist())) == 16
    assert torch.equal(x1, data.features[i1]) and torch.equal(y1, data.labels[i1])
    sub = data.subset(i1)
    assert torch.equal(sub.features, x1) and sub.schema is data.schema


# --------------------------------------------------------------------------- end to end


def test_spear_pp_recovers_adult_rows_exactly(adult_dir: tuple[Path, dict[str, Any]]) -> None:
    root, _ = adult_dir
    data = load_adult(root=root)
    inputs, labels, _ = sample_tabular_batch(data, batch_size=8, seed=0)
    model = build_victim("spear", input_dim=data.input_dim, width=200, num_classes=2, seed=0)
    weight_grad, bias_grad = client_gradient(model, inputs, labels)
    _, layer = first_linear(model)
    rec = SpearPlusPlus(seed=0, time_budget=30, progress=False).invert(
        weight_grad, bias_grad, weight=layer.weight.detach(), bias=layer.bias.detach(), batch_size=8
    )
    score = data.score(rec.inputs, inputs)
    assert rec.complete, rec.summary()
    print(f"SPEAR++ on 8 Adult-format rows: {rec.seconds:.2f} s")
    assert score.discrete_accuracy == 100.0
    assert score.continuous_mae < 0.05  # original units; fnlwgt is ~1e5
    assert score.exact_fraction == 1.0
    recovered = data.decode(rec.inputs[score.order], round_integers=True)
    assert recovered == data.decode(inputs, round_integers=True)


@pytest.mark.skipif(not (SHARED_ADULT / "adult.data").is_file(), reason="no shared Adult data")
def test_real_adult_files() -> None:
    train = load_adult(root=SHARED_ADULT, split="all")  # train (30162 rows) then test (15060)
    assert (len(train), train.input_dim) == (30162 + 15060, 105)  # Tableak's sizes
    for feature in train.schema.continuous:  # standardized with the training rows' statistics
        assert abs(float(train.features[:30162, feature.columns.start].double().mean())) < 1e-5
    first = train.decode(train.features[:1], round_integers=True)[0]
    assert first == {
        "age": 39.0, "workclass": "State-gov", "fnlwgt": 77516.0, "education": "Bachelors",
        "education-num": 13.0, "marital-status": "Never-married", "occupation": "Adm-clerical",
        "relationship": "Not-in-family", "race": "White", "sex": "Male", "capital-gain": 2174.0,
        "capital-loss": 0.0, "hours-per-week": 40.0, "native-country": "United-States",
    }  # fmt: skip
    assert int(train.labels[0]) == 0
    assert 0.2 < float(train.labels[:30162].float().mean()) < 0.3  # a quarter earn > 50K
