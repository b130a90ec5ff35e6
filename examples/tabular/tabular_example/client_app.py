"""tabular-example: a Flower ClientApp (Flower's fl-tabular), plus one optional audit line."""

from __future__ import annotations

from itertools import islice
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from clients.ground_truth import attach_ground_truth
from tabular_example.task import IncomeClassifier, load_data
from tabular_example.task import evaluate as evaluate_fn
from tabular_example.task import train as train_fn

app = ClientApp()


def _loaders(context: Context, server_round: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    partition_id = int(context.node_config["partition-id"])
    return load_data(
        partition_id,
        int(context.node_config["num-partitions"]),
        batch_size=int(context.run_config["batch-size"]),
        source=str(context.run_config["data-source"]),
        data_root=str(context.run_config["data-root"]),
        seed=int(context.run_config["seed"]) + 1000 * server_round + partition_id,
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model for `local-steps` steps of the configured optimizer."""
    torch.set_num_threads(1)
    model = IncomeClassifier()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    trainloader, _ = _loaders(context, cast(int, msg.content.config_records["config"]["server-round"]))
    batches = list(islice(trainloader, int(context.run_config["local-steps"])))
    train_loss = train_fn(
        model, batches, optimizer=str(context.run_config["optimizer"]), lr=float(context.run_config["lr"])
    )

    content = RecordDict({"arrays": ArrayRecord(model.state_dict())})
    content["metrics"] = MetricRecord(
        {"train_loss": train_loss, "num-examples": sum(len(targets) for _, targets in batches)}
    )
    # Optional, for scoring the audit: the rows trained on (layer1 is the model's first layer).
    attach_ground_truth(content, context, inputs=torch.cat([rows for rows, _ in batches]), simulation=True)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local test rows."""
    torch.set_num_threads(1)
    model = IncomeClassifier()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    _, testloader = _loaders(context, 0)
    loss, accuracy, count = evaluate_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": count})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
