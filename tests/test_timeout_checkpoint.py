"""An attack stopped at its hard limit keeps what it had found: checkpoints, the kill path, the record.

The attacks here checkpoint two partial results and then hang. The runner's wait for the result
starts only once both checkpoints exist (a gate in front of the real wait), so the outcome does
not depend on how fast a worker at idle priority gets the CPU on a busy machine: the real
timeout then always finds the attack hanging after its second checkpoint.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import signal
import stat
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import LayerUpdate, Reconstruction, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings, workers
from fl_attack.audit import checkpoint as checkpoint_module
from fl_attack.audit.checkpoint import TEMPORARY_SUFFIX, CheckpointFile, read_checkpoint
from fl_attack.audit.ray_progress import TaskProgress, read_board
from fl_attack.audit.units import attack_summary
from fl_attack.audit.verdict import decide_verdict
from fl_attack.progress import report_progress, reporting_to
from fl_attack.results.store import INPUTS_FILE, METRICS_FILE, ReconstructionStore, load_table
from tests.synthetic_layer import relu_layer_update
from tests.test_audit_strategy import INPUT_DIM, _client_arrays, _global_arrays

ROWS = 3
TIMEOUT = 2.0


def _partial(found: int, value: float, *, complete: bool = False) -> Reconstruction:
    """A partial result with ``found`` of :data:`ROWS` rows; rows ``value``, ``value + 1``, ..."""
    inputs = value + torch.arange(ROWS * INPUT_DIM, dtype=torch.float64).reshape(ROWS, INPUT_DIM)
    confidence = torch.tensor([1.0] * found + [0.0] * (ROWS - found), dtype=torch.float64)
    return Reconstruction(
        inputs=inputs,
        batch_size=ROWS,
        sparsity_matching=float(confidence.mean()),
        complete=complete,
        confidence=confidence,
        seconds=0.1,
        stats={"directions_found": found},
    )


FIRST, SECOND = _partial(1, 0.0), _partial(2, 100.0, complete=True)  # the second claims too much


class CheckpointingAttacker(LayerAttackBase):
    """Reports :data:`FIRST` then :data:`SECOND`, sets ``checkpointed``, then hangs (until killed,
    or in a thread until released).

    Module-level and holding only multiprocessing events, so a worker process can unpickle it.
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.checkpointed = context.Event()
        self.release = context.Event()

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        report_progress(FIRST)
        report_progress(SECOND)
        self.checkpointed.set()
        if multiprocessing.parent_process() is not None:
            # a worker process is killed long before; it must not be waiting on an event then
            # (a process killed inside Event.wait leaves the event's condition unusable)
            time.sleep(120.0)
        else:
            self.release.wait(120.0)  # a thread is released when the test ends
        raise TimeoutError("the test released a hanging attack")


class GatedConnection:
    """The runner's end of the worker's pipe; its wait for a result starts after the checkpoints."""

    def __init__(self, inner: Any, gate: Any) -> None:
        self.inner, self.gate = inner, gate

    def poll(self, timeout: float | None = None) -> bool:
        assert self.gate.wait(300.0), "the attack never checkpointed"
        return bool(self.inner.poll(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _gate_the_runners(monkeypatch: pytest.MonkeyPatch, gate: Any) -> None:
    """Both runners wait for the result only once ``gate`` is set (see the module docstring)."""
    start = workers.ProcessAttackRunner._start  # pylint: disable=protected-access

    def gated_start(runner: workers.ProcessAttackRunner) -> str | None:
        failure = start(runner)
        if failure is None:
            runner._connection = GatedConnection(runner._connection, gate)  # type: ignore[assignment]  # pylint: disable=protected-access
        return failure

    class GatedThread(threading.Thread):
        def join(self, timeout: float | None = None) -> None:
            if self.name != "fl-attack-fork":  # the thread that forks a worker is not gated
                assert gate.wait(300.0), "the attack never checkpointed"
            super().join(timeout)

    monkeypatch.setattr(workers.ProcessAttackRunner, "_start", gated_start)
    monkeypatch.setattr(
        workers, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": GatedThread})
    )


@pytest.mark.parametrize(("isolation", "runner"), [("process", "it"), ("thread", "its thread")])
def test_an_attack_killed_at_its_timeout_keeps_its_last_checkpoint(
    isolation: str, runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attacker = CheckpointingAttacker()
    _gate_the_runners(monkeypatch, attacker.checkpointed)
    store = ReconstructionStore.create(tmp_path / "run")
    auditor = Auditor(
        attacker,
        store=store,
        attack=AttackSettings(timeout=TIMEOUT),
        execution=ExecutionSettings(isolation=isolation, priority="low"),
    )
    global_arrays = _global_arrays()
    update = ClientUpdate(
        identity=ClientIdentity(node_id=11, partition_id=0), arrays=_client_arrays(global_arrays, 0)
    )
    try:
        auditor.start_round(1, global_arrays)
        (record,) = auditor.audit_round(1, [update])
    finally:
        attacker.release.set()
        auditor.close()

    how = "worker killed" if isolation == "process" else "abandoned"
    assert (record.status, record.verdict) == ("timeout", "timeout")
    cpu = rf"{runner} got \d+(\.\d)? s of CPU in \d+(\.\d)? s of wall time"
    assert re.fullmatch(rf"attack did not finish within the 2 s timeout \({how}; {cpu}\)", record.error or "")
    assert (
        record.verdict_reason
        == f"{record.error}; 2 of 3 rows found so far are kept, not verified as the batch"
    )

    (row,) = load_table(store.table_path)
    assert (row["status"], row["verdict"], row["complete"]) == ("timeout", "timeout", "False")
    directory = store.directory / row["directory"]
    np.testing.assert_array_equal(np.load(directory / INPUTS_FILE), SECOND.inputs.numpy())
    metrics = json.loads((directory / METRICS_FILE).read_text(encoding="utf-8"))
    assert metrics["complete"] is False  # the attack claimed a complete batch: a partial one never is
    assert metrics["attack"]["partial"] is True
    assert (metrics["attack"]["directions_found"], metrics["attack"]["batch_size"]) == (2, ROWS)
    if isolation == "process":
        checkpoints = auditor.runner._checkpoints  # pylint: disable=protected-access
        assert checkpoints is None  # closed: the private checkpoints are gone with the runner


class RayCheckpointingAttacker(LayerAttackBase):
    """Reports :data:`FIRST` then :data:`SECOND`, then hangs until its Ray task is cancelled."""

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        report_progress(FIRST)
        report_progress(SECOND)
        time.sleep(120.0)
        raise TimeoutError("the Ray task was not cancelled")


@pytest.fixture(name="local_ray", scope="module")
def _local_ray() -> Any:
    ray = pytest.importorskip("ray")
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    except Exception as error:  # pragma: no cover - depends on the machine
        pytest.skip(f"Ray cannot start here: {error}")
    # pytest imports this module from tests/ by its bare name, which a Ray worker cannot import:
    # its attackers travel by value
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(module)
    ray.shutdown()


def _gate_ray_wait(monkeypatch: pytest.MonkeyPatch, ray: Any, runner: Any) -> None:
    """The runner's wait for the task starts once its board holds :data:`SECOND` (the module
    docstring's gate: the task's worker first imports the attack, seconds on a busy machine)."""
    wait = ray.wait

    def gated_wait(references: list[Any], **options: Any) -> Any:
        deadline = time.monotonic() + 300.0
        while time.monotonic() < deadline:
            partial = read_board(runner._board, runner._jobs).partial  # pylint: disable=protected-access
            if partial is not None and partial.stats["directions_found"] == 2:
                return wait(references, **options)
            if wait(references, timeout=0)[0]:  # the task ended without checkpointing: let it fail
                return wait(references, **options)
            time.sleep(0.2)
        raise AssertionError("the Ray task never checkpointed")

    monkeypatch.setattr(ray, "wait", gated_wait)


@pytest.mark.slow  # starts a local Ray: about 30 s on a busy 2-core machine
def test_a_ray_task_cancelled_at_its_timeout_keeps_its_last_checkpoint(
    local_ray: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReconstructionStore.create(tmp_path / "run")
    auditor = Auditor(
        RayCheckpointingAttacker(),
        store=store,
        attack=AttackSettings(timeout=TIMEOUT),
        execution=ExecutionSettings(backend="ray", attack_cpus=1.0),
    )
    runner = auditor.runner
    _gate_ray_wait(monkeypatch, local_ray, runner)
    global_arrays = _global_arrays()
    update = ClientUpdate(
        identity=ClientIdentity(node_id=11, partition_id=0), arrays=_client_arrays(global_arrays, 0)
    )
    try:
        auditor.start_round(1, global_arrays)
        (record,) = auditor.audit_round(1, [update])
        board = runner._board  # pylint: disable=protected-access
    finally:
        auditor.close()

    assert (record.status, record.verdict) == ("timeout", "timeout")
    cpu = r"it got \d+(\.\d)? s of CPU in \d+(\.\d)? s of wall time"  # the task ran on this node
    assert re.fullmatch(
        rf"attack did not finish within the 2 s timeout \(Ray task cancelled; {cpu}\)", record.error or ""
    )
    assert (
        record.verdict_reason
        == f"{record.error}; 2 of 3 rows found so far are kept, not verified as the batch"
    )
    (row,) = load_table(store.table_path)
    assert (row["status"], row["verdict"], row["complete"]) == ("timeout", "timeout", "False")
    directory = store.directory / row["directory"]
    np.testing.assert_array_equal(np.load(directory / INPUTS_FILE), SECOND.inputs.numpy())
    metrics = json.loads((directory / METRICS_FILE).read_text(encoding="utf-8"))
    assert metrics["complete"] is False and metrics["attack"]["partial"] is True
    assert runner._board is None  # pylint: disable=protected-access
    assert _gone_within(local_ray, board, seconds=60.0)  # closed: the board is gone


def _gone_within(ray: Any, board: Any, *, seconds: float) -> bool:
    """Whether the killed actor stops answering within ``seconds``: ``ray.kill`` is asynchronous, and
    on a busy machine a call sent right after it was once answered before the kill took effect."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(board.latest.remote(1), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.5)
    return False


@pytest.mark.slow  # starts a local Ray: about 30 s on a busy 2-core machine
def test_a_ray_task_that_never_started_says_so(local_ray: Any) -> None:
    from fl_attack.audit.ray_runner import RayAttackRunner

    rng = np.random.default_rng(0)
    update = LayerUpdate(
        rng.standard_normal((6, 4)),
        rng.standard_normal(6),
        rng.standard_normal((6, 4)),
        rng.standard_normal(6),
    )
    runner = RayAttackRunner(RayCheckpointingAttacker(), num_cpus=2.0)  # more CPUs than Ray has
    try:
        result = runner.run(update, timeout=1.0)
    finally:
        runner.close()
    assert result.status == "timeout" and result.reconstruction is None
    assert re.fullmatch(
        r"attack did not finish within the 1 s timeout \(Ray task cancelled before it started the attack: "
        r"it waited for a Ray worker and free resources\)",
        result.error or "",
    )


def test_a_ray_task_on_another_node_keeps_its_partial_and_says_its_cpu_time_is_unknown() -> None:
    progress = TaskProgress(start=("another-node", os.getpid(), 0.0), partial=SECOND)
    assert progress.cpu_seconds(here="this-node") is None  # no /proc of that node here
    assert progress.cpu_seconds(here="another-node") is not None  # the same process, read on its node
    result = workers._timed_out(  # pylint: disable=protected-access
        45.0,
        45.2,
        "Ray task cancelled",
        progress.cpu_seconds(here="this-node"),
        partial=progress.partial,
        cpu_unknown=progress.cpu_unknown(here="this-node"),
    )
    assert result.error == (
        "attack did not finish within the 45 s timeout (Ray task cancelled; it ran on another node, so only "
        "its wall time is known: 45 s)"
    )
    assert result.reconstruction is not None and torch.equal(result.reconstruction.inputs, SECOND.inputs)
    assert result.reconstruction.complete is False
    unread = TaskProgress(unread="GetTimeoutError: no answer")
    assert (
        unread.cpu_unknown(here="this-node") == "its progress could not be read (GetTimeoutError: no answer)"
    )


class SelfKillingAttacker(LayerAttackBase):
    """Reports :data:`FIRST` then :data:`SECOND`, then dies as the out-of-memory killer kills."""

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        report_progress(FIRST)
        report_progress(SECOND)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("SIGKILL returned")


def test_a_worker_killed_by_a_signal_keeps_its_last_checkpoint() -> None:
    rng = np.random.default_rng(0)
    update = LayerUpdate(
        weight_update=rng.standard_normal((6, INPUT_DIM)),
        bias_update=rng.standard_normal(6),
        weight=rng.standard_normal((6, INPUT_DIM)),
        bias=rng.standard_normal(6),
    )
    runner = workers.ProcessAttackRunner(SelfKillingAttacker(), priority="low")
    try:
        result = runner.run(update, timeout=300.0)
    finally:
        runner.close()
    assert result.status == "killed" and "SIGKILL" in (result.error or "")
    assert torch.equal(result.reconstruction.inputs, SECOND.inputs)
    assert result.reconstruction.complete is False and result.reconstruction.stats["partial"] is True
    summary = attack_summary(result)
    verdict = decide_verdict(
        status=result.status,
        error=result.error,
        attack=summary,
        signature=lambda: None,
        magnitude_concentration=None,
        input_space=None,
    )
    assert verdict.verdict == "failed"
    assert verdict.reason.endswith("; 2 of 3 rows found so far are kept, not verified as the batch")


def test_a_timeout_without_a_checkpoint_keeps_nothing_and_says_so() -> None:
    verdict = decide_verdict(
        status="timeout",
        error="attack did not finish within the 45 s timeout (worker killed; it got 12 s of CPU in 45 s of wall time)",
        attack={"attack": "spear++"},
        signature=lambda: None,
        magnitude_concentration=None,
        input_space=None,
    )
    assert verdict.verdict == "timeout"
    assert verdict.reason == (
        "attack did not finish within the 45 s timeout (worker killed; it got 12 s of CPU in 45 s of wall "
        "time); it had handed back no partial result, so nothing it found is kept"
    )


@pytest.mark.parametrize(
    ("attack", "kept"),
    [
        (
            {"partial": True, "batch_size": 20, "directions_found": 14, "next_layer_certified": 3},
            "14 of 20 rows found so far are kept, not verified as the batch (3 of them confirmed one by one "
            "through the next layer's update)",
        ),
        (
            {"partial": True, "batch_size": 20, "directions_found": 0},
            "none of the 20 rows was found before the limit",
        ),
        (
            {"partial": True, "batch_size": 0, "directions_found": 0, "stop_reason": "the SVD did not fit"},
            "the batch size was not estimated before the limit (the SVD did not fit)",
        ),
        (
            {"partial": True, "batch_size": 0, "directions_found": 0},
            "the batch size was not estimated before the limit",
        ),
        (  # the Cocktail Party as the exact attack: an estimate of every row, none found one by one
            {
                "partial": True,
                "batch_size": 6,
                "directions_found": 0,
                "approximate": True,
                "ica_iterations": 12,
            },
            "its last estimate of the 6 rows after 12 ICA iterations is kept, approximate (it has no "
            "self-check)",
        ),
    ],
)
def test_the_timeout_reason_says_how_many_rows_were_kept(attack: dict[str, Any], kept: str) -> None:
    verdict = decide_verdict(
        status="timeout",
        error="stopped",
        attack=attack,
        signature=lambda: None,
        magnitude_concentration=None,
        input_space=None,
    )
    assert (verdict.verdict, verdict.reason) == ("timeout", f"stopped; {kept}")
    assert "0 of 0" not in verdict.reason


def test_a_checkpoint_is_replaced_whole_and_a_half_written_one_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "job-1.pickle"
    sink = CheckpointFile(path)
    sink.report(FIRST)
    kept = read_checkpoint(path)
    assert kept is not None and torch.equal(kept.inputs, FIRST.inputs)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # reconstructed client data

    # a worker killed in the middle of writing the next one leaves half of it in the temporary file
    payload = pickle.dumps(SECOND)
    Path(str(path) + TEMPORARY_SUFFIX).write_bytes(payload[: len(payload) // 2])
    kept = read_checkpoint(path)
    assert kept is not None and torch.equal(kept.inputs, FIRST.inputs)

    # killed after writing it whole but before the rename: the checkpoint is still the first one
    def killed(source: Any, target: Any) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(checkpoint_module.os, "replace", killed)
    sink.report(SECOND)
    kept = read_checkpoint(path)
    assert kept is not None and torch.equal(kept.inputs, FIRST.inputs)
    monkeypatch.undo()

    sink.report(SECOND)
    kept = read_checkpoint(path)
    assert kept is not None and torch.equal(kept.inputs, SECOND.inputs)

    # a file cut short is refused, never half read
    path.write_bytes(payload[: len(payload) // 2])
    assert read_checkpoint(path) is None
    assert read_checkpoint(tmp_path / "missing.pickle") is None


class Collected:
    """A progress sink that keeps every partial result."""

    def __init__(self) -> None:
        self.partials: list[Reconstruction] = []

    def report(self, partial: Reconstruction) -> None:
        self.partials.append(partial)


def test_the_spear_search_reports_each_better_selection_without_changing_its_result() -> None:
    inputs = torch.randn(6, 30, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    update = relu_layer_update(inputs, width=90, seed=3)
    attacker = SpearPlusPlus(seed=0, time_budget=60.0, progress=False)
    collected = Collected()
    with reporting_to(collected):
        watched = attacker.invert(**update.arrays(), batch_size=6)
    plain = attacker.invert(**update.arrays(), batch_size=6)

    assert torch.equal(watched.inputs, plain.inputs) and watched.complete == plain.complete
    assert collected.partials, "the search reported no selection"
    for partial in collected.partials:
        assert partial.complete is False and partial.self_check is None and partial.stats["partial"] is True
        assert partial.inputs.shape == (6, 30) and partial.batch_size == 6
        assert 1 <= partial.stats["directions_found"] <= 6
        assert partial.inputs.data_ptr() != watched.inputs.data_ptr()
    found = [partial.stats["directions_found"] for partial in collected.partials]
    assert found[-1] == 6 and plain.complete  # the easy case: the last selection had the whole batch
