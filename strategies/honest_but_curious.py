"""Honest-but-curious server for any Flower strategy: aggregate normally, audit every update.

The wrapper follows Flower's strategy wrappers (e.g. the differential-privacy ones): it holds
an inner strategy and delegates every decision to it. It only observes: it hands the global
arrays it sends and the replies it receives to a framework-free
:class:`fl_attack.audit.Auditor`, removes the audit-only records, and lets the inner strategy
aggregate exactly what it would have aggregated without the audit.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, UserConfigValue
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fl_attack.audit import Auditor, ClientUpdate
from fl_attack.results.store import AttackRecord

from .audit_end import finish_audit, training_history
from .log_forwarding import forward_audit_log
from .replies import sent_train_config, strip_audit_records, to_client_update, training_replies
from .run_config import one_line


class HonestButCuriousStrategy(Strategy):
    """Strategy wrapper that audits how much each client update leaks.

    Training is exactly that of the inner strategy: the replies it aggregates are the
    clients' replies without the audit-only records. Every failure of the attack is
    recorded for that (round, client) and training goes on.

    Parameters
    ----------
    strategy : Strategy
        The strategy that actually trains (FedAvg, FedProx, FedAdam, a DP wrapper, ...).
    auditor : Auditor
        Attacks, judges, scores and stores the updates (see :class:`fl_attack.audit.Auditor`).
    """

    def __init__(self, strategy: Strategy, auditor: Auditor) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"HonestButCuriousStrategy wraps a Message-API strategy (flwr.serverapp.strategy.Strategy), "
                f"got {type(strategy).__name__}; for a legacy flwr.server.strategy one (e.g. with SecAgg+), "
                "use strategies.secagg"
            )
        self.strategy = strategy
        self.auditor = auditor
        #: Wall seconds of every round, from configure_train to the end of aggregate_train.
        self.round_seconds: dict[int, float] = {}
        self._round_started: dict[int, float] = {}
        #: Per round, the train config sent to each node (its keys the audit reads), until its replies come.
        self._sent_configs: dict[int, dict[int, dict[str, object]]] = {}
        #: The report written when the audit ended (None before, or when none could be written).
        self.report: Path | None = None
        self._history: dict[str, Any] | None = None
        self._completed = True
        self._closed = False
        self._records_reported = 0
        forward_audit_log()
        # a strategy driven without start() and never closed still gets its report at exit
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def from_context(
        cls, strategy: Strategy, context: Context, **overrides: UserConfigValue | Any
    ) -> HonestButCuriousStrategy:
        """Wrap ``strategy`` with an auditor configured from the run config (one line in a ServerApp).

        Every audit key (``attack-*``, ``output-dir``, ``secagg-group-size``; see
        :data:`strategies.run_config.SETTINGS`) is read from ``context.run_config``; missing keys
        take their defaults, and a misspelled audit key is an error naming the closest key.
        ``overrides`` use the same names with underscores (``output_dir=...``,
        ``attack_time_budget=...``) and win. ``scorer=`` and ``attacker=`` may also be given
        as objects.

        Raises
        ------
        TypeError
            If ``strategy`` is not a Message-API strategy.
        strategies.run_config.AuditConfigError
            On an unknown audit key (naming the closest valid one) or a bad value: a
            :class:`~strategies.run_config.RunConfigError` that Flower's log shows as one line.
        """
        from .factory import build_auditor

        objects: dict[str, Any] = {
            key: overrides.pop(key) for key in ("scorer", "attacker") if key in overrides
        }
        if not isinstance(strategy, Strategy):
            cls(strategy, None)  # type: ignore[arg-type,unused-ignore]  # raises the TypeError
        settings = {key.replace("_", "-"): value for key, value in overrides.items()}
        if "scorer" not in objects:
            from fl_attack.evaluation.scoring_features import FeatureScorer

            # the server of an arbitrary app knows no dataset: score the layer's inputs as
            # vectors (relative error) against what opted-in clients send
            objects["scorer"] = FeatureScorer()
        try:
            auditor = build_auditor(context.run_config, settings, **objects)
        except ValueError as error:  # a wrong key or value (RunConfigError, an unknown attack): one line
            raise one_line(error) from None
        return cls(strategy, auditor)

    @property
    def records(self) -> list[AttackRecord]:
        """Every attack so far (without arrays when a store keeps them)."""
        return self.auditor.records

    def __repr__(self) -> str:
        """Compute a string representation of the strategy."""
        return f"HonestButCuriousStrategy({self.strategy!r})"

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        auditor = self.auditor
        attack, sampling = auditor.attack, auditor.sampling
        log(INFO, "\t├──> Honest-but-curious audit:")
        log(INFO, "\t│\t├── Attacker: %s", type(auditor.attacker).__name__)
        log(INFO, "\t│\t├── Attacked layer: %s", attack.weight_key or "first linear layer")
        log(
            INFO,
            "\t│\t├── Attacked updates: fraction %.2f, partitions %s",
            sampling.attack_fraction,
            "all" if sampling.attack_partitions is None else sorted(sampling.attack_partitions),
        )
        log(INFO, "\t│\t├── Time budget / timeout: %s s / %s s", attack.time_budget, attack.timeout)
        if auditor.secagg.group_size > 1:
            log(INFO, "\t│\t├── Secure aggregation: sums of %d clients", auditor.secagg.group_size)
        log(INFO, "\t│\t└── Store: %s", "memory only" if auditor.store is None else auditor.store.directory)
        self.strategy.summary()

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global layer sent in this round, then let the inner strategy configure.

        Raises
        ------
        fl_attack.audit.LayerNotFoundError
            In the first round, if the configured layer is not in ``arrays`` (a configuration
            error, reported before any client trains).
        """
        self._round_started[server_round] = time.perf_counter()
        self.auditor.start_round(server_round, {key: value.numpy() for key, value in arrays.items()})
        instructions = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._sent_configs[server_round] = self._train_configs(instructions)
        return instructions

    @staticmethod
    def _train_configs(instructions: list[Message]) -> dict[int, dict[str, object]]:
        """The train-config keys sent to each node (never raises: the audit only observes)."""
        sent: dict[int, dict[str, object]] = {}
        for instruction in instructions:
            try:
                sent[instruction.metadata.dst_node_id] = sent_train_config(instruction)
            except Exception as error:  # an instruction the audit cannot read is sent unchanged
                log(WARNING, "The audit cannot read a train instruction: %s: %s", type(error).__name__, error)
        return sent

    def aggregate_train(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Audit the replies, then aggregate them with the inner strategy."""
        replies_list = list(replies)
        sent_configs = self._sent_configs.pop(server_round, {})
        try:
            updates: list[ClientUpdate] = [
                to_client_update(reply, sent_configs.get(reply.metadata.src_node_id))
                for reply in training_replies(replies_list)
            ]
            self.auditor.audit_round(server_round, updates)
            self.auditor.record_vanished(
                server_round,
                [
                    (
                        reply.metadata.src_node_id,
                        f"the client's training reply is an error (code {reply.error.code}): {reply.error.reason}",
                    )
                    for reply in replies_list
                    if reply.has_error()
                ],
            )
        except Exception as error:  # the audit never stops training
            log(WARNING, "Audit of round %s failed: %s: %s", server_round, type(error).__name__, error)
        strip_audit_records(replies_list)
        aggregated = self.strategy.aggregate_train(server_round, replies_list)
        if server_round in self._round_started:
            self.round_seconds[server_round] = time.perf_counter() - self._round_started.pop(server_round)
        return aggregated

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the rounds like any Flower strategy, then end the audit (:meth:`close`).

        After the last round the queued attacks are awaited, ``history.json``, ``report.html``
        and ``report.json`` are written and the summary is printed to the run's log. When the
        rounds raise (the run was stopped), the workers are stopped and no report is written.
        """
        try:
            result = super().start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=evaluate_fn,
            )
        except BaseException:
            self._completed = False
            self.close()
            raise
        self._history = {
            **training_history(result),
            "round_seconds": {str(key): value for key, value in self.round_seconds.items()},
        }
        self.close()
        return result

    def close(self) -> Path | None:
        """End the audit: wait for every queued attack, stop the workers, write the report, print the summary.

        :meth:`start` calls it after the last round. Calling it again waits for attacks queued
        since (the auditor stays usable), and writes the report and summary again only if new
        attacks were recorded. A strategy driven round by round without :meth:`start` should call
        it; if it is never called, it runs when the Python process exits (too late for
        ``flwr run``'s log, in time for the report).

        Returns
        -------
        Path or None
            The ``report.html`` written (None: memory-only audit, stopped run, or a report that
            could not be written, which the summary says).
        """
        self.auditor.close()
        if self._closed and len(self.auditor.records) == self._records_reported:
            return self.report
        self._closed = True
        self.report = finish_audit(self.auditor, history=self._history, completed=self._completed)
        self._records_reported = len(self.auditor.records)
        return self.report

    # ---------------------------------------------------------------- evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of federated evaluation."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> MetricRecord | None:
        """Aggregate MetricRecords in the received Messages."""
        return self.strategy.aggregate_evaluate(server_round, replies)


def _close_at_exit(reference: weakref.ReferenceType[HonestButCuriousStrategy]) -> None:
    strategy = reference()
    if strategy is None:
        return
    reported = strategy._closed and len(strategy.records) == strategy._records_reported  # pylint: disable=protected-access
    if not reported:
        try:
            strategy.close()
        except Exception as error:  # pylint: disable=broad-exception-caught  # never fail an exiting process
            log(WARNING, "The audit could not be closed at exit: %s: %s", type(error).__name__, error)
