"""Flower ServerApp: federated training audited by an embedded SPEAR++ attacker.

The ServerApp builds the victim model, the reconstruction store, the attacker and the
:class:`~strategies.audit.HonestButCuriousStrategy` around FedAvg from the run config
(see :mod:`strategies.config` for the keys and defaults), then runs the rounds.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ArrayRecord, Context, UserConfigValue
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fl_attack.evaluation.scoring import ReconstructionScorer

from .audit_end import training_history, write_run_report
from .evaluation import make_test_evaluator
from .factory import build_auditor, build_store
from .honest_but_curious import HonestButCuriousStrategy
from .run_config import AUDIT_KEYS, RunConfigError, client_config, one_line, resolve_run_config
from .run_control import AuditStopped, RunControl, StoppableGrid
from .unaudited import TimedFedAvg, open_unaudited_directory, save_unaudited_history

#: What the log says when ``attack-enabled=false``.
AUDIT_OFF_TEXT = "The audit is off (attack-enabled=false): FedAvg trains without any attack"


def build_strategy(
    config: Mapping[str, UserConfigValue],
    *,
    scorer: ReconstructionScorer | None,
) -> HonestButCuriousStrategy | FedAvg:
    """FedAvg, wrapped by the honest-but-curious auditor when ``attack-enabled`` (else timing its rounds)."""
    min_nodes = int(config["min-nodes"])
    fedavg = (FedAvg if config["attack-enabled"] else TimedFedAvg)(
        fraction_train=float(config["fraction-train"]),
        fraction_evaluate=float(config["fraction-evaluate"]),
        min_train_nodes=min_nodes,
        min_evaluate_nodes=min_nodes,
        min_available_nodes=min_nodes,
    )
    if not config["attack-enabled"]:
        return fedavg
    config = {**config, "attack-local-steps": full_batch_local_steps(config)}
    audit = {key: config[key] for key in AUDIT_KEYS}
    return HonestButCuriousStrategy(fedavg, build_auditor(audit, scorer=scorer, store=build_store(config)))


def full_batch_local_steps(config: Mapping[str, UserConfigValue]) -> int:
    """The step count given to the attack: ``attack-local-steps`` when set (above 0); else, when
    this app's clients take one full-batch step per epoch (FedAvg with ``mini-batch-size`` at least
    ``samples-per-client``) and each update is attacked alone, their ``local-epochs``; else 1.

    The server configured the clients, so it knows their steps.
    """
    told = int(config["attack-local-steps"])
    full_batch = int(config["mini-batch-size"]) >= int(config["samples-per-client"])
    if told > 0:
        return told
    if config["train-mode"] != "fedavg" or not full_batch or int(config["secagg-group-size"]) > 1:
        return 1
    return int(config["local-epochs"])


def run_audit(
    grid: Grid, config: Mapping[str, UserConfigValue], *, control: RunControl | None = None
) -> tuple[Result, HonestButCuriousStrategy | FedAvg]:
    """Build everything from a resolved run config and run the federated rounds.

    Parameters
    ----------
    grid : Grid
        The Grid given to the ServerApp.
    config : Mapping[str, UserConfigValue]
        Output of :func:`strategies.config.resolve_run_config`.
    control : RunControl or None (default: None)
        Given by a command that may stop the run: the store is registered with it, and a
        stop raises :class:`~strategies.run_control.AuditStopped` from the next Grid call
        (the attack workers are closed; no history and no report are written).

    Returns
    -------
    tuple[Result, HonestButCuriousStrategy | FedAvg]
        Flower's training result and the strategy (its ``records`` and ``store`` hold
        the attacks).
    """
    from fl_attack.data.images import load_dataset  # pylint: disable=import-outside-toplevel
    from fl_attack.simulate.victims import build_victim  # pylint: disable=import-outside-toplevel

    # The server knows the task's input shape; in simulation it also holds the data,
    # which is used only to score and render reconstructions, never by the attacker.
    limit = int(config["dataset-limit"])
    data = load_dataset(
        str(config["dataset"]),
        root=str(config["data-root"]) or None,
        split="train",
        limit=limit or None,
    )
    depth = int(config["depth"])
    model = build_victim(
        str(config["architecture"]),
        input_dim=int(data.input_dim),
        width=int(config["width"]),
        num_classes=int(data.num_classes),
        depth=depth or None,
        seed=int(config["model-seed"]),
    )

    evaluate_fn = None
    if config["server-evaluation"]:
        test_limit = int(config["test-limit"])
        test = load_dataset(
            str(config["dataset"]),
            root=str(config["data-root"]) or None,
            split="test",
            limit=test_limit or None,
        )
        evaluate_fn = make_test_evaluator(copy.deepcopy(model), test.images, test.labels)

    scorer = ReconstructionScorer.from_image_data(data)
    strategy = build_strategy(config, scorer=scorer)
    store = strategy.auditor.store if isinstance(strategy, HonestButCuriousStrategy) else None
    if store is not None:
        log(INFO, "Reconstructions are stored in %s", store.directory)
        if control is not None:
            control.register(store)
    unaudited = open_unaudited_directory(config) if isinstance(strategy, TimedFedAvg) else None
    if unaudited is not None:
        log(INFO, "%s; its history goes to %s", AUDIT_OFF_TEXT, unaudited)

    # the wrapper ends the audit after the last round: history, report.html / report.json and
    # the summary in the run's log (strategies.audit_end)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(config["num-server-rounds"]),
        train_config=client_config(config),
        evaluate_config=client_config(config),
        evaluate_fn=evaluate_fn,
    )
    if unaudited is not None and isinstance(strategy, TimedFedAvg):
        history = {**training_history(result), "round_seconds": _round_seconds(strategy.round_seconds)}
        log(INFO, "%s: history written to %s", AUDIT_OFF_TEXT, save_unaudited_history(unaudited, history))
    if isinstance(strategy, HonestButCuriousStrategy):
        failures = strategy.auditor.store_failures
        if failures:
            raise AuditStoreError(
                f"{len(failures)} attack results could not be stored (first: {failures[0]}); "
                "training finished, but the audit is incomplete"
            )
    return result, strategy


#: Kept for callers of the former name.
_write_report = write_run_report
__all__ = ["app", "build_strategy", "create_server_app", "run_audit", "training_history"]


def _round_seconds(seconds: Mapping[int, float]) -> dict[str, float]:
    return {str(key): value for key, value in seconds.items()}


class AuditStoreError(RuntimeError):
    """Some attack results could not be written (a full disk, a file-size limit)."""


def create_server_app(
    overrides: Mapping[str, UserConfigValue] | None = None, *, control: RunControl | None = None
) -> ServerApp:
    """A ServerApp reading ``context.run_config``, with ``overrides`` on top.

    Parameters
    ----------
    overrides : Mapping[str, UserConfigValue] or None (default: None)
        Run-config values taking precedence (useful with
        ``flwr.simulation.run_simulation``, which passes an empty run config).
    control : RunControl or None (default: None)
        Lets the command that runs the app in-process stop it (``fl-attack-audit``): the app
        then returns as soon as its stop event is set, having written no history and no report.

    Returns
    -------
    ServerApp
    """
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            config = resolve_run_config(context.run_config, overrides)
        except RunConfigError as error:  # one line in Flower's log, not a traceback
            raise one_line(error) from None
        log(INFO, "fl-attack ServerApp (working directory %s)", Path(os.getcwd()))
        if control is None:
            run_audit(grid, config)
            return
        try:
            run_audit(StoppableGrid(grid, control.stop), config, control=control)
        except AuditStopped:
            log(WARNING, "The audit was stopped before it finished: no history and no report were written")

    return server_app


app = create_server_app()
