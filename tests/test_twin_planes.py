"""Near-identical samples: their directions from a blend's zeros, and claims that stay honest."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import fl_attack.attacks.spear as spear_module
import fl_attack.pipeline.selection.near_duplicates as twin_planes_module
from fl_attack import get_attack
from fl_attack.pipeline.search.sparsity import ZeroTolerance, zero_masks
from fl_attack.pipeline.selection.near_duplicates import twin_plane_proposals, twin_self_check
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer
from fl_attack.pipeline.selection.self_check import SelfCheck, self_check
from fl_attack.pipeline.spectrum.decompose import decompose
from fl_attack.vocabulary import EXACT_RELATIVE_ERROR

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"


def _twin_update(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 update of 5 samples on 40 neurons; samples 3 and 4 differ on 3 neurons only.

    Returns the weight update and the true unit gradient columns ``(m, b)``.
    """
    generator = torch.Generator().manual_seed(seed)
    m, n, b = 40, 30, 5
    active = torch.rand(m, b, generator=generator, dtype=torch.float64) < 0.5
    active[:, 4] = active[:, 3]
    active[[0, 1], 4] = ~active[[0, 1], 3]  # the twins' patterns differ on neurons 0, 1 and 2
    active[2, 3], active[2, 4] = True, False
    columns = torch.randn(m, b, generator=generator, dtype=torch.float64) * active
    inputs = torch.randn(b, n, generator=generator, dtype=torch.float64)
    inputs[4] = inputs[3] + 1e-2 * torch.randn(n, generator=generator, dtype=torch.float64)
    return columns @ inputs, columns / columns.norm(dim=0)


def test_a_blend_of_twins_gives_both_exact_directions() -> None:
    update, columns = _twin_update()
    factors = decompose(update, batch_size=5)
    directions = factors.left.T @ columns  # (b, b): column i is sample i's direction
    tolerance = ZeroTolerance.from_noise(1e-12, width=40)
    blend = (directions[:, 3] + 0.7 * directions[:, 4])[None]
    proposals = twin_plane_proposals(factors, blend, tolerance)
    unit = proposals / proposals.norm(dim=1, keepdim=True)
    best = (unit @ directions).abs().max(dim=0).values
    assert best[3] > 1.0 - 1e-12 and best[4] > 1.0 - 1e-12
    # sample 3's direction is where 2 neurons vanish (sample 4's: 1): proposed first
    assert (unit[0] @ directions[:, 3]).abs() > 1.0 - 1e-12


def test_a_samples_own_direction_gives_no_plane_and_any_blend_of_two_gives_theirs() -> None:
    update, columns = _twin_update()
    factors = decompose(update, batch_size=5)
    directions = factors.left.T @ columns
    tolerance = ZeroTolerance.from_noise(1e-12, width=40)
    assert twin_plane_proposals(factors, directions.T, tolerance).shape == (0, 5)
    # two unrelated samples: their common zeros still pin their plane, and each direction is the
    # angle where most neurons vanish (its own zeros outside the common ones) -- proposed first
    unrelated = (directions[:, 0] + directions[:, 1])[None]
    proposals = twin_plane_proposals(factors, unrelated, tolerance)
    unit = proposals / proposals.norm(dim=1, keepdim=True)
    first_two = (unit[:2] @ directions[:, :2]).abs()
    assert bool((first_two.max(dim=0).values > 1.0 - 1e-12).all())
    noisy = tolerance.with_entry_noise(1e-3, factors.singular_values)
    assert twin_plane_proposals(factors, (directions[:, 3] + directions[:, 4])[None], noisy).shape == (0, 5)


def _quickstart_batch(seed: int, *, image_twin: bool) -> tuple[torch.nn.Module, torch.nn.Module, np.ndarray]:
    """The global and the client's model after one SGD step on batch ``seed`` of 8, and fc1's inputs."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from audit_route import twin_step
        from measure_frontier import client_step

        from clients.ground_truth import layer_inputs
        from fl_attack.data.images import load_dataset

        received, net, images, labels = client_step(
            load_dataset("photo-patches", split="train"), batch_size=8, seed=seed, lr=0.1
        )
        if image_twin:
            received, net = twin_step(images, labels, seed=seed, lr=0.1)
        return received, net, layer_inputs(received, images).double().numpy()
    finally:
        sys.path.remove(str(EXAMPLE))


def _attack(
    received: torch.nn.Module, net: torch.nn.Module, *, time_budget: float = 20.0
) -> tuple[bool, np.ndarray]:
    first, changed = (
        [module for module in model.modules() if isinstance(module, torch.nn.Linear)][0]
        for model in (received, net)
    )
    weight, bias = first.weight.detach().double(), first.bias.detach().double()
    result = get_attack("spear++", device="cpu", seed=0, time_budget=time_budget, progress=False).invert(
        changed.weight.detach().double() - weight,
        changed.bias.detach().double() - bias,
        weight=weight,
        bias=bias,
        batch_size=8,
    )
    return result.complete, result.inputs.numpy()


def _errors(truth: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.linalg.norm(truth[None] - rows[:, None], axis=2) / np.linalg.norm(truth, axis=1)


def test_spear_recovers_a_cnn_batch_with_near_identical_features_exactly() -> None:
    # quickstart CNN, seed 10: two samples' pooled features at cosine 0.986 whose fc1 patterns
    # differ on 5 neurons; without the twin planes SPEAR++ ended at its budget with 7 rows
    torch.set_num_threads(1)
    received, net, truth = _quickstart_batch(10, image_twin=False)
    unit = truth / np.linalg.norm(truth, axis=1, keepdims=True)
    assert (unit @ unit.T - 2 * np.eye(8)).max() > 0.98
    complete, rows = _attack(received, net)
    errors = _errors(truth, rows)
    exact = {
        int(j)
        for j, error in zip(errors.argmin(axis=1), errors.min(axis=1), strict=True)
        if error < EXACT_RELATIVE_ERROR
    }
    # how far the search gets depends on the machine (and torch's kernels): at least 7 of the 8
    # samples come back exact, and a complete claim holds every row exact
    assert len(exact) >= 7, sorted(exact)
    assert not complete or len(exact) == 8


def test_near_identical_images_with_another_consistent_batch_are_not_claimed() -> None:
    # the CNN's image twin, seed 24: four patches of one wall. Twin planes split from every
    # selected direction (not only doubtful ones) once led SPEAR++ to a batch with one row 0.10
    # off that matched the update as well as the true one and was reported complete. How far the
    # search gets in its budget depends on the machine's load; whatever it reaches, a complete
    # claim must hold every row exact, and a withheld one says why.
    torch.set_num_threads(1)
    received, net, truth = _quickstart_batch(24, image_twin=True)
    complete, rows = _attack(received, net)
    errors = _errors(truth, rows).min(axis=1)
    assert not complete or errors.max() < EXACT_RELATIVE_ERROR


def _attack_scorer(received: torch.nn.Module, net: torch.nn.Module) -> SparsityMatchingScorer:
    """The scorer SPEAR++ builds for this update (it depends on the update only, not on the search)."""
    with mock.patch.object(spear_module, "twin_self_check", wraps=twin_self_check) as spy:
        _attack(received, net, time_budget=1.0)
    scorer: SparsityMatchingScorer = spy.call_args.kwargs["scorer"]
    return scorer


def _true_directions(scorer: SparsityMatchingScorer, truth: np.ndarray) -> torch.Tensor:
    """``(b, b)`` unit directions whose inputs are ``truth`` (``X^T = Q^{-1} R``)."""
    inputs = torch.as_tensor(truth, dtype=torch.float64)
    q = torch.linalg.inv(inputs @ torch.linalg.pinv(scorer.factors.right))
    return (q / q.norm(dim=0)).T


def _wrong_consistent_batches(
    scorer: SparsityMatchingScorer, true: torch.Tensor, truth: np.ndarray
) -> list[torch.Tensor]:
    """Batches that differ from the true one in one or two rows of one pair's plane (at angles where
    a neuron vanishes), match the update at the acceptance level and pass the self-check, yet
    hold a row that is not exact: what a search stopped anywhere could select."""
    left, tolerance = scorer.factors.left, scorer.tolerance
    masks = zero_masks(scorer.factors, true, tolerance)
    width = twin_planes_module._angle_width(tolerance, left.shape[0])
    wrong = []
    b = true.shape[0]
    for first in range(b):
        for second in range(first + 1, b):
            plane, _ = torch.linalg.qr(true[[first, second]].T)
            common = masks[first] & masks[second]
            candidates = twin_planes_module._plane_proposals(left, common, plane.T, width=width, limit=64)
            candidates = candidates / candidates.norm(dim=1, keepdim=True)
            sets = twin_planes_module._plane_batches(true, candidates, first, second)
            sets = sets[scorer.score(sets)[0].min(dim=1).values >= 0.99]
            for batch in sets:
                off = _errors(truth, scorer.inputs(batch).numpy()).min(axis=1).max() >= EXACT_RELATIVE_ERROR
                if off and twin_planes_module._passes_self_check(scorer, batch):
                    wrong.append(batch)
    return wrong


def _check_of(scorer: SparsityMatchingScorer, directions: torch.Tensor) -> SelfCheck:
    return self_check(
        scorer.inputs(directions),
        factors=scorer.factors,
        weight=scorer.update.weight,
        bias=scorer.update.bias,
        bias_grad=scorer.update.bias_update,
        relative_noise=scorer.tolerance.relative_noise,
        exact=True,
        pre_activation_basis=scorer.pre_activation_basis,
    )


def test_every_other_consistent_batch_of_a_twin_plane_is_refused_whatever_the_search_reached() -> None:
    # seed 24: the true batch's near-identical pair holds other batches, one or two rows off by
    # 0.02-0.2, that match the update and pass the self-check. Each is what a search stopped at
    # some point could select; the claim must be refused for every one of them, and for the
    # true batch as well (it is not identifiable from the update).
    torch.set_num_threads(1)
    received, net, truth = _quickstart_batch(24, image_twin=True)
    scorer = _attack_scorer(received, net)
    true = _true_directions(scorer, truth)
    wrong = _wrong_consistent_batches(scorer, true, truth)
    assert len(wrong) >= 3
    for directions in [*wrong[:: max(1, len(wrong) // 4)], true]:
        per_sample, _ = scorer.score(directions)
        selection = Selection(
            directions=directions,
            found=torch.ones(directions.shape[0], dtype=torch.bool),
            inputs=scorer.inputs(directions),
            per_sample=per_sample,
            sparsity_matching=float(per_sample.mean()),
        )
        check = _check_of(scorer, directions)
        refused = twin_self_check(check, scorer=scorer, selection=selection, accept=0.99)
        assert not refused.passed
        # refused by the pair's nested patterns, or by the other batches its plane holds
        assert (refused.nested_patterns or 0) >= 1 or refused.ambiguous_twins >= 1
        assert any(
            "nested ReLU patterns" in reason or "another batch explains the update as well" in reason
            for reason in refused.reasons
        )


def test_the_true_batch_is_found_behind_a_selection_with_both_twin_rows_wrong() -> None:
    # a selection with both rows of the near-identical pair off (other directions of their plane,
    # matching the update): the true batch is two replacements away, which one replacement at a
    # time never reaches (the earlier test found nothing here); the test tries both rows at once
    torch.set_num_threads(1)
    received, net, truth = _quickstart_batch(24, image_twin=True)
    scorer = _attack_scorer(received, net)
    true = _true_directions(scorer, truth)
    masks = zero_masks(scorer.factors, true, scorer.tolerance)
    width = twin_planes_module._angle_width(scorer.tolerance, scorer.factors.left.shape[0])
    plane, _ = torch.linalg.qr(true[[1, 3]].T)  # rows 1 and 3: patterns 2 neurons apart
    candidates = twin_planes_module._plane_proposals(
        scorer.factors.left, masks[1] & masks[3], plane.T, width=width, limit=64
    )
    candidates = candidates / candidates.norm(dim=1, keepdim=True)
    others = candidates[((candidates @ true[[1, 3]].T).abs() < 1.0 - 1e-6).all(dim=1)]
    first, second = torch.meshgrid(torch.arange(len(others)), torch.arange(len(others)), indexing="ij")
    distinct = first != second
    both = true.expand(int(distinct.sum()), 8, 8).clone()
    both[:, 1], both[:, 3] = others[first[distinct]], others[second[distinct]]
    both = both[scorer.score(both)[0].min(dim=1).values >= 0.99]
    assert both.shape[0] >= 1
    for directions in both[:4]:
        per_sample, _ = scorer.score(directions)
        selection = Selection(
            directions=directions,
            found=torch.ones(8, dtype=torch.bool),
            inputs=scorer.inputs(directions),
            per_sample=per_sample,
            sparsity_matching=float(per_sample.mean()),
        )
        assert twin_planes_module.twin_ambiguity(scorer, selection, accept_matching=0.99) >= 1


def test_near_identical_rows_too_costly_to_test_are_not_claimed() -> None:
    torch.set_num_threads(1)
    received, net, truth = _quickstart_batch(10, image_twin=False)
    with mock.patch.object(twin_planes_module, "AMBIGUITY_FLOPS", 0.0):
        complete, rows = _attack(received, net)
    assert not complete  # whatever rows the search reached in its budget (the machine's load decides)
    assert rows.shape == truth.shape
