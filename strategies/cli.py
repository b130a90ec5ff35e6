"""``fl-attack-audit``: run the default audit as an in-process Flower simulation.

The same ServerApp and ClientApp as ``flwr run .``, started with
``flwr.simulation.run_simulation`` so that one command installs nothing at run time, leaves
no SuperLink behind, and exits non-zero when the audit did not produce its results.
Flower deprecates ``run_simulation`` in favour of ``flwr run`` and offers no in-process
replacement yet: its deprecation warning is shown as Flower prints it.
:func:`run_audit_simulation` is that simulation as a function, shared with the
defense sweep (``python -m experiments.defense_sweep``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib
from flwr.app import UserConfigValue

from .process_guard import (
    SIGNAL_EXIT_BASE,
    adopt_orphans,
    check_file_size_limit,
    file_size_hint,
    join_threads,
    lingering_threads,
    run_processes,
    signals_ignored,
    stop_signals,
    stopping_signal,
    terminate_until_quiet,
)
from .run_control import RunControl
from .stuck_stop import stuck_stop_watchdog

#: The ClientApp factory of this project's app, named like pyproject's components (the server
#: side never imports the client package).
CLIENT_APP_FACTORY = "clients.client_app:create_client_app"

#: Exit codes of ``fl-attack-audit`` (a signal ends it with 128 + the signal's number).
EXIT_OK, EXIT_FAILED, EXIT_SETTINGS, EXIT_GATE = 0, 1, 2, 3
#: Ray's crash-signal handler (absl) answers SIGTERM by dumping a stack and aborting, which
#: would leave Ray's and the attack workers' processes behind: the command disables it, so
#: that SIGTERM reaches Python and stops the run (see :func:`stop_run`).
RAY_SIGNAL_HANDLER_SWITCH = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
#: Seconds a stopped run waits for a record being written, then for its threads (the ServerApp
#: stops at once; attack threads may drain their queue, writing nothing into the closed store),
#: then for its child processes after SIGTERM before SIGKILL (multiprocessing's resource
#: tracker ignores SIGTERM), and for processes started meanwhile before the command leaves.
STORE_GRACE, THREAD_GRACE, PROCESS_GRACE, LAST_PROCESS_GRACE = 5.0, 1.0, 1.0, 0.5
#: Processes are swept until none appeared for QUIET seconds (LAST_QUIET just before the
#: command leaves), SWEEP_LIMIT seconds at most.
QUIET, LAST_QUIET, SWEEP_LIMIT = 0.5, 0.2, 5.0
#: Seconds a thread that did not win the stop waits for the one that did to end the process.
STOP_OWNER_WAIT = 60.0


def _load_attribute(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def check_data(config: Mapping[str, UserConfigValue]) -> None:
    """Fail fast, before Ray starts, when the run's dataset cannot be loaded.

    Raises
    ------
    ValueError
        With one line naming the dataset and how to get it.
    """
    from fl_attack.data.images import check_dataset

    name, root = str(config["dataset"]), str(config["data-root"]) or None
    try:
        check_dataset(name, root=root)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(str(error).splitlines()[0]) from None


class AuditSimulationError(RuntimeError):
    """The simulation ended without writing the run's results table (``attacks.csv``), or, with the
    audit off, its ``history.json``."""


def parse_overrides(text: str) -> dict[str, UserConfigValue]:
    """Parse ``"key=value key2='text'"`` like ``flwr run -c``: values are TOML literals."""
    overrides: dict[str, UserConfigValue] = {}
    for item in shlex.split(text, posix=False):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"run-config override {item!r} is not of the form key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip("'\"")
        overrides[key] = value
    return overrides


def run_audit_simulation(
    overrides: Mapping[str, UserConfigValue],
    *,
    num_supernodes: int = 3,
    cpus: int = 2,
    control: RunControl | None = None,
) -> Path:
    """Run the audited federation in-process and return its run directory.

    When the simulation does not end normally (Ray fails to start, a signal arrives, the
    ServerApp crashes), the run is stopped before the error is raised again: the stores are
    closed (a record being written is completed), the ServerApp thread is told to stop, and
    the child processes the simulation started (Ray, attack workers) are terminated.

    Parameters
    ----------
    overrides : Mapping[str, UserConfigValue]
        Run-config values on top of :data:`strategies.config.DEFAULT_RUN_CONFIG`.
        ``min-nodes`` defaults to ``min(num_supernodes, 2)`` and ``output-dir`` to
        ``outputs/audit-<timestamp>``; the directory is made absolute.
    num_supernodes : int (default: 3)
        Simulated clients (partitions ``0 .. num_supernodes - 1``).
    cpus : int (default: 2)
        CPUs Ray may use; every client takes one, so at most ``cpus`` train at once.
    control : RunControl or None (default: None)
        Stops the run from outside (a new one when None).

    Returns
    -------
    Path
        The run directory, holding ``attacks.csv``, ``history.json`` and the
        reconstructions (see :mod:`fl_attack.results.store`); with ``attack-enabled=false``
        only ``run_config.json`` and ``history.json``.

    Raises
    ------
    ValueError
        On an invalid run config or resource count, or a file-size limit too small for Ray,
        before the simulation starts.
    AuditSimulationError
        When the simulation ended without writing ``attacks.csv`` (``history.json`` with
        ``attack-enabled=false``).
    Exception
        Whatever the ServerApp raised (Flower re-raises it).
    """
    os.environ.setdefault(RAY_SIGNAL_HANDLER_SWITCH, "1")  # read when Ray is imported, below
    from flwr.simulation import run_simulation  # pylint: disable=import-outside-toplevel

    from fl_attack.results.rundir import is_run_directory
    from fl_attack.results.store import HISTORY_FILE, TABLE_FILE
    from strategies.run_config import resolve_run_config
    from strategies.server_app import create_server_app

    if num_supernodes < 1:
        raise ValueError(f"num_supernodes must be positive, got {num_supernodes}")
    if cpus < 1:
        raise ValueError(f"cpus must be positive, got {cpus}")
    settings: dict[str, UserConfigValue] = dict(overrides)
    settings.setdefault("min-nodes", min(num_supernodes, 2))
    if not settings.get("output-dir"):
        settings["output-dir"] = str(Path("outputs") / time.strftime("audit-%Y%m%d-%H%M%S"))
    output = Path(str(settings["output-dir"])).resolve()
    if is_run_directory(output):
        raise ValueError(f"{output} already holds an audit run; it is never reset: choose another output-dir")
    if output.exists():
        # an existing directory keeps its mode and contents: the run gets a new one inside it
        output = output / time.strftime("audit-%Y%m%d-%H%M%S")
    settings["output-dir"] = str(output)
    resolved = resolve_run_config({}, settings)  # fail here, not inside the ServerApp thread
    check_data(resolved)
    check_file_size_limit()
    control = RunControl() if control is None else control
    create_client_app = _load_attribute(CLIENT_APP_FACTORY)
    spared = run_processes(spared=set())  # processes that are not the simulation's
    try:
        _run(
            run_simulation,
            create_server_app(settings, control=control),
            create_client_app(resolved, ground_truth=True),
            num_supernodes,
            cpus,
        )
    except BaseException:
        if control.claim_stop():
            stop_run(control, spared=spared)
        else:  # the stop watchdog serves it and ends the process
            threading.Event().wait(STOP_OWNER_WAIT)
        raise
    if resolved["attack-enabled"] and not (output / TABLE_FILE).exists():
        raise AuditSimulationError(f"the run wrote no results table at {output / TABLE_FILE}")
    if not (output / HISTORY_FILE).exists() and not resolved["attack-enabled"]:
        raise AuditSimulationError(f"the run (audit off) wrote no history at {output / HISTORY_FILE}")
    return output


def stop_run(control: RunControl, *, spared: set[int]) -> None:
    """Stop a simulation that did not end normally; further stop signals are ignored meanwhile.

    Closes the stores (waiting up to :data:`STORE_GRACE` for a record being written), sets
    the stop event and waits up to :data:`THREAD_GRACE` for the ServerApp thread, then
    terminates every process of the run not in ``spared`` (SIGKILL after :data:`PROCESS_GRACE`)
    until none appeared for :data:`QUIET` seconds.
    """
    with signals_ignored():
        control.request_stop(store_timeout=STORE_GRACE)
        join_threads(timeout=THREAD_GRACE)
        terminate_until_quiet(spared=spared, grace=PROCESS_GRACE, quiet=QUIET, limit=SWEEP_LIMIT)


def serve_stuck_stop(signum: int, control: RunControl) -> None:
    """Stop the run from the stop watchdog and end the process with ``128 + signum``.

    Called when the main thread did not take up a stop signal in time (stuck in native code,
    e.g. ``ray.init`` waiting for its raylet); returns at once when the main thread serves it.
    """
    if not control.claim_stop():
        return
    try:
        stop_run(control, spared=set())
        print(f"fl-attack-audit: {stop_text(signum, control)}", file=sys.stderr)
        terminate_until_quiet(spared=set(), grace=LAST_PROCESS_GRACE, quiet=LAST_QUIET, limit=SWEEP_LIMIT)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(SIGNAL_EXIT_BASE + signum)


def failure_text(error: BaseException) -> str:
    """One line saying why the simulation failed, from the innermost cause of ``error``.

    Flower wraps what went wrong ("An error was encountered. Ending simulation." from
    "Simulation Runtime crashed." from Ray's own error); the line names the innermost cause,
    says when Ray raised it, and names a finite file-size limit as a likely culprit.
    """
    chain = [error]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    message = (str(root).strip().splitlines() or [type(root).__name__])[0]
    if any(_raised_in_ray(item) for item in chain):
        return (
            f"Ray, which runs the simulated clients, could not start or crashed: {message}{file_size_hint()}"
        )
    if root is error:
        return message
    return f"the simulation failed: {type(root).__name__}: {message}"


def stop_text(signum: int, control: RunControl) -> str:
    """One line saying that a signal stopped the run, and what its stores hold."""
    from fl_attack.results.store import HISTORY_FILE  # pylint: disable=import-outside-toplevel

    finished = [store.directory for store in control.stores if (store.directory / HISTORY_FILE).exists()]
    written = (
        "the run had finished and written its results"
        if finished
        else "no history and no report were written"
    )
    kept = "; ".join(str(store.directory) for store in control.stores if store.directory not in finished)
    return f"stopped by {signal.Signals(signum).name}: Ray and the attack workers were stopped, {written}" + (
        f"; {kept} keeps the attacks stored so far" if kept else ""
    )


def _raised_in_ray(error: BaseException) -> bool:
    traceback = error.__traceback__
    while traceback is not None:
        module = str(traceback.tb_frame.f_globals.get("__name__", ""))
        if module == "ray" or module.startswith("ray."):
            return True
        traceback = traceback.tb_next
    return False


def _run(run_simulation: Any, server_app: Any, client_app: Any, num_supernodes: int, cpus: int) -> None:
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "num_gpus": 0},
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit; print where its results are; return the process exit code.

    Exit codes: 0 done, 1 the run failed, 2 bad settings, 3 the leakage gate
    (``--fail-above``) was exceeded, 128 + N stopped by signal N (143: SIGTERM, 130: SIGINT).
    """
    parser = argparse.ArgumentParser(
        prog="fl-attack-audit",
        description="Audit a simulated Flower federation with the embedded SPEAR++ attacker.",
    )
    parser.add_argument(
        "-c",
        "--run-config",
        default="",
        help="run-config overrides, e.g. \"num-server-rounds=3 dataset='digits'\"",
    )
    parser.add_argument("--num-supernodes", type=int, default=3, help="simulated clients (default 3)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (default 2; 1 per client)")
    parser.add_argument(
        "--fail-above",
        type=float,
        default=None,
        metavar="SHARE",
        help="leakage gate for CI: exit 3 when more than this share of samples was recovered exactly",
    )
    args = parser.parse_args(argv)
    if args.fail_above is not None and not 0.0 <= args.fail_above <= 1.0:
        print(
            f"fl-attack-audit: --fail-above must be a share in [0, 1], got {args.fail_above}", file=sys.stderr
        )
        return EXIT_SETTINGS

    from fl_attack.results.store import HISTORY_FILE, TABLE_FILE, load_table
    from fl_attack.vocabulary import VERDICTS, format_psnr

    try:
        overrides = parse_overrides(args.run_config)
        from strategies.run_config import resolve_run_config

        audited = bool(resolve_run_config({}, overrides)["attack-enabled"])
    except ValueError as error:
        print(f"fl-attack-audit: {error}", file=sys.stderr)
        return EXIT_SETTINGS
    if args.fail_above is not None and not audited:
        print("fl-attack-audit: --fail-above needs the audit on (attack-enabled=true)", file=sys.stderr)
        return EXIT_SETTINGS
    control = RunControl()
    try:
        with stop_signals(), stuck_stop_watchdog(lambda signum: serve_stuck_stop(signum, control)):
            output = run_audit_simulation(
                overrides, num_supernodes=args.num_supernodes, cpus=args.cpus, control=control
            )
    except BaseException as error:  # a stop signal is turned into an exit code here
        signum = stopping_signal(error)
        if signum is not None:
            if not control.claim_stop():
                threading.Event().wait(STOP_OWNER_WAIT)  # the stop watchdog ends the process
            print(f"fl-attack-audit: {stop_text(signum, control)}", file=sys.stderr)
            return SIGNAL_EXIT_BASE + signum
        if isinstance(error, ValueError):
            print(f"fl-attack-audit: {error}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(error, RuntimeError):
            print(f"fl-attack-audit: {failure_text(error)}", file=sys.stderr)
            return EXIT_FAILED
        raise
    if not audited:
        print("\nThe audit was off (attack-enabled=false): the federation trained, nothing was attacked.")
        print(f"  training history: {output / HISTORY_FILE}")
        return EXIT_OK
    from fl_attack.results.record import is_fallback_row
    from fl_attack.results.report import load_summary

    table = load_table(output / TABLE_FILE)
    rows = [row for row in table if not is_fallback_row(row)]
    fallbacks = [row for row in table if is_fallback_row(row)]
    summary = load_summary(output)
    counts = {verdict: sum(1 for row in rows if row.get("verdict") == verdict) for verdict in VERDICTS}
    share = summary.get("exact_sample_share")
    print(f"\nAudit results: {output}")
    print(
        f"  {len(rows)} client updates attacked: "
        + ", ".join(f"{count} {verdict}" for verdict, count in counts.items() if count)
    )
    if share is not None:
        print(
            f"  {100.0 * share:.0f}% of the {summary['scored_samples']} scored client samples recovered "
            f"exactly ({summary['exact_criterion']})"
        )
    for row in rows + fallbacks:
        mean = float(row["mean_psnr"]) if row.get("mean_psnr") else None
        after = f" [{row.get('attack') or 'fallback'}, approximate fallback]" if is_fallback_row(row) else ""
        print(
            f"  round {row['round']} {row['client']}{after}: {row.get('verdict') or row['status']}"
            f" (mean PSNR {format_psnr(mean)}, {float(row.get('seconds') or 0):.1f} s)"
            f" - {row.get('verdict_reason', '')}"
        )
    report = output / "report.html"
    if report.exists():
        print(f"  report: {report}")
    if args.fail_above is not None:
        gate = summary.get("exact_sample_share")
        what = f"samples recovered exactly ({summary['exact_criterion']})"
        if gate is None:  # nothing scored: judge by the attacks' own verdicts
            gate, what = summary.get("exact_attack_share"), "attacks with verdict exact"
        if gate is not None and gate > args.fail_above:
            print(
                f"fl-attack-audit: leakage gate failed: {100.0 * gate:.1f}% of {what} "
                f"(allowed {100.0 * args.fail_above:.1f}%)",
                file=sys.stderr,
            )
            return EXIT_GATE
    return EXIT_OK


def entry_point() -> None:
    """Console-script entry: exit with :func:`main`'s code, also when a thread or Ray would hang the exit.

    The command adopts the orphans of its process tree (:func:`adopt_orphans`), so that a Ray
    worker whose raylet exited first is still found and stopped. After a failure or a stop,
    threads that did not end (a ServerApp still waiting for client replies, attack threads
    still draining their queue) or Ray's exit handlers talking to processes that are gone
    would keep the interpreter alive: the processes those threads started meanwhile are
    terminated until no new one appears (:func:`terminate_until_quiet`), the output is
    flushed and the process leaves at once.
    """
    adopt_orphans()
    code = main()
    if code not in (EXIT_OK, EXIT_SETTINGS, EXIT_GATE) or lingering_threads():
        with signals_ignored():
            terminate_until_quiet(spared=set(), grace=LAST_PROCESS_GRACE, quiet=LAST_QUIET, limit=SWEEP_LIMIT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry_point()
