"""``fl-attack-audit``: run the default audit as an in-process Flower simulation.

The same ServerApp and ClientApp as ``flwr run .``, started with
``flwr.simulation.run_simulation`` so that one command installs nothing at run time, leaves
no SuperLink behind, and exits non-zero when the audit did not produce its results.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

from flwr.app import UserConfigValue


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

    from flwr.simulation import run_simulation

    from clients.client_app import app as client_app
    from fl_attack.store import load_table
    from strategies.server_app import create_server_app

    overrides = parse_overrides(args.run_config)
    overrides.setdefault("min-nodes", min(args.num_supernodes, 2))
    if not overrides.get("output-dir"):
        overrides["output-dir"] = str(Path("outputs") / time.strftime("audit-%Y%m%d-%H%M%S"))
    output = Path(str(overrides["output-dir"])).resolve()
    overrides["output-dir"] = str(output)
    run_simulation(
        server_app=create_server_app(overrides),
        client_app=client_app,
        num_supernodes=args.num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": args.cpus, "num_gpus": 0},
        },
    )
    table = output / "attacks.csv"
    if not table.exists():
        print(f"fl-attack-audit: the run wrote no results table at {table}", file=sys.stderr)
        return 1
    rows = load_table(table)
    exact = sum(1 for row in rows if row.get("min_psnr") and float(row["min_psnr"]) > 90.0)
    print(f"\nAudit results: {output}")
    print(f"  {len(rows)} client updates attacked, {exact} recovered exactly (every sample > 90 dB)")
    for row in rows:
        print(f"  round {row['round']} {row['client']}: status={row['status']} "
              f"mean PSNR={row.get('mean_psnr', '')} complete={row.get('complete', '')} "
              f"seconds={row.get('seconds', '')}")
    return 0


def entry_point() -> None:
    """Console-script entry."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry_point()
