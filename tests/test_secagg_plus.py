"""SecAgg+ arithmetic: Flower's quantization and protocol redone bit for bit, and the simulated option.

The protocol tests run Flower's own ``SecAggPlusWorkflow`` and ``secaggplus_mod`` in this
process (:mod:`tests.secagg_inprocess`) and compare the reimplementation
(:mod:`fl_attack.simulate.secagg`) with what Flower hands to ``aggregate_fit``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation import quantization as flower_quantization
from flwr.server.workflow import SecAggPlusWorkflow
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_attack.audit import Auditor, ClientIdentity, ClientUpdate, SecAggSettings
from fl_attack.simulate.secagg import (
    FLOWER_DEFAULTS,
    SecAggPlusQuantization,
    dequantize,
    modular_sum,
    quantize,
    secagg_observed_sum,
    secagg_plus_aggregate,
    weight_factor,
)
from strategies import RunConfigError, build_auditor
from tests.secagg_inprocess import (
    NAMES,
    RecordingAttacker,
    RecordingFedAvg,
    client_replies,
    run_flower_round,
    task_identity,
)

__all__ = ["task_identity"]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(), (1,), (7,), (3, 4), (2, 3, 2)]),
    values_seed=st.integers(0, 2**31),
    draw_seed=st.integers(0, 2**32 - 1),
    clipping_range=st.sampled_from([0.5, 1.0, 3.0, 8.0]),
    quantization_range=st.integers(2, 2**24),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_quantize_and_dequantize_match_flower(
    shape: tuple[int, ...],
    values_seed: int,
    draw_seed: int,
    clipping_range: float,
    quantization_range: int,
    dtype: type[np.floating[Any]],
) -> None:
    values = np.random.RandomState(values_seed).uniform(-2 * clipping_range, 2 * clipping_range, shape)
    arrays = [np.asarray(values, dtype=dtype), np.asarray(values[..., None] * 0.5, dtype=dtype)]

    np.random.seed(draw_seed)
    expected = flower_quantization.quantize(arrays, clipping_range, quantization_range)
    ours = quantize(
        arrays,
        clipping_range=clipping_range,
        quantization_range=quantization_range,
        rng=np.random.RandomState(draw_seed),
    )
    for theirs, mine in zip(expected, ours, strict=True):
        assert np.array_equal(theirs, mine) and np.asarray(theirs).dtype == mine.dtype
        assert mine.min(initial=0) >= 0 and mine.max(initial=0) <= quantization_range

    flower_back = flower_quantization.dequantize(expected, clipping_range, quantization_range)
    ours_back = dequantize(ours, clipping_range=clipping_range, quantization_range=quantization_range)
    for theirs, mine in zip(flower_back, ours_back, strict=True):
        assert np.array_equal(theirs, mine)
    # Stochastic rounding is off by less than one step from the clipped value.
    step = 2 * clipping_range / quantization_range
    assert np.all(np.abs(ours_back[0] - np.clip(arrays[0], -clipping_range, clipping_range)) < step * 1.001)


@pytest.mark.parametrize(
    ("examples", "workflow", "scale"),
    [
        ((8, 8, 8, 8), None, 0.01),
        ((5, 9, 1, 30), None, 0.01),
        # values beyond the clipping range once weighted: clipped by the protocol
        ((900, 700, 1000), SecAggPlusWorkflow(3, 2, clipping_range=1.0), 2.0),
        # 4 x 2**20 exceeds the modulus 2**21: the sum wraps and Flower returns garbage, faithfully modelled
        ((8, 8, 8, 8), SecAggPlusWorkflow(3, 2, quantization_range=2**20, modulus_range=2**21), 0.01),
    ],
)
def test_simulation_is_bit_identical_to_flowers_secaggplus(
    examples: tuple[int, ...], workflow: Any, scale: float
) -> None:
    start, replies = client_replies(len(examples), seed=len(examples), examples=examples, scale=scale)
    strategy = RecordingFedAvg(min_fit_clients=len(examples), min_available_clients=len(examples))
    order = run_flower_round(replies, start=start, strategy=strategy, seed=17, workflow=workflow)
    delivered = [parameters_to_ndarrays(fit_res.parameters) for _, fit_res in strategy.received]

    settings_ = FLOWER_DEFAULTS if workflow is None else SecAggPlusQuantization.from_workflow(workflow)
    ours = secagg_plus_aggregate(
        [replies[node][0] for node in order],
        num_examples=[replies[node][1] for node in order],
        settings=settings_,
        rng=np.random.RandomState(17),
    )
    assert sorted(order) == sorted(replies)
    for arrays in delivered:  # every FitRes carries the same aggregate
        assert all(np.array_equal(theirs, mine) for theirs, mine in zip(arrays, ours, strict=True))
        assert all(theirs.dtype == np.float64 for theirs in arrays)


def test_aggregate_is_the_weighted_mean_of_the_parameters_within_the_quantization_bound() -> None:
    examples = (5, 9, 1, 30)
    start, replies = client_replies(4, seed=3, examples=examples)
    members = [replies[node][0] for node in sorted(replies)]
    rng = np.random.RandomState(0)
    aggregate = secagg_plus_aggregate(members, num_examples=examples, rng=rng)
    weights = [weight_factor(n, max_weight=1000.0, quantization_range=2**22) for n in examples]
    assert weights == [20972, 37749, 4194, 125829]
    total = sum(weights)
    bound = len(examples) * 1.25 * (2 * FLOWER_DEFAULTS.clipping_range) / total
    for position, array in enumerate(aggregate):
        mean = (
            sum(w * member[position].astype(np.float64) for w, member in zip(weights, members, strict=True))
            / total
        )
        error = np.abs(array - mean)
        assert error.max() <= bound
        assert error.max() > bound / 100  # the protocol's noise is there: not a float mean

    changes = [
        [array.astype(np.float64) - origin for array, origin in zip(member, start, strict=True)]
        for member in members
    ]
    observed = secagg_observed_sum(changes, start=start, num_examples=examples, seed=5)
    again = secagg_observed_sum(changes, start=start, num_examples=examples, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(observed, again, strict=True))  # seeded
    for position, array in enumerate(observed):  # k (A - W0) = sum_i (r_i / mean r) change_i + noise
        weighted = sum(w * change[position] for w, change in zip(weights, changes, strict=True)) * 4 / total
        assert np.abs(array - weighted).max() <= 4 * bound


def test_modular_sum_wraps_like_the_protocol() -> None:
    vectors = [[np.array([3]), np.array([[7, 2**20]])], [np.array([4]), np.array([[2**21 - 1, 2**20]])]]
    summed = modular_sum(vectors, modulus_range=2**21)
    assert summed[0].tolist() == [7] and summed[1].tolist() == [[6, 0]]
    with pytest.raises(ValueError, match="differ in shape"):
        modular_sum([[np.zeros(2)], [np.zeros(3)]], modulus_range=2**21)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clipping_range": 0.0}, "clipping_range must be a positive finite number, got 0.0"),
        ({"max_weight": float("nan")}, "max_weight must be a positive finite number, got nan"),
        ({"quantization_range": 2.5}, "quantization_range must be a positive integer, got 2.5"),
        (
            {"modulus_range": 2**22},
            r"modulus_range must be an integer larger than quantization_range \(4194304\)",
        ),
        ({"modulus_range": 3 * 2**22}, "modulus_range must be a power of 2, got 12582912"),
    ],
)
def test_settings_reject_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecAggPlusQuantization(**kwargs)


def test_settings_read_from_a_workflow_and_errors_name_the_problem() -> None:
    workflow = SecAggPlusWorkflow(3, 2, max_weight=9000.0, clipping_range=2.0)
    assert SecAggPlusQuantization.from_workflow(workflow) == SecAggPlusQuantization(
        clipping_range=2.0, max_weight=9000.0
    )
    assert FLOWER_DEFAULTS == SecAggPlusQuantization.from_workflow(SecAggPlusWorkflow(3, 2))
    with pytest.raises(TypeError, match="expected a SecAggPlusWorkflow .* got str"):
        SecAggPlusQuantization.from_workflow("secagg")
    start = [np.zeros((2, 3)), np.zeros(2)]
    changes = [[np.ones((2, 3)), np.ones(2)]] * 2
    with pytest.raises(
        ValueError, match="member 1 reported no example count: SecAgg\\+ weights each update by it"
    ):
        secagg_observed_sum(changes, start=start, num_examples=[8, None])
    with pytest.raises(ValueError, match="a change of shape \\(3,\\) for an array of shape \\(2,\\)"):
        secagg_observed_sum([[np.ones((2, 3)), np.ones(3)]], start=start, num_examples=[8])
    with pytest.raises(ValueError, match="total SecAgg\\+ weight is zero"):
        secagg_observed_sum(changes, start=start, num_examples=[0, 0])
    with pytest.raises(ValueError, match="num_examples must be a non-negative integer, got -1"):
        weight_factor(-1, max_weight=1000.0, quantization_range=2**22)


def test_auditor_models_secaggplus_when_asked() -> None:
    start, replies = client_replies(2, seed=1, examples=(8, 8))
    updates = [
        ClientUpdate(
            identity=ClientIdentity(node_id=node, partition_id=node - 101),
            arrays=dict(zip(NAMES, arrays, strict=True)),
            num_examples=count,
        )
        for node, (arrays, count, _) in replies.items()
    ]
    observed = {}
    for quantization in (None, FLOWER_DEFAULTS):
        attacker = RecordingAttacker()
        auditor = Auditor(attacker, secagg=SecAggSettings(group_size=2, quantization=quantization), seed=3)
        auditor.start_round(1, dict(zip(NAMES, start, strict=True)))
        (record,) = auditor.audit_round(1, updates)
        assert record.client == "secagg-partition-0_partition-1" and record.status == "ok"
        observed[quantization] = attacker.calls[0]["update"].weight_update
    float_sum = sum(arrays[0].astype(np.float64) - start[0] for arrays, _, _ in replies.values())
    assert np.array_equal(observed[None], float_sum)
    expected, _ = secagg_observed_sum(
        [
            [arrays[0].astype(np.float64) - start[0], arrays[1].astype(np.float64) - start[1]]
            for arrays, _, _ in replies.values()
        ],
        start=start[:2],
        num_examples=[8, 8],
        seed=(3, 1, 101, 102),
    )
    assert np.array_equal(observed[FLOWER_DEFAULTS], expected)
    assert 0 < np.abs(observed[FLOWER_DEFAULTS] - float_sum).max() < 2 * 1.25 * 16 / (2 * 33554) * 2

    # Without example counts SecAgg+ cannot weight: the unit fails with that reason, training goes on.
    unweighted = [ClientUpdate(identity=u.identity, arrays=u.arrays) for u in updates]
    auditor = Auditor(RecordingAttacker(), secagg=SecAggSettings(group_size=2, quantization=FLOWER_DEFAULTS))
    auditor.start_round(1, dict(zip(NAMES, start, strict=True)))
    (record,) = auditor.audit_round(1, unweighted)
    assert record.status == "error"
    assert (
        record.error
        == "audit failed: ValueError: member 0 reported no example count: SecAgg+ weights each update by it"
    )


def test_run_config_key_switches_the_simulated_quantization_on() -> None:
    auditor = build_auditor(
        {"secagg-group-size": 4, "secagg-quantization": True}, store=None, attacker=RecordingAttacker()
    )
    assert auditor.secagg.quantization == FLOWER_DEFAULTS and auditor.secagg.group_size == 4
    assert build_auditor({}, store=None, attacker=RecordingAttacker()).secagg.quantization is None
    with pytest.raises(
        RunConfigError,
        match="unknown run-config key 'secagg-quantisation'; did you mean 'secagg-quantization'",
    ):
        build_auditor({"secagg-quantisation": True}, store=None, attacker=RecordingAttacker())
