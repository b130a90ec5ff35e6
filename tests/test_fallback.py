"""The approximate fallback: a second attack (Cocktail Party) on every update not recovered exactly."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import CocktailPartyAttack, LayerUpdate, Reconstruction, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import (
    AttackSettings,
    Auditor,
    ClientIdentity,
    ClientUpdate,
    ExecutionSettings,
    GroundTruth,
    workers,
)
from fl_attack.audit.fallback import fallback_verdict
from fl_attack.audit.workers import AttackResult
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.results.report import load_summary, write_report
from fl_attack.results.store import INPUTS_FILE, METRICS_FILE, ReconstructionStore, load_table
from strategies.factory import build_auditor
from tests.synthetic_layer import relu_layer_update

IMAGE_SHAPE = (3, 4, 4)  # n = 48 inputs, scored as tiny images


def _scorer(inputs: torch.Tensor) -> ReconstructionScorer:
    return ReconstructionScorer(inputs, denormalize=lambda rows: rows, image_shape=IMAGE_SHAPE)


def _update(
    *, b: int, width: int, adam: bool = False, seed: int = 0
) -> tuple[dict[str, np.ndarray], ClientUpdate, torch.Tensor]:
    """The global layer and one client's FedSGD (or first Adam) step on ``b`` inputs in [0, 1]."""
    generator = torch.Generator().manual_seed(100 + seed)
    inputs = torch.rand(b, int(np.prod(IMAGE_SHAPE)), generator=generator, dtype=torch.float64)
    layer = relu_layer_update(inputs, width=width, seed=seed)
    weight_step, bias_step = layer.weight_grad, layer.bias_grad
    if adam:  # Adam's first step is lr * sign(gradient), whatever the gradient's magnitudes
        weight_step, bias_step = weight_step.sign(), bias_step.sign()
    global_arrays = {"fc.weight": layer.weight.numpy(), "fc.bias": layer.bias.numpy()}
    sent = {
        "fc.weight": (layer.weight - 0.01 * weight_step).numpy(),
        "fc.bias": (layer.bias - 0.01 * bias_step).numpy(),
    }
    update = ClientUpdate(
        ClientIdentity(node_id=7, partition_id=0),
        sent,
        ground_truth=GroundTruth(inputs=inputs.numpy()),
        num_examples=b,
    )
    return global_arrays, update, inputs


def _audit(auditor: Auditor, global_arrays: dict[str, np.ndarray], update: ClientUpdate) -> list[Any]:
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, [update])
    auditor.close()
    return list(auditor.records)


def _auditor(
    inputs: torch.Tensor, tmp_path: Path, *, fallback: str | None, time_budget: float = 10.0, workers: int = 0
) -> Auditor:
    return Auditor(
        SpearPlusPlus(seed=0, progress=False),
        store=ReconstructionStore.create(tmp_path / "run"),
        scorer=_scorer(inputs),
        attack=AttackSettings(time_budget=time_budget, fallback=fallback),
        execution=ExecutionSettings(isolation="thread", workers=workers),
    )


def test_an_adam_update_gets_a_second_row_from_the_cocktail_party(tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=6, width=200, adam=True)
    auditor = _auditor(inputs, tmp_path, fallback="cocktail-party")
    primary, second = _audit(auditor, global_arrays, update)
    assert primary.verdict == "not-applicable" and "Adam" in primary.verdict_reason
    assert second.client == primary.client == "partition-0" and second.server_round == 1
    assert second.status == "ok" and second.verdict == "approximate"
    assert second.attack["attack"] == "cocktail-party" and second.attack["complete"] is False
    assert second.attack["batch_size"] == 6  # the exact attack's estimate (else the client's count)
    assert "cocktail-party fallback after the exact attack's verdict not-applicable" in second.verdict_reason
    assert second.details["fallback_after"] == {"attack": "spear++", "verdict": "not-applicable"}
    assert second.quality["kind"] == "images" and len(second.psnr) == 6  # the same scorer, PSNR per sample
    rows = load_table(auditor.store.table_path)  # type: ignore[union-attr]
    assert [(row["attack"], row["verdict"]) for row in rows] == [
        ("spear++", "not-applicable"),
        ("cocktail-party", "approximate"),
    ]
    assert rows[1]["mean_psnr"] != "" and rows[1]["directory"] == "round-001/partition-0-cocktail-party"
    summary = load_summary(auditor.store.directory)  # type: ignore[union-attr]
    assert summary["attacks"] == 1 and summary["verdict_counts"]["not-applicable"] == 1  # fallbacks apart
    assert summary["fallback"]["attacks"] == 1 and summary["fallback"]["verdict_counts"]["approximate"] == 1
    assert summary["fallback"]["scored_samples"] == 6 and summary["fallback"]["attack_names"] == [
        "cocktail-party"
    ]
    html = write_report(auditor.store.directory).read_text()  # type: ignore[union-attr]
    assert 'id="fallback"' in html and "cocktail-party" in html


def test_a_batch_close_to_the_width_gets_an_approximate_fallback(tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=18, width=20, seed=1)
    auditor = _auditor(inputs, tmp_path, fallback="cocktail-party", time_budget=3.0)
    records = _audit(auditor, global_arrays, update)
    assert records[0].verdict != "exact", records[0].verdict_reason
    assert len(records) == 2
    assert records[1].attack["attack"] == "cocktail-party" and records[1].verdict == "approximate"
    assert records[1].attack["batch_size"] == 18 and len(records[1].psnr) == 18


def test_an_exact_recovery_gets_no_fallback(tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=6, width=200)
    auditor = _auditor(inputs, tmp_path, fallback="cocktail-party")
    records = _audit(auditor, global_arrays, update)
    assert [record.verdict for record in records] == ["exact"]
    assert [row["attack"] for row in load_table(auditor.store.table_path)] == ["spear++"]  # type: ignore[union-attr]


@pytest.mark.parametrize("off", ["", "none", None])
def test_no_fallback_when_disabled(off: str | None, tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=6, width=200, adam=True)
    records = _audit(_auditor(inputs, tmp_path, fallback=off), global_arrays, update)
    assert [record.verdict for record in records] == ["not-applicable"]


def test_the_fallback_runs_in_the_pool_worker_and_drain_waits_for_it(tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=6, width=200, adam=True)
    auditor = _auditor(inputs, tmp_path, fallback="cocktail-party", workers=1)
    auditor.start_round(1, global_arrays)
    assert auditor.audit_round(1, [update]) == []  # queued: the round does not wait
    assert auditor.drain(timeout=120.0)
    assert [record.attack.get("attack") for record in auditor.records] == ["spear++", "cocktail-party"]
    auditor.close()


def test_a_zero_update_gets_no_fallback(tmp_path: Path) -> None:
    global_arrays, update, inputs = _update(b=6, width=200)
    unchanged = ClientUpdate(update.identity, dict(global_arrays), num_examples=6)
    records = _audit(_auditor(inputs, tmp_path, fallback="cocktail-party"), global_arrays, unchanged)
    assert len(records) == 1 and records[0].verdict != "exact"


def test_the_run_config_key_reaches_the_auditor() -> None:
    fallback = build_auditor({}, store=None, attacker=SpearPlusPlus(progress=False)).fallback
    assert fallback.name == "cocktail-party" and fallback.attacker is not None
    off = build_auditor({"attack-fallback": ""}, store=None, attacker=SpearPlusPlus(progress=False))
    assert off.fallback.attacker is None
    with pytest.raises(ValueError, match="unknown attack 'ica'; available: .*cocktail-party"):
        build_auditor({"attack-fallback": "ica"}, store=None, attacker=SpearPlusPlus(progress=False))


def test_the_fallback_verdict_is_never_exact() -> None:
    failed = AttackResult(status="timeout", reconstruction=None, seconds=9.0, error="did not finish")
    verdict, reason = fallback_verdict("cocktail-party", failed, {}, primary_verdict="timeout")
    assert verdict == "failed"
    assert (
        reason
        == "the cocktail-party fallback (after the exact attack's verdict timeout) failed: did not finish"
    )
    with pytest.raises(ValueError, match="fallback must be an attack name"):
        AttackSettings(fallback=42)  # type: ignore[arg-type]


class GivingUpAttacker(LayerAttackBase):
    """An exact attack that fails at once, so that the fallback runs."""

    name = "giving-up"

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        raise ValueError("the exact attack gives up")


class GivingUpInItsProcess(LayerAttackBase):
    """An exact attack that fails at once, saying which process it ran in."""

    name = "giving-up"

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        raise ValueError(f"the exact attack gives up in process {os.getpid()}")


class FallbackInItsProcess(LayerAttackBase):
    """A fallback that fails at once, saying which process it ran in."""

    name = "process-reporting"

    def attack(self, update: LayerUpdate[np.ndarray], /, **options: Any) -> Reconstruction:
        raise ValueError(f"the fallback gives up in process {os.getpid()}")


@pytest.mark.parametrize("pool_workers", [0, 1])
def test_the_fallback_runs_in_the_exact_attacks_worker_process(pool_workers: int) -> None:
    """One worker process per runner, forked at start-up, runs both attacks: the fallback forks no
    second process (one forked mid-run would keep a copy of the server's memory of that moment)."""
    global_arrays, update, _ = _update(b=6, width=200)
    auditor = Auditor(
        GivingUpInItsProcess(),
        attack=AttackSettings(timeout=120.0, fallback=FallbackInItsProcess()),
        execution=ExecutionSettings(isolation="process", priority="low", workers=pool_workers),
    )
    try:
        auditor.start_round(1, global_arrays)
        auditor.audit_round(1, [update])
        assert auditor.drain(timeout=120.0)
        records = list(auditor.records)
        made_by_fallback = list(auditor.fallback._runners._made)  # pylint: disable=protected-access
    finally:
        auditor.close()

    assert [record.attack.get("attack") for record in records] == ["giving-up", "process-reporting"]
    pids = [re.search(r"gives up in process (\d+)", record.error or "") for record in records]
    assert all(pids), [record.error for record in records]
    exact_pid, fallback_pid = (int(found.group(1)) for found in pids if found is not None)
    assert exact_pid == fallback_pid != os.getpid()
    assert made_by_fallback == []


def test_a_fallback_with_its_own_runner_where_the_exact_attack_shares_none(tmp_path: Path) -> None:
    """Thread runners have no worker to share: the fallback gets a runner of its own, as before."""
    global_arrays, update, _ = _update(b=6, width=200)
    auditor = Auditor(
        GivingUpInItsProcess(),
        attack=AttackSettings(timeout=120.0, fallback=FallbackInItsProcess()),
        execution=ExecutionSettings(isolation="thread", workers=1),
    )
    records = _audit(auditor, global_arrays, update)
    assert [record.attack.get("attack") for record in records] == ["giving-up", "process-reporting"]
    assert len(auditor.fallback._runners._made) == 1  # pylint: disable=protected-access


class CheckpointGate:
    """A fallback worker's pipe: the runner's wait for the result starts once the attack has
    checkpointed (a worker at low priority on a busy machine may take long to get there)."""

    def __init__(self, inner: Any, runner: workers.ProcessAttackRunner) -> None:
        self.inner, self.runner = inner, runner

    def poll(self, timeout: float | None = None) -> bool:
        runner = self.runner
        checkpoint = runner._checkpoints / f"job-{runner._jobs}.pickle"  # type: ignore[operator]  # pylint: disable=protected-access
        deadline = time.monotonic() + 300.0
        while not checkpoint.exists():
            if self.inner.poll(0.1):  # it ended without a checkpoint: the test fails on its result
                return True
            assert time.monotonic() < deadline, "the fallback never checkpointed"
        return bool(self.inner.poll(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_fallback_stopped_at_its_timeout_keeps_its_last_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = workers.ProcessAttackRunner._start  # pylint: disable=protected-access

    def gated_start(runner: workers.ProcessAttackRunner) -> str | None:
        failure = start(runner)
        # the fallback runs in the exact attack's worker: gate the worker that also runs it
        if failure is None and any(isinstance(each, CocktailPartyAttack) for each in runner.attackers):
            runner._connection = CheckpointGate(runner._connection, runner)  # type: ignore[assignment]  # pylint: disable=protected-access
        return failure

    monkeypatch.setattr(workers.ProcessAttackRunner, "_start", gated_start)
    global_arrays, update, inputs = _update(b=6, width=200)
    endless = {"max_iter": 10**7, "tolerance": 1e-300, "unmix": "inputs"}  # ICA never converges
    auditor = Auditor(
        GivingUpAttacker(),
        store=ReconstructionStore.create(tmp_path / "run"),
        scorer=_scorer(inputs),
        attack=AttackSettings(timeout=2.0, fallback=CocktailPartyAttack(**endless)),
        execution=ExecutionSettings(isolation="process", priority="low"),
    )
    primary, second = _audit(auditor, global_arrays, update)

    assert primary.status == "error" and second.attack["attack"] == "cocktail-party"
    assert (second.status, second.verdict) == ("timeout", "timeout")
    kept = re.fullmatch(
        rf"the cocktail-party fallback \(after the exact attack's verdict {primary.verdict}\) did not finish: "
        r"attack did not finish within the 2 s timeout \(worker killed; it got [\d.]+ s of CPU in [\d.]+ s "
        r"of wall time\); its last estimate of 6 inputs after (\d+) ICA iterations is kept, approximate "
        r"\(it has no self-check\)",
        second.verdict_reason,
    )
    assert kept is not None, second.verdict_reason
    assert second.attack["complete"] is False and second.attack["partial"] is True
    assert len(second.psnr) == 6  # the kept estimate is scored like any reconstruction

    # the kept rows are exactly what the attack returns when its ICA stops after those iterations
    delta = {
        name: update.arrays[name].astype(np.float64) - global_arrays[name].astype(np.float64)
        for name in ("fc.weight", "fc.bias")
    }
    stopped = CocktailPartyAttack(**{**endless, "max_iter": int(kept.group(1))}).invert(
        delta["fc.weight"],
        delta["fc.bias"],
        weight=global_arrays["fc.weight"],
        bias=global_arrays["fc.bias"],
        batch_size=6,
    )
    (_, row) = load_table(auditor.store.table_path)  # type: ignore[union-attr]
    directory = auditor.store.directory / row["directory"]  # type: ignore[union-attr]
    np.testing.assert_array_equal(np.load(directory / INPUTS_FILE), stopped.inputs.numpy())
    metrics = json.loads((directory / METRICS_FILE).read_text(encoding="utf-8"))
    assert (row["verdict"], metrics["complete"]) == ("timeout", False)


def test_a_timed_out_or_killed_fallback_says_what_it_kept() -> None:
    estimate = Reconstruction(
        inputs=torch.zeros(4, 3, dtype=torch.float64),
        batch_size=4,
        sparsity_matching=float("nan"),
        complete=False,
        confidence=torch.zeros(4, dtype=torch.float64),
        seconds=1.0,
        stats={"ica_iterations": 17, "partial": True, "approximate": True},
    )
    summary = estimate.summary()
    timed_out = AttackResult(status="timeout", reconstruction=estimate, seconds=9.0, error="did not finish")
    verdict, reason = fallback_verdict("cocktail-party", timed_out, summary, primary_verdict="failed")
    assert (verdict, reason) == (
        "timeout",
        "the cocktail-party fallback (after the exact attack's verdict failed) did not finish: did not finish; "
        "its last estimate of 4 inputs after 17 ICA iterations is kept, approximate (it has no self-check)",
    )
    killed = AttackResult(status="killed", reconstruction=estimate, seconds=9.0, error="SIGKILL")
    verdict, reason = fallback_verdict("cocktail-party", killed, summary, primary_verdict="failed")
    assert verdict == "failed" and reason.endswith(
        "failed: SIGKILL; its last estimate of 4 inputs after 17 ICA iterations is kept, approximate (it has no self-check)"
    )
