"""Inputs on a shared background (digits): the value is read from the update, and the whole batch
is reached from the input side shifted by it, whatever several local epochs did to its patterns."""

from __future__ import annotations

import pytest
import torch
from test_claims_property import _assert_every_row_is_a_true_sample, _attack, _local_training_update

import fl_attack.attacks.spear as spear_module
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.side_information.background_rows import _last_row, background_value
from fl_attack.types import LayerUpdate, ObservedUpdate

MEAN, STD = 0.1307, 0.3081  # MNIST's normalization: the background 0 becomes -0.4242


def _digits(b: int, side: int, seed: int, *, ink: float = 0.3) -> torch.Tensor:
    """``(b, side * side)`` normalized 8-bit grey images: a background of level 0 with a share
    ``ink`` of inked pixels at levels 1-255, and a 2-pixel border blank in every image."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(1, 256, (b, side, side), generator=generator).double()
    levels *= torch.rand(b, side, side, generator=generator) < ink
    levels[:, :2], levels[:, -2:], levels[:, :, :2], levels[:, :, -2:] = 0.0, 0.0, 0.0, 0.0
    levels[0, 5, 5] = 255.0
    return ((levels / 255 - MEAN) / STD).reshape(b, -1)


def _observed(update) -> ObservedUpdate:  # type: ignore[no-untyped-def]
    layer = LayerUpdate(
        weight_update=update.weight_grad, bias_update=update.bias_grad, weight=update.weight, bias=update.bias
    )
    return ObservedUpdate.from_update(layer, device=torch.device("cpu"))


def test_the_shared_background_is_read_from_the_update() -> None:
    inputs = _digits(8, 16, seed=0)
    update = _local_training_update(
        inputs, width=100, seed=0, batch=4, epochs=3, lr=0.1, momentum=0.0, decay=0.0
    )
    value = background_value(_observed(update), relative_noise=1e-12, batch_size=8)
    assert value == pytest.approx(-MEAN / STD, rel=1e-9)


def test_no_background_is_read_where_inputs_share_none_or_share_zero() -> None:
    generator = torch.Generator().manual_seed(1)
    photos = torch.randn(8, 256, generator=generator, dtype=torch.float64)
    update = _local_training_update(
        photos, width=100, seed=1, batch=4, epochs=1, lr=0.1, momentum=0.0, decay=0.0
    )
    assert background_value(_observed(update), relative_noise=1e-12, batch_size=8) is None
    zero_background = _digits(8, 16, seed=1) + MEAN / STD  # the background is 0 itself: the cone as it is
    update = _local_training_update(
        zero_background, width=100, seed=1, batch=4, epochs=1, lr=0.1, momentum=0.0, decay=0.0
    )
    assert background_value(_observed(update), relative_noise=1e-12, batch_size=8) is None


def _epochs_update(seed: int):  # type: ignore[no-untyped-def]
    inputs = _digits(8, 16, seed=seed)
    return inputs, _local_training_update(
        inputs, width=100, seed=seed, batch=4, epochs=4, lr=0.3, momentum=0.0, decay=0.0
    )


def test_digits_trained_over_several_epochs_are_reached_from_the_background_and_claimed() -> None:
    inputs, update = _epochs_update(seed=2)
    rec = _attack(update)
    assert rec is not None and rec.complete and rec.self_check is not None and rec.self_check.passed
    assert rec.stats["background_rows"] == "every sample reached"
    assert rec.stats["background_value"] == pytest.approx(-MEAN / STD, rel=1e-6)
    assert rec.stats["stopped_by"] == "pixel_grid" and rec.stats["pixel_grid"] == "grey"
    _assert_every_row_is_a_true_sample(rec, inputs)


def test_without_the_background_rows_the_same_digits_are_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the claim above rests on: the sphere search's own selection is not the batch here.
    The pixel lattice reaches these digits too; with both switched off nothing is claimed."""
    inputs, update = _epochs_update(seed=2)
    monkeypatch.setattr(spear_module, "background_rows", lambda *args, **kwargs: None)
    rec = _attack(update)
    assert rec is not None and rec.complete and rec.stats["stopped_by"] == "pixel_lattice"
    _assert_every_row_is_a_true_sample(rec, inputs)
    monkeypatch.setattr(spear_module, "find_lattice", lambda *args, **kwargs: None)
    rec = _attack(update)
    assert rec is not None and not rec.complete
    assert rec.stats["background_rows"] == "not every sample reached"


def test_the_last_row_follows_from_the_others_and_the_columns_sparsity() -> None:
    """With b - 1 rows of ``Q^{-1}`` known, the missing one is where every known column is sparsest
    (a sample whose ink covers a known one's is no vertex of the cone; the columns still decide)."""
    generator = torch.Generator().manual_seed(3)
    m, b = 60, 5
    columns = torch.randn(m, b, generator=generator, dtype=torch.float64)
    columns *= torch.rand(m, b, generator=generator) > 0.4  # each sample inactive on ~40% of the neurons
    left, triangle = torch.linalg.qr(columns)  # columns = left @ triangle: q_i = triangle[:, i]
    rows = torch.linalg.inv(triangle)
    rows = rows / rows.norm(dim=1, keepdim=True)
    tolerance = ZeroTolerance(absolute=1e-9, relative_noise=1e-15)
    for missing in range(b):
        known = torch.cat([rows[:missing], rows[missing + 1 :]])
        last = _last_row(known, left, tolerance)
        assert last is not None
        assert float((last @ rows[missing]).abs()) == pytest.approx(1.0, abs=1e-12)
