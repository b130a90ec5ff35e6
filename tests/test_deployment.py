"""The Deployment Engine on one machine: a real SuperLink, two real SuperNodes, ``flwr run``.

``flower-superlink --insecure`` and two ``flower-supernode --insecure`` processes run on
free localhost ports, each SuperNode with its own ``--node-config`` (its partition; only the
second opts in to ground truth). The app is this project's, with the deployment ClientApp
``clients.client_app:app``. Every process (and what it started) is stopped by pid when the
test ends, also when it fails.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fl_attack.results.store import load_table
from tests.flower_processes import (
    ROOT,
    FlowerProcesses,
    flower_env,
    free_port,
    run_flwr,
    supernode_command,
    write_flower_config,
)

#: A real SuperLink, SuperNodes and ``flwr run``, minutes on two cores: the slow tier.
pytestmark = pytest.mark.slow

#: Seconds the run may take on a loaded two-core machine (each message starts a ClientApp process).
RUN_TIMEOUT = 480.0
SIMULATION_CLIENTAPP = 'clientapp = "clients.client_app:simulation_app"'
DEPLOYMENT_CLIENTAPP = 'clientapp = "clients.client_app:app"'


@dataclass(frozen=True)
class Deployment:
    """A running SuperLink with its SuperNodes, and the Flower home that names it ``deployment``."""

    app: Path
    env: dict[str, str]
    processes: FlowerProcesses


def _deployment_app(directory: Path) -> Path:
    """This project's app with the deployment ClientApp (ground truth only where a node opts in)."""
    app = directory / "app"
    for package in ("strategies", "clients"):
        shutil.copytree(ROOT / package, app / package, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert SIMULATION_CLIENTAPP in pyproject
    (app / "pyproject.toml").write_text(
        pyproject.replace(SIMULATION_CLIENTAPP, DEPLOYMENT_CLIENTAPP), encoding="utf-8"
    )
    return app


@contextmanager
def _deployment(
    directory: Path, node_configs: list[str], *, short_heartbeat: frozenset[int] = frozenset()
) -> Iterator[Deployment]:
    """A SuperLink and one SuperNode per node config (``supernode-<i>``), all stopped on leaving.

    The SuperNodes numbered in ``short_heartbeat`` send heartbeats at Flower's shortest interval.
    """
    home = directory / "flower-home"
    env = flower_env(home)
    port = free_port()
    write_flower_config(home, {"deployment": f'address = "127.0.0.1:{port}"\ninsecure = true'})
    processes = FlowerProcesses(directory, env)
    try:
        processes.start(
            "superlink",
            [
                "flower-superlink",
                "--insecure",
                "--port",
                str(port),
                "--database",
                str(directory / "state.db"),
            ],
        )
        processes.wait_for_log("superlink", "Starting the SuperLink Fleet HTTP API")
        for index, node_config in enumerate(node_configs):
            processes.start(
                f"supernode-{index}",
                supernode_command(port, node_config, short_heartbeat=index in short_heartbeat),
            )
        yield Deployment(_deployment_app(directory), env, processes)
    finally:
        survivors = processes.stop()
        assert not survivors, f"processes still alive after SIGKILL: {survivors}"


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    with _deployment(
        tmp_path,
        ["partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2 audit-ground-truth=true"],
    ) as running:
        yield running


def test_an_audited_deployment_scores_only_the_node_that_opted_in(
    deployment: Deployment, tmp_path: Path
) -> None:
    output = tmp_path / "audit"
    settings = (
        "num-server-rounds=1 dataset='digits' width=32 samples-per-client=12 batch-size=4 "
        "fraction-evaluate=0.0 attack-time-budget=20.0 attack-isolation='thread' "
        f"output-dir='{output}'"
    )
    log = run_flwr(
        ["run", str(deployment.app), "deployment", "--stream", "-c", settings],
        env=deployment.env,
        cwd=tmp_path,
        timeout=RUN_TIMEOUT,
    )
    assert (output / "attacks.csv").is_file(), log[-5000:]
    rows = {row["client"]: row for row in load_table(output / "attacks.csv")}
    assert len(rows) == 2, rows
    opted_in = rows.pop("partition-1")  # its audit record named its partition
    (client, silent), *_ = rows.items()
    assert client.startswith("node-")  # the other sent its update only: the server knows its node id
    for row in (opted_in, silent):
        assert (row["status"], row["verdict"], row["complete"], row["batch_size"]) == (
            "ok",
            "exact",
            "True",
            "4",
        )
    assert int(opted_in["num_references"]) == 4 and float(opted_in["min_psnr"]) > 90.0
    assert silent["num_references"] == "" and silent["mean_psnr"] == ""
    metrics = json.loads((output / silent["directory"] / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["psnr"] is None and "num_reference" not in metrics["quality"]
    assert metrics["details"]["partition_id"] is None and "train_mode" not in metrics["details"]
    history = json.loads((output / "history.json").read_text(encoding="utf-8"))
    assert set(history["round_seconds"]) == {"1"}
    assert "Could not write the audit report" not in log
    assert (output / "report.html").is_file() and (output / "report.json").is_file()


def test_a_supernode_that_dies_mid_round_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    """SuperNode 0 is killed once it received its round-1 message: Flower reports it unavailable
    (no heartbeat within 2 x 10 s, its short interval), the audit records that node's round as
    failed, round 2 trains the other two."""
    configs = [f"partition-id={index} num-partitions=3 audit-ground-truth=true" for index in range(3)]
    output = tmp_path / "audit"
    settings = (
        "num-server-rounds=2 min-nodes=2 dataset='digits' width=32 samples-per-client=12 batch-size=4 "
        f"fraction-evaluate=0.0 attack-time-budget=20.0 attack-isolation='thread' output-dir='{output}'"
    )
    with _deployment(tmp_path, configs, short_heartbeat=frozenset({0})) as deployment:
        run = deployment.processes.start(
            "flwr-run", ["flwr", "run", str(deployment.app), "deployment", "--stream", "-c", settings]
        )
        deployment.processes.wait_for_log("supernode-0", "Received", timeout=RUN_TIMEOUT)
        assert not deployment.processes.kill("supernode-0")
        run.wait(timeout=RUN_TIMEOUT)
        log = deployment.processes.log("flwr-run")
    assert (output / "history.json").is_file(), log[-5000:]
    rows = load_table(output / "attacks.csv")
    first = {row["client"]: row for row in rows if row["round"] == "1"}
    (dead,) = [row for client, row in first.items() if client not in ("partition-1", "partition-2")]
    assert dead["status"] == "error" and "Node Unavailable" in dead["verdict_reason"], dead
    assert first["partition-1"]["status"] == first["partition-2"]["status"] == "ok"
    second = {row["client"] for row in rows if row["round"] == "2" and row["attack"] != "cocktail-party"}
    assert second == {"partition-1", "partition-2"}
