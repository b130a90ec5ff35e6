"""The audit runs the next-layer route on a CNN's fc1 when SPEAR++ does not recover the batch whole.

A real batch of 32 photo patches through the quickstart CNN (one float32 SGD step at lr 0.1,
seed 0) goes through the :class:`fl_attack.audit.Auditor` exactly as a Flower strategy hands
it over: the global state dict, then the client's. SPEAR++ alone recovers none of fc1's 32
inputs there; with fc2's update in the client's arrays the route adds rows, and the verdict
counts those its check confirmed, without ever calling the batch exact.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"
sys.path.insert(0, str(EXAMPLE))

from measure_frontier import client_step  # noqa: E402

import fl_attack.attacks.next_layer_merge as next_layer_merge_module  # noqa: E402
from clients.ground_truth import layer_inputs  # noqa: E402
from fl_attack import LayerUpdate, get_attack  # noqa: E402
from fl_attack.attacks.next_layer import (  # noqa: E402
    NextLayerResult,
    RecoveredSample,
    smooth_starts,
)
from fl_attack.attacks.next_layer_merge import (  # noqa: E402
    DUPLICATE,
    EXACT_ATTACK,
    EXACT_ATTACK_WEAK,
    ROUTE_CHECKED,
    ROUTE_UNCHECKED,
    batch_matching,
    complete_with_next_layer,
    merged_rows,
    route_budget,
)
from fl_attack.audit import AttackSettings, Auditor  # noqa: E402
from fl_attack.audit.layer import select_layer  # noqa: E402
from fl_attack.audit.next_layer_stage import with_next_layer  # noqa: E402
from fl_attack.audit.observations import ClientIdentity, ClientUpdate  # noqa: E402
from fl_attack.audit.prepare import prepare_unit, round_layer  # noqa: E402
from fl_attack.audit.units import Prepared  # noqa: E402
from fl_attack.audit.verdict import decide_verdict  # noqa: E402
from fl_attack.data.images import load_dataset  # noqa: E402
from fl_attack.pipeline.budget import budget as budget_module  # noqa: E402
from fl_attack.pipeline.budget.budget import Budget, Deadline, hard_limit  # noqa: E402
from fl_attack.pipeline.spectrum.decompose import decompose  # noqa: E402
from fl_attack.reconstruction import Reconstruction  # noqa: E402
from fl_attack.vocabulary import (  # noqa: E402
    EXACT_RELATIVE_ERROR,
    VERDICT_APPROXIMATE,
    VERDICT_EXACT,
    VERDICT_TIMEOUT,
)


def _arrays(net: torch.nn.Module) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in net.state_dict().items()}


def test_the_auditor_merges_the_routes_checked_rows_on_a_real_batch_of_32() -> None:
    torch.set_num_threads(1)
    received, net, images, _ = client_step(
        load_dataset("photo-patches", split="train"), batch_size=32, seed=0, lr=0.1
    )
    truth = layer_inputs(received, images).double().numpy()
    auditor = Auditor(
        get_attack("spear++", device="cpu", seed=0, progress=False),
        attack=AttackSettings(batch_size=32, time_budget=8.0),
    )
    auditor.start_round(1, _arrays(received))
    assert auditor.layer is not None and auditor.layer.following == "fc2.weight"
    (record,) = auditor.audit_round(
        1, [ClientUpdate(identity=ClientIdentity(node_id=7), arrays=_arrays(net))]
    )
    auditor.close()
    summary = record.attack
    checked, unchecked = summary["next_layer_checked"], summary["next_layer_unchecked"]
    assert record.verdict == VERDICT_APPROXIMATE and not summary["complete"]
    assert checked >= 1
    assert record.verdict_reason.startswith(
        f"{checked} of 32 samples recovered and confirmed by the next-layer"
    )
    assert f"{unchecked} more found by it without that confirmation" in record.verdict_reason
    assert record.inputs is not None and record.inputs.shape == truth.shape
    errors = np.array(
        [np.min(np.linalg.norm(truth - row, axis=1) / np.linalg.norm(truth, axis=1)) for row in record.inputs]
    )
    # the route's rows come first, checked ones before unchecked; every checked row is exact
    assert (errors[:checked] < EXACT_RELATIVE_ERROR).all()
    assert int((errors < EXACT_RELATIVE_ERROR).sum()) >= checked
    assert summary["self_check_passed"] is False
    # the route ran and the attack ended on its own, within the audit's hard limit; that the
    # exact attack and the route share one budget is asserted on the Budget objects they are
    # handed (tests/test_head_wiring.py), not on this machine's clock
    assert summary["next_layer_rounds"] >= 1
    assert record.status == "ok" and record.seconds <= hard_limit(8.0), record.seconds


def _attacked_batch_of_8(seed: int) -> tuple[LayerUpdate[np.ndarray], np.ndarray, Reconstruction]:
    """Batch ``seed`` of 8 through the quickstart CNN: fc1 and fc2's updates, fc1's true inputs, and
    SPEAR++'s result on fc1 alone (10 s budget)."""
    received, net, images, _ = client_step(
        load_dataset("photo-patches", split="train"), batch_size=8, seed=seed, lr=0.1
    )

    def values(tensor: torch.Tensor) -> np.ndarray:
        return np.asarray(tensor.detach().double().numpy())

    weight, bias = values(received.fc1.weight), values(received.fc1.bias)
    observed = LayerUpdate(
        weight=weight,
        bias=bias,
        weight_update=values(net.fc1.weight) - weight,
        bias_update=values(net.fc1.bias) - bias,
        next_weight_update=values(net.fc2.weight) - values(received.fc2.weight),
    )
    reconstruction = get_attack("spear++", device="cpu", seed=0, time_budget=10.0, progress=False).invert(
        torch.from_numpy(observed.weight_update),
        torch.from_numpy(observed.bias_update),
        weight=torch.from_numpy(weight),
        bias=torch.from_numpy(bias),
        batch_size=8,
    )
    return observed, layer_inputs(received, images).double().numpy(), reconstruction


def test_the_merge_keeps_every_exact_row_of_an_attack_the_route_cannot_check() -> None:
    # batch 8, seed 1: SPEAR++ recovers all 8 fc1 inputs exactly but cannot claim two of them
    # (near-identical patches: patterns agree at 0.992); the route confirms none and finds rows
    # whose patterns agree worse. Those once displaced an exact row of the attack's.
    observed, truth, reconstruction = _attacked_batch_of_8(1)
    merged = complete_with_next_layer(reconstruction, observed, budget=Budget.start(3.0), seed=0)
    exact: list[set[int]] = []
    for result in (reconstruction, merged):
        rows = result.inputs.numpy()
        errors = np.linalg.norm(truth[None] - rows[:, None], axis=2) / np.linalg.norm(truth, axis=1)
        assert not result.complete
        exact.append(
            {
                int(j)
                for j, e in zip(errors.argmin(axis=1), errors.min(axis=1), strict=True)
                if e < EXACT_RELATIVE_ERROR
            }
        )
    # the attack's exact rows (7 or 8 of them, as far as its search got) all survive the merge
    assert len(exact[0]) >= 7 and exact[0] <= exact[1], exact
    assert merged.stats["next_layer_attack_rows"] == 8


def test_the_merge_does_not_claim_what_the_twin_check_withheld() -> None:
    # batch 8, seed 0: SPEAR++ recovers the batch and claims it. Were its self-check to find
    # near-identical samples with another batch as good, the merge must not claim its rows back.
    observed, _, claimed = _attacked_batch_of_8(0)
    assert claimed.complete and claimed.self_check is not None
    check = dataclasses.replace(
        claimed.self_check, passed=False, reasons=("1 pair of near-identical samples",), ambiguous_twins=1
    )
    withheld = dataclasses.replace(claimed, complete=False, self_check=check)
    unchanged = dataclasses.replace(claimed, complete=False)
    # the route finds one row again, unchecked: the merge keeps the attack's 8 rows either way
    again = NextLayerResult(
        samples=(_sample(claimed.inputs[0].numpy() * 2.0, verified=False),),
        batch_size=8,
        rounds=1,
        seconds=0.0,
    )
    with mock.patch.object(next_layer_merge_module, "recover_from_next_layer", lambda *_, **__: again):
        assert complete_with_next_layer(unchanged, observed, budget=Budget.start(1.0), seed=0).complete
        merged = complete_with_next_layer(withheld, observed, budget=Budget.start(1.0), seed=0)
    assert not merged.complete
    assert merged.stats["next_layer_attack_rows"] == 8


def _sample(inputs: np.ndarray, *, verified: bool) -> RecoveredSample:
    return RecoveredSample(
        inputs=inputs,
        approximate=inputs,
        residual=0.0,
        pattern_kernel=0.0,
        input_kernel=0.0,
        input_gap=1.0,
        verified=verified,
        seconds=0.0,
    )


def test_merged_rows_rank_the_sources_and_drop_duplicates() -> None:
    eye = np.eye(6)
    route = NextLayerResult(
        samples=(_sample(eye[0], verified=False), _sample(eye[1], verified=True)),
        batch_size=4,
        rounds=1,
        seconds=0.0,
    )
    # the exact attack's rows: a duplicate of the route's checked row, a confident row, two weak rows
    attack_rows = np.array([eye[1] * 2.0, eye[2], eye[3], eye[4]])
    confidence = np.array([0.9, 1.0, 0.5, 0.7])
    # the unchecked route row (pattern agreement 0.6) and the weak rows compete on agreement
    rows, sources = merged_rows(route, attack_rows, confidence, 4, route_agreement=np.array([0.6, 1.0]))
    assert sources.tolist() == [ROUTE_CHECKED, EXACT_ATTACK, EXACT_ATTACK_WEAK, ROUTE_UNCHECKED]
    assert np.array_equal(rows, np.array([eye[1], eye[2], eye[4], eye[0]]))
    # a route row whose pattern agrees worse than every weak row does not displace them
    rows, sources = merged_rows(route, attack_rows, confidence, 4, route_agreement=np.array([0.4, 1.0]))
    assert sources.tolist() == [ROUTE_CHECKED, EXACT_ATTACK, EXACT_ATTACK_WEAK, EXACT_ATTACK_WEAK]
    assert np.array_equal(rows, np.array([eye[1], eye[2], eye[4], eye[3]]))
    # on a tie the exact attack's row goes first
    rows, sources = merged_rows(route, attack_rows, confidence, 4, route_agreement=np.array([0.7, 1.0]))
    assert sources.tolist() == [ROUTE_CHECKED, EXACT_ATTACK, EXACT_ATTACK_WEAK, ROUTE_UNCHECKED]
    # too few distinct rows: duplicates fill the batch, never claimed
    # (the route's unchecked row ties with the attack's weak copy of it, which goes first)
    rows, sources = merged_rows(route, np.array([eye[1], eye[1], eye[0], eye[0]]), np.zeros(4), 4)
    assert sources.tolist() == [ROUTE_CHECKED, EXACT_ATTACK_WEAK, DUPLICATE, DUPLICATE]


def test_the_stage_leaves_updates_without_a_next_layer_or_complete_results_alone() -> None:
    zeros = np.zeros((3, 2))
    update = LayerUpdate(zeros, np.zeros(3), zeros, np.zeros(3))
    marker = object()
    assert with_next_layer(marker, update, budget=Budget.start(1.0), seed=0) is marker


def test_the_exact_attack_gets_half_the_budget_and_the_route_what_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budget_module, "now", lambda: 100.0)
    budget = Budget.start(10.0)
    assert budget.exact_attack_share() == Budget(seconds=5.0, started=100.0)
    assert budget.exact_attack_share().deadline == Deadline(105.0)
    assert Budget.start(None).exact_attack_share() == Budget.start(None)
    monkeypatch.setattr(budget_module, "now", lambda: 106.5)
    assert route_budget(budget) == 3.5
    monkeypatch.setattr(budget_module, "now", lambda: 110.2)
    assert route_budget(budget) == 0.0
    assert route_budget(None) == route_budget(Budget.start(None)) == 60.0


def test_the_following_layer_is_found_after_any_layer_and_the_route_runs_only_after_other_layers() -> None:
    arrays = {
        "conv.weight": np.zeros((2, 1, 3, 3)),
        "conv.bias": np.zeros(2),
        "fc1.weight": np.zeros((5, 8)),
        "fc1.bias": np.zeros(5),
        "fc2.weight": np.zeros((4, 5)),
        "fc2.bias": np.zeros(4),
    }
    assert select_layer(arrays, weight_key="fc1.weight").following == "fc2.weight"
    first = {key: value for key, value in arrays.items() if not key.startswith("conv")}
    assert select_layer(first).following == "fc2.weight"  # the exact attack certifies through it
    assert select_layer(arrays, weight_key="fc2.weight").following is None  # nothing follows
    # raw inputs: the route, which needs ReLU features, leaves the attack's result alone
    delta = LayerUpdate(
        np.ones((5, 8)), np.ones(5), np.zeros((5, 8)), np.zeros(5), next_weight_update=np.ones((4, 5))
    )
    marker = object()
    assert (
        not delta.after_layers and with_next_layer(marker, delta, budget=Budget.start(1.0), seed=0) is marker
    )


def test_rows_of_the_route_make_an_approximate_verdict_that_counts_them() -> None:
    attack = {
        "batch_size": 32,
        "directions_found": 32,
        "complete": False,
        "stopped_by": "time_budget",
        "sparsity_matching": 0.6,
    }
    figures: dict[str, Any] = {
        "status": "ok",
        "error": None,
        "signature": lambda: None,
        "magnitude_concentration": 0.0,
    }
    # without the route: the exact attack's own verdict
    assert decide_verdict(attack=attack, input_space="features", **figures).verdict == VERDICT_TIMEOUT
    merged = attack | {"next_layer_checked": 0, "next_layer_unchecked": 5}
    verdict = decide_verdict(attack=merged, input_space="features", **figures)
    assert verdict.verdict == VERDICT_APPROXIMATE
    assert verdict.reason.startswith(
        "0 of 32 samples recovered and confirmed by the next-layer route (from the following layer's update"
    )
    assert "5 more found by it without that confirmation (not claimed), 27 not found by it" in verdict.reason
    # a merged batch the whole-batch self-check passed is judged as any complete one
    complete = merged | {"complete": True, "noisy": False, "min_confidence": 1.0}
    assert decide_verdict(attack=complete, input_space="features", **figures).verdict == VERDICT_EXACT


def test_one_clients_update_keeps_the_next_layers_change_and_a_sum_does_not() -> None:
    rng = np.random.default_rng(0)
    global_arrays = {
        "conv.weight": rng.standard_normal((2, 1, 3, 3)).astype(np.float32),
        "fc1.weight": rng.standard_normal((5, 8)).astype(np.float32),
        "fc1.bias": rng.standard_normal(5).astype(np.float32),
        "fc2.weight": rng.standard_normal((4, 5)).astype(np.float32),
    }
    layer = select_layer(global_arrays)
    assert layer.weight == "fc1.weight" and layer.following == "fc2.weight"
    round_arrays = round_layer(global_arrays, layer)
    change = {key: rng.standard_normal(value.shape) for key, value in global_arrays.items()}
    members = [
        ClientUpdate(
            identity=ClientIdentity(node_id=node),
            arrays={key: (value + change[key]).astype(dtype) for key, value in global_arrays.items()},
        )
        for node, dtype in ((1, np.float32), (2, np.float64))
    ]
    for member in members:  # kept as sent (float32) or subtracted at once (float64)
        prepared = prepare_unit(1, [member], round_arrays, layer=layer, quantization=None, seed=0)
        assert isinstance(prepared, Prepared)
        assert member.arrays is not None
        expected = member.arrays["fc2.weight"].astype(np.float64) - global_arrays["fc2.weight"].astype(
            np.float64
        )
        following = prepared.delta.next_weight_update
        assert following is not None and np.array_equal(following, expected)
    summed = prepare_unit(1, members, round_arrays, layer=layer, quantization=None, seed=0)
    assert isinstance(summed, Prepared) and summed.delta.next_weight_update is None
    # a reply without the next layer still gets its attack, without the route
    without = {key: value for key, value in members[0].arrays.items() if key != "fc2.weight"}  # type: ignore[union-attr]
    alone = prepare_unit(
        1,
        [ClientUpdate(identity=ClientIdentity(node_id=3), arrays=without)],
        round_arrays,
        layer=layer,
        quantization=None,
        seed=0,
    )
    assert isinstance(alone, Prepared) and alone.delta.next_weight_update is None


def test_batch_matching_scores_a_true_batch_as_spear_does_and_a_wrong_row_lower() -> None:
    rng = np.random.default_rng(3)
    batch, width, inputs = 4, 30, 12
    rows = np.maximum(rng.standard_normal((batch, inputs)), 0.0)
    weight, bias = rng.standard_normal((width, inputs)), rng.standard_normal(width)
    active = (rows @ weight.T + bias > 0).astype(float)  # (batch, width)
    output_grads = rng.standard_normal((batch, width)) * active
    observed = LayerUpdate(
        weight=weight,
        bias=bias,
        weight_update=output_grads.T @ rows,
        bias_update=output_grads.sum(0),
        next_weight_update=rng.standard_normal((6, width)),
    )
    factors = decompose(torch.from_numpy(observed.weight_update), batch_size=batch)
    matching = batch_matching(rows, observed=observed, factors=factors, relative_noise=1e-12)
    assert np.array_equal(matching, np.ones(batch))
    wrong = rows.copy()
    wrong[1] = rng.random(inputs)
    assert batch_matching(wrong, observed=observed, factors=factors, relative_noise=1e-12).min() < 0.9


def test_the_routes_smoothing_stops_at_its_deadline() -> None:
    rng = np.random.default_rng(0)
    inputs_map, bias = rng.normal(size=(6, 3)), rng.normal(size=6)
    outside, starts = np.eye(6)[:, :4], rng.normal(size=(5, 3))
    assert np.array_equal(smooth_starts(inputs_map, bias, outside, starts, deadline=Deadline(0.0)), starts)
    moved = smooth_starts(inputs_map, bias, outside, starts, steps=20)
    assert not np.allclose(moved, starts)
