"""The ClientApp, as in Flower's fl-tabular: nothing of the audit in it."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor
from torch.utils.data import DataLoader

from fltabular.task import IncomeClassifier, evaluate, load_data, train

app = ClientApp()


def _loaders(context: Context) -> tuple[DataLoader[tuple[Tensor, ...]], DataLoader[tuple[Tensor, ...]]]:
    return load_data(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        int(context.run_config["partition-size"]),
    )


@app.train()
def train_model(msg: Message, context: Context) -> Message:
    """One local epoch; like fl-tabular, ``num-examples`` is the number of mini-batches."""
    train_loader, _ = _loaders(context)
    model = IncomeClassifier()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    train(model, train_loader)
    metrics = MetricRecord({"num-examples": len(train_loader)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    """Loss and accuracy on the local test split."""
    _, test_loader = _loaders(context)
    model = IncomeClassifier()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss, accuracy = evaluate(model, test_loader)
    metrics = MetricRecord({"loss": loss, "accuracy": accuracy, "num-examples": len(test_loader)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
