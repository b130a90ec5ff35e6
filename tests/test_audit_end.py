"""Every audited run ends the same way: the report is written and a summary reaches Flower's log.

The rounds run in-process: a Grid that hands each message to the quickstart CNN example's own
ClientApp functions (no Ray). Flower's run log (``flwr run``, the Deployment Engine) mirrors what
Flower's console handler writes; the tests read that handler's stream.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log
from flwr.supercore.logger import console_handler
from flwr.supercore.task_identity import TaskIdentity

from strategies import HonestButCuriousStrategy
from strategies.run_config import AuditConfigError
from tests.example_apps import CNN_ONE_STEP, example_on_path, load_example

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages built outside a Flower run need a task identity (as a ServerApp has)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # pylint: disable=protected-access
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # pylint: disable=protected-access


@pytest.fixture
def flower_log(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What Flower's console handler writes (the stream ``flwr run`` mirrors into the run log)."""
    stream = io.StringIO()
    monkeypatch.setattr(console_handler, "stream", stream)
    return stream


def _context(config: dict[str, Any], node_id: int = 0, node_config: dict[str, Any] | None = None) -> Context:
    return Context(
        run_id=1, node_id=node_id, node_config=node_config or {}, state=RecordDict(), run_config=config
    )


class ClientAppGrid:
    """A Grid whose two nodes answer with the example's ClientApp functions, in this process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def get_node_ids(self) -> list[int]:
        return [1, 2]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        from cnn_example.client_app import evaluate, train

        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            context = _context(self.config, node, {"partition-id": node - 1, "num-partitions": 2})
            answer = train if message.metadata.message_type == "train" else evaluate
            replies.append(answer(message, context))
        return replies


def test_start_ends_the_audit_with_its_report_and_a_summary_in_flowers_log(
    tmp_path: Path, flower_log: io.StringIO
) -> None:
    example = load_example("quickstart_cnn")
    run = tmp_path / "run"
    config = {
        **example.config,
        **CNN_ONE_STEP,
        "attack-isolation": "thread",
        "attack-time-budget": 5.0,
        "output-dir": str(run),
        "num-server-rounds": 1,
    }
    with example_on_path(example):
        from cnn_example.task import Net

        torch.manual_seed(0)
        # what the user adds: the wrap; no close() after start()
        strategy = HonestButCuriousStrategy.from_context(FedAvg(fraction_evaluate=0.0), _context(config))
        grid: Any = ClientAppGrid(config)  # a Grid in all that Strategy.start calls
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1)
    assert strategy.report == run / "report.html" and strategy.report.is_file()
    summary = json.loads((run / "report.json").read_text(encoding="utf-8"))
    history = json.loads((run / "history.json").read_text(encoding="utf-8"))
    assert "1" in history["round_seconds"]
    attacked = [record for record in strategy.records if "fallback_after" not in record.details]
    exact = sum(1 for record in attacked if record.verdict == "exact")
    assert summary["attacks"] == len(attacked) == 2 and summary["verdict_counts"]["exact"] == exact
    text = flower_log.getvalue()
    counts = ", ".join(f"{count} {verdict}" for verdict, count in summary["verdict_counts"].items() if count)
    assert f"fl-attack audit: 2 client update(s) attacked in round 1: {counts}." in text
    assert f"{exact} of 2 updates reconstructed exactly by the server's own check" in text
    assert f"Results: {run} (report: {run / 'report.html'}" in text
    assert "Attack on node-1 in round 1:" in text  # each verdict reaches Flower's log too
    # closing again changes nothing and prints nothing more
    assert strategy.close() == strategy.report
    assert flower_log.getvalue().count("fl-attack audit:") == 1


def test_a_strategy_never_closed_writes_its_report_at_exit(tmp_path: Path) -> None:
    """Driven round by round without start() and never closed: the report still comes at exit."""
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import numpy as np
        from flwr.app import ArrayRecord, Context, RecordDict
        from flwr.serverapp.strategy import FedAvg
        from strategies import HonestButCuriousStrategy

        context = Context(run_id=1, node_id=0, node_config={{}}, state=RecordDict(),
                          run_config={{"output-dir": {str(run)!r}, "attack-isolation": "thread"}})
        strategy = HonestButCuriousStrategy.from_context(FedAvg(), context)
        arrays = {{"fc.weight": np.ones((4, 3)), "fc.bias": np.zeros(4)}}
        strategy.auditor.start_round(1, arrays)
        strategy.auditor.audit_round(1, [])
        print("driven without start() or close()")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "report.html").is_file() and (run / "report.json").is_file()
    assert "fl-attack audit: no client update was attacked" in done.stdout + done.stderr


def test_a_misspelled_audit_key_is_one_line_in_flowers_log(flower_log: io.StringIO) -> None:
    with pytest.raises(AuditConfigError) as raised:
        HonestButCuriousStrategy.from_context(FedAvg(), _context({"attack-time-budgt": 60.0}))
    assert str(raised.value) == (
        "fl-attack audit configuration: unknown run-config key 'attack-time-budgt'; "
        "did you mean 'attack-time-budget'?"
    )
    # what Flower does with an exception that ends a ServerApp
    log(40, "ServerApp raised an exception", exc_info=raised.value)
    lines = flower_log.getvalue().strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in flower_log.getvalue()
    assert lines[1] == f"strategies.run_config.AuditConfigError: {raised.value}"
