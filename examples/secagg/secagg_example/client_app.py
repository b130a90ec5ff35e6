"""secagg-example: a legacy NumPyClient behind Flower's ``secaggplus_mod``, plus one optional audit line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.client import Client, ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context, NDArrays, Scalar

from clients.secagg import audit_metrics
from secagg_example.task import (
    app_config,
    draw_batch,
    fedsgd_step,
    get_weights,
    load_data,
    make_model,
    partition,
    set_weights,
)


class DigitsClient(NumPyClient):
    """Trains the received model for one FedSGD step on a batch of its images."""

    def __init__(self, context: Context, config: Mapping[str, Any]) -> None:
        self.context = context
        self.config = config
        self.partition_id = int(context.node_config["partition-id"])
        self.data = load_data(str(config["dataset"]))
        self.indices = partition(
            len(self.data),
            partition_id=self.partition_id,
            num_partitions=int(context.node_config["num-partitions"]),
            size=int(config["samples-per-client"]),
            seed=int(config["seed"]),
        )
        self.model = make_model(
            input_dim=self.data.input_dim,
            num_classes=self.data.num_classes,
            width=int(config["width"]),
            seed=int(config["seed"]),
        )

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """One SGD step on this round's batch; the reply is masked and summed by SecAgg+."""
        torch.set_num_threads(1)
        run_config = self.config
        set_weights(self.model, parameters)
        server_round = int(config["server-round"])
        batch = draw_batch(
            self.indices,
            batch_size=int(run_config["batch-size"]),
            seed=int(run_config["seed"]) + 1000 * server_round + self.partition_id,
        )
        inputs = self.data.images[torch.as_tensor(batch)]
        labels = self.data.labels[torch.as_tensor(batch)]
        loss = fedsgd_step(self.model, inputs, labels, lr=float(run_config["lr"]))
        metrics: dict[str, Scalar] = {"train-loss": loss}
        # Optional, for scoring the audit: the batch's dataset indices. SecAgg+ masks only the
        # parameters, so these metrics reach the server in the clear (simulation only here).
        metrics.update(
            audit_metrics(
                self.context,
                sample_indices=batch.tolist(),
                partition_id=self.partition_id,
                train_mode="fedsgd",
                simulation=True,
            )
        )
        return get_weights(self.model), len(batch), metrics

    def evaluate(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, int, dict[str, Scalar]]:
        """Loss and accuracy of the received model on this client's samples."""
        torch.set_num_threads(1)
        set_weights(self.model, parameters)
        selected = torch.as_tensor(np.asarray(self.indices))
        with torch.no_grad():
            logits = self.model(self.data.images[selected])
            labels = self.data.labels[selected]
            loss = float(torch.nn.functional.cross_entropy(logits, labels))
            accuracy = float((logits.argmax(dim=1) == labels).double().mean())
        return loss, len(self.indices), {"accuracy": accuracy}


def create_client_app(overrides: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp, with Flower's SecAgg+ mod: every fit reply is quantized, masked and summed.

    ``overrides`` complete the run config (``run_simulation`` passes an empty one).
    """

    def client_fn(context: Context) -> Client:
        """Build the client of one SuperNode (its partition comes from its node config)."""
        return DigitsClient(context, app_config(context.run_config, overrides)).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


app = create_client_app()
