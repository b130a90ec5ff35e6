"""One attack's time budget: its shares, and the deadlines the stages check.

The clock is :func:`fl_attack.pipeline.budget.budget.now`, read in that one place: the tests
set it, so every share is checked to the second.
"""

from __future__ import annotations

import math

import pytest

from fl_attack.pipeline.budget import budget as budget_module
from fl_attack.pipeline.budget.budget import (
    DECOMPOSITION_SHARE,
    FINISH_FRACTION,
    NEXT_LAYER_SHARE,
    PRUNE_GRACE,
    PRUNE_GRACE_FRACTION,
    Budget,
    Deadline,
    hard_limit,
)

START = 1000.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The budget's clock, set by the test: ``clock[0]`` is now."""
    time = [START]
    monkeypatch.setattr(budget_module, "now", lambda: time[0])
    return time


def test_a_deadline_passes_once_the_clock_is_past_it(clock: list[float]) -> None:
    deadline = Deadline.in_seconds(10.0)
    assert deadline == Deadline(START + 10.0) and deadline.bounded
    assert not deadline.expired() and deadline.remaining() == 10.0
    assert deadline.fits(10.0) and not deadline.fits(10.5)
    clock[0] = START + 10.0
    assert not deadline.expired()  # at the deadline itself, not yet past it
    clock[0] = START + 10.5
    assert deadline.expired() and deadline.remaining() == -0.5 and not deadline.fits(0.0)


def test_a_deadline_that_never_passes(clock: list[float]) -> None:
    for never in (Deadline.never(), Deadline.in_seconds(None), Deadline.in_seconds(math.inf), Deadline()):
        assert never == Deadline.never() and not never.bounded
        clock[0] = 1e300
        assert not never.expired() and never.remaining() == math.inf and never.fits(1e300)


def test_a_stage_share_ends_by_the_deadline(clock: list[float]) -> None:
    deadline = Deadline(START + 10.0)
    assert deadline.within(4.0) == Deadline(START + 4.0)
    assert deadline.within(40.0) == deadline
    assert Deadline.never().within(4.0) == Deadline(START + 4.0)
    assert Deadline.never().within(math.inf) == Deadline.never()
    assert min(deadline, Deadline(START + 3.0)) == Deadline(START + 3.0)


def test_every_share_of_a_budget_counts_from_its_start(clock: list[float]) -> None:
    budget = Budget.start(100.0)
    clock[0] = START + 30.0  # the shares do not move with the clock
    assert budget.started == START and budget.elapsed() == 30.0 and budget.remaining() == 70.0
    assert budget.deadline == Deadline(START + 100.0) and not budget.expired()
    assert budget.decomposition == Deadline(START + DECOMPOSITION_SHARE * 100.0)
    # the finishing work is set aside up to FINISH_FRACTION of the budget
    assert budget.search(2.0) == Deadline(START + 100.0 - 2.0)
    assert budget.search(60.0) == Deadline(START + 100.0 - FINISH_FRACTION * 100.0)
    assert budget.pruning == Deadline(START + 100.0 + PRUNE_GRACE_FRACTION * 100.0)
    assert Budget.start(10_000.0).pruning == Deadline(START + 30.0 + 10_000.0 + PRUNE_GRACE)
    clock[0] = START + 100.5
    assert budget.expired()


def test_the_exact_attack_shares_the_start_of_the_budget(clock: list[float]) -> None:
    budget = Budget.start(10.0)
    clock[0] = START + 4.0
    share = budget.exact_attack_share()
    assert share == Budget(seconds=(1.0 - NEXT_LAYER_SHARE) * 10.0, started=START)
    assert share.deadline == Deadline(START + 5.0) and share.remaining() == 1.0
    assert budget.remaining() == 6.0  # the route's part is what is left of the whole


def test_a_budget_without_a_limit_never_ends(clock: list[float]) -> None:
    budget = Budget.start(None)
    clock[0] = 1e300
    assert not budget.bounded and not budget.expired() and budget.remaining() == math.inf
    never = Deadline.never()
    assert budget.deadline == budget.decomposition == budget.search(5.0) == budget.pruning == never
    assert budget.exact_attack_share() == budget


def test_the_hard_limit_leaves_the_attack_half_its_budget_and_a_grace() -> None:
    assert hard_limit(30.0) == 1.5 * 30.0 + 15.0
