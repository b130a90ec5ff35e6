"""The process runner: a worker process that is killed on timeout and recovers after failures."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import LayerUpdate, Reconstruction
from fl_attack.attacks import LayerAttackBase
from tests.test_audit_strategy import INPUT_DIM, WIDTH


def _complete(inputs: torch.Tensor) -> Reconstruction:
    """A complete reconstruction of ``inputs`` (one row per sample)."""
    rows = inputs.shape[0]
    return Reconstruction(
        inputs=inputs,
        batch_size=rows,
        sparsity_matching=1.0,
        complete=True,
        confidence=torch.ones(rows, dtype=torch.float64),
        seconds=0.0,
    )


class PicklableAttacker(LayerAttackBase):
    """Module-level (so picklable) attacker for the worker process: behaviour by batch size."""

    def attack(
        self, update: LayerUpdate[np.ndarray], /, *, batch_size: int | None = None, **_: Any
    ) -> Reconstruction:
        if batch_size == 1:
            time.sleep(60.0)
        if batch_size == 2:
            raise ValueError("cannot invert")
        if batch_size == 3:
            raise MemoryError("host memory exhausted")
        return _complete(torch.as_tensor(update.weight_update[:2], dtype=torch.float64))


def test_process_isolation_kills_timeouts_and_recovers() -> None:
    from fl_attack.audit.workers import ProcessAttackRunner

    rng = np.random.default_rng(0)
    update = LayerUpdate(
        weight_update=rng.standard_normal((WIDTH, INPUT_DIM)),
        bias_update=rng.standard_normal(WIDTH),
        weight=rng.standard_normal((WIDTH, INPUT_DIM)),
        bias=rng.standard_normal(WIDTH),
    )
    runner = ProcessAttackRunner(PicklableAttacker())
    try:
        ok = runner.run(update, batch_size=None, timeout=120.0)
        assert ok.status == "ok"
        np.testing.assert_array_equal(ok.reconstruction.inputs.numpy(), update.weight_update[:2])
        worker = runner._process  # pylint: disable=protected-access

        slow = runner.run(update, batch_size=1, timeout=0.5)
        assert slow.status == "timeout" and slow.seconds < 5.0
        # how much CPU the killed worker got (a sleeping one: none) against the wall time it was given
        assert re.fullmatch(
            r"attack did not finish within the 0\.5 s timeout \(worker killed; "
            r"it got 0\.0 s of CPU in \d\.\d s of wall time\)",
            slow.error or "",
        ), slow.error
        assert not worker.is_alive()  # the runaway attack was killed, not abandoned

        failed = runner.run(update, batch_size=2, timeout=120.0)
        assert failed.status == "error" and "cannot invert" in (failed.error or "")
        assert failed.traceback and "ValueError" in failed.traceback
        oom = runner.run(update, batch_size=3, timeout=120.0)
        assert oom.status == "out-of-memory"
        assert runner.run(update, batch_size=None, timeout=120.0).status == "ok"
    finally:
        runner.close()
    assert runner._process is None  # pylint: disable=protected-access


class SchedulingAttacker(LayerAttackBase):
    """Reports the worker's scheduling policy and nice value as its 'inputs'."""

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        policy = os.sched_getscheduler(0)
        inputs = torch.tensor(
            [[float(policy), float(os.getpriority(os.PRIO_PROCESS, 0))]], dtype=torch.float64
        )
        return _complete(inputs)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.parametrize(
    ("priority", "policy", "nice"), [("idle", "SCHED_IDLE", None), ("low", "SCHED_OTHER", 19)]
)
def test_worker_process_runs_at_the_chosen_cpu_priority(priority: str, policy: str, nice: int | None) -> None:
    from fl_attack.audit.workers import ProcessAttackRunner

    update = LayerUpdate(
        weight_update=np.ones((4, 3)), bias_update=np.ones(4), weight=np.ones((4, 3)), bias=np.ones(4)
    )
    runner = ProcessAttackRunner(SchedulingAttacker(), priority=priority)
    try:
        result = runner.run(update, timeout=120.0)
    finally:
        runner.close()
    assert result.status == "ok", result.error
    seen_policy, seen_nice = result.reconstruction.inputs[0].tolist()
    assert int(seen_policy) == getattr(os, policy)
    if nice is not None:
        assert int(seen_nice) == nice
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the server process itself is untouched


def test_unknown_worker_priority_is_refused_naming_the_choices() -> None:
    from fl_attack.audit import ExecutionSettings
    from fl_attack.audit.workers import ProcessAttackRunner

    with pytest.raises(ValueError, match="priority must be one of idle, low, got 'high'"):
        ProcessAttackRunner(SchedulingAttacker(), priority="high")
    with pytest.raises(ValueError, match="priority must be one of idle, low, got 'realtime'"):
        ExecutionSettings(priority="realtime")


class BudgetSpy(LayerAttackBase):
    """Records the budget each call is given."""

    time_budget = 7.0

    def __init__(self) -> None:
        self.budgets: list[Any] = []

    def attack(
        self, update: LayerUpdate[np.ndarray], /, *, batch_size: int | None = None, budget: Any = None
    ) -> Reconstruction:
        self.budgets.append(budget)
        return _complete(torch.as_tensor(update.weight_update[:2], dtype=torch.float64))


def test_the_worker_starts_the_attacks_one_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from fl_attack.audit.workers import run_attack
    from fl_attack.pipeline.budget import budget as budget_module
    from fl_attack.pipeline.budget.budget import Budget

    monkeypatch.setattr(budget_module, "now", lambda: 50.0)
    rng = np.random.default_rng(0)
    arrays = {
        "weight_update": rng.standard_normal((WIDTH, INPUT_DIM)),
        "bias_update": rng.standard_normal(WIDTH),
        "weight": rng.standard_normal((WIDTH, INPUT_DIM)),
        "bias": rng.standard_normal(WIDTH),
    }
    alone = LayerUpdate(**arrays)
    followed = LayerUpdate(**arrays, next_weight_update=rng.standard_normal((3, WIDTH)), after_layers=True)
    spy = BudgetSpy()
    assert run_attack(spy, alone, time_budget=4.0).status == "ok"
    assert run_attack(spy, alone).status == "ok"  # no audit budget: the attacker's own
    assert run_attack(spy, followed, time_budget=4.0).status == "ok"  # the route may follow: half
    assert spy.budgets == [Budget(4.0, started=50.0), Budget(7.0, started=50.0), Budget(2.0, started=50.0)]


class ParallelTorchAttacker(LayerAttackBase):
    """An attack whose first operation is a parallel torch one (OpenMP on a CPU build)."""

    device = "cpu"

    def attack(self, update: LayerUpdate[np.ndarray], /, **_: Any) -> Reconstruction:
        square = torch.randn(600, 600, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        (square @ square).exp_().sum()
        return _complete(torch.as_tensor(update.weight_update[:2], dtype=torch.float64))


def test_a_forked_worker_runs_parallel_torch_after_the_server_did() -> None:
    # a worker forked from a thread that ran a parallel torch operation waited forever for that
    # thread's OpenMP helpers (the default audit's worker hung so, with 0 s of CPU)
    from fl_attack.audit.workers import ProcessAttackRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        square = torch.randn(600, 600, dtype=torch.float64)
        (square @ square).exp_().sum()  # the server's own parallel work, in this thread
        rng = np.random.default_rng(0)
        update = LayerUpdate(
            weight_update=rng.standard_normal((WIDTH, INPUT_DIM)),
            bias_update=rng.standard_normal(WIDTH),
            weight=rng.standard_normal((WIDTH, INPUT_DIM)),
            bias=rng.standard_normal(WIDTH),
        )
        runner = ProcessAttackRunner(ParallelTorchAttacker(), priority="low")
        assert runner.start_method == "fork"
        try:
            runner.prestart()  # forked now, from this thread's side, as the Auditor does
            result = runner.run(update, timeout=60.0)
        finally:
            runner.close()
        assert result.status == "ok", result.error
    finally:
        torch.set_num_threads(threads)


class OnDevice(PicklableAttacker):
    """An attacker that says where it runs."""

    def __init__(self, device: str) -> None:
        self.device = device


def test_a_worker_runs_only_the_companions_it_was_made_with() -> None:
    from fl_attack.audit.workers import ProcessAttackRunner, worker_start_method

    primary, companion = OnDevice("cpu"), OnDevice("cpu")
    runner = ProcessAttackRunner(primary, companions=(companion,), start_method="fork")
    shared = runner.sharing(companion)
    assert shared is not None and shared.attacker is companion
    assert runner.sharing(OnDevice("cpu")) is None  # an equal attacker that was not given: its own runner
    assert runner.sharing(primary) is None  # the runner's own attacker runs through run()
    assert ProcessAttackRunner(primary).sharing(companion) is None
    # one worker for both: forked only when each attacker could run in a forked worker
    if worker_start_method(primary) == "fork":
        assert worker_start_method(primary, companion) == "fork"
        assert worker_start_method(primary, OnDevice("cuda:0")) == "spawn"
        assert worker_start_method(OnDevice("cuda:0"), companion) == "spawn"
