"""Victims with three hidden layers and sparse non-negative inputs (issue #18 item 1).

SPEAR++'s own setting (normalised CIFAR-10 behind three hidden layers) finishes in its first
sphere round; raw-pixel-like inputs (non-negative, ~85% exact zeros, look-alike samples) leave a
few samples unfound there. The missing ones are vertices of the input side's cone narrowed by the
directions already trusted (:mod:`fl_attack.pipeline.side_information.missing_samples`), for any number missing.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

import fl_attack.attacks.spear as spear_module
import fl_attack.pipeline.selection.near_duplicates as twin_planes_module
import fl_attack.pipeline.side_information.input_rounds as input_rounds_module
import fl_attack.pipeline.side_information.missing_samples as missing_module
from fl_attack import Reconstruction, SpearPlusPlus
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, sparsest_independent
from fl_attack.pipeline.side_information.input_cone import InputSide
from fl_attack.pipeline.side_information.missing_samples import missing_sample_directions
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.simulate.victims import build_victim, client_gradient, first_linear
from fl_attack.types import ObservedUpdate
from tests.synthetic_layer import relu_layer_update

BATCH, WIDTH, FEATURES = 20, 200, 784


def pixel_like_batch(seed: int, *, batch: int = BATCH, features: int = FEATURES) -> torch.Tensor:
    """Non-negative rows with ~85% exact zeros that share a common part (max cosine ~0.65)."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(features, generator=generator, dtype=torch.float64)
    own = torch.randn(batch, features, generator=generator, dtype=torch.float64)
    return torch.relu(0.8 * common + 0.6 * own - 1.0)


def attack_deep_victim(seed: int, *, one_round: bool) -> tuple[Reconstruction, torch.Tensor]:
    """SPEAR++ on the float32 FedSGD gradient of a three-hidden-layer victim; the true inputs too."""
    torch.set_num_threads(1)
    inputs = pixel_like_batch(seed)
    model = build_victim("spear++", input_dim=FEATURES, width=WIDTH, num_classes=10, depth=4, seed=seed)
    weight_grad, bias_grad = client_gradient(model, inputs.float(), torch.arange(BATCH) % 10)
    _, layer = first_linear(model)
    attacker = SpearPlusPlus(
        device="cpu",
        seed=0,
        time_budget=30.0,
        progress=False,
        max_initializations=640 if one_round else None,  # 640: one sphere round at b = 20
    )
    # without the sweep before the first round (tests/test_deep_layers.py), which finds these samples alone
    with mock.patch.object(input_rounds_module, "sweep_proposals", lambda state, scorer: None):
        reconstruction = attacker.invert(
            weight_grad, bias_grad, weight=layer.weight.detach(), bias=layer.bias.detach(), batch_size=BATCH
        )
    return reconstruction, inputs


def recovered_rows(reconstruction: Reconstruction, truth: torch.Tensor, *, tolerance: float) -> int:
    distances = torch.cdist(truth, reconstruction.inputs.to(torch.float64)).min(dim=1).values
    return int((distances / truth.norm(dim=1) < tolerance).sum())


def test_missing_samples_finish_the_first_round_exactly() -> None:
    reconstruction, inputs = attack_deep_victim(0, one_round=True)
    assert reconstruction.stats["missing_sample_proposals"] > 0
    assert reconstruction.stats["rounds"] == 1
    assert reconstruction.complete
    assert recovered_rows(reconstruction, inputs, tolerance=1e-5) == BATCH


def test_without_them_the_first_round_falls_short() -> None:
    def nothing(side: InputSide, known: torch.Tensor, **_: object) -> torch.Tensor:
        return known.new_zeros(0, BATCH)

    def no_planes(factors: object, directions: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        return directions.new_zeros(0, BATCH)

    def no_deepest_rows(state: object, scorer: object, selection: Selection, **_: object) -> torch.Tensor:
        return selection.directions.new_zeros(0, BATCH)

    # the twin planes (fl_attack/pipeline/selection/near_duplicates.py) and the deepest rows' kernels
    # (fl_attack/pipeline/local_training/epoch_last_directions.py) reach these samples too: all off
    with (
        mock.patch.object(missing_module, "missing_sample_directions", nothing),
        mock.patch.object(twin_planes_module, "twin_plane_proposals", no_planes),
        mock.patch.object(spear_module, "epoch_last_directions", no_deepest_rows),
    ):
        reconstruction, inputs = attack_deep_victim(0, one_round=True)
    assert not reconstruction.complete
    assert recovered_rows(reconstruction, inputs, tolerance=1e-5) < BATCH


def true_columns(update_inputs: torch.Tensor, weight_grad: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows: the unit columns ``q_i`` of ``Q`` (``X^T = Q^{-1} R``) of the exact update."""
    factors = decompose(weight_grad, batch_size=batch)
    inverse = update_inputs @ torch.linalg.pinv(factors.right)
    columns = torch.linalg.inv(inverse).T
    unit: torch.Tensor = columns / columns.norm(dim=1, keepdim=True)
    return unit


@pytest.mark.parametrize("missing", [1, 3, 5])
def test_every_missing_sample_is_proposed(missing: int) -> None:
    batch, width = 10, 40
    inputs = pixel_like_batch(11, batch=batch, features=200)
    update = relu_layer_update(inputs, width=width, seed=11)
    observed = ObservedUpdate.from_update(update.layer_update(), device=torch.device("cpu"))
    factors = decompose(observed.weight_update, batch_size=batch)
    tolerance = ZeroTolerance.from_noise(1e-12, width=width)
    side = InputSide.from_factors(factors, relative_noise=1e-12, relative_zero=1e-8)
    columns = true_columns(update.inputs, update.weight_grad, batch)
    proposals = missing_sample_directions(
        side,
        columns[missing:],
        left=factors.left,
        pre_activation_basis=SparsityMatchingScorer(observed, factors, tolerance).pre_activation_basis,
        bias=observed.bias,
        tolerance=tolerance,
        min_zeros=batch - 1,
        generator=torch.Generator().manual_seed(0),
    )
    matches = (proposals @ columns.T).abs() > 1 - 1e-9
    assert matches[:, :missing].any(dim=0).all()  # each missing sample's column is proposed
    assert not matches[:, missing:].any()  # and no known one again


def test_known_directions_of_the_wrong_shape_are_refused() -> None:
    inputs = pixel_like_batch(12, batch=6, features=80)
    update = relu_layer_update(inputs, width=30, seed=12)
    factors = decompose(update.weight_grad, batch_size=6)
    side = InputSide.from_factors(factors, relative_noise=1e-12, relative_zero=1e-8)
    arguments = {
        "left": factors.left,
        "pre_activation_basis": factors.left,
        "bias": torch.zeros(30, dtype=torch.float64),
        "tolerance": ZeroTolerance.from_noise(1e-12, width=30),
        "min_zeros": 5,
        "generator": torch.Generator(),
    }
    for known in (torch.ones(6, 6), torch.ones(2, 5), torch.ones(6)):
        message = f"known must have shape (k, 6) with 0 <= k < 6, got {tuple(known.shape)}"
        with pytest.raises(ValueError, match=re.escape(message)):
            missing_sample_directions(side, known.double(), **arguments)  # type: ignore[arg-type]


def test_near_dependent_mixtures_never_make_a_singular_start() -> None:
    # three candidates each add only 1.6e-6 of a new direction to the one before: one pass of
    # classical Gram-Schmidt then loses orthogonality (~1e-4), and combinations of those new
    # directions, exactly in the span already chosen, looked independent (Adult, 3 hidden layers)
    size = 20
    frame = torch.linalg.qr(torch.randn(size, size, generator=torch.Generator().manual_seed(0)).double())[0].T
    chain = [frame[i] for i in range(4)]
    for j in range(4, 7):
        step = chain[-1] + 0.3 * chain[-2] + 1.6e-6 * frame[j]
        chain.append(step / step.norm())
    in_span = [frame[4] + frame[5], frame[5] - frame[6], frame[4] + frame[6], frame[6] - 2 * frame[4]]
    candidates = torch.cat([torch.stack(chain), torch.stack([row / row.norm() for row in in_span])])
    chosen = sparsest_independent(candidates, torch.arange(candidates.shape[0], 0, -1), size)
    assert chosen == list(range(7))
    assert float(torch.linalg.svdvals(candidates[chosen]).min()) > 1e-7
