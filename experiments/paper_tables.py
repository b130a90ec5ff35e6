"""One command per reproducible table of the SPEAR and SPEAR++ papers.

``python -m experiments.paper_tables`` lists the tables with the command each one runs;
``python -m experiments.paper_tables spear-t3 [--quick] [extra options]`` runs one. Extra
options are passed to the underlying script unchanged (see its ``--help``), so the quick
setting and every knob of the scripts stay available. Each script writes its CSV, JSON and
markdown table (ours beside the paper's) under ``experiments/results/``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PaperTable:
    """A paper table and the benchmark invocation that reproduces it."""

    paper: str
    table: str
    title: str
    module: str
    arguments: tuple[str, ...]

    @property
    def command(self) -> str:
        return " ".join(("python -m", f"experiments.{self.module}", *self.arguments))


PAPER_TABLES: dict[str, PaperTable] = {
    "spear-t1": PaperTable(
        "SPEAR", "Table 1", "comparison with an optimization attack (Geiping et al.)",
        "spear_table1", (),
    ),
    "spear-t2": PaperTable("SPEAR", "Table 2", "tabular data (UCI Adult)", "spear_table2", ()),
    "spear-t3": PaperTable("SPEAR", "Table 3", "datasets (MNIST, CIFAR-10, image folders)",
                           "spear_tables", ("table3",)),
    "spear-t4": PaperTable("SPEAR", "Table 4", "depth of the attacked layer", "spear_tables",
                           ("table4",)),
    "spear-t9": PaperTable("SPEAR", "Table 9", "DP-SGD: clipping norm x noise", "defended_updates",
                           ("--sections", "dpsgd")),
    "spear-t10": PaperTable("SPEAR", "Table 10", "FedAvg: epochs x mini-batch size",
                            "defended_updates", ("--sections", "fedavg-grid")),
    "spear-t11": PaperTable("SPEAR", "Table 11", "FedAvg: local learning rate", "defended_updates",
                            ("--sections", "lr-grid")),
    "spearpp-t1": PaperTable("SPEAR++", "Table 1", "batch size x width (FedSGD)", "spear_pp_tables",
                             ("--estimate-batch-size",)),
    "spearpp-t2": PaperTable("SPEAR++", "Table 2", "Riemannian Adam vs projected gradient descent",
                             "spear_pp_tables", ("--methods", "l1,pgd")),
    "spearpp-t3": PaperTable("SPEAR++", "Table 3", "DP noise", "defended_updates",
                             ("--sections", "dp")),
    "spearpp-t4": PaperTable("SPEAR++", "Table 4", "FedAvg updates", "defended_updates",
                             ("--sections", "fedavg")),
}
"""Reproducible tables by name."""


def listing() -> str:
    """The table names, what they reproduce and the command each runs."""
    width = max(len(name) for name in PAPER_TABLES)
    lines = ["Paper tables (python -m experiments.paper_tables NAME [--quick] [options]):"]
    for name, table in PAPER_TABLES.items():
        lines.append(f"  {name:<{width}}  {table.paper} {table.table}: {table.title}")
        lines.append(f"  {'':<{width}}    {table.command}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named table's script with the extra arguments; list the tables without one.

    Everything after the table name, ``--help`` included, goes to the table's script.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help", "--list"):
        print(listing())
        return 0
    name, extra = arguments[0], arguments[1:]
    if name not in PAPER_TABLES:
        print(f"unknown table {name!r}; available: {', '.join(PAPER_TABLES)}", file=sys.stderr)
        return 2
    table = PAPER_TABLES[name]
    module = importlib.import_module(f"experiments.{table.module}")
    return int(module.main([*table.arguments, *extra]) or 0)


if __name__ == "__main__":
    sys.exit(main())
