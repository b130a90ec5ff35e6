"""Flower ClientApp: trains the received model by FedSGD, FedAvg or DP-SGD.

The training configuration arrives with every message (the server forwards the run
config's client keys, see ``strategies.config.CLIENT_KEYS``); keys missing there are
read from ``context.run_config``. The client's data partition comes from the node
config (``partition-id``, ``num-partitions``) set by the simulation engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .data import ClientData, client_data
from .protocol import (
    ARRAYS_KEY,
    AUDIT_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
    TRAIN_MODE_KEY,
)
from .training import TrainOutcome, evaluate_model, train_dpsgd, train_fedavg, train_fedsgd

app = ClientApp()


class _Settings:
    """Typed read access to the message config with the run config as fallback."""

    def __init__(self, message: Message, context: Context) -> None:
        record = message.content.get(CONFIG_KEY)
        self._primary: Mapping[str, Any] = record if isinstance(record, ConfigRecord) else {}
        self._fallback: Mapping[str, Any] = context.run_config

    def get(self, key: str) -> Any:
        if key in self._primary:
            return self._primary[key]
        if key in self._fallback:
            return self._fallback[key]
        raise KeyError(f"config key '{key}' is neither in the message config nor the run config")

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


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on the local data and reply with the new weights.

    The reply holds the trained ArrayRecord, a MetricRecord with ``num-examples`` and
    ``train-loss``, and (simulation only) an audit ConfigRecord with the partition id,
    the training mode and, when ``audit-ground-truth`` is on, the dataset indices of
    the samples trained on.
    """
    torch.set_num_threads(1)
    settings = _Settings(msg, context)
    data = _load(settings, context)
    model = _model(settings, data, msg.content[ARRAYS_KEY])
    partition_id, _ = _partition(context)
    config = msg.content.get(CONFIG_KEY)
    server_round = int(config.get("server-round", 0)) if isinstance(config, ConfigRecord) else 0
    mode = settings.text("train-mode")
    seed = [settings.integer("client-seed"), partition_id, server_round]
    outcome = _train(mode, settings, model, data, seed)

    audit: dict[str, Any] = {PARTITION_ID_KEY: partition_id, TRAIN_MODE_KEY: mode}
    if settings.flag("audit-ground-truth") and outcome.sample_indices:
        audit[SAMPLE_INDICES_KEY] = outcome.sample_indices
    content = RecordDict(
        {
            ARRAYS_KEY: ArrayRecord(outcome.state_dict),
            METRICS_KEY: MetricRecord(
                {NUM_EXAMPLES_KEY: outcome.num_examples, "train-loss": outcome.loss}
            ),
            AUDIT_KEY: ConfigRecord(audit),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local data."""
    torch.set_num_threads(1)
    settings = _Settings(msg, context)
    data = _load(settings, context)
    model = _model(settings, data, msg.content[ARRAYS_KEY])
    loss, accuracy = evaluate_model(model, data.images, data.labels, data.indices)
    metrics = MetricRecord(
        {NUM_EXAMPLES_KEY: len(data.indices), "eval-loss": loss, "eval-acc": accuracy}
    )
    return Message(content=RecordDict({METRICS_KEY: metrics}), reply_to=msg)
