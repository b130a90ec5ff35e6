"""The ClientApp, as in Flower's quickstart-pytorch: nothing of the audit in it."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pytorchexample.task import Net, load_data
from pytorchexample.task import test as test_fn
from pytorchexample.task import train as train_fn

app = ClientApp()


def _loaders(context: Context) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:  # type: ignore[type-arg]
    return load_data(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        int(context.run_config["batch-size"]),
        int(context.run_config["partition-size"]),
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on the local partition for ``local-epochs`` epochs."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = _loaders(context)
    train_loss = train_fn(
        model,
        trainloader,
        int(context.run_config["local-epochs"]),
        float(msg.content["config"]["lr"]),
        torch.device("cpu"),
    )
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})  # type: ignore[arg-type]
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local test split."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = _loaders(context)
    eval_loss, eval_acc = test_fn(model, testloader, torch.device("cpu"))
    metrics = MetricRecord(
        {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(testloader.dataset)}  # type: ignore[arg-type]
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
