"""``fl-attack-audit``: run the default audit as an in-process Flower simulation.

The same ServerApp and ClientApp as ``flwr run .``, started with
``flwr.simulation.run_simulation`` so that one command installs nothing at run time, leaves
no SuperLink behind, and exits non-zero when the audit did not produce its results.
:func:`run_audit_simulation` is that simulation as a function, shared with the
defense sweep (``python -m experiments.defense_sweep``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from flwr.app import UserConfigValue


class AuditSimulationError(RuntimeError):
    """The simulation ended without writing the run's results table (``attacks.csv``)."""


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
) -> Path:
    """Run the audited federation in-process and return its run directory.

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

    Returns
    -------
    Path
        The run directory, holding ``attacks.csv``, ``history.json`` and the
        reconstructions (see :mod:`fl_attack.results.store`).

    Raises
    ------
    ValueError
        On an invalid run config or resource count, before the simulation starts.
    AuditSimulationError
        When the simulation ended without writing ``attacks.csv``.
    Exception
        Whatever the ServerApp raised (Flower re-raises it).
    """
    from flwr.simulation import run_simulation  # pylint: disable=import-outside-toplevel

    from clients.client_app import app as client_app  # pylint: disable=import-outside-toplevel
    from fl_attack.results.store import TABLE_FILE  # pylint: disable=import-outside-toplevel
    from strategies.config import resolve_run_config  # pylint: disable=import-outside-toplevel
    from strategies.server_app import create_server_app  # pylint: disable=import-outside-toplevel

    if num_supernodes < 1:
        raise ValueError(f"num_supernodes must be positive, got {num_supernodes}")
    if cpus < 1:
        raise ValueError(f"cpus must be positive, got {cpus}")
    settings: dict[str, UserConfigValue] = dict(overrides)
    settings.setdefault("min-nodes", min(num_supernodes, 2))
    if not settings.get("output-dir"):
        settings["output-dir"] = str(Path("outputs") / time.strftime("audit-%Y%m%d-%H%M%S"))
    output = Path(str(settings["output-dir"])).resolve()
    settings["output-dir"] = str(output)
    resolve_run_config({}, settings)  # fail here, not inside the ServerApp thread
    run_simulation(
        server_app=create_server_app(settings),
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "num_gpus": 0},
        },
    )
    if not (output / TABLE_FILE).exists():
        raise AuditSimulationError(f"the run wrote no results table at {output / TABLE_FILE}")
    return output


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit; print where its results are; return the process exit code."""
    parser = argparse.ArgumentParser(
        prog="fl-attack-audit",
        description="Audit a simulated Flower federation with the embedded SPEAR++ attacker.",
    )
    parser.add_argument("-c", "--run-config", default="",
                        help='run-config overrides, e.g. "num-server-rounds=3 dataset=\'digits\'"')
    parser.add_argument("--num-supernodes", type=int, default=3, help="simulated clients (default 3)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (default 2; 1 per client)")
    args = parser.parse_args(argv)

    from fl_attack.results.store import TABLE_FILE, load_table  # pylint: disable=import-outside-toplevel

    try:
        output = run_audit_simulation(
            parse_overrides(args.run_config), num_supernodes=args.num_supernodes, cpus=args.cpus
        )
    except (ValueError, AuditSimulationError) as error:
        print(f"fl-attack-audit: {error}", file=sys.stderr)
        return 1
    rows = load_table(output / TABLE_FILE)
    exact = sum(1 for row in rows if row.get("min_psnr") and float(row["min_psnr"]) > 90.0)
    print(f"\nAudit results: {output}")
    print(f"  {len(rows)} client updates attacked, {exact} recovered exactly (every sample > 90 dB)")
    for row in rows:
        print(f"  round {row['round']} {row['client']}: status={row['status']} "
              f"mean PSNR={row.get('mean_psnr', '')} complete={row.get('complete', '')} "
              f"seconds={row.get('seconds', '')}")
    report = output / "report.html"
    if report.exists():
        print(f"  report: {report}")
    return 0


def entry_point() -> None:
    """Console-script entry."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry_point()
