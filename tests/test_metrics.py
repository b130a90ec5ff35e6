"""Scoring reconstructions against ground truth: PSNR, SSIM, matching, batch quality."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl_attack.evaluation.metrics import (
    PSNR_CAP_DB,
    BatchQuality,
    batch_accuracy,
    evaluate_reconstruction,
    lpips_available,
    match_samples,
    psnr,
    ssim,
)


def test_psnr_identical_is_capped() -> None:
    x = torch.rand(4, 3, 8, 8)
    value = psnr(x, x.clone())
    assert value.dtype == torch.float64
    assert torch.equal(value, torch.full((4,), PSNR_CAP_DB, dtype=torch.float64))


def test_psnr_known_mse() -> None:
    ref = torch.zeros(2, 100, dtype=torch.float64)
    rec = ref.clone()
    rec[0] += 0.1  # MSE 0.01 -> 20 dB at data_range 1
    rec[1] += 0.01  # MSE 1e-4 -> 40 dB
    assert torch.allclose(psnr(rec, ref), torch.tensor([20.0, 40.0], dtype=torch.float64))
    # Doubling the range adds 20 log10(2) dB.
    assert torch.allclose(
        psnr(rec, ref, data_range=2.0),
        torch.tensor([20.0, 40.0], dtype=torch.float64) + 20 * math.log10(2.0),
    )


def test_psnr_computed_in_float64_and_accepts_numpy() -> None:
    ref = np.zeros((1, 10), dtype=np.float32)
    rec = ref + np.float32(1e-3)
    assert float(psnr(rec, ref)[0]) == pytest.approx(60.0, abs=1e-4)


def test_psnr_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="same shape"):
        psnr(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="data_range"):
        psnr(torch.zeros(2, 3), torch.zeros(2, 3), data_range=0.0)


def test_psnr_nan_reconstruction_scores_zero() -> None:
    rec = torch.full((1, 5), float("nan"))
    assert float(psnr(rec, torch.zeros(1, 5))[0]) == 0.0


def test_match_samples_recovers_permutation() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(12, 30, generator=gen)
    perm = torch.randperm(12, generator=gen)
    rec = ref[perm] + 1e-3 * torch.randn(12, 30, generator=gen)
    order = match_samples(rec, ref)
    assert torch.equal(perm[order], torch.arange(12))


def test_match_samples_fewer_and_more_reconstructions() -> None:
    ref = torch.eye(4) * 5
    order = match_samples(ref[[2, 0]], ref)
    assert order.tolist() == [1, -1, 0, -1]
    extra = torch.cat([torch.full((1, 4), 100.0), ref[[3, 1, 0, 2]]])
    assert match_samples(extra, ref).tolist() == [3, 2, 4, 1]


def test_match_samples_survives_nan() -> None:
    ref = torch.eye(3)
    rec = ref[[1, 0, 2]].clone()
    rec[1] = float("nan")
    order = match_samples(rec, ref)
    assert order[1].item() == 0 and order[2].item() == 2 and order[0].item() == 1


def test_match_samples_size_mismatch() -> None:
    with pytest.raises(ValueError, match="entries"):
        match_samples(torch.zeros(2, 3), torch.zeros(2, 4))


def test_ssim_identical_and_decreasing_with_noise() -> None:
    gen = torch.Generator().manual_seed(1)
    ref = torch.rand(3, 3, 32, 32, generator=gen)
    assert torch.allclose(ssim(ref, ref), torch.ones(3, dtype=torch.float64))
    noise = torch.randn(ref.shape, generator=gen)
    scores = [float(ssim(ref + s * noise, ref).mean()) for s in (0.01, 0.05, 0.2)]
    assert 1.0 > scores[0] > scores[1] > scores[2]


def test_ssim_matches_skimage() -> None:
    structural_similarity = pytest.importorskip("skimage.metrics").structural_similarity
    gen = torch.Generator().manual_seed(2)
    ref = torch.rand(2, 3, 24, 20, generator=gen, dtype=torch.float64)
    rec = (ref + 0.1 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)).clamp(0, 1)
    ours = ssim(rec, ref)
    for i in range(2):
        expected = structural_similarity(
            rec[i].numpy(),
            ref[i].numpy(),
            data_range=1.0,
            channel_axis=0,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
        )
        assert float(ours[i]) == pytest.approx(expected, abs=1e-6)


def test_ssim_small_images_use_smaller_window() -> None:
    ref = torch.rand(2, 1, 8, 8)
    assert torch.allclose(ssim(ref, ref), torch.ones(2, dtype=torch.float64))
    assert float(ssim(ref + 0.3 * torch.randn_like(ref), ref).mean()) < 0.9
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        ssim(torch.zeros(2, 64), torch.zeros(2, 64))


def test_lpips_availability_is_a_bool() -> None:
    assert isinstance(lpips_available(), bool)


def _denorm(flat: torch.Tensor) -> torch.Tensor:
    return (flat * 0.5 + 0.5).reshape(flat.shape[0], 1, 4, 4)


def test_evaluate_exact_reconstruction_in_shuffled_order() -> None:
    gen = torch.Generator().manual_seed(3)
    ref = torch.rand(6, 16, generator=gen) * 2 - 1
    perm = torch.randperm(6, generator=gen)
    quality = evaluate_reconstruction(ref[perm].numpy().astype(np.float64), ref, denormalize=_denorm)
    assert isinstance(quality, BatchQuality)
    assert torch.equal(perm[quality.order], torch.arange(6))
    assert quality.mean_psnr > 90 and quality.batch_exact
    assert quality.exact_fraction == 1.0 and quality.approx_fraction == 1.0
    assert quality.ssim is not None and torch.allclose(quality.ssim, torch.ones(6, dtype=torch.float64))
    summary = quality.summary()
    json.dumps(summary)
    assert summary["batch_exact"] is True and summary["num_matched"] == 6


def test_evaluate_partial_reconstruction() -> None:
    gen = torch.Generator().manual_seed(4)
    ref = torch.rand(4, 16, generator=gen)
    rec = torch.stack([ref[2], ref[0] + 0.05 * torch.randn(16, generator=gen)])
    quality = evaluate_reconstruction(rec, ref, denormalize=_denorm)
    assert quality.order.tolist() == [1, -1, 0, -1]
    assert quality.psnr[1] == 0 and quality.psnr[3] == 0
    assert quality.psnr[2] > 90 and 25 < quality.psnr[0] < 90
    assert quality.exact_fraction == 0.25 and quality.approx_fraction == 0.5
    assert not quality.batch_exact


def test_evaluate_without_denormalize_uses_reference_range() -> None:
    ref = torch.tensor([[0.0, 10.0], [10.0, 0.0]])
    rec = ref + torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    quality = evaluate_reconstruction(rec, ref)
    assert quality.ssim is None and quality.lpips is None
    assert float(quality.psnr[0]) == pytest.approx(20.0)  # MSE 1, range 10
    assert float(quality.psnr[1]) == PSNR_CAP_DB


def test_evaluate_image_shape_enables_ssim() -> None:
    ref = torch.rand(2, 2 * 12 * 12)
    quality = evaluate_reconstruction(ref, ref, image_shape=(2, 12, 12))
    assert quality.ssim is not None and quality.ssim.shape == (2,)


def test_evaluate_validates_shapes() -> None:
    with pytest.raises(ValueError, match="n=5"):
        evaluate_reconstruction(torch.zeros(2, 5), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="image_shape"):
        evaluate_reconstruction(torch.zeros(2, 6), torch.zeros(2, 6), image_shape=(1, 2, 2))
    with pytest.raises(ValueError, match="batch"):
        evaluate_reconstruction(torch.zeros(6), torch.zeros(2, 6))


def test_batch_accuracy() -> None:
    ref = torch.rand(3, 16)
    exact = evaluate_reconstruction(ref, ref)
    rough = evaluate_reconstruction(ref + 0.02, ref)
    assert batch_accuracy([exact, rough, exact]) == pytest.approx(2 / 3)
    assert batch_accuracy([exact, rough], threshold_db=25.0) == 1.0
    with pytest.raises(ValueError):
        batch_accuracy([])
