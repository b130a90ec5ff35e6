"""Flower's own SecAgg+ run in this process, for the SecAgg+ tests.

An in-memory grid hands every message to the ClientApp of its node as a copy, as a real
transport would, so that ``SecAggPlusWorkflow`` and ``secaggplus_mod`` run unchanged while
the clients' quantization draws come from a seeded ``np.random``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import FitRes, ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.supercore.task_identity import TaskIdentity

from fl_attack import LayerUpdate, Reconstruction
from fl_attack.attacks import LayerAttackBase
from fl_attack.evaluation.scoring import ReconstructionScorer

INPUT_DIM, WIDTH = 6, 4
NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Messages built outside a Flower run need a task identity (as a ServerApp has)."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)  # pylint: disable=protected-access
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved  # pylint: disable=protected-access


# ---------------------------------------------------------------------------- Flower in-process


class FixedClient(NumPyClient):
    """Replies with given parameters, example count and metrics; remembers the order of fits."""

    def __init__(
        self, node_id: int, replies: dict[int, tuple[list[np.ndarray], int, dict[str, Any]]], order: list[int]
    ):
        self.node_id, self.replies, self.order = node_id, replies, order

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.order.append(self.node_id)
        arrays, count, metrics = self.replies[self.node_id]
        return arrays, count, dict(metrics)


class InProcessGrid:
    """Hands every message to the ClientApp of its node as a copy, as a transport would."""

    def __init__(self, app: ClientApp, node_ids: Iterable[int]) -> None:
        self.app = app
        self.contexts = {
            node_id: Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
            for node_id in node_ids
        }

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return [
            copy.deepcopy(self.app(copy.deepcopy(message), self.contexts[message.metadata.dst_node_id]))
            for message in messages
        ]


def run_flower_round(
    replies: dict[int, tuple[list[np.ndarray], int, dict[str, Any]]],
    *,
    start: Sequence[np.ndarray],
    strategy: Any,
    seed: int,
    workflow: Any = None,
    secure: bool = True,
) -> list[int]:
    """One fit round of Flower's own workflow (SecAgg+ by default) on ``replies``; the clients' fit order."""
    order: list[int] = []
    mods = [secaggplus_mod] if secure else []
    app = ClientApp(
        client_fn=lambda context: FixedClient(context.node_id, replies, order).to_client(), mods=mods
    )
    grid = InProcessGrid(app, replies)
    manager = SimpleClientManager()
    for node_id in replies:
        manager.register(GridClientProxy(node_id, grid, 1))  # type: ignore[arg-type]
    base = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(
        base, config=ServerConfig(num_rounds=1), strategy=strategy, client_manager=manager
    )
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(list(start)), True
    )
    np.random.seed(seed)
    if secure:
        (workflow or SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2))(grid, context)
    else:
        default_fit_workflow(grid, context)  # type: ignore[arg-type]
    return order


class RecordingFedAvg(LegacyFedAvg):
    """Legacy FedAvg that keeps what it was given and what it returned."""

    def __init__(self, **kwargs: Any) -> None:
        self.seen_metrics: list[dict[str, Any]] = []
        super().__init__(fit_metrics_aggregation_fn=self._metrics, **kwargs)
        self.received: list[tuple[Any, FitRes]] = []
        self.returned: Any = None

    def _metrics(self, metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        self.seen_metrics.extend(entry for _, entry in metrics)
        return {}

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        self.received = list(results)
        self.returned = super().aggregate_fit(server_round, results, failures)
        return self.returned


def client_replies(
    count: int, *, seed: int, examples: Sequence[int], scale: float = 0.01
) -> tuple[list[np.ndarray], dict[int, tuple[list[np.ndarray], int, dict[str, Any]]]]:
    rng = np.random.RandomState(seed)
    start = [
        rng.randn(WIDTH, INPUT_DIM).astype(np.float32),
        rng.randn(WIDTH).astype(np.float32),
        rng.randn(3, WIDTH).astype(np.float32),
        rng.randn(3).astype(np.float32),
    ]
    replies = {}
    for position in range(count):
        arrays = [(array + scale * rng.randn(*array.shape)).astype(np.float32) for array in start]
        replies[101 + position] = (arrays, examples[position], {"loss": float(position)})
    return start, replies


class RecordingAttacker(LayerAttackBase):
    """Returns fixed inputs and remembers the observed updates it was given."""

    def __init__(self, rows: int = 2, width: int = INPUT_DIM) -> None:
        self.calls: list[dict[str, Any]] = []
        self.rows, self.width = rows, width

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        self.calls.append({"update": update, **options})
        return Reconstruction(
            inputs=torch.zeros(self.rows, self.width, dtype=torch.float64),
            batch_size=self.rows,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(self.rows, dtype=torch.float64),
            seconds=0.0,
        )


def scorer(samples: int = 40) -> ReconstructionScorer:
    dataset = np.random.RandomState(9).randn(samples, INPUT_DIM)
    return ReconstructionScorer(
        dataset,
        denormalize=lambda x: (torch.as_tensor(x) * 0.1 + 0.5).reshape(-1, 1, 2, 3),
        image_shape=(1, 2, 3),
    )
