"""Privacy-utility trade-off of a defense, measured in the Flower simulation.

One command sweeps one defense parameter: for every value it runs the audited federation
(the ServerApp and ClientApp of ``fl-attack-audit``, in-process) with the same seeds and
rounds, then reads the run's ``attacks.csv`` (leakage: how much of the clients' data the
server recovered) and ``history.json`` (utility: the global model's test accuracy)::

    python -m experiments.defense_sweep --parameter noise-multiplier --values 0,0.5,1,2
    python -m experiments.defense_sweep --parameter secagg-group-size --values 1,2,3 \\
        --rounds 2 --clients 6 -c "dataset='digits' attack-isolation='thread'"

``--list`` prints the sweepable defenses (:data:`DEFENSES`). Each brings the run-config
overrides it needs (e.g. ``train-mode='dpsgd'``); ``-c`` overrides those, the swept value
overrides everything. The sweep writes ``<name>.csv`` (one row per value, columns
:data:`SWEEP_COLUMNS` documented in :data:`COLUMN_DOCS`), ``.md``, ``.json`` and ``.png``
to ``outputs/experiments/<name>/`` (``--update-results``: ``experiments/results/``), and each
point's run directory under ``raw/<name>/`` there. A point whose simulation fails is a row
with ``status=error``; the sweep goes on.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from experiments.cli import configure_runtime
from experiments.output import OUTPUTS_DIR, ResultsWriter, output_directory
from experiments.sweep_point import COLUMN_DOCS, SWEEP_COLUMNS, SWEEP_DATA, PointResult, run_point
from experiments.sweep_report import fixed, percent, plot_sweep, sweep_markdown

DEFAULT_DELTA = 1e-5
"""Delta of the DP-SGD privacy budget reported for ``dpsgd`` points."""


@dataclass(frozen=True)
class Defense:
    """One sweepable defense parameter (an entry of ``defenses.toml``).

    Attributes
    ----------
    name : str
        Name given to ``--parameter``, also the run-config key set to the swept value.
    kind : type
        ``int`` or ``float``: values are parsed as this type.
    defaults : tuple[float, ...]
        Values swept when ``--values`` is not given.
    base : Mapping[str, Any]
        Run-config overrides the defense needs (applied under the user's ``-c``).
    minimum, allow_minimum : float, bool
        Smallest allowed value, and whether it is allowed itself.
    description : str
        One line for ``--list`` and the markdown.
    clients_per_value : bool
        Whether a value is a number of clients the sweep must have.
    """

    name: str
    kind: type
    defaults: tuple[float, ...]
    base: Mapping[str, Any] = field(default_factory=dict)
    minimum: float = 0.0
    allow_minimum: bool = False
    description: str = ""
    clients_per_value: bool = False

    @property
    def key(self) -> str:
        """The run-config key set to the swept value."""
        return self.name

    def min_clients(self, values: Sequence[float]) -> int:
        """Clients a sweep over ``values`` needs."""
        return int(max(values)) if self.clients_per_value else 1

    def check(self, value: float) -> None:
        """Raise ``ValueError`` when ``value`` is outside the defense's range."""
        if not math.isfinite(value):
            raise ValueError(f"{self.name} values must be finite, got {value!r}")
        if value < self.minimum or (value == self.minimum and not self.allow_minimum):
            bound = ">=" if self.allow_minimum else ">"
            raise ValueError(f"{self.name} values must be {bound} {self.minimum:g}, got {value!r}")


def _defense(name: str, entry: Mapping[str, Any]) -> Defense:
    kind = {"int": int, "float": float}[entry["kind"]]
    fields = {key: value for key, value in entry.items() if key not in ("kind", "defaults")}
    return Defense(name, kind, tuple(kind(value) for value in entry["defaults"]), **fields)


DEFENSES: dict[str, Defense] = {name: _defense(name, entry) for name, entry in SWEEP_DATA["defenses"].items()}
"""The sweepable defenses, by name."""


def get_defense(name: str) -> Defense:
    """The registered defense called ``name``; a ``ValueError`` listing them for an unknown one."""
    if name not in DEFENSES:
        raise ValueError(f"unknown defense parameter {name!r}; registered: {', '.join(DEFENSES)}")
    return DEFENSES[name]


def parse_values(defense: Defense, text: str | None) -> list[float]:
    """``--values`` (``"0,0.5,1"``) typed as ``defense.kind``; None gives its defaults.

    Raises
    ------
    ValueError
        On an empty list, a value that is not a number (or not an integer for an integer
        parameter), out of range, or given twice.
    """
    if text is None:
        return [defense.kind(value) for value in defense.defaults]
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--values for {defense.name} is empty")
    values: list[float] = []
    for item in items:
        try:
            number = float(item)
        except ValueError as error:
            raise ValueError(f"{defense.name} value {item!r} is not a number") from error
        if defense.kind is int and not number.is_integer():
            raise ValueError(f"{defense.name} takes integers, got {item!r}")
        defense.check(number)
        values.append(defense.kind(number))
    if len(set(values)) != len(values):
        raise ValueError(f"{defense.name} values must be distinct, got {items}")
    return values


def point_overrides(
    defense: Defense,
    value: float,
    *,
    user: Mapping[str, Any],
    rounds: int | None,
    clients: int,
    seed: int,
    output_dir: Path,
) -> dict[str, Any]:
    """The run-config overrides of one point.

    Precedence, lowest first: the seeds (model, partitioning, clients, attacker), ``min-nodes``
    (every client in every round), the defense's base, the user's ``-c``, then the rounds, the
    swept value and the point's ``output-dir``.

    Raises
    ------
    ValueError
        When ``user`` sets the swept key or ``output-dir``, which the sweep owns.
    """
    for owned in (defense.key, "output-dir"):
        if owned in user:
            raise ValueError(f"-c must not set '{owned}': the sweep sets it for every point")
    overrides: dict[str, Any] = {f"{part}-seed": seed for part in ("model", "partition", "client", "attack")}
    overrides |= {"min-nodes": clients, **defense.base, **user}
    if rounds is not None:
        overrides["num-server-rounds"] = rounds
    return overrides | {defense.key: value, "output-dir": str(output_dir)}


def run_sweep(
    defense: Defense,
    values: Sequence[float],
    *,
    user_overrides: Mapping[str, Any] | None = None,
    rounds: int | None = None,
    clients: int | None = None,
    cpus: int = 2,
    seed: int = 0,
    delta: float = DEFAULT_DELTA,
    output_dir: Path | None = None,
    name: str | None = None,
    runs_dir: Path | None = None,
    stream: TextIO | None = None,
) -> list[PointResult]:
    """Run the sweep and write ``<name>.csv``, ``.json``, ``.md`` and ``.png``.

    ``clients`` defaults to 3 (or what the defense needs), ``name`` to
    ``sweep_<parameter>``, ``output_dir`` to ``outputs/experiments/<name>``, ``runs_dir`` to
    ``<output_dir>/raw/<name>``; ``seed`` seeds the model, partitioning, clients and attacker
    of every point; progress goes to ``stream`` (stderr). Returns one result per value.

    Raises
    ------
    ValueError
        On invalid settings, checked for every point before any simulation starts.
    """
    from strategies import resolve_run_config  # pylint: disable=import-outside-toplevel

    say = functools.partial(print, file=stream if stream is not None else sys.stderr, flush=True)
    values = list(values)
    if not values:
        raise ValueError("a sweep needs at least one value")
    for value in values:
        defense.check(float(value))
    needed = defense.min_clients(values)
    clients = max(3, needed) if clients is None else clients
    if clients < needed:
        raise ValueError(
            f"{defense.name}={max(values):g} needs at least {needed} clients; pass --clients {needed}"
        )
    if (rounds is not None and rounds < 1) or cpus < 1:
        raise ValueError(f"rounds and cpus must be positive, got {rounds} and {cpus}")
    name = name or f"sweep_{defense.name}"
    output_dir = Path(output_dir) if output_dir is not None else OUTPUTS_DIR / name
    runs_dir = Path(runs_dir) if runs_dir is not None else output_dir / "raw" / name
    user, plans = dict(user_overrides or {}), []
    for index, value in enumerate(values):  # every point's run config is checked before the first runs
        point_dir = (runs_dir / f"{index:02d}_{defense.name}={value:g}").resolve()
        overrides = point_overrides(
            defense, value, user=user, rounds=rounds, clients=clients, seed=seed, output_dir=point_dir
        )
        plans.append((value, overrides, resolve_run_config({}, overrides)))
    for value in values if defense.clients_per_value else ():
        if clients % int(value):
            say(f"[{name}] note: {clients} clients in groups of {value:g}: the last group is smaller")
    config = plans[0][2]
    settings: dict[str, Any] = {"parameter": defense.name, "run_config_key": defense.key}
    settings["description"] = defense.description
    settings |= {"values": values, "base_overrides": dict(defense.base), "user_overrides": user, "seed": seed}
    settings |= {"rounds": config["num-server-rounds"], "clients": clients, "cpus": cpus, "delta": delta}
    settings |= {
        key.replace("-", "_"): config[key] for key in ("dataset", "width", "train-mode", "attack-time-budget")
    }
    settings["runs_dir"] = str(runs_dir)
    results: list[PointResult] = []
    start = time.perf_counter()
    with ResultsWriter(output_dir, name=name, fields=SWEEP_COLUMNS) as writer:
        for index, (value, overrides, _) in enumerate(plans):
            where = f"[{name}] point {index + 1}/{len(plans)}"
            say(f"{where}: {defense.name}={value:g} ({clients} clients, {settings['rounds']} rounds) ...")
            resources: dict[str, Any] = {"clients": clients, "cpus": cpus, "delta": delta}
            results.append(
                run_point(defense.name, value, overrides=overrides, csv_dir=output_dir, **resources)
            )
            writer.add(results[-1].row)
            say(f"{where}: {_progress(results[-1].row)}")
        rows = [result.row for result in results]
        summary = {"settings": settings, "columns": COLUMN_DOCS, "rows": rows}
        writer.finish(
            summary | {"seconds": round(time.perf_counter() - start, 1)},
            sweep_markdown(rows, name=defense.name, description=defense.description, settings=settings),
        )
    plot_sweep(rows, name=defense.name, integer=defense.kind is int, path=output_dir / f"{name}.png")
    say(f"[{name}] wrote {output_dir / name}.{{csv,json,md,png}}")
    return results


def _progress(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"error after {row['seconds']} s: {row['error']}"
    leaked = f"exact {percent(row['exact_fraction'])} approx {percent(row['approx_fraction'])}"
    return (
        f"{row['attacked_updates']} updates attacked ({row['attack_failures']} failed), {leaked} of "
        f"{row['scored_samples']} samples; test acc {fixed(row['initial_test_acc'])} -> "
        f"{fixed(row['final_test_acc'])}; {row['seconds']} s"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="python -m experiments.defense_sweep",
        description="Sweep a defense parameter in the Flower simulation: leakage vs test accuracy.",
    )
    p.add_argument("--parameter", help=f"the defense to sweep: {', '.join(DEFENSES)}")
    p.add_argument("--values", help="comma-separated values (default: the defense's defaults)")
    p.add_argument("--rounds", type=int, help="federated rounds (default: num-server-rounds, 2)")
    p.add_argument("--clients", type=int, help="simulated clients (default 3, or what the defense needs)")
    p.add_argument("-c", "--run-config", default="", help="run-config overrides, e.g. \"dataset='digits'\"")
    p.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (default 2; 1 per client)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server/attacker (default 1)")
    p.add_argument("--seed", type=int, default=0, help="model, partition, client and attack seed (default 0)")
    p.add_argument(
        "--delta", type=float, default=DEFAULT_DELTA, help="delta of the DP-SGD epsilon (default 1e-5)"
    )
    p.add_argument(
        "--output-dir",
        "--out",
        type=Path,
        help="folder of the sweep's files (default outputs/experiments/<name>)",
    )
    p.add_argument(
        "--update-results", action="store_true", help="write to the committed experiments/results/"
    )
    p.add_argument("--name", help="file stem (default sweep_<parameter>)")
    p.add_argument(
        "--runs-dir", type=Path, help="the points' run directories (default <output-dir>/raw/<name>)"
    )
    p.add_argument("--verbose", action="store_true", help="keep Flower's INFO log on stderr")
    p.add_argument("--list", action="store_true", help="list the sweepable defenses and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sweep from the command line; return the exit code (2 on bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for defense in DEFENSES.values():
            defaults = ",".join(f"{value:g}" for value in defense.defaults)
            base = " ".join(f"{key}={value!r}" for key, value in defense.base.items()) or "-"
            print(
                f"{defense.name:18s} {defense.description}\n{'':18s} default values {defaults}; base {base}"
            )
        return 0
    if not args.parameter:
        parser.error(f"--parameter is required; registered: {', '.join(DEFENSES)}")
    from strategies.cli import parse_overrides  # pylint: disable=import-outside-toplevel

    try:
        defense = get_defense(args.parameter)
        values = parse_values(defense, args.values)
        user = parse_overrides(args.run_config)
        name = args.name or f"sweep_{defense.name}"
        output_dir = output_directory(name=name, out=args.output_dir, update_results=args.update_results)
    except ValueError as error:
        parser.error(str(error))
    configure_runtime(threads=args.threads)
    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    try:
        results = run_sweep(
            defense,
            values,
            user_overrides=user,
            rounds=args.rounds,
            clients=args.clients,
            cpus=args.cpus,
            seed=args.seed,
            delta=args.delta,
            output_dir=output_dir,
            name=name,
            runs_dir=args.runs_dir,
        )
    except ValueError as error:
        parser.error(str(error))
    print((output_dir / f"{name}.md").read_text(encoding="utf-8"))
    return 0 if any(result.ok for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
