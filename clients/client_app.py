"""Flower ClientApp: trains the received model by FedSGD, FedAvg or DP-SGD.

The training hyper-parameters arrive with every message (the server forwards them); the
client's data (dataset, data root, partitioning) comes only from the client's own run
config and node config, so a server can never point a client at a path on its disk.
Ground truth for scoring is sent only when the client opted in (its node config, or
:data:`simulation_app`, the app built for simulations): never because the server asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_attack.audit.protocol import (
    ARRAYS_KEY,
    AUDIT_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
    TRAIN_MODE_KEY,
)
from fl_attack.simulate.training import TrainOutcome, evaluate_model, train_dpsgd, train_fedavg, train_fedsgd

from .data import ClientData, client_data
from .ground_truth import ground_truth_enabled

#: Keys a client takes only from its own configuration, never from a server's message.
LOCAL_KEYS = frozenset(
    {
        "dataset",
        "data-root",
        "dataset-limit",
        "partitioning",
        "labels-per-client",
        "samples-per-client",
        "partition-seed",
    }
)


class _Settings:
    """Typed read access to the message config with the run config as fallback."""

    def __init__(self, message: Message, context: Context, local: Mapping[str, Any]) -> None:
        record = message.content.get(CONFIG_KEY)
        self._message: Mapping[str, Any] = record if isinstance(record, ConfigRecord) else {}
        self._local: dict[str, Any] = {**context.run_config, **local}

    def get(self, key: str) -> Any:
        if key not in LOCAL_KEYS and key in self._message:
            return self._message[key]
        if key in self._local:
            return self._local[key]
        raise KeyError(f"config key '{key}' is neither in the message config nor the client's run config")

    def integer(self, key: str) -> int:
        return int(self.get(key))

    def number(self, key: str) -> float:
        return float(self.get(key))

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if isinstance(value, str):
            return value.lower() in ("true", "1", "yes")
        return bool(value)

    def text(self, key: str) -> str:
        return str(self.get(key))


def _partition(context: Context) -> tuple[int, int]:
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    return partition_id, num_partitions


def _load(settings: _Settings, context: Context) -> ClientData:
    partition_id, num_partitions = _partition(context)
    return client_data(
        dataset=settings.text("dataset"),
        data_root=settings.text("data-root"),
        dataset_limit=settings.integer("dataset-limit"),
        partitioning=settings.text("partitioning"),
        num_partitions=num_partitions,
        partition_id=partition_id,
        samples_per_client=settings.integer("samples-per-client"),
        labels_per_client=settings.integer("labels-per-client"),
        seed=settings.integer("partition-seed"),
    )


def _received_arrays(msg: Message) -> ArrayRecord:
    """The global model's arrays the server sent, under :data:`ARRAYS_KEY`."""
    record = msg.content[ARRAYS_KEY]
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"message entry '{ARRAYS_KEY}' must be an ArrayRecord, got {type(record).__name__}")
    return record


def _server_round(msg: Message) -> int:
    """The round number the server put in the message config; 0 when it sent none."""
    config = msg.content.get(CONFIG_KEY)
    if not isinstance(config, ConfigRecord):
        return 0
    value = config.get("server-round", 0)
    if not isinstance(value, (int, float, str, bytes)):
        raise ValueError(f"config entry 'server-round' must be a number, got {value!r}")
    return int(value)


def _model(settings: _Settings, data: ClientData, arrays: ArrayRecord) -> torch.nn.Module:
    from fl_attack.simulate.victims import build_victim  # pylint: disable=import-outside-toplevel

    depth = settings.integer("depth")
    model = build_victim(
        settings.text("architecture"),
        input_dim=data.input_dim,
        width=settings.integer("width"),
        num_classes=data.num_classes,
        depth=depth or None,
    )
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


def _train(
    mode: str, settings: _Settings, model: torch.nn.Module, data: ClientData, seed: list[int]
) -> TrainOutcome:
    if mode == "fedsgd":
        return train_fedsgd(
            model,
            data.images,
            data.labels,
            data.indices,
            batch_size=settings.integer("batch-size"),
            lr=settings.number("local-lr"),
            rng=np.random.default_rng(seed),
        )
    if mode == "fedavg":
        return train_fedavg(
            model,
            data.images,
            data.labels,
            data.indices,
            epochs=settings.integer("local-epochs"),
            mini_batch_size=settings.integer("mini-batch-size"),
            lr=settings.number("local-lr"),
            rng=np.random.default_rng(seed),
        )
    if mode == "dpsgd":
        return train_dpsgd(
            model,
            data.images,
            data.labels,
            data.indices,
            epochs=settings.integer("local-epochs"),
            mini_batch_size=settings.integer("mini-batch-size"),
            lr=settings.number("local-lr"),
            noise_multiplier=settings.number("noise-multiplier"),
            max_grad_norm=settings.number("max-grad-norm"),
            poisson_sampling=settings.flag("poisson-sampling"),
            seed=int(np.random.default_rng(seed).integers(2**31 - 1)),
        )
    raise ValueError(f"unknown train-mode {mode!r}; use 'fedsgd', 'fedavg' or 'dpsgd'")


def _train_reply(msg: Message, context: Context, local: Mapping[str, Any], simulation: bool) -> Message:
    """Train the received model on the local data and reply with the new weights.

    The reply holds the trained ArrayRecord and a MetricRecord with ``num-examples`` and
    ``train-loss``; only where the client opted in to ground truth, also an audit
    ConfigRecord with the partition id, the training mode and the dataset indices of the
    samples trained on.
    """
    torch.set_num_threads(1)
    settings = _Settings(msg, context, local)
    data = _load(settings, context)
    model = _model(settings, data, _received_arrays(msg))
    partition_id, _ = _partition(context)
    server_round = _server_round(msg)
    mode = settings.text("train-mode")
    seed = [settings.integer("client-seed"), partition_id, server_round]
    outcome = _train(mode, settings, model, data, seed)

    content = RecordDict(
        {
            ARRAYS_KEY: ArrayRecord(outcome.state_dict),
            METRICS_KEY: MetricRecord({NUM_EXAMPLES_KEY: outcome.num_examples, "train-loss": outcome.loss}),
        }
    )
    # the run config may switch ground truth off; only the client's own side can switch it on
    if ground_truth_enabled(context, simulation=simulation) and settings.flag("audit-ground-truth"):
        audit: dict[str, Any] = {PARTITION_ID_KEY: partition_id, TRAIN_MODE_KEY: mode}
        if outcome.sample_indices:
            audit[SAMPLE_INDICES_KEY] = outcome.sample_indices
        content[AUDIT_KEY] = ConfigRecord(audit)
    return Message(content=content, reply_to=msg)


def _evaluate_reply(msg: Message, context: Context, local: Mapping[str, Any]) -> Message:
    """Evaluate the received model on the local data."""
    torch.set_num_threads(1)
    settings = _Settings(msg, context, local)
    data = _load(settings, context)
    model = _model(settings, data, _received_arrays(msg))
    loss, accuracy = evaluate_model(model, data.images, data.labels, data.indices)
    metrics = MetricRecord({NUM_EXAMPLES_KEY: len(data.indices), "eval-loss": loss, "eval-acc": accuracy})
    return Message(content=RecordDict({METRICS_KEY: metrics}), reply_to=msg)


def create_client_app(local: Mapping[str, Any] | None = None, *, ground_truth: bool = False) -> ClientApp:
    """This project's ClientApp.

    Parameters
    ----------
    local : Mapping[str, Any] or None (default: None)
        The client's own settings on top of its ``context.run_config`` (a simulation passes
        its resolved run config here).
    ground_truth : bool (default: False)
        Report the samples trained on, for scoring (simulations); otherwise only a node
        config with ``audit-ground-truth=true`` enables it.
    """
    client_app = ClientApp()
    settings = dict(local or {})

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        """Train the received model on the local data and reply with the new weights."""
        return _train_reply(msg, context, settings, ground_truth)

    @client_app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """Evaluate the received model on the local data."""
        return _evaluate_reply(msg, context, settings)

    return client_app


#: For deployments: ground truth only where a node config opts in.
app = create_client_app()
#: For simulations (``flwr run .`` locally, ``fl-attack-audit``): ground truth for scoring.
simulation_app = create_client_app(ground_truth=True)
