"""How every audited run ends: workers stopped, history and report written, a summary printed.

The summary goes through Flower's own logger, whose console handler writes to the process's
stdout: ``flwr run``'s run log (simulation and Deployment Engine alike) mirrors stdout, while
INFO lines of the ``fl_attack`` logger reach no handler there.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fl_attack.audit import Auditor
from fl_attack.results.run_summary import run_summary_lines
from fl_attack.results.store import ReconstructionStore


def training_history(result: Result) -> dict[str, Any]:
    """Per-round metrics of a finished run, as stored in ``history.json``.

    ``train`` and ``evaluate`` are the clients' aggregated metrics, ``test`` the
    centralized test-split metrics (round 0 is the initial model); ``final`` repeats the
    last round's test metrics, the utility side of a privacy-utility trade-off.
    """
    sources = {
        "train": result.train_metrics_clientapp,
        "evaluate": result.evaluate_metrics_clientapp,
        "test": result.evaluate_metrics_serverapp,
    }
    rounds = sorted({int(key) for source in sources.values() for key in source})
    history = [
        {
            "round": server_round,
            **{
                name: dict(source[server_round]) if server_round in source else None
                for name, source in sources.items()
            },
        }
        for server_round in rounds
    ]
    tested = [entry for entry in history if entry["test"] is not None]
    return {"rounds": history, "final_test": tested[-1]["test"] if tested else None}


def write_run_report(store: ReconstructionStore) -> Path | None:
    """Write ``<run>/report.html`` and ``report.json``; a failure is logged and never ends the run;
    a closed store (a stopped run) gets none."""
    if store.closed:  # the run was stopped: its results are incomplete
        return None
    try:
        from fl_attack.results.report import write_report  # pylint: disable=import-outside-toplevel

        return write_report(store.directory)
    except Exception as error:  # pylint: disable=broad-exception-caught
        log(WARNING, "Could not write the audit report: %s: %s", type(error).__name__, error)
        return None


def finish_audit(
    auditor: Auditor, *, history: Mapping[str, Any] | None, completed: bool = True
) -> Path | None:
    """End an audit: wait for the queued attacks, store the history, write the report, print the summary.

    Parameters
    ----------
    auditor : Auditor
        The run's auditor (closed here).
    history : Mapping[str, Any] or None
        ``history.json``'s content (the run's metrics), when the run's result is known.
    completed : bool (default: True)
        False when the run ended by an exception: no history and no report are written.

    Returns
    -------
    Path or None
        The ``report.html`` written.
    """
    auditor.close()
    store = auditor.store
    report = None
    problems: list[str] = []
    if store is not None and completed and not store.closed:
        if history is not None:
            try:
                store.save_history(history)
            except Exception as error:  # pylint: disable=broad-exception-caught
                problems.append(f"history.json was not written: {type(error).__name__}: {error}")
        report = write_run_report(store)
        if report is None:
            problems.append("report.html could not be written (see the warning above)")
    elif store is not None:
        problems.append("the run did not finish: no report was written")
    if auditor.store_failures:
        problems.append(
            f"{len(auditor.store_failures)} attack result(s) could not be stored "
            f"(first: {auditor.store_failures[0]}): the audit is incomplete"
        )
    for line in run_summary_lines(
        auditor.records,
        directory=None if store is None else store.directory,
        report=report,
        problems=problems,
    ):
        log(WARNING if problems and line.strip() in problems else INFO, "%s", line)
    return report
