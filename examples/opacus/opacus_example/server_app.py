"""opacus-example: a Flower ServerApp (Flower's Opacus example), audited with one line."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack.evaluation.scoring import FeatureScorer
from opacus_example.task import Net
from strategies import HonestButCuriousStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the CNN with DP-SGD clients and FedAvg while the honest-but-curious server audits."""
    fraction_train = float(context.run_config["fraction-train"])
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])

    torch.manual_seed(int(context.run_config["seed"]))
    arrays = ArrayRecord(Net().state_dict())

    strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)
    # The audit, one line: fc1's input features are recovered and scored by relative error.
    strategy = HonestButCuriousStrategy.from_context(strategy, context, scorer=FeatureScorer())

    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    strategy.close()
