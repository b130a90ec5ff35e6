"""``flwr run`` as a user types it: Flower builds the app's FAB and starts a local SuperLink.

Both apps run on one SuperLink that Flower starts in the background (``flwr ls`` starts it, each
``flwr run`` finds it through the ``local`` connection; simulation federation, Flower's default
of two SuperNodes), with this module's own Flower home and ports; the SuperLink and everything
it started are stopped by pid at the end. ``flwr run --stream``
returns 0 even when the ServerApp crashed, so the tests judge the run by what it wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    superlink_pid,
    write_flower_config,
)

#: Real ``flwr run`` processes, a minute each on two cores: the slow tier (pyproject's markers).
pytestmark = pytest.mark.slow

#: Seconds one ``flwr run`` may take (a loaded two-core machine: Ray and torch start in each worker).
RUN_TIMEOUT = 420.0
#: ``flwr ls`` calls that may try to start the local SuperLink.
START_TRIES = 3
#: One FedSGD round on 8x8 digits, small enough that the attack takes about a second.
SMALL_RUN = {
    "num-server-rounds": 1,
    "attack-time-budget": 20.0,
    "attack-isolation": "'thread'",
}

USER_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "digits-app"
version = "1.0.0"
dependencies = ["fl-attack"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "digits_app.server_app:app"
clientapp = "digits_app.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 2
batch-size = 8
lr = 0.1
attack-time-budget = 30.0
attack-isolation = "process"
output-dir = ""
"""

USER_TASK = '''\
"""The model and the data: a small MLP on scikit-learn's bundled 8x8 digits."""

import torch
from sklearn.datasets import load_digits
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))


def load_partition(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_digits(return_X_y=True)
    rows = slice(partition_id, None, num_partitions)
    return torch.tensor(images[rows] / 16.0, dtype=torch.float32), torch.tensor(labels[rows])
'''

USER_SERVER = '''\
"""The user's ServerApp: FedAvg, audited with one line."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from digits_app.task import make_model
from strategies import HonestButCuriousStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = HonestButCuriousStrategy.from_context(FedAvg(fraction_evaluate=0.0), context)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_model().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
'''

USER_CLIENT = '''\
"""The user's ClientApp: one SGD step on a batch, as Flower's quickstarts train."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digits_app.task import load_partition, make_model

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = load_partition(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    batch = int(context.run_config["batch-size"])
    optimizer = torch.optim.SGD(model.parameters(), lr=float(context.run_config["lr"]))
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(images[:batch]), labels[:batch])
    loss.backward()
    optimizer.step()
    metrics = MetricRecord({"train-loss": float(loss), "num-examples": batch})
    return Message(
        content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg
    )
'''


@dataclass(frozen=True)
class LocalFlower:
    """A Flower home whose ``local`` connection makes ``flwr run`` start its own SuperLink."""

    home: Path
    env: dict[str, str]
    port: int
    processes: FlowerProcesses

    def run(self, app: Path, overrides: dict[str, object], output: Path) -> str:
        """``flwr run <app> --stream -c ...`` from a scratch folder; the SuperLink it starts is adopted."""
        settings = " ".join(
            f"{key}={value}" for key, value in {**overrides, "output-dir": f"'{output}'"}.items()
        )
        text = run_flwr(
            ["run", str(app), "--stream", "-c", settings],
            env=self.env,
            cwd=self.home.parent,
            timeout=RUN_TIMEOUT,
        )
        self.adopt_superlink()
        return text

    def start_superlink(self) -> None:
        """Let Flower start its local SuperLink (``flwr ls`` does, as ``flwr run`` would).

        Flower gives its SuperLink 15 s to come up and kills it after that, which a loaded
        machine can exceed: up to :data:`START_TRIES` tries.
        """
        text = ""
        for _ in range(START_TRIES):
            text = run_flwr(["ls"], env=self.env, cwd=self.home.parent, timeout=RUN_TIMEOUT)
            self.adopt_superlink()
            if superlink_pid(self.port) is not None:
                return
        raise RuntimeError(f"flwr did not start its local SuperLink in {START_TRIES} tries:\n{text[-3000:]}")

    def adopt_superlink(self) -> None:
        pid = superlink_pid(self.port)
        if pid is not None:
            self.processes.adopt("superlink", pid)


@pytest.fixture(scope="module")
def local_flower(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFlower]:
    directory = tmp_path_factory.mktemp("flwr-run")
    home = directory / "flower-home"
    env = flower_env(home)
    port, control_port = free_port(), free_port()
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(port)
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control_port)
    # in memory: no database to migrate at start (slow on a loaded machine, and left half-migrated
    # when Flower kills a SuperLink that was not up in time)
    write_flower_config(home, {"local": 'address = ":local-in-memory:"'})
    flower = LocalFlower(home, env, port, FlowerProcesses(directory, env))
    try:
        flower.start_superlink()
        yield flower
    finally:
        flower.adopt_superlink()  # also when a run timed out before it was adopted
        survivors = flower.processes.stop()
        assert not survivors, f"processes still alive after SIGKILL: {survivors}"
        assert superlink_pid(port) is None


def _assert_exact_rows(output: Path, clients: int, batch: int) -> None:
    rows = load_table(output / "attacks.csv")
    assert len(rows) == clients, rows
    for row in rows:
        assert (row["status"], row["verdict"], row["complete"]) == ("ok", "exact", "True"), row
        assert int(row["batch_size"]) == batch
        assert (output / row["directory"] / "reconstruction.npy").is_file()


def _assert_report(output: Path, log: str) -> None:
    assert "Could not write the audit report" not in log, log[-3000:]
    assert "<html" in (output / "report.html").read_text(encoding="utf-8").lower()
    report = json.loads((output / "report.json").read_text(encoding="utf-8"))
    assert report["attacks"] == 2 and report["exact_attack_share"] == 1.0, report


def test_flwr_run_of_this_project_writes_every_artefact(local_flower: LocalFlower, tmp_path: Path) -> None:
    output = tmp_path / "audit"
    overrides = {
        **SMALL_RUN,
        "dataset": "'digits'",
        "width": 32,
        "samples-per-client": 12,
        "batch-size": 4,
        "fraction-evaluate": 0.0,
    }
    log = local_flower.run(ROOT, overrides, output)
    assert (output / "attacks.csv").is_file(), log[-5000:]
    assert superlink_pid(local_flower.port) == local_flower.processes.pid("superlink")  # left running
    _assert_exact_rows(output, clients=2, batch=4)
    _assert_report(output, log)
    history = json.loads((output / "history.json").read_text(encoding="utf-8"))
    assert [entry["round"] for entry in history["rounds"]] == [0, 1]
    assert set(history["round_seconds"]) == {"1"} and history["round_seconds"]["1"] > 0.0


def test_flwr_run_of_a_users_app_that_installs_the_plugin(local_flower: LocalFlower, tmp_path: Path) -> None:
    app = tmp_path / "digits-app"
    package = app / "digits_app"
    package.mkdir(parents=True)
    (app / "pyproject.toml").write_text(USER_PYPROJECT, encoding="utf-8")
    for name, text in {
        "__init__": "",
        "task": USER_TASK,
        "server_app": USER_SERVER,
        "client_app": USER_CLIENT,
    }.items():
        (package / f"{name}.py").write_text(text, encoding="utf-8")
    output = tmp_path / "audit"
    log = local_flower.run(app, {**SMALL_RUN, "batch-size": 4}, output)
    assert (output / "attacks.csv").is_file(), log[-5000:]
    _assert_exact_rows(output, clients=2, batch=4)
    _assert_report(output, log)
    # the one-line wrap alone (no close(), no write_report) ends the audit: history and summary too
    history = json.loads((output / "history.json").read_text(encoding="utf-8"))
    assert set(history["round_seconds"]) == {"1"}, history
    assert "fl-attack audit:" in log, log[-5000:]
