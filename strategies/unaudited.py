"""The run a user compares an audit against: ``attack-enabled=false``.

FedAvg trains exactly as in an audited run, timing its training rounds the same way, and the
run directory gets ``run_config.json`` and ``history.json`` (with ``round_seconds``) but no
attack table, no reconstructions and no report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, UserConfigValue
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fl_attack.results.files import atomic_write_json, claim_fresh_directory, jsonable, make_private_directory
from fl_attack.results.rundir import RUN_CONFIG_FILE, open_run_directory, timestamp
from fl_attack.results.store import HISTORY_FILE


class TimedFedAvg(FedAvg):
    """FedAvg keeping each training round's seconds, from configuring it to its aggregate.

    The same span :class:`~strategies.honest_but_curious.HonestButCuriousStrategy` reports, so
    that an audited run and this one compare round by round.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.round_seconds: dict[int, float] = {}
        self._round_started: dict[int, float] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start the round's clock, then configure as FedAvg."""
        self._round_started[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate as FedAvg, then stop the round's clock."""
        aggregated = super().aggregate_train(server_round, replies)
        if server_round in self._round_started:
            self.round_seconds[server_round] = time.perf_counter() - self._round_started.pop(server_round)
        return aggregated


def open_unaudited_directory(config: Mapping[str, UserConfigValue]) -> Path:
    """Open the run directory (``output-dir``, else ``outputs/<timestamp>``) and write ``run_config.json``.

    The directory rules are an audited run's (:func:`fl_attack.results.rundir.open_run_directory`).
    """
    output_dir = str(config["output-dir"])
    if output_dir:
        directory, _ = open_run_directory(output_dir, resume=False)
    else:
        directory = claim_fresh_directory(make_private_directory(Path("outputs").resolve()), timestamp())
    atomic_write_json(directory / RUN_CONFIG_FILE, jsonable(dict(config)))
    return directory


def save_unaudited_history(directory: Path, history: Mapping[str, Any]) -> Path:
    """Write ``history.json`` into ``directory``."""
    return atomic_write_json(directory / HISTORY_FILE, jsonable(dict(history)))
