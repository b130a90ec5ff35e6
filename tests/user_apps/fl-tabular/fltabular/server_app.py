"""The ServerApp, as in Flower's fl-tabular, with the audit's one line around FedAvg."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fltabular.task import IncomeClassifier
from strategies import HonestButCuriousStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over ``num-server-rounds`` rounds on every client."""
    strategy = HonestButCuriousStrategy.from_context(FedAvg(), context)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(IncomeClassifier().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
