"""``python -m experiments``: list the paper tables, run one, or sweep a defense.

::

    python -m experiments list                      # every table
    python -m experiments list spearpp-t3           # its options, full run and --quick
    python -m experiments run spearpp-t1 --quick    # a smoke test, under a minute on 2 CPUs
    python -m experiments run spearpp-t3 --cells 150x4000 --trials 2 --set noise_factors=0.1,0.25
    python -m experiments run spear-t2 --update-results   # rewrite experiments/results/
    python -m experiments sweep --list              # the Flower defense sweep (experiments.defense_sweep)

A run prints progress on stderr and the markdown report on stdout, and writes
``<name>.csv`` (one row per attacked batch, as it finishes), ``<name>.json`` (options,
environment, one summary row per setting and method) and ``<name>.md`` (ours beside the
paper's) to ``outputs/experiments/<name>/``; ``<name>`` is the table's name, ``_quick``
appended under ``--quick``. A dataset that is not on this machine stops the run before it
starts, with exit code 2 and one line saying how to get it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from experiments.config import parse_option, show_option
from experiments.output import ResultsWriter, output_directory
from experiments.plots import defended_plots
from experiments.report import quick_banner, render
from experiments.runner import DatasetUnavailable, csv_fields, load_data, run_settings, summary_rows, warm_up
from experiments.tables import TABLES, TableConfig, get_table

_SHORTCUTS = {
    "--trials": ("trials", "batches per setting"),
    "--time-budget": ("time_budget", "attack time budget, seconds per batch"),
    "--cells": ("cells", "<b>x<m> cells, comma-separated"),
    "--methods": ("methods", "comma-separated: l1, logcosh, neg_l4, pgd, spear, ig, ig-notv"),
    "--seed": ("seed", "seed of trial 0; trial t uses seed + t"),
    "--data-root": ("data_root", "root of the datasets stored on disk (default: searched)"),
}
_FLAGS = {
    "--quick": "a smoke test under a minute (not the paper comparison)",
    "--estimate-batch-size": "let the attack estimate b (option known_batch_size=false)",
    "--update-results": "write to the committed experiments/results/",
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments", description="Reproduce the SPEAR / SPEAR++ tables."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the tables, or one's options").add_argument("table", nargs="?")
    commands.add_parser("sweep", help="the Flower defense sweep (sweep --help)", add_help=False)
    run = commands.add_parser("run", help="run one table")
    run.add_argument("table", help=f"one of: {', '.join(TABLES)}")
    for flag, text in _FLAGS.items():
        run.add_argument(flag, action="store_true", help=text)
    for flag, (key, text) in _SHORTCUTS.items():
        run.add_argument(flag, dest=key, metavar=key.upper(), help=f"{text} (option {key})")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change any option (list TABLE)"
    )
    run.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    run.add_argument("--name", help="file stem (default: the table's name, _quick appended under --quick)")
    run.add_argument("--out", type=Path, help="output folder (default outputs/experiments/<name>)")
    return parser


def listing(table: TableConfig | None = None) -> str:
    """Every table with what it reproduces, or one table's options (full run and ``--quick``)."""
    if table is None:
        width = max(len(name) for name in TABLES)
        lines = ["Tables (python -m experiments run NAME [--quick] [--trials N] [--set KEY=VALUE] ...):"]
        lines += [f"  {t.name:<{width}}  {t.source}: {t.title}" for t in TABLES.values()]
        lines.append("Defense sweep in the Flower simulation: python -m experiments sweep --list")
        return "\n".join(lines)
    quick = {key: show_option(value) for key, value in table.quick.items()}
    rows = [(key, show_option(value), quick.get(key, "")) for key, value in table.options.items()]
    rows.insert(0, ("option", "full run", "--quick"))
    width, fulls = max(len(key) for key, _, _ in rows), max(len(full) for _, full, _ in rows)
    lines = [f"{table.name}: {table.source}: {table.title}"]
    lines += [f"  {key:<{width}}  {full:<{fulls}}  {quick}".rstrip() for key, full, quick in rows]
    return "\n".join(lines)


def overrides_of(args: argparse.Namespace, table: TableConfig) -> dict[str, Any]:
    """The options given on the command line (shortcuts and ``--set``), parsed.

    Raises
    ------
    ValueError
        For a malformed ``--set``, an option the table does not have, or a bad value.
    """
    given = [(key, getattr(args, key)) for key, _ in _SHORTCUTS.values() if getattr(args, key) is not None]
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        given.append((key.strip(), value))
    overrides = {key: parse_option(key, value, allowed=table.options) for key, value in given}
    if args.estimate_batch_size:
        overrides["known_batch_size"] = False
    return overrides


def configure_runtime(*, threads: int) -> None:
    """Torch threads (1 is polite on a shared machine); library warnings and info logs off."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("fl_attack").setLevel(logging.WARNING)


def run_table(table: TableConfig, options: dict[str, Any], *, quick: bool, name: str, directory: Path) -> int:
    """Run ``table`` with resolved ``options``; return the exit code (2: a dataset is missing)."""
    settings = table.settings(options)
    try:
        data = load_data(settings)
    except DatasetUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if quick:
        print(quick_banner(table, options), flush=True)
    with ResultsWriter(directory, name=name, fields=csv_fields(settings, data)) as writer:
        if options.get("warm_up"):
            warm_up(settings, data, options=options)
        results = run_settings(settings, data, options=options, writer=writer)
        rows = summary_rows(results, family=table.family)
        markdown = render(table, options, rows, quick=quick)
        plots = defended_plots(rows, directory=directory, name=name) if table.family == "defended" else []
        summary = {"table": table.name, "source": table.source, "title": table.title, "quick": quick}
        summary |= {"options": options, "rows": rows, "plots": [path.name for path in plots]}
        written = writer.finish(summary, markdown) + plots
    print(markdown)
    print(f"\nwrote {', '.join(str(path) for path in written)}", file=sys.stderr)
    if not any(result.observed for result in results):
        print("error: no setting could be attacked (see the status column)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["sweep"]:
        from experiments import defense_sweep  # pylint: disable=import-outside-toplevel

        return defense_sweep.main(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    try:
        table = get_table(args.table) if args.table else None
        if args.command == "list":
            print(listing(table))
            return 0
        assert table is not None  # run requires a table
        options = table.resolve(quick=args.quick, overrides=overrides_of(args, table))
        table.settings(options)  # every option checked before anything runs
        name = args.name or table.name + ("_quick" if args.quick else "")
        directory = output_directory(name=name, out=args.out, update_results=args.update_results)
    except ValueError as error:
        parser.error(str(error))
    configure_runtime(threads=args.threads)
    return run_table(table, options, quick=args.quick, name=name, directory=directory)
