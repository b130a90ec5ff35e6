"""The ServerApp, as in Flower's quickstart-pytorch, with the audit's one line around FedAvg."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from pytorchexample.task import Net
from strategies import HonestButCuriousStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over ``num-server-rounds`` rounds, the learning rate sent in each train message."""
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])
    lr = float(context.run_config["learning-rate"])
    strategy = HonestButCuriousStrategy.from_context(FedAvg(fraction_evaluate=fraction_evaluate), context)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
    )
