"""Tiny synthetic run directories for the report tests, written by the real store."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack.results.store import AttackRecord, ReconstructionStore

#: Columns the audit adds to attacks.csv (and metrics.json) for verdicts and job timing.
VERDICT_COLUMNS = ("verdict", "verdict_reason", "input_space", "queued_at", "started_at", "finished_at")

#: The run of :func:`make_run`: its configuration.
RUN_CONFIG: dict[str, Any] = {
    "dataset": "digits <script>alert(1)</script>",
    "train-mode": "dpsgd",
    "noise-multiplier": 0.5,
    "max-grad-norm": 2.0,
    "batch-size": 4,
    "width": 16,
    "architecture": "spear++",
    "secagg-group-size": 1,
    "attack-time-budget": 5.0,
    "audit-ground-truth": True,
}


def images(count: int, seed: int, channels: int = 1) -> np.ndarray:
    """``count`` random 4x4 images in [0, 1]."""
    return np.random.default_rng(seed).random((count, channels, 4, 4))


def ok_record(server_round: int, client: str, psnr: list[float], *, seed: int, **fields: Any) -> AttackRecord:
    """A successful, scored attack whose samples have the given PSNR values."""
    reference = images(len(psnr), seed)
    reconstructed = np.clip(reference + 0.01 * np.arange(len(psnr))[:, None, None, None], 0, 1)
    values: dict[str, Any] = {
        "status": "ok",
        "seconds": 1.0 + seed,
        "inputs": reconstructed.reshape(len(psnr), -1),
        "reconstructed_images": reconstructed,
        "reference_images": reference,
        "attack": {"batch_size": len(psnr), "complete": True, "sparsity_matching": 1.0},
        "quality": {
            "mean_psnr": float(np.mean(psnr)),
            "exact_fraction": float(np.mean([v > 90 for v in psnr])),
            "approx_fraction": float(np.mean([v > 25 for v in psnr])),
        },
        "psnr": psnr,
        "details": {"partition_id": 0, "layer": {"weight": "fc1.weight", "bias": "fc1.bias"}},
    }
    values.update(fields)
    return AttackRecord(server_round=server_round, client=client, **values)


def history(accuracies: list[float]) -> dict[str, Any]:
    """A history.json document: round r has test accuracy ``accuracies[r]`` (round 0: initial model)."""
    rounds = [
        {
            "round": index,
            "train": None if index == 0 else {"train-loss": 2.0 - 0.1 * index},
            "evaluate": None,
            "test": {"test-loss": 2.3 - 0.3 * index, "test-acc": accuracy, "test-examples": 50},
        }
        for index, accuracy in enumerate(accuracies)
    ]
    return {"rounds": rounds, "final_test": rounds[-1]["test"]}


def make_run(base: Path) -> Path:
    """Two rounds, two clients; one timed-out and one unscored attack; a history.

    Round 1: 4 scored samples (300, 120, 40, 10 dB): 2 exact, 3 approximate; a timeout.
    Round 2: 3 scored samples (95, 20, 5 dB): 1 exact, 1 approximate; an unscored reconstruction.
    """
    store = ReconstructionStore(base / "run", run_config=RUN_CONFIG)
    store.save(ok_record(1, "partition-0", [300.0, 120.0, 40.0, 10.0], seed=0))
    store.save(
        AttackRecord(
            server_round=1,
            client="partition-1",
            status="timeout",
            seconds=22.5,
            error="attack exceeded <20 s> & was killed",
        )
    )
    store.save(ok_record(2, "partition-0", [95.0, 20.0, 5.0], seed=1))
    unscored = images(2, 7)
    store.save(
        AttackRecord(
            server_round=2,
            client="partition-1",
            status="ok",
            seconds=3.0,
            inputs=unscored.reshape(2, -1),
            reconstructed_images=unscored,
            attack={"batch_size": 2, "complete": False},
        )
    )
    store.save_history(
        {
            "rounds": [
                {"round": 0, "train": None, "evaluate": None,
                 "test": {"test-loss": 2.3, "test-acc": 0.1, "test-examples": 50}},
                {"round": 1, "train": {"train-loss": 2.0}, "evaluate": None,
                 "test": {"test-loss": 2.0, "test-acc": 0.25, "test-examples": 50}},
                {"round": 2, "train": {"train-loss": 1.5}, "evaluate": None,
                 "test": {"test-loss": 1.6, "test-acc": 0.5, "test-examples": 50}},
            ],
            "final_test": {"test-loss": 1.6, "test-acc": 0.5, "test-examples": 50},
        }
    )  # fmt: skip
    return store.directory


def simple_run(base: Path, config: Mapping[str, Any] | None, psnr_per_round: list[list[float]]) -> Path:
    """One scored client per round with the given PSNR values, and a history."""
    store = ReconstructionStore(base / "run", run_config=None if config is None else dict(config))
    for index, psnr in enumerate(psnr_per_round):
        store.save(ok_record(index + 1, "partition-0", psnr, seed=index))
    store.save_history(history([0.1 + 0.1 * index for index in range(len(psnr_per_round) + 1)]))
    return store.directory


def add_verdicts(run_dir: Path, verdicts: Mapping[tuple[int, str], Mapping[str, Any]]) -> None:
    """Give a stored run the audit's verdict columns, as a run of the current audit has them.

    ``verdicts[(round, client)]`` maps column names of :data:`VERDICT_COLUMNS` to values;
    the table gets the columns (after ``status``) when it lacks them, and each attack's
    metrics.json gets the same keys.
    """
    table = run_dir / "attacks.csv"
    with open(table, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        rows = list(reader)
    missing = [column for column in VERDICT_COLUMNS if column not in columns]
    position = columns.index("status") + 1
    columns[position:position] = missing
    for row in rows:
        values = verdicts.get((int(row["round"]), row["client"]), {})
        for column in VERDICT_COLUMNS:
            row[column] = "" if values.get(column) is None else str(values[column])
        metrics = run_dir / row["directory"] / "metrics.json"
        if metrics.is_file():
            document = json.loads(metrics.read_text(encoding="utf-8"))
            document.update({column: values.get(column) for column in VERDICT_COLUMNS})
            metrics.write_text(json.dumps(document), encoding="utf-8")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    table.write_text(text.getvalue(), encoding="utf-8")


#: Verdicts of a user-shaped run (no ground truth): two exact, one timeout with every sample found
#: but blended look-alikes, one timeout short of samples, two updates the spectrum ruled out.
USER_SHAPED_VERDICTS: dict[tuple[int, str], dict[str, Any]] = {
    (1, "node-1"): {"verdict": "exact", "verdict_reason": "all 8 samples recovered; the self-check passed"},
    (1, "node-2"): {
        "verdict": "timeout",
        "verdict_reason": "the attack spent its whole 30 s budget: all 8 directions were found but not "
        "verified as the batch: every direction is consistent with both ends of the client's local steps, "
        "which one layer's update cannot tell from a blend of look-alike samples",
    },
    (2, "node-1"): {"verdict": "exact", "verdict_reason": "all 8 samples recovered; the self-check passed"},
    (2, "node-2"): {
        "verdict": "timeout",
        "verdict_reason": "the attack spent its whole 30 s budget with 3 of 8 samples found",
    },
    **{
        (server_round, "node-3"): {
            "verdict": "not-applicable",
            "verdict_reason": "the update has no low-rank structure (rank close to min(m, n) = 120): it is "
            "not one gradient of a small batch",
        }
        for server_round in (1, 2)
    },
}


def user_shaped_run(base: Path) -> Path:
    """A run as a user's own app leaves it: features of a CNN's fc1, no ground truth, no history,
    two updates of many local steps that the spectrum ruled out before attacking."""
    store = ReconstructionStore(base / "run", run_config={"attack-time-budget": 30.0, "output-dir": ""})
    rng = np.random.default_rng(0)
    for server_round in (1, 2):
        for client in ("node-1", "node-2"):
            store.save(
                AttackRecord(
                    server_round=server_round,
                    client=client,
                    status="ok",
                    seconds=2.0,
                    inputs=np.abs(rng.normal(size=(8, 400))),
                    attack={"batch_size": 8, "complete": True},
                    input_space="features",
                )  # fmt: skip
            )
        store.save(
            AttackRecord(
                server_round=server_round, client="node-3", status="not-run", seconds=0.05,
                input_space="features",
                details={"fallback_skipped": "cocktail-party: the update's spectrum shows no batch of per-sample "
                         "gradients (see the verdict), so there are no sources to unmix"},
            )
        )  # fmt: skip
    add_verdicts(store.directory, USER_SHAPED_VERDICTS)
    return store.directory
