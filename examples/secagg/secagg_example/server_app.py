"""secagg-example: a legacy ServerApp running SecAgg+, audited with one line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import Context, Scalar, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from fl_attack.evaluation.scoring import ReconstructionScorer
from secagg_example.task import app_config, get_weights, load_data, make_model
from strategies.secagg import audit_secagg


def fit_config(server_round: int) -> dict[str, Scalar]:
    """Tell the clients the round (each draws its batch from it)."""
    return {"server-round": server_round}


def run(grid: Grid, context: Context) -> None:
    """Train with FedAvg under SecAgg+ while the honest-but-curious server attacks every aggregate."""
    config = context.run_config
    data = load_data(str(config["dataset"]))
    model = make_model(
        input_dim=data.input_dim,
        num_classes=data.num_classes,
        width=int(config["width"]),
        seed=int(config["seed"]),
    )
    num_clients = int(config["num-clients"])

    # The audit is one line: audit_secagg(...) around the strategy. The scorer looks up the
    # batches that clients report (dataset indices); without it the audit still attacks and judges.
    strategy = audit_secagg(
        FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=num_clients,
            min_available_clients=num_clients,
            initial_parameters=ndarrays_to_parameters(get_weights(model)),
            on_fit_config_fn=fit_config,
        ),
        context,
        array_names=list(model.state_dict()),
        scorer=ReconstructionScorer.from_image_data(data),
    )

    legacy_context = LegacyContext(
        context=context,
        config=ServerConfig(num_rounds=int(config["num-server-rounds"])),
        strategy=strategy,
    )
    fit_workflow = SecAggPlusWorkflow(
        num_shares=int(config["num-shares"]),
        reconstruction_threshold=int(config["reconstruction-threshold"]),
        max_weight=float(config["max-weight"]),
        clipping_range=float(config["clipping-range"]),
        quantization_range=int(config["quantization-range"]),
    )
    try:
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy_context)
    finally:
        strategy.close()


def create_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """The ServerApp; ``overrides`` complete the run config (``run_simulation`` passes an empty one)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = app_config(context.run_config, overrides)
        run(grid, context)

    return server_app


app = create_server_app()
