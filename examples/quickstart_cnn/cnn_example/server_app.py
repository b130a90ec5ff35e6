"""cnn-example: a Flower ServerApp (Flower's quickstart-pytorch), audited with one line."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from cnn_example.task import Net
from fl_attack.evaluation.scoring import FeatureScorer
from strategies import HonestButCuriousStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the CNN with FedAvg while the honest-but-curious server audits every update."""
    fraction_train = float(context.run_config["fraction-train"])
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])

    torch.manual_seed(int(context.run_config["seed"]))
    arrays = ArrayRecord(Net().state_dict())

    strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)
    # The audit, one line: fc1 follows the convolutions, so the attack recovers fc1's input
    # features; FeatureScorer scores them by relative error where clients send ground truth.
    strategy = HonestButCuriousStrategy.from_context(strategy, context, scorer=FeatureScorer())

    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    strategy.close()
