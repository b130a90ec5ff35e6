"""Flower's published apps as a user runs them, audited with the one server line.

``tests/user_apps/`` holds look-alikes of Flower's ``quickstart-pytorch`` (its small CNN, local
epochs of mini-batch SGD with momentum 0.9 at the ``lr`` the server sends, ``num-examples`` =
training examples) and ``fl-tabular`` (its MLP on one-hot encoded census columns, Adam at
lr 0.001 on mini-batches of 32, ``num-examples`` = mini-batches), each with its own run config;
only their data is offline and tiny (scikit-learn's digits, a synthetic census). Their server
wraps FedAvg with ``HonestButCuriousStrategy.from_context`` and nothing else; their clients
know nothing of the audit. Each app runs in-process (``flwr.simulation.run_simulation``, two
SuperNodes) and the tests check what the audit says about it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack.results.store import load_table
from fl_attack.vocabulary import STATUS_NOT_RUN
from tests.example_apps import load_example, run_example

USER_APPS = Path(__file__).resolve().parent / "user_apps"
#: Audit keys a user may add to an app's run config; here short, in-process attacks.
AUDIT = {"attack-isolation": "thread", "attack-time-budget": 10.0}


def _run(app: str, output: Path, **overrides: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run a user app for one round; its exact attack's rows (with metrics.json) and report.json."""
    torch.manual_seed(0)  # the server's initial model (the apps do not seed it)
    run_example(
        app, {"num-server-rounds": 1, **AUDIT, **overrides, "output-dir": str(output)}, root=USER_APPS
    )
    table = load_table(output / "attacks.csv")
    report = json.loads((output / "report.json").read_text(encoding="utf-8"))
    rows = [row for row in table if row["attack"] != "cocktail-party"]
    _assert_report_matches_table(report, rows)
    assert "<html" in (output / "report.html").read_text(encoding="utf-8").lower()
    history = json.loads((output / "history.json").read_text(encoding="utf-8"))
    assert set(history["round_seconds"]) == {"1"}, history
    return [
        {**row, **json.loads((output / row["directory"] / "metrics.json").read_text())} for row in rows
    ], report


def _assert_report_matches_table(report: dict[str, Any], rows: list[dict[str, str]]) -> None:
    """report.json's figures are those of attacks.csv (the exact attack's rows)."""
    assert report["attacks"] == len(rows) == 2, (report["attacks"], rows)
    verdicts = Counter(row["verdict"] for row in rows)
    assert {key: value for key, value in report["verdict_counts"].items() if value} == dict(verdicts)
    assert report["statuses"] == dict(Counter(row["status"] for row in rows))
    assert report["exact_attack_share"] == verdicts["exact"] / len(rows)
    assert sorted((detail["round"], detail["client"]) for detail in report["attack_details"]) == sorted(
        (int(row["round"]), row["client"]) for row in rows
    )


def test_user_apps_keep_flowers_shape() -> None:
    """Each look-alike is a Flower app folder whose server has the one line and whose client has none."""
    for name, package in (("quickstart-pytorch", "pytorchexample"), ("fl-tabular", "fltabular")):
        app = load_example(name, root=USER_APPS)
        assert (app.serverapp, app.clientapp) == (f"{package}.server_app:app", f"{package}.client_app:app")
        server = (app.folder / package / "server_app.py").read_text(encoding="utf-8")
        client = (app.folder / package / "client_app.py").read_text(encoding="utf-8")
        assert server.count("HonestButCuriousStrategy.from_context(") == 1
        assert "fl_attack" not in client and "clients." not in client and "strategies" not in client
        assert not any(key.startswith("attack-") for key in app.config)  # the audit's defaults


@pytest.mark.slow  # a Ray simulation
def test_quickstart_pytorch_one_step_is_recovered(tmp_path: Path) -> None:
    """8 training examples, batch size 32: one SGD step; fc1's 400 input features are all recovered.

    The server's self-check calls a recovery exact only when every neuron's ReLU pattern agrees;
    one below 0.999 (near-identical upscaled digits, float32 rounding) leaves it approximate.
    """
    records, report = _run("quickstart-pytorch", tmp_path / "run", **{"partition-size": 10})
    for record in records:
        assert record["status"] == "ok" and record["verdict"] in ("exact", "approximate"), record[
            "verdict_reason"
        ]
        assert record["batch_size"] == 8 and record["input_space"] == "features"
        stored = np.load(tmp_path / "run" / record["directory"] / "reconstruction.npy")
        assert stored.shape == (8, 400)
    exact = [record for record in records if record["verdict"] == "exact"]
    assert exact, [record["verdict_reason"] for record in records]
    assert all(record["complete"] is True for record in exact)
    assert report["exact_attack_share"] == len(exact) / 2


@pytest.mark.slow  # a Ray simulation
def test_quickstart_pytorch_local_epoch_is_not_applicable(tmp_path: Path) -> None:
    """160 examples in batches of 32: five momentum steps, full rank on fc1's active neurons; never exact."""
    records, report = _run(
        "quickstart-pytorch", tmp_path / "run", **{"partition-size": 200, "attack-time-budget": 2.0}
    )
    for record in records:
        assert record["verdict"] == "not-applicable", record["verdict_reason"]
        assert record["status"] in ("ok", STATUS_NOT_RUN) and record["complete"] is not True
        assert "no low-rank structure" in record["verdict_reason"] or "full rank" in record["verdict_reason"]
    assert report["exact_attack_share"] == 0.0


@pytest.mark.slow  # a Ray simulation
def test_fl_tabular_one_adam_step_is_not_applicable_without_a_search(tmp_path: Path) -> None:
    """16 rows, one mini-batch: one Adam step, told apart by its equal magnitudes before any attack runs."""
    records, report = _run("fl-tabular", tmp_path / "run", **{"partition-size": 20})
    for record in records:
        assert (record["status"], record["verdict"]) == (STATUS_NOT_RUN, "not-applicable"), record[
            "verdict_reason"
        ]
        assert "Adam" in record["verdict_reason"], record["verdict_reason"]
    assert report["exact_attack_share"] == 0.0 and report["statuses"] == {STATUS_NOT_RUN: 2}


@pytest.mark.slow  # a Ray simulation
def test_fl_tabular_adam_epoch_is_never_claimed(tmp_path: Path) -> None:
    """320 rows, ten Adam steps: no exact attack finds a sample, and none is claimed.

    The spectrum may still suggest a tiny batch (2 or 3 on this 128 x 17 layer); the search then
    finds nothing. Such an update is judged not-applicable, or timeout when its spectrum looked
    low-rank (the verdict then says that no sample was found).
    """
    records, report = _run(
        "fl-tabular", tmp_path / "run", **{"partition-size": 400, "attack-time-budget": 3.0}
    )
    for record in records:
        assert record["verdict"] in ("not-applicable", "timeout"), record["verdict_reason"]
        assert record["complete"] is False and record["attack"].get("directions_found", 0) == 0
        if record["verdict"] == "timeout":
            # fl-tabular reports mini-batches as num-examples: the reason says the count was not used
            assert record["verdict_reason"].endswith(
                "with 0 of " + str(record["batch_size"]) + " samples found; it rests on the batch size from "
                "the update's rank " + str(record["batch_size"]) + " (the client's num-examples, 10, "
                "differs, so it was not used)"
            ), record["verdict_reason"]
    assert report["exact_attack_share"] == 0.0
