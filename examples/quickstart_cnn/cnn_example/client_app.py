"""cnn-example: a Flower ClientApp (Flower's quickstart-pytorch), plus one optional audit line."""

from __future__ import annotations

from typing import Any, cast

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from clients.ground_truth import attach_ground_truth
from cnn_example.task import Net, load_data
from cnn_example.task import test as test_fn
from cnn_example.task import train as train_fn

app = ClientApp()


def _loaders(context: Context, server_round: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    partition_id = int(context.node_config["partition-id"])
    return load_data(
        partition_id,
        int(context.node_config["num-partitions"]),
        batch_size=int(context.run_config["batch-size"]),
        dataset=str(context.run_config["dataset"]),
        data_root=str(context.run_config["data-root"]),
        seed=int(context.run_config["seed"]) + 1000 * server_round + partition_id,
        samples=int(context.run_config["samples-per-client"]),
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model as Flower's quickstart does: `local-epochs` of mini-batches."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    server_round = cast(int, msg.content.config_records["config"]["server-round"])
    trainloader, _ = _loaders(context, server_round)

    fc1_inputs: list[torch.Tensor] = []
    train_loss = train_fn(
        model,
        trainloader,
        epochs=int(context.run_config["local-epochs"]),
        lr=float(context.run_config["lr"]),
        max_steps=int(context.run_config["local-steps"]),
        fc1_inputs=fc1_inputs,
    )

    content = RecordDict()
    # Optional, for scoring the audit: fc1's true inputs as fc1 saw them at each sample's own
    # step (the convolutions move between steps); model=None sends them as they are.
    attach_ground_truth(content, context, inputs=torch.cat(fc1_inputs), simulation=True)
    content["arrays"] = ArrayRecord(model.state_dict())
    content["metrics"] = MetricRecord(
        # len(trainset), as Flower's clients reply; fewer where `local-steps` stops inside the first epoch
        {"train_loss": train_loss, "num-examples": sum(len(rows) for rows in fc1_inputs)}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local test data."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    _, testloader = _loaders(context, 0)
    loss, accuracy, count = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": count})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
