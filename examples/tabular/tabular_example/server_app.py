"""tabular-example: a Flower ServerApp (Flower's fl-tabular), audited with one line."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl_attack.evaluation.scoring import TabularScorer
from strategies import HonestButCuriousStrategy
from tabular_example.task import IncomeClassifier, load_table, table_schema

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the income classifier with FedAvg while the honest-but-curious server audits every update."""
    fraction_train = float(context.run_config["fraction-train"])
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])

    torch.manual_seed(int(context.run_config["seed"]))
    arrays = ArrayRecord(IncomeClassifier().state_dict())
    # The table's encoding (public metadata: categories, means, standard deviations) for scoring.
    raw, _ = load_table(str(context.run_config["data-source"]), str(context.run_config["data-root"]))

    strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)
    # The audit, one line; TabularScorer scores categories exactly, continuous values within TabLeak's tolerance.
    strategy = HonestButCuriousStrategy.from_context(
        strategy, context, scorer=TabularScorer(table_schema(raw))
    )

    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    strategy.close()
