"""An update whose spectrum rules the exact attack out is judged without running it; the fallback
runs only where it can say something, and the record says when it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_attack import LayerUpdate, SpearPlusPlus
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings
from fl_attack.results.report import load_summary
from fl_attack.results.store import ReconstructionStore
from tests.synthetic_layer import relu_layer_update


class MustNotRun(SpearPlusPlus):
    """SPEAR++ that fails the test if it is ever asked to invert."""

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Any:
        raise AssertionError("the attack ran on an update its spectrum rules out")


def _global(width: int, n: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(0)
    return {"fc.weight": generator.normal(size=(width, n)), "fc.bias": generator.normal(size=width)}


def _update(global_arrays: dict[str, np.ndarray], step: np.ndarray, *, examples: int) -> ClientUpdate:
    """A client whose layer moved by ``step`` (its bias by the row sums), on ``examples`` samples."""
    sent = {
        "fc.weight": global_arrays["fc.weight"] + step,
        "fc.bias": global_arrays["fc.bias"] + step.sum(axis=1),
    }
    return ClientUpdate(ClientIdentity(node_id=3, partition_id=0), sent, num_examples=examples)


def _audit(auditor: Auditor, global_arrays: dict[str, np.ndarray], update: ClientUpdate) -> list[Any]:
    auditor.start_round(1, global_arrays)
    auditor.audit_round(1, [update])
    auditor.close()
    return list(auditor.records)


def _full_rank_step(width: int, n: int) -> np.ndarray:
    """A dense step with no low-rank structure at all (what many local steps leave behind)."""
    return 1e-2 * np.random.default_rng(1).normal(size=(width, n))


def test_an_update_without_low_rank_structure_is_not_attacked(tmp_path: Path) -> None:
    global_arrays = _global(120, 400)
    update = _update(global_arrays, _full_rank_step(120, 400), examples=416)
    auditor = Auditor(
        MustNotRun(seed=0, progress=False),
        store=ReconstructionStore.create(tmp_path / "run"),
        attack=AttackSettings(time_budget=30.0, fallback="cocktail-party"),
        execution=ExecutionSettings(isolation="thread"),
    )
    (record,) = _audit(auditor, global_arrays, update)  # no fallback row either
    assert (record.status, record.verdict) == ("not-run", "not-applicable")
    assert "no low-rank structure" in record.verdict_reason
    assert record.error is None and record.inputs is None
    assert record.details["fallback_skipped"] == (
        "cocktail-party: the update's spectrum shows no batch of per-sample gradients (see the verdict), "
        "so there are no sources to unmix"
    )
    summary = load_summary(tmp_path / "run")
    assert summary["verdict_counts"]["not-applicable"] == 1 and summary["failed_attacks"] == 0
    assert summary["fallback"] is None
    assert summary["fallback_skipped"] == [
        {"round": 1, "client": "partition-0", "reason": record.details["fallback_skipped"]}
    ]


def test_a_low_rank_update_is_still_attacked() -> None:
    inputs = torch.rand(4, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layer = relu_layer_update(inputs, width=120, seed=0)
    global_arrays = {"fc.weight": layer.weight.numpy(), "fc.bias": layer.bias.numpy()}
    sent = {
        "fc.weight": (layer.weight - 0.01 * layer.weight_grad).numpy(),
        "fc.bias": (layer.bias - 0.01 * layer.bias_grad).numpy(),
    }
    auditor = Auditor(
        SpearPlusPlus(seed=0, progress=False),
        attack=AttackSettings(time_budget=20.0, fallback=""),
        execution=ExecutionSettings(isolation="thread"),
    )
    update = ClientUpdate(ClientIdentity(node_id=3, partition_id=0), sent, num_examples=4)
    (record,) = _audit(auditor, global_arrays, update)
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason


def test_the_fallback_is_not_run_on_more_samples_than_the_layer_can_unmix(tmp_path: Path) -> None:
    """Told a batch of 200 on a 120 x 400 layer: the exact attack runs (and fails), ICA is not tried."""
    global_arrays = _global(120, 400)
    update = _update(global_arrays, _full_rank_step(120, 400), examples=200)
    auditor = Auditor(
        SpearPlusPlus(seed=0, progress=False),
        attack=AttackSettings(time_budget=5.0, batch_size=200, fallback="cocktail-party"),
        execution=ExecutionSettings(isolation="thread"),
    )
    (record,) = _audit(auditor, global_arrays, update)
    assert record.status != "not-run"  # a given batch size leaves the decision to the attack
    assert record.details["fallback_skipped"] == (
        "cocktail-party: 200 samples cannot be unmixed from a 120 x 400 layer update "
        "(at most min(m, n) = 120 sources)"
    )


def test_an_update_of_full_rank_on_its_live_neurons_is_not_attacked(tmp_path: Path) -> None:
    """Neurons dead for a whole local epoch send zero rows; the rest is full rank (quickstart's
    fc1 after an epoch): the spectrum's estimate equals the live rows, so no exact attack applies."""
    global_arrays = _global(120, 400)
    step = _full_rank_step(120, 400)
    step[:8] = 0.0  # 8 neurons never active: 112 live rows, rank 112
    update = _update(global_arrays, step, examples=416)
    auditor = Auditor(
        MustNotRun(seed=0, progress=False),
        store=ReconstructionStore.create(tmp_path / "run"),
        attack=AttackSettings(time_budget=30.0, fallback=""),
        execution=ExecutionSettings(isolation="thread"),
    )
    (record,) = _audit(auditor, global_arrays, update)
    assert (record.status, record.verdict) == ("not-run", "not-applicable")
    assert "full rank 112 on its 112 live neurons" in record.verdict_reason, record.verdict_reason


def test_a_low_rank_update_with_dead_neurons_is_still_attacked() -> None:
    inputs = torch.rand(4, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layer = relu_layer_update(inputs, width=120, seed=0)
    grad = layer.weight_grad.clone()
    assert int((grad.abs().amax(dim=1) == 0).sum()) > 0  # ReLU leaves some rows at zero
    global_arrays = {"fc.weight": layer.weight.numpy(), "fc.bias": layer.bias.numpy()}
    sent = {
        "fc.weight": (layer.weight - 0.01 * grad).numpy(),
        "fc.bias": (layer.bias - 0.01 * layer.bias_grad).numpy(),
    }
    auditor = Auditor(
        SpearPlusPlus(seed=0, progress=False),
        attack=AttackSettings(time_budget=20.0, fallback=""),
        execution=ExecutionSettings(isolation="thread"),
    )
    update = ClientUpdate(ClientIdentity(node_id=3, partition_id=0), sent, num_examples=4)
    (record,) = _audit(auditor, global_arrays, update)
    assert (record.status, record.verdict) == ("ok", "exact"), record.verdict_reason
