"""opacus-example: a Flower ClientApp training with DP-SGD (Opacus), plus one optional audit line."""

from __future__ import annotations

from typing import cast

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.ground_truth import attach_ground_truth
from opacus_example.task import load_data, model_from, noise_multiplier, train_private
from opacus_example.task import test as test_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """`local-steps` DP-SGD steps on Poisson-sampled batches of the local data."""
    torch.set_num_threads(1)
    partition_id = int(context.node_config["partition-id"])
    server_round = cast(int, msg.content.config_records["config"]["server-round"])
    model = model_from(msg.content.array_records["arrays"])
    trainloader, _ = load_data(
        partition_id,
        int(context.node_config["num-partitions"]),
        batch_size=int(context.run_config["batch-size"]),
        dataset=str(context.run_config["dataset"]),
        data_root=str(context.run_config["data-root"]),
    )
    train_loss, batches = train_private(
        model,
        trainloader,
        steps=int(context.run_config["local-steps"]),
        lr=float(context.run_config["lr"]),
        noise_multiplier=noise_multiplier(str(context.run_config["noise-multipliers"]), partition_id),
        max_grad_norm=float(context.run_config["max-grad-norm"]),
        seed=int(context.run_config["seed"]) + 1000 * server_round + partition_id,
    )

    content = RecordDict({"arrays": ArrayRecord(model.state_dict())})
    content["metrics"] = MetricRecord(
        {"train_loss": train_loss, "num-examples": sum(len(images) for images in batches)}
    )
    # Optional, for scoring the audit: fc1's true inputs, computed with the received weights.
    attach_ground_truth(
        content,
        context,
        inputs=torch.cat(batches),
        model=model_from(msg.content.array_records["arrays"]),
        simulation=True,
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local test data."""
    torch.set_num_threads(1)
    model = model_from(msg.content.array_records["arrays"])
    _, testloader = load_data(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        batch_size=int(context.run_config["batch-size"]),
        dataset=str(context.run_config["dataset"]),
        data_root=str(context.run_config["data-root"]),
    )
    loss, accuracy, count = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": count})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
