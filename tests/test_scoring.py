"""Scorers of every data kind: images (PSNR), tabular rows (TabLeak), features (relative error)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import LayerUpdate, Reconstruction
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import Auditor, ClientIdentity, ClientUpdate, ExecutionSettings, GroundTruth
from fl_attack.data.images import ImageData
from fl_attack.data.tabular import CONTINUOUS, DISCRETE, TabularFeature, TabularSchema, score_reconstruction
from fl_attack.data.tabular_data import TabularData
from fl_attack.evaluation.scoring import (
    FeatureScorer,
    OrdinalSchema,
    ReconstructionScorer,
    Scorer,
    TabularScorer,
    pick_scorer,
)
from fl_attack.evaluation.scoring_features import match_by_relative_error


def _image_data(count: int = 6, seed: int = 0) -> ImageData:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(count, 3, 4, 4)).astype(np.float32) / np.float32(255.0)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normalized = (torch.from_numpy(pixels) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    return ImageData(
        name="toy",
        images=normalized.float(),
        labels=torch.zeros(count, dtype=torch.int64),
        mean=mean,
        std=std,
        num_classes=2,
    )


# ----------------------------------------------------------------------------- images


def test_image_scorer_reports_psnr_per_sample_and_8bit_plausibility() -> None:
    data = _image_data()
    scorer = ReconstructionScorer.from_image_data(data)
    flat = data.images.reshape(6, -1).double()
    scored = scorer.score(flat[[2, 0, 1]], [0, 1, 2])
    assert scored.kind == "images" and scored.per_sample_metric == "psnr_db"
    assert scored.psnr is not None and min(scored.psnr) > 90.0
    assert scored.per_sample == scored.psnr
    assert scored.quality["exact_fraction"] == 1.0 and scored.quality["kind"] == "images"
    assert scored.quality["plausibility"]["on_8bit_grid_fraction"] == 1.0
    assert scored.quality["plausibility"]["in_range_fraction"] == 1.0
    assert scored.reconstructed_images is not None and scored.reconstructed_images.shape == (3, 3, 4, 4)

    noisy = flat[:3] + 0.05 * torch.randn(3, flat.shape[1], generator=torch.Generator().manual_seed(1))
    rendered = scorer.render(noisy)
    assert rendered.psnr is None and rendered.per_sample is None and rendered.reference_images is None
    assert set(rendered.quality) == {"kind", "plausibility"}
    assert rendered.quality["plausibility"]["on_8bit_grid_fraction"] < 0.05


# ----------------------------------------------------------------------------- features


def test_feature_matching_by_relative_error_by_hand() -> None:
    reference = np.array([[3.0, 4.0], [0.0, 1.0]])
    reconstructed = np.array([[0.0, 1.1], [3.0, 4.0]])
    order, errors = match_by_relative_error(reconstructed, reference)
    assert order.tolist() == [1, 0]
    np.testing.assert_allclose(errors, [0.0, 0.1])

    scored = FeatureScorer().score_against(reconstructed, reference)
    assert scored.kind == "features" and scored.per_sample_metric == "relative_error"
    assert scored.psnr is None and scored.reconstructed_images is None
    assert scored.per_sample is not None
    np.testing.assert_allclose(scored.per_sample, [0.0, 0.1])
    quality = scored.quality
    assert quality["exact_fraction"] == 0.5
    assert quality["approx_fraction"] == 0.5  # 0.1 is not below APPROX_RELATIVE_ERROR = 0.1
    assert quality["batch_exact"] is False
    assert quality["num_reference"] == 2 and quality["num_matched"] == 2
    assert quality["max_relative_error"] == pytest.approx(0.1)


def test_feature_scorer_exact_approximate_and_unmatched() -> None:
    rng = np.random.default_rng(3)
    truth = np.maximum(rng.standard_normal((5, 40)), 0.0)  # ReLU features
    recovered = truth[[4, 2, 0, 1]].copy()
    recovered[1] *= 1.01  # truth[2] within 1% only
    scored = FeatureScorer().score_against(recovered, truth)
    errors = scored.per_sample
    assert errors is not None and errors[3] == 1.0  # truth[3] has no reconstruction
    assert errors[2] == pytest.approx(0.01)
    assert max(errors[0], errors[1], errors[4]) < 1e-12
    assert scored.quality["exact_fraction"] == pytest.approx(3 / 5)
    assert scored.quality["approx_fraction"] == pytest.approx(4 / 5)
    assert scored.quality["num_matched"] == 4
    assert scored.quality["plausibility"]["non_negative_fraction"] == 1.0


def test_feature_scorer_zero_reference_row_uses_a_floor() -> None:
    truth = np.array([[0.0, 0.0], [3.0, 4.0]])
    scored = FeatureScorer().score_against(np.array([[3.0, 4.0], [0.0, 0.0]]), truth)
    assert scored.per_sample == [0.0, 0.0]
    off = FeatureScorer().score_against(np.array([[3.0, 4.0], [0.0, 0.005]]), truth)
    assert off.per_sample == pytest.approx([0.005 / (1e-3 * 5.0), 0.0])


def test_feature_plausibility_by_hand() -> None:
    figures = FeatureScorer().plausibility(np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]))
    assert figures == {
        "non_negative_fraction": pytest.approx(5 / 6),
        "zero_fraction": pytest.approx(3 / 6),
        "non_negative_rows": 1,
        "finite_fraction": 1.0,
    }


def test_feature_scorer_errors_name_the_problem() -> None:
    scorer = FeatureScorer()
    with pytest.raises(ValueError, match="reconstruction rows have 3 features, the ground truth 2"):
        scorer.score_against(np.zeros((2, 3)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="at least one sample"):
        scorer.score_against(np.zeros((2, 3)), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="has no dataset"):
        scorer.references(GroundTruth(indices=[0, 1]))
    with pytest.raises(ValueError, match=r"batch of shape \(B, n\)"):
        scorer.score_against(np.zeros(3), np.zeros((1, 3)))
    with_dataset = FeatureScorer(dataset=np.arange(12.0).reshape(4, 3))
    np.testing.assert_array_equal(
        with_dataset.references(GroundTruth(indices=[2, 2, 0])), [[6, 7, 8], [0, 1, 2]]
    )
    with pytest.raises(ValueError, match=r"\[0, 4\), got 0..4"):
        with_dataset.references(GroundTruth(indices=[0, 4]))


# ----------------------------------------------------------------------------- tabular


def _one_hot_schema() -> TabularSchema:
    return TabularSchema(
        (
            TabularFeature("age", CONTINUOUS, slice(0, 1), mean=40.0, std=10.0, integer=True),
            TabularFeature("colour", DISCRETE, slice(1, 4), categories=("red", "green", "blue")),
            TabularFeature("hours", CONTINUOUS, slice(4, 5), mean=38.0, std=5.0),
        )
    )


def _records() -> list[dict[str, Any]]:
    return [
        {"age": 30, "colour": "red", "hours": 40},
        {"age": 52, "colour": "blue", "hours": 35},
        {"age": 41, "colour": "green", "hours": 20},
        {"age": 25, "colour": "blue", "hours": 45},
    ]


def test_tabular_scorer_agrees_with_spear_table2_scoring_on_one_hot_rows() -> None:
    schema = _one_hot_schema()
    truth = schema.encode(_records()).double().numpy()
    guess = truth[[3, 1, 0, 2]].copy()
    guess[0, 0] += 0.2  # truth[3]'s age: 2 years off (0.2 std, inside TabLeak's 0.319)
    guess[1, 1:4] = [0.9, 0.1, 0.0]  # truth[1]'s colour decodes to red instead of blue
    guess[3, 4] += 0.5  # truth[2]'s hours: 2.5 off (0.5 std, outside the tolerance)
    scored = TabularScorer(schema).score_against(guess, truth)
    reference = score_reconstruction(guess, truth, schema=schema)
    quality = scored.quality
    assert quality["discrete_accuracy"] == pytest.approx(reference.discrete_accuracy) == 75.0
    assert quality["continuous_mae"] == pytest.approx(reference.continuous_mae)
    assert quality["continuous_mae"] == pytest.approx(4.5 / 8)
    assert quality["continuous_accuracy"] == pytest.approx(100 * 7 / 8)
    assert quality["tableak_accuracy"] == pytest.approx(100 * 10 / 12)
    assert quality["feature_accuracy"] == {"colour": 75.0, "age": 100.0, "hours": 75.0}
    assert scored.per_sample == pytest.approx([1.0, 2 / 3, 2 / 3, 1.0])
    assert quality["exact_fraction"] == 0.25  # only truth[0] is exact
    assert quality["approx_fraction"] == 0.5  # truth[0], and truth[3] within the tolerance
    assert quality["plausibility"] == {"valid_category_fraction": 0.75, "plausible_rows": 3}
    assert scored.kind == "tabular" and scored.per_sample_metric == "features_recovered"


def test_ordinal_schema_round_trip_and_scoring() -> None:
    raw = np.array([[30, 0, 40.5], [52, 2, 35.0], [41, 1, 20.0], [25, 2, 45.0]])
    schema = OrdinalSchema.fit(raw, names=("age", "colour", "hours"), categories={"colour": ("r", "g", "b")})
    assert [feature.is_discrete for feature in schema.features] == [False, True, False]
    encoded = schema.encode(raw)
    assert encoded.dtype == np.float32 and encoded.shape == (4, 3)
    decoded = schema.decode_columns(encoded)
    assert decoded.discrete[:, 0].tolist() == [0, 2, 1, 2]
    np.testing.assert_allclose(decoded.continuous, raw[:, [0, 2]], rtol=1e-6)

    scorer = pick_scorer(data=schema)
    assert isinstance(scorer, TabularScorer)
    exact = scorer.score_against(encoded[[1, 3, 0, 2]], encoded)
    assert exact.quality["exact_fraction"] == 1.0 and exact.quality["tableak_accuracy"] == 100.0
    mixtures = (encoded[[0, 1]] + encoded[[2, 3]]) / 2  # codes (0+1)/2 and (2+2)/2
    assert scorer.plausibility(mixtures) == {"valid_category_fraction": 0.5, "plausible_rows": 1}
    with pytest.raises(ValueError, match="integer codes in \\[0, 2\\]"):
        OrdinalSchema.fit(raw + 0.5, names=("age", "colour", "hours"), categories={"colour": ("r", "g", "b")})
    with pytest.raises(ValueError, match="unknown features \\['color'\\]"):
        OrdinalSchema.fit(raw, names=("age", "colour", "hours"), categories={"color": ("r", "g", "b")})
    with pytest.raises(ValueError, match=r"shape \(B, 3\)"):
        scorer.score_against(np.zeros((2, 4)), encoded)


# ----------------------------------------------------------------------------- pick_scorer


def test_pick_scorer_from_data_kind_and_input_space() -> None:
    images = _image_data()
    assert isinstance(pick_scorer(data=images), ReconstructionScorer)
    assert isinstance(pick_scorer(), FeatureScorer)
    assert isinstance(pick_scorer(data=images, input_space="features"), FeatureScorer)
    assert isinstance(pick_scorer(data=_one_hot_schema()), TabularScorer)
    table = TabularData(
        name="toy",
        features=_one_hot_schema().encode(_records()),
        labels=torch.tensor([0, 1, 0, 1]),
        schema=_one_hot_schema(),
        classes=("no", "yes"),
    )
    from_table = pick_scorer(data=table)
    assert isinstance(from_table, TabularScorer)
    assert from_table.references(GroundTruth(indices=[1])).shape == (1, 5)
    assert isinstance(pick_scorer(kind="features", data=np.ones((3, 2))), FeatureScorer)
    assert all(isinstance(scorer, Scorer) for scorer in (pick_scorer(), pick_scorer(data=images)))

    with pytest.raises(ValueError, match="kind must be one of"):
        pick_scorer(kind="audio")
    with pytest.raises(ValueError, match="kind='images' needs the image dataset"):
        pick_scorer(kind="images")
    with pytest.raises(ValueError, match="inputs are features, not images"):
        pick_scorer(kind="images", data=images, input_space="features")
    with pytest.raises(ValueError, match="kind='tabular' needs"):
        pick_scorer(kind="tabular", data=images)
    with pytest.raises(TypeError, match="got str"):
        pick_scorer(data="cifar10")


# ----------------------------------------------------------------------------- with the Auditor


class FixedAttacker(LayerAttackBase):
    """Returns fixed rows as a complete reconstruction."""

    def __init__(self, inputs: np.ndarray) -> None:
        self.inputs = inputs

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        count = len(self.inputs)
        return Reconstruction(
            inputs=torch.as_tensor(self.inputs, dtype=torch.float64),
            batch_size=count,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(count, dtype=torch.float64),
            seconds=0.0,
        )


def test_auditor_scores_features_of_a_layer_after_convolutions() -> None:
    rng = np.random.default_rng(7)
    arrays = {
        "conv.weight": rng.standard_normal((2, 1, 3, 3)).astype(np.float32),
        "conv.bias": rng.standard_normal(2).astype(np.float32),
        "fc1.weight": rng.standard_normal((6, 8)).astype(np.float32),
        "fc1.bias": rng.standard_normal(6).astype(np.float32),
    }
    features = np.maximum(rng.standard_normal((3, 8)), 0.0)
    auditor = Auditor(
        FixedAttacker(features[[1, 2, 0]]),  # type: ignore[arg-type]
        scorer=FeatureScorer(),
        execution=ExecutionSettings(isolation="thread"),
    )
    auditor.start_round(1, arrays)
    reply = {
        key: value - 0.01 * rng.standard_normal(value.shape).astype(np.float32)
        for key, value in arrays.items()
    }
    scored, unscored = auditor.audit_round(
        1,
        [
            ClientUpdate(ClientIdentity(1, 0), reply, ground_truth=GroundTruth(inputs=features)),
            ClientUpdate(ClientIdentity(2, 1), reply),
        ],
    )
    auditor.close()
    assert scored.input_space == "features" and scored.verdict == "exact"
    assert scored.quality["kind"] == "features" and scored.quality["exact_fraction"] == 1.0
    assert scored.quality["max_relative_error"] < 1e-12
    assert scored.psnr is None and scored.reconstructed_images is None
    assert unscored.quality == {"kind": "features", "plausibility": FeatureScorer().plausibility(features)}


def test_every_scorer_looks_up_indices_and_renders_alike() -> None:
    schema = _one_hot_schema()
    rows = schema.encode(_records()).double().numpy()
    images = ReconstructionScorer(
        torch.arange(24.0).reshape(4, 6),
        denormalize=lambda flat: flat.reshape(-1, 1, 2, 3),
        image_shape=(1, 2, 3),
    )
    scorers = (images, FeatureScorer(dataset=rows), TabularScorer(schema, dataset=rows))
    for scorer, dataset in zip(scorers, (np.arange(24.0).reshape(4, 6), rows, rows), strict=True):
        np.testing.assert_array_equal(scorer.references(GroundTruth(indices=[2, 0, 2])), dataset[[2, 0]])
        with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got 1..4"):
            scorer.references(GroundTruth(indices=[1, 4]))
        with pytest.raises(ValueError, match="no ground-truth indices"):
            scorer.references(GroundTruth(indices=[]))
        rendered = scorer.render(dataset[:2])
        assert rendered.quality == {"kind": scorer.kind, "plausibility": scorer.plausibility(dataset[:2])}
        assert rendered.psnr is None and rendered.reference_images is None
        assert (rendered.reconstructed_images is None) == (scorer is not images)
    with pytest.raises(
        ValueError, match=r"TabularScorer has no dataset: pass TabularScorer\(schema, dataset"
    ):
        TabularScorer(schema).references(GroundTruth(indices=[0]))
