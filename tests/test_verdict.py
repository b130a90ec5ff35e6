"""Verdicts from what the server sees: real SGD / Adam / noisy updates, and the decision table."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fl_attack import SpearPlusPlus
from fl_attack.audit import decide_verdict, not_applicable_reason, update_signature
from fl_attack.audit.signature import magnitude_concentration


def _tabular_update(optimizer: str, *, steps: int, batch: int = 8, features: int = 14, seed: int = 0):
    """``W_new - W_old`` of a Linear(features, 128) first layer after local training (float32)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 2))
    before = [p.detach().clone() for p in model[0].parameters()]
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}
    opt = make[optimizer](model.parameters())
    x = torch.randn(batch * steps, features)
    y = torch.randint(0, 2, (batch * steps,))
    for step in range(steps):
        opt.zero_grad()
        rows = slice(step * batch, (step + 1) * batch)
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    after = [p.detach() for p in model[0].parameters()]
    return (
        (after[0] - before[0]).double().numpy(),
        (after[1] - before[1]).double().numpy(),
        before[0].double().numpy(),
        before[1].double().numpy(),
        x[:batch].double().numpy(),
    )


def test_one_sgd_step_is_low_rank_and_recovered_exactly() -> None:
    dw, db, w, b, x = _tabular_update("sgd", steps=1, batch=6, features=40)
    signature = update_signature(dw)
    assert signature.low_rank and signature.rank_estimate == 6
    assert not signature.adaptive_like and not_applicable_reason(signature) is None
    rec = SpearPlusPlus(time_budget=30.0, progress=False).invert(dw, db, weight=w, bias=b)
    verdict = decide_verdict(
        status="ok",
        error=None,
        attack=rec.summary(),
        signature=lambda: signature,
        magnitude_concentration=magnitude_concentration(dw),
        input_space="inputs",
    )
    assert verdict.verdict == "exact", verdict
    # the claim holds: every true sample is among the recovered rows
    recovered = rec.inputs.numpy()
    for sample in x:
        assert np.min(np.abs(recovered - sample).max(axis=1)) < 1e-5


def test_adam_updates_are_not_applicable_and_the_reason_says_adam() -> None:
    for steps in (1, 13):
        dw, _, _, _, _ = _tabular_update("adam", steps=steps)
        signature = update_signature(dw)
        reason = not_applicable_reason(signature)
        assert reason is not None, steps
        assert "Adam" in reason, reason
    one_step, _, _, _, _ = _tabular_update("adam", steps=1)
    assert update_signature(one_step).adaptive_like  # sign-like: every entry about lr
    verdict = decide_verdict(
        status="ok",
        error=None,
        attack={"batch_size": 1, "directions_found": 1, "complete": True, "noisy": False},
        signature=lambda: update_signature(one_step),
        magnitude_concentration=magnitude_concentration(one_step),
        input_space="inputs",
    )
    assert verdict.verdict == "not-applicable" and "Adam" in verdict.reason


def test_batch_larger_than_the_input_dimension_is_not_applicable() -> None:
    dw, *_ = _tabular_update("sgd", steps=1, batch=32, features=14)
    reason = not_applicable_reason(update_signature(dw))
    assert reason is not None and "14 input features" in reason
    told = not_applicable_reason(update_signature(dw), num_examples=32)
    assert told is not None and told.startswith("batch of 32 rows on 14 input features")


def test_zero_update_is_not_applicable() -> None:
    reason = not_applicable_reason(update_signature(np.zeros((5, 4))))
    assert reason is not None and "zero" in reason


def test_decision_table() -> None:
    def never() -> None:
        raise AssertionError("the signature must not be computed for this case")

    clean = {
        "batch_size": 4,
        "directions_found": 4,
        "complete": True,
        "noisy": False,
        "sparsity_matching": 1.0,
    }
    exact = decide_verdict(
        status="ok",
        error=None,
        attack=clean,
        signature=never,
        magnitude_concentration=0.02,
        input_space="features",
    )
    assert exact.verdict == "exact" and "features" in exact.reason
    assert "precise" not in exact.reason  # no estimate, no claim
    with_precision = decide_verdict(
        status="ok",
        error=None,
        attack={**clean, "estimated_max_relative_error": 3.2e-6},
        signature=never,
        magnitude_concentration=0.02,
        input_space="inputs",
    )
    assert with_precision.verdict == "exact" and "rows precise to ~3e-06 (estimated)" in with_precision.reason

    blended = decide_verdict(
        status="ok",
        error=None,
        attack={**clean, "min_confidence": 0.995},
        signature=never,
        magnitude_concentration=0.02,
        input_space="inputs",
    )
    assert blended.verdict == "approximate" and "0.9950" in blended.reason
    confirmed_weak = {"weak_rows": 2, "next_layer_confirmed_rows": 2, "unconfirmed_min_confidence": 1.0}

    def weak(**confirmation: Any) -> Any:
        attack = {**clean, "min_confidence": 0.995, **confirmation}
        return decide_verdict(
            status="ok",
            error=None,
            attack=attack,
            signature=never,
            magnitude_concentration=0.02,
            input_space="inputs",
        )

    confirmed = weak(**confirmed_weak)
    assert confirmed.verdict == "exact" and confirmed.reason.endswith(
        "; 2 samples whose ReLU pattern agrees with the update at only 0.9950 (an active neuron whose "
        "gradient vanishes below the update's precision) were each confirmed through the next layer's update"
    )
    # one weak row left unconfirmed keeps the batch approximate
    partly = {**confirmed_weak, "next_layer_confirmed_rows": 1, "unconfirmed_min_confidence": 0.995}
    still_blended = weak(**partly)
    assert still_blended.verdict == "approximate" and "0.9950" in still_blended.reason

    noisy = {**clean, "noisy": True, "relative_noise": 0.3}
    low_rank = update_signature(np.outer(np.arange(1.0, 7.0), np.arange(1.0, 5.0)))
    approx = decide_verdict(
        status="ok",
        error=None,
        attack=noisy,
        signature=lambda: low_rank,
        magnitude_concentration=0.02,
        input_space="inputs",
    )
    assert approx.verdict == "approximate" and "noise" in approx.reason

    spent = {**clean, "complete": False, "directions_found": 2, "stopped_by": "time_budget"}
    timeout = decide_verdict(
        status="ok",
        error=None,
        attack=spent,
        signature=lambda: low_rank,
        magnitude_concentration=0.02,
        input_space="inputs",
        time_budget=30.0,
    )
    assert timeout.verdict == "timeout" and "30 s" in timeout.reason and "2 of 4" in timeout.reason

    crashed = decide_verdict(
        status="error",
        error="RuntimeError: boom",
        attack={},
        signature=lambda: low_rank,
        magnitude_concentration=0.02,
        input_space="inputs",
    )
    assert crashed.verdict == "failed" and "boom" in crashed.reason
    hard = decide_verdict(
        status="timeout",
        error="did not finish",
        attack={},
        signature=never,
        magnitude_concentration=None,
        input_space=None,
    )
    assert hard.verdict == "timeout"


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2)])
def test_signature_rejects_non_matrices(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2-D"):
        update_signature(np.ones(shape))
