"""``python -m experiments.paper_tables [NAME [options]]``: the former entry point, kept as an alias.

Without a name it lists the tables (``python -m experiments list``); with one it runs it
(``python -m experiments run NAME [options]``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.cli import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """List the tables, or run the named one with the options that follow."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help", "--list"):
        return cli_main(["list"])
    return cli_main(["run", *arguments])


if __name__ == "__main__":
    sys.exit(main())
