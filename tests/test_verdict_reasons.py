"""The verdict's reason says what happened: directions missing, or all found but not verified (and why)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fl_attack.audit import decide_verdict, update_signature
from fl_attack.audit.signature import UpdateSignature
from fl_attack.pipeline.selection.self_check import SelfCheck

LOW_RANK = update_signature(np.outer(np.arange(1.0, 7.0), np.arange(1.0, 5.0)))


def _never() -> UpdateSignature:
    raise AssertionError("the signature must not be computed for this case")


def _self_check(*reasons: str) -> dict[str, Any]:
    """The ``self_check_*`` statistics the attack writes, from a real :class:`SelfCheck`."""
    check = SelfCheck(
        passed=not reasons,
        exact=True,
        residual=3e-2 if reasons else 1e-8,
        tolerance=1e-6,
        bias_residual=1e-8,
        bias_tolerance=1e-6,
        min_pair_distance=0.5,
        pair_distance_floor=1e-7,
        pattern_twins=0,
        nested_patterns=0,
        rank=4,
        reasons=tuple(reasons),
    )
    return check.stats()


def _reason(attack: dict[str, Any], **options: Any) -> tuple[str, str]:
    verdict = decide_verdict(
        status="ok",
        error=None,
        attack={"batch_size": 4, "complete": False, "noisy": False, "sparsity_matching": 0.97, **attack},
        signature=options.pop("signature", _never),
        magnitude_concentration=0.02,
        input_space="inputs",
        **options,
    )
    return verdict.verdict, verdict.reason


def test_some_directions_not_found() -> None:
    verdict, reason = _reason(
        {
            "directions_found": 3,
            "stopped_by": "no_improvement",
            **_self_check("1 row without a confirmed direction"),
        },
        signature=lambda: LOW_RANK,
    )
    assert verdict == "approximate"
    assert reason == (
        "3 of 4 samples recovered with a consistent ReLU pattern; the rest were not found "
        "(the search stopped when more proposals no longer improved it)"
    )


def test_all_found_but_the_self_check_failed() -> None:
    stats = _self_check("re-synthesised weight update off by 0.03 (noise allows 1e-06)")
    verdict, reason = _reason({"directions_found": 4, "min_confidence": 1.0, **stats})
    assert verdict == "approximate"
    assert reason == (
        "all 4 directions were found but not verified as the batch: the self-check against the observed "
        "update failed (re-synthesised weight update off by 0.03 (noise allows 1e-06))"
    )
    assert "not found" not in reason


def test_all_found_self_check_passed_but_a_pattern_disagrees() -> None:
    verdict, reason = _reason({"directions_found": 4, "min_confidence": 0.9312, **_self_check()})
    assert verdict == "approximate"
    assert reason == (
        "all 4 directions were found but not verified as the batch: the self-check passed, but the weakest "
        "sample's ReLU pattern agrees with the update at only 0.9312 (sparsity matching 0.970), below what "
        "the attack accepts"
    )


def test_all_found_without_self_check_figures() -> None:
    verdict, reason = _reason({"directions_found": 4})
    assert (verdict, reason) == (
        "approximate",
        "all 4 directions were found but not verified as the batch: the attack reported no self-check that "
        "confirms them",
    )


@pytest.mark.parametrize(
    ("found", "progress"),
    [
        (2, " with 2 of 4 samples found"),
        (4, ": all 4 directions were found but not verified as the batch: the self-check against the observed "
            "update failed (rank 3 < 4 above the noise)"),
    ],
)  # fmt: skip
def test_time_budget_spent(found: int, progress: str) -> None:
    stats = {
        "directions_found": found,
        "stopped_by": "time_budget",
        **_self_check("rank 3 < 4 above the noise"),
    }
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (verdict, reason) == ("timeout", f"the attack spent its whole 30 s budget{progress}")


def test_all_found_on_a_noisy_update_with_a_matching_near_chance() -> None:
    stats = {"directions_found": 4, "noisy": True, "sparsity_matching": 0.61, **_self_check()}
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK)
    assert verdict == "approximate"
    assert reason == (
        "all 4 directions were found but not verified as the batch: the self-check passed up to the noise, "
        "but their ReLU patterns agree with the update at a sparsity matching of only 0.610, too close to "
        "chance for the attack to accept"
    )


def test_a_drifted_batch_is_never_called_exact() -> None:
    stats = {"directions_found": 4, "drift_aware": True, **_self_check()}
    verdict, reason = _reason(stats)
    assert verdict == "approximate"
    assert reason == (
        "all 4 directions were found but not verified as the batch: every direction is consistent with "
        "both ends of the client's local steps, which one layer's update cannot tell from a blend of "
        "look-alike samples, so exactness is not claimed"
    )


def test_a_partial_batch_says_how_many_samples_the_next_layer_confirmed() -> None:
    stats = {"directions_found": 3, "next_layer": "on", "next_layer_certified": 2, **_self_check("1 row")}
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK)
    assert verdict == "approximate"
    assert reason == (
        "3 of 4 samples recovered with a consistent ReLU pattern (2 of them confirmed one by one through "
        "the next layer's update); the rest were not found"
    )
    verdict, reason = _reason(
        {**stats, "stopped_by": "time_budget"}, signature=lambda: LOW_RANK, time_budget=9.0
    )
    assert reason == (
        "the attack spent its whole 9 s budget with 3 of 4 samples found (2 of them confirmed one by one "
        "through the next layer's update)"
    )


def test_a_budget_spent_before_the_batch_size_was_estimated_says_so() -> None:
    stats = {
        "batch_size": 0,
        "directions_found": 0,
        "stopped_by": "time_budget",
        "stop_reason": "the decomposition ended past its share of the time budget",
    }
    verdict, reason = _reason(stats, time_budget=20.0)
    assert verdict == "timeout"
    assert "0 of 0" not in reason
    assert reason == (
        "the attack spent its whole 20 s budget: the batch size was not estimated "
        "(the decomposition ended past its share of the time budget)"
    )


@pytest.mark.parametrize(
    ("stop_reason", "why"),
    [("the spectrum had no gap", "the spectrum had no gap"), (None, "the attack reported no batch size")],
)
def test_an_attack_that_estimated_no_batch_size_says_so_and_why(stop_reason: str | None, why: str) -> None:
    stats = {"batch_size": 0, "directions_found": 0, "stopped_by": "no_improvement"}
    if stop_reason is not None:
        stats["stop_reason"] = stop_reason
    verdict, reason = _reason(stats)
    assert "0 of 0" not in reason and "batch of 0" not in reason
    assert (verdict, reason) == ("failed", f"no sample recovered: the batch size was not estimated ({why})")


SPARSITY_OUT_OF_REACH = (
    ": each sample must leave at least 65 of the layer's 116 live neurons inactive to be found (more than "
    "half), which a ReLU layer rarely does"
)


@pytest.mark.parametrize(
    ("stats", "verdict", "before"),
    [
        ({"directions_found": 0, "stopped_by": "time_budget"}, "timeout",
         "the attack spent its whole 30 s budget with 0 of 64 samples found"),
        ({"directions_found": 0, "stopped_by": "no_improvement"}, "failed",
         "no sample recovered of an estimated batch of 64 (the search stopped when more proposals no longer "
         "improved it)"),
        ({"directions_found": 3}, "approximate",
         "3 of 64 samples recovered with a consistent ReLU pattern; the rest were not found"),
    ],
)  # fmt: skip
def test_a_batch_needing_most_of_the_layer_inactive_per_sample_says_so(
    stats: dict[str, Any], verdict: str, before: str
) -> None:
    # the quickstart CNN's fc1 on a client of 64 images: 116 of its 120 neurons live
    attack = {"batch_size": 64, "informative_rows": 116, "min_zeros": 65, **stats}
    decided, reason = _reason(attack, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (decided, reason) == (verdict, before + SPARSITY_OUT_OF_REACH)
    # a batch of 57 needs 58 zeros, exactly half of 116: not out of reach, no such reason
    decided, reason = _reason({**attack, "batch_size": 57}, signature=lambda: LOW_RANK, time_budget=30.0)
    assert decided == verdict
    assert reason == before.replace("64", "57")
    assert "live neurons" not in reason


def test_a_batch_at_most_half_the_live_neurons_gets_no_sparsity_reason() -> None:
    stats = {"batch_size": 8, "directions_found": 5, "stopped_by": "time_budget", "informative_rows": 116}
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (verdict, reason) == (
        "timeout",
        "the attack spent its whole 30 s budget with 5 of 8 samples found",
    )
    # without the attack's count of live neurons the verdict says nothing of them
    verdict, reason = _reason(
        {**stats, "batch_size": 64, "informative_rows": None}, signature=lambda: LOW_RANK, time_budget=30.0
    )
    assert reason == "the attack spent its whole 30 s budget with 5 of 64 samples found"


def test_a_batch_needing_more_zeros_than_live_neurons_says_so() -> None:
    stats = {"batch_size": 64, "directions_found": 0, "stopped_by": "time_budget", "informative_rows": 64}
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (verdict, reason) == (
        "timeout",
        "the attack spent its whole 30 s budget with 0 of 64 samples found: each sample must leave at least "
        "65 live neurons inactive to be found, and the layer has only 64",
    )


def test_a_spent_share_of_the_budget_is_named_as_a_share() -> None:
    # beside the next-layer route the exact attack gets part of the audit's budget
    stats = {"directions_found": 0, "stopped_by": "time_budget", "time_budget": 15.0}
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (verdict, reason) == (
        "timeout",
        "the attack spent its whole 15 s share of the 30 s budget with 0 of 4 samples found",
    )
    whole = {**stats, "time_budget": 30.0}
    assert _reason(whole, signature=lambda: LOW_RANK, time_budget=30.0)[1].startswith(
        "the attack spent its whole 30 s budget"
    )


def test_a_whole_batch_not_verified_names_its_certified_samples() -> None:
    stats = {
        "directions_found": 4,
        "stopped_by": "time_budget",
        "next_layer_certified": 3,
        **_self_check("rank 2 < 4 above the noise"),
    }
    verdict, reason = _reason(stats, signature=lambda: LOW_RANK, time_budget=30.0)
    assert (verdict, reason) == (
        "timeout",
        "the attack spent its whole 30 s budget: all 4 directions were found but not verified as the batch "
        "(3 of them confirmed one by one through the next layer's update): the self-check against the "
        "observed update failed (rank 2 < 4 above the noise)",
    )
