"""``fl-attack-report RUN_DIR [-o FILE]``: write the report of an existing run directory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fl_attack.results.report.writer import write_report
from fl_attack.results.store import TABLE_FILE

__all__ = ["entry_point", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit code.

    Exit codes: 0 written, 1 could not be written, 2 bad usage or not a run directory.
    """
    parser = argparse.ArgumentParser(
        prog="fl-attack-report",
        description=(
            "Write the self-contained HTML report (and report.json) of an fl-attack audit run directory."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds attacks.csv)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="HTML file to write (default: RUN_DIR/report.html)",
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / TABLE_FILE).is_file():
        parser.error(f"{run_dir} is not a run directory: it has no {TABLE_FILE}")
    try:
        path = write_report(run_dir, output=args.output)
    except OSError as error:
        print(f"fl-attack-report: could not write the report: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def entry_point() -> None:
    """Console-script entry."""
    raise SystemExit(main())
