"""The pixel lattice: the integer images of an update's row space, found for the right step only;
approximate rows decoded to exact pixels; missing samples completed through the update; a
decoded row that holds other samples replaced; and several epochs claimed through it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_claims_property import _assert_every_row_is_a_true_sample, _local_training_update
from test_pixel_grid import STD, _normalize, _pixels

import fl_attack.attacks.spear as spear_module
import fl_attack.pipeline.side_information.pixel_lattice as pixel_lattice
from fl_attack import SpearPlusPlus
from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.selection.pixel_grid import pixel_grid
from fl_attack.pipeline.side_information.pixel_lattice import (
    ClientUpdate,
    ImageLattice,
    candidate_steps,
    channel_steps,
    complete_rows,
    decode_rows,
    find_lattice,
    grid_lattice,
    image_lattice,
    lattice_batch,
    left_out_rows,
)

STEPS = tuple(1 / (255 * s) for s in STD)


def _row_space(truth: torch.Tensor, seed: int) -> torch.Tensor:
    """``(b, n)`` another basis of the rows' span, as an update's right factor would be."""
    mixing = torch.randn(truth.shape[0], truth.shape[0], generator=torch.Generator().manual_seed(seed))
    return mixing.double() @ truth


def _seen(update) -> ClientUpdate:  # type: ignore[no-untyped-def]
    """A synthetic update as the lattice reads it: ``left``, ``right`` (``S V^T``) of its weight
    delta, ``left^T db`` and ``W_0``, ``b_0``."""
    b = update.inputs.shape[0]
    u, s, vt = torch.linalg.svd(update.weight_grad.double(), full_matrices=False)
    left, right = u[:, :b], s[:b, None] * vt[:b]
    return ClientUpdate(
        left=left.numpy(),
        right=right.numpy(),
        bias_direction=(left.T @ update.bias_grad.double()).numpy(),
        weight=update.weight.double().numpy(),
        bias=update.bias.double().numpy(),
    )


def _lattice_of(seen: ClientUpdate) -> ImageLattice:
    lattice = image_lattice(
        torch.from_numpy(seen.right),
        layout="channels-first",
        steps=STEPS,
        generator=np.random.default_rng(0),
        constant=torch.from_numpy(seen.bias_direction),
    )
    assert lattice is not None
    return lattice


def test_the_lattice_holds_the_images_for_their_step_and_no_other() -> None:
    truth = _normalize(_pixels(8, 64, seed=0))
    right = _row_space(truth, seed=1)
    lattice = image_lattice(right, layout="channels-first", steps=STEPS, generator=np.random.default_rng(0))
    assert lattice is not None and lattice.basis.shape == (8 + 3, 192)
    # every image is an integer combination of the basis (up to its channels' constant offsets)
    levels = truth.numpy() / lattice.scale
    levels -= (levels - np.rint(levels)) @ lattice.channels.T @ lattice.channels / 64
    coefficients = np.linalg.lstsq(lattice.basis.T, np.rint(levels).T, rcond=None)[0]
    assert np.abs(coefficients - np.rint(coefficients)).max() < 1e-6
    # only the channels' ratios matter: a common factor finds the same integer images
    scaled = image_lattice(
        right,
        layout="channels-first",
        steps=tuple(1.7 * s for s in STEPS),
        generator=np.random.default_rng(0),
    )
    assert scaled is not None and np.allclose(
        np.abs(np.linalg.det(scaled.basis @ lattice.basis.T)),
        np.abs(np.linalg.det(lattice.basis @ lattice.basis.T)),
    )
    wrong = (STEPS[0], 1.2345678 * STEPS[1], STEPS[2])
    assert (
        image_lattice(right, layout="channels-first", steps=wrong, generator=np.random.default_rng(0)) is None
    )
    # a simple fraction off holds multiples of the images: no row decodes there, so it is passed over
    sixfifths = (STEPS[0], 1.2 * STEPS[1], STEPS[2])
    multiples = image_lattice(
        right, layout="channels-first", steps=sixfifths, generator=np.random.default_rng(0)
    )
    assert multiples is not None and decode_rows(multiples, truth.numpy())[0].shape[0] == 0
    assert decode_rows(lattice, truth.numpy())[0].shape[0] == 8


def test_the_step_is_read_from_a_row_on_its_grid_before_the_users() -> None:
    truth = _normalize(_pixels(4, 400, seed=2))
    noisy = truth + 0.3 * torch.randn(
        truth.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    noisy[2] = truth[2]
    steps = candidate_steps(noisy, image_std=(0.3,))
    assert steps[0][0] == "channels-first"
    assert steps[0][1] == pytest.approx(STEPS, rel=1e-4)
    # then the user's, as grey and as colour with a constant per channel
    assert steps[1:] == [
        ("grey", (1 / (255 * 0.3),)),
        ("channels-first", (1 / (255 * 0.3),) * 3),
        ("channels-last", (1 / (255 * 0.3),) * 3),
    ]


def test_a_rows_steps_are_refined_in_the_row_space() -> None:
    # a row up to 0.08 of a level off (an approximate search row still on its grid) reads steps
    # that are slightly off; the row space holds the one sample its levels stand for
    truth = _normalize(_pixels(8, 400, seed=6))
    right = _row_space(truth, seed=7)
    generator = torch.Generator().manual_seed(8)
    off = truth[3] + 0.08 * (torch.rand(truth.shape[1], generator=generator, dtype=torch.float64) - 0.5) * (
        torch.tensor(STEPS, dtype=torch.float64).repeat_interleave(400)
    )
    off[:400] += 0.04 * STEPS[0] * torch.linspace(-1, 1, 400, dtype=torch.float64)  # a drifting error
    read = candidate_steps(off[None, :])
    refined = candidate_steps(off[None, :], right=right)
    true_ratios = np.array(STEPS) / STEPS[0]
    read_error = np.abs(np.array(read[0][1]) / read[0][1][0] - true_ratios).max()
    refined_error = np.abs(np.array(refined[0][1]) / refined[0][1][0] - true_ratios).max()
    assert refined_error < 1e-9 < 1e-6 < read_error
    assert refined[1] == read[0]  # the row's own reading stays as the next try
    lattice = image_lattice(
        right, layout=refined[0][0], steps=refined[0][1], generator=np.random.default_rng(0)
    )
    assert lattice is not None and decode_rows(lattice, truth.numpy())[0].shape[0] == 8


def test_approximate_rows_decode_to_the_exact_images() -> None:
    truth = _normalize(_pixels(8, 64, seed=4))
    right = _row_space(truth, seed=5)
    lattice = image_lattice(right, layout="channels-first", steps=STEPS, generator=np.random.default_rng(0))
    assert lattice is not None
    generator = torch.Generator().manual_seed(6)
    mixing = torch.eye(8, dtype=torch.float64) + 0.03 * torch.randn(
        8, 8, generator=generator, dtype=torch.float64
    )
    approximate = (mixing @ truth).numpy()  # every row off by a few percent of the others
    assert np.abs(approximate - truth.numpy()).max() > 5 * STEPS[0]
    levels, inputs = decode_rows(lattice, approximate)
    assert levels.shape[0] == 8
    order = np.argmin(np.abs(inputs[:, None, :] - truth.numpy()[None]).max(axis=2), axis=1)
    assert sorted(order.tolist()) == list(range(8))
    assert np.abs(inputs - truth.numpy()[order]).max() < 1e-9


def _trained(seed: int, *, b: int = 10, epochs: int = 5, lr: float = 0.1):  # type: ignore[no-untyped-def]
    truth = _normalize(_pixels(b, 64, seed=seed))
    update = _local_training_update(
        truth, width=120, seed=seed, batch=5, epochs=epochs, lr=lr, momentum=0.0, decay=0.0
    )
    return truth, update


@pytest.mark.parametrize("known", [9, 6])
def test_missing_samples_are_completed_exactly_through_the_update(known: int) -> None:
    truth, update = _trained(seed=7)
    seen = _seen(update)
    lattice = _lattice_of(seen)
    levels, inputs = decode_rows(lattice, truth.numpy()[:known])
    assert levels.shape[0] == known
    completion = complete_rows(lattice, levels, inputs, seen)
    assert completion is not None
    missing = truth.numpy()[known:]
    found = completion[1]
    assert found.shape == missing.shape
    distance = np.abs(found[:, None, :] - missing[None]).max(axis=2)
    assert (
        distance.min(axis=1).max() < 1e-9 and len(set(distance.argmin(axis=1).tolist())) == missing.shape[0]
    )


def test_a_decoded_row_holding_other_samples_is_replaced_by_the_sample() -> None:
    """A decode can land on a lattice point in the window that is not a sample (a low-contrast
    image plus the difference of two near copies); left out, the row comes back as the sample."""
    truth, update = _imposter_case()
    imposter = truth[0] + truth[1] - truth[2]
    seen = _seen(update)
    lattice = _lattice_of(seen)
    approximate = truth.clone()
    approximate[0] = imposter
    decoded, _ = decode_rows(lattice, approximate.numpy())
    assert decoded.shape[0] == 10  # the imposter fits the window: decoding alone keeps it
    batch = lattice_batch(lattice, approximate.numpy(), seen)
    assert batch is not None
    distance = np.abs(batch.inputs[:, None, :] - truth.numpy()[None]).max(axis=2)
    assert distance.min(axis=1).max() < 1e-9 and sorted(distance.argmin(axis=1).tolist()) == list(range(10))


def test_the_colour_channels_steps_are_read_from_the_row_space_alone() -> None:
    truth = _normalize(_pixels(8, 64, seed=13))
    ratios = channel_steps(_row_space(truth, 14), layout="channels-first", generator=np.random.default_rng(0))
    assert ratios is not None
    assert ratios == pytest.approx(tuple(step / STEPS[0] for step in STEPS), rel=1e-9)
    # and the lattice found from them (no std given) is at the inputs' own steps
    truth_update = _local_training_update(
        truth, width=80, seed=13, batch=4, epochs=3, lr=0.1, momentum=0.0, decay=0.0
    )
    seen = _seen(truth_update)
    lattice = find_lattice(
        torch.from_numpy(seen.right),
        truth
        + 0.01 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(15), dtype=torch.float64),
        generator=np.random.default_rng(0),
        deadline=Deadline.never(),
        constant=torch.from_numpy(seen.bias_direction),
    )
    assert lattice is not None and lattice.steps == pytest.approx(STEPS, rel=1e-9)


def _imposter_case():  # type: ignore[no-untyped-def]
    levels = _pixels(10, 64, seed=8)
    levels[0] = 100 + levels[0] % 40  # low contrast: room for another image's difference
    noise = torch.randint(-40, 41, levels[1].shape, generator=torch.Generator().manual_seed(9))
    levels[2] = (levels[1] + noise).clamp(0, 255)
    truth = _normalize(levels)
    update = _local_training_update(
        truth, width=120, seed=8, batch=5, epochs=5, lr=0.1, momentum=0.0, decay=0.0
    )
    return truth, update


def _left_out(batch: torch.Tensor, update) -> tuple[np.ndarray, np.ndarray] | None:  # type: ignore[no-untyped-def]
    grid = pixel_grid(batch)
    assert grid is not None  # the grid alone would certify it
    seen = _seen(update)
    frame = grid_lattice(grid.layout, tuple(c.step for c in grid.channels), torch.from_numpy(seen.right))
    offset = np.asarray([c.offset for c in grid.channels]) @ frame.channels
    levels = np.rint((batch.numpy() - offset) / frame.scale)
    return left_out_rows(frame, levels, frame.inputs(levels)[0], seen)


def test_a_batch_on_its_grid_holding_a_combination_of_samples_does_not_come_back() -> None:
    """The pixel grid rules out blends, not integer combinations that stay in the 256 levels: the
    batch below, one row a low-contrast image plus the difference of two others, lies on its grid,
    but that row, left out, comes back from the others and the update as the sample."""
    truth, update = _imposter_case()
    kept = _left_out(truth, update)
    assert kept is not None and np.abs(kept[1] - truth.numpy()).max() < 1e-9
    wrong = truth.clone()
    wrong[0] = truth[0] + truth[1] - truth[2]
    assert _left_out(wrong, update) is None


def test_no_lattice_for_inputs_off_any_grid() -> None:
    truth = torch.randn(8, 192, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    lattice = find_lattice(
        _row_space(truth, 11), truth, generator=np.random.default_rng(0), deadline=Deadline.never()
    )
    assert lattice is None


def test_several_epochs_the_search_cannot_separate_are_claimed_through_the_lattice() -> None:
    truth, update = _trained(seed=12, b=20, epochs=8, lr=0.3)
    # no std given: the channels' steps are read from the row space (about 1 s; room for load)
    rec = SpearPlusPlus(seed=0, time_budget=30.0, max_initializations=768, progress=False).invert(
        **update.arrays()
    )
    assert rec is not None and rec.complete and rec.self_check is not None and rec.self_check.passed
    assert rec.stats["stopped_by"] == "pixel_lattice"
    assert rec.stats["pixel_lattice_decoded"] + rec.stats["pixel_lattice_completed"] == 20
    _assert_every_row_is_a_true_sample(rec, truth)
    assert float(torch.cdist(rec.inputs, truth).min(dim=1).values.max()) < 1e-9


def test_without_the_lattice_the_same_update_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    truth, update = _trained(seed=12, b=20, epochs=8, lr=0.3)
    monkeypatch.setattr(spear_module, "find_lattice", lambda *args, **kwargs: None)
    rec = SpearPlusPlus(seed=0, time_budget=5.0, max_initializations=768, progress=False).invert(
        **update.arrays()
    )
    assert rec is not None and not rec.complete


def test_a_batch_above_the_limit_is_not_searched_for_a_lattice(monkeypatch: pytest.MonkeyPatch) -> None:
    truth = _normalize(_pixels(8, 64, seed=0))
    right = _row_space(truth, seed=1)
    found = find_lattice(right, truth, generator=np.random.default_rng(0), deadline=Deadline.never())
    assert found is not None
    monkeypatch.setattr(pixel_lattice, "MAX_LATTICE_BATCH", 7)
    assert find_lattice(right, truth, generator=np.random.default_rng(0), deadline=Deadline.never()) is None
    # the attack says why it did not look
    _, update = _trained(seed=12, b=20, epochs=8, lr=0.3)
    monkeypatch.setattr(spear_module, "MAX_LATTICE_BATCH", 19)
    rec = SpearPlusPlus(seed=0, time_budget=5.0, max_initializations=768, progress=False).invert(
        **update.arrays()
    )
    assert rec is not None and not rec.complete
    assert rec.stats["pixel_lattice"].startswith("not looked for: a batch of 20 is above 19")


def test_a_reduction_fplll_gives_up_on_is_no_lattice(monkeypatch: pytest.MonkeyPatch) -> None:
    # fplll's double-precision BKZ can abort ("infinite loop in babai", measured at b = 100);
    # cysignals turns the abort into a RuntimeError, which must cost the lattice, not the attack
    fp = pixel_lattice._fpylll()

    def gives_up(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Aborted")

    failing = SimpleNamespace(
        IntegerMatrix=fp.IntegerMatrix,
        LLL=fp.LLL,
        BKZ=SimpleNamespace(reduction=gives_up, Param=fp.BKZ.Param),
    )
    monkeypatch.setattr(pixel_lattice, "_fpylll", lambda: failing)
    truth = _normalize(_pixels(8, 64, seed=0))
    right = _row_space(truth, seed=1)
    assert (
        image_lattice(right, layout="channels-first", steps=STEPS, generator=np.random.default_rng(0)) is None
    )
    failing.LLL = SimpleNamespace(reduction=gives_up)
    assert pixel_lattice._beyond(np.eye(4), np.eye(4)[:1]).shape == (0, 4)


def test_image_std_must_be_positive() -> None:
    with pytest.raises(ValueError, match="image_std must be one or more positive finite numbers"):
        SpearPlusPlus(image_std=(0.25, 0.0, 0.26))
    with pytest.raises(ValueError, match="image_std"):
        SpearPlusPlus(image_std=())
    assert SpearPlusPlus(image_std=[0.5]).image_std == (0.5,)
