"""Privacy-utility trade-off of a defense, measured in the Flower simulation.

One command sweeps one defense parameter: for every value it runs the audited federation
(the same ServerApp and ClientApp as ``fl-attack-audit``, in-process) with the same seeds
and the same number of rounds, then reads the run's ``attacks.csv`` (leakage: how much of
the clients' training data the honest-but-curious server recovered) and ``history.json``
(utility: the global model's accuracy on the dataset's test split after the last round)::

    python -m experiments.defense_sweep --parameter noise-multiplier --values 0,0.5,1,2
    python -m experiments.defense_sweep --parameter secagg-group-size --values 1,2,3 \\
        --rounds 2 --clients 6 -c "dataset='digits' attack-isolation='thread'"

Sweepable defenses (:data:`DEFENSES`, ``--list`` prints them): ``noise-multiplier`` and
``max-grad-norm`` (DP-SGD), ``local-epochs`` and ``local-lr`` (FedAvg), ``batch-size``
(FedSGD), ``secagg-group-size`` (secure aggregation: the server only sees sums of that many
clients' updates) and ``width`` (of the attacked layer). Each defense brings the run-config
overrides it needs (e.g. ``train-mode='dpsgd'``); ``-c`` overrides those, and the swept
value overrides everything.

Outputs, under ``--output-dir`` (default ``experiments/results``), with ``--name``
(default ``sweep_<parameter>``):

``<name>.csv``
    One row per value, columns :data:`SWEEP_COLUMNS` (documented in :data:`COLUMN_DOCS`).
``<name>.md``
    The settings and a markdown table of the parameter, leakage and accuracy.
``<name>.json``
    Settings, environment and the rows.
``<name>.png``
    Leakage fractions (top) and test accuracy (bottom) against the parameter.
``raw/<name>/<point>/``
    Each point's run directory (reconstructions included; ``experiments/results/raw`` is
    not committed). ``--runs-dir`` puts them elsewhere.

A point whose simulation fails is a row with ``status=error`` and the error text; the sweep
goes on. Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from experiments.common import RESULTS_DIR, ResultsWriter, configure_runtime, markdown_table

__all__ = [
    "COLUMN_DOCS",
    "DEFENSES",
    "Defense",
    "PointResult",
    "SWEEP_COLUMNS",
    "dpsgd_epsilon",
    "get_defense",
    "leakage_of",
    "main",
    "parse_values",
    "point_overrides",
    "run_sweep",
    "utility_of",
]

#: PSNR (dB) above which a sample counts as recovered exactly / approximately (as the store).
EXACT_DB = 90.0
APPROX_DB = 25.0

#: Default delta of the DP-SGD privacy budget reported for ``dpsgd`` points.
DEFAULT_DELTA = 1e-5

#: Columns of ``<name>.csv``, in order.
SWEEP_COLUMNS: tuple[str, ...] = (
    "parameter",
    "value",
    "status",
    "train_mode",
    "rounds",
    "clients",
    "attacked_updates",
    "attack_failures",
    "scored_samples",
    "exact_fraction",
    "approx_fraction",
    "updates_exact_fraction",
    "mean_psnr",
    "median_attack_seconds",
    "initial_test_acc",
    "final_test_acc",
    "final_test_loss",
    "test_examples",
    "epsilon",
    "delta",
    "seconds",
    "run_dir",
    "error",
)

#: What every column of ``<name>.csv`` holds (blank = not available).
COLUMN_DOCS: dict[str, str] = {
    "parameter": "the swept defense (a key of DEFENSES, also its run-config key)",
    "value": "the parameter's value at this point",
    "status": "'ok' when the simulation finished and wrote its results, else 'error'",
    "train_mode": "client training of the point: fedsgd, fedavg or dpsgd",
    "rounds": "federated rounds run (num-server-rounds)",
    "clients": "simulated clients (supernodes)",
    "attacked_updates": "attacked updates over all rounds: one per client, or per secure-aggregation sum",
    "attack_failures": "attacked updates whose attack raised, timed out or ran out of memory",
    "scored_samples": "client samples inside the scored updates (sum of num_references)",
    "exact_fraction": "share of scored_samples recovered exactly (PSNR > 90 dB); 0 when every attack failed",
    "approx_fraction": "share of scored_samples recovered approximately (PSNR > 25 dB, exact included)",
    "updates_exact_fraction": "share of attacked_updates whose every sample was recovered exactly (failures count as not)",
    "mean_psnr": "mean PSNR (dB) of the scored samples (per-update means weighted by num_references)",
    "median_attack_seconds": "median wall-clock seconds of one attack, failures included",
    "initial_test_acc": "test-split accuracy of the initial global model (round 0), the same for every point with the same model",
    "final_test_acc": "test-split accuracy of the global model after the last round: the utility",
    "final_test_loss": "test-split cross-entropy after the last round",
    "test_examples": "test-split samples scored",
    "epsilon": "dpsgd only: per-client DP-SGD epsilon after all rounds (Opacus RDP accountant; 'inf' without noise)",
    "delta": "dpsgd only: the delta of epsilon",
    "seconds": "wall-clock seconds of the point's simulation",
    "run_dir": "the point's run directory (relative to the CSV when below it)",
    "error": "why the point failed (status=error), else blank",
}


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Defense:
    """One sweepable defense parameter.

    Attributes
    ----------
    name : str
        Name given to ``--parameter``.
    key : str
        Run-config key set to the swept value.
    kind : type
        ``int`` or ``float``: values are parsed as this type.
    defaults : tuple[float, ...]
        Values swept when ``--values`` is not given.
    base : Mapping[str, Any]
        Run-config overrides the defense needs (applied under the user's ``-c``).
    minimum : float
        Smallest allowed value.
    allow_minimum : bool
        Whether ``minimum`` itself is allowed (``0`` noise: yes; ``0`` width: no).
    description : str
        One line for ``--list`` and the markdown header.
    min_clients : Callable[[Sequence[float]], int] or None
        Clients the sweep needs for these values (None: no requirement).
    """

    name: str
    key: str
    kind: type
    defaults: tuple[float, ...]
    base: Mapping[str, Any] = field(default_factory=dict)
    minimum: float = 0.0
    allow_minimum: bool = False
    description: str = ""
    min_clients: Callable[[Sequence[float]], int] | None = None

    def check(self, value: float) -> None:
        """Raise ``ValueError`` when ``value`` is outside the defense's range."""
        if not math.isfinite(value):
            raise ValueError(f"{self.name} values must be finite, got {value!r}")
        if value < self.minimum or (value == self.minimum and not self.allow_minimum):
            bound = ">=" if self.allow_minimum else ">"
            raise ValueError(f"{self.name} values must be {bound} {self.minimum:g}, got {value!r}")


def _at_least_largest(values: Sequence[float]) -> int:
    return int(max(values))


#: DP-SGD as one clipped, noised step per round on all of a client's samples ("DP-FedSGD").
#: With more local steps (the run config's 64 samples in mini-batches of 8), SPEAR++ already
#: recovers nothing without noise, which would hide the noise's effect.
_DP_FEDSGD: dict[str, Any] = {
    "train-mode": "dpsgd",
    "samples-per-client": 8,
    "mini-batch-size": 8,
    "local-epochs": 1,
}

#: The sweepable defenses, by name.
DEFENSES: dict[str, Defense] = {
    defense.name: defense
    for defense in (
        Defense(
            "noise-multiplier",
            "noise-multiplier",
            float,
            (0.0, 0.01, 0.1, 1.0),
            base=_DP_FEDSGD,
            minimum=0.0,
            allow_minimum=True,
            description=(
                "DP-SGD (Opacus) noise std relative to the clipping norm; one clipped, noised "
                "step per round on each client's 8 samples"
            ),
        ),
        Defense(
            "max-grad-norm",
            "max-grad-norm",
            float,
            (0.1, 1.0, 10.0, 100.0),
            base={**_DP_FEDSGD, "noise-multiplier": 0.1},
            minimum=0.0,
            description=(
                "DP-SGD (Opacus) per-sample clipping norm at noise multiplier 0.1; one step per "
                "round on each client's 8 samples"
            ),
        ),
        Defense(
            "local-epochs",
            "local-epochs",
            int,
            (1, 2, 5, 10),
            base={"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 5},
            minimum=1,
            allow_minimum=True,
            description="FedAvg local epochs over 20 samples in mini-batches of 5 (SPEAR++ Tab. 4)",
        ),
        Defense(
            "local-lr",
            "local-lr",
            float,
            (0.01, 0.1, 0.3, 1.0),
            base={
                "train-mode": "fedavg",
                "samples-per-client": 20,
                "mini-batch-size": 5,
                "local-epochs": 3,
            },
            minimum=0.0,
            description="FedAvg local learning rate, 3 epochs x mini-batches of 5 of 20 samples",
        ),
        Defense(
            "batch-size",
            "batch-size",
            int,
            (4, 8, 16, 32),
            base={"train-mode": "fedsgd"},
            minimum=1,
            allow_minimum=True,
            description="FedSGD client batch size",
        ),
        Defense(
            "secagg-group-size",
            "secagg-group-size",
            int,
            (1, 2, 3, 4),
            base={"train-mode": "fedsgd"},
            minimum=1,
            allow_minimum=True,
            description="secure aggregation: the server only sees sums of this many FedSGD updates",
            min_clients=_at_least_largest,
        ),
        Defense(
            "width",
            "width",
            int,
            (10, 20, 50, 200),
            base={"train-mode": "fedsgd"},
            minimum=1,
            allow_minimum=True,
            description="width of the victim's hidden layers (the attacked layer has this many neurons)",
        ),
    )
}


def get_defense(name: str) -> Defense:
    """The registered defense called ``name``.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the registered ones.
    """
    if name not in DEFENSES:
        raise ValueError(
            f"unknown defense parameter {name!r}; registered: {', '.join(DEFENSES)}"
        )
    return DEFENSES[name]


def parse_values(defense: Defense, text: str | None) -> list[float]:
    """Parse ``--values`` (``"0,0.5,1"``) for ``defense``; None gives its defaults.

    Parameters
    ----------
    defense : Defense
        The swept defense; fixes the type and range.
    text : str or None
        Comma-separated values.

    Returns
    -------
    list[float]
        The values, typed ``int`` or ``float`` as the defense's run-config key, in the
        order given.

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
        if defense.kind is int:
            if not number.is_integer():
                raise ValueError(f"{defense.name} takes integers, got {item!r}")
            defense.check(number)
            values.append(int(number))
        else:
            defense.check(number)
            values.append(float(number))
    if len(set(values)) != len(values):
        raise ValueError(f"{defense.name} values must be distinct, got {items}")
    return values


# --------------------------------------------------------------------------- one point


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
    """The run-config overrides of one point of the sweep.

    Precedence, lowest first: the seeds (``--seed`` for the model, the partitioning, the
    clients and the attacker), ``min-nodes`` (every client in every round), the defense's
    :attr:`Defense.base`, the user's ``-c``, then ``--rounds``, the swept value and the
    point's ``output-dir``.

    Raises
    ------
    ValueError
        When ``user`` sets the swept key or ``output-dir``, which the sweep owns.
    """
    for owned in (defense.key, "output-dir"):
        if owned in user:
            raise ValueError(f"-c must not set '{owned}': the sweep sets it for every point")
    overrides: dict[str, Any] = {
        "model-seed": seed,
        "partition-seed": seed,
        "client-seed": seed,
        "attack-seed": seed,
        "min-nodes": clients,
    }
    overrides.update(defense.base)
    overrides.update(user)
    if rounds is not None:
        overrides["num-server-rounds"] = rounds
    overrides[defense.key] = value
    overrides["output-dir"] = str(output_dir)
    return overrides


def dpsgd_epsilon(config: Mapping[str, Any], *, delta: float = DEFAULT_DELTA) -> float | None:
    """Per-client DP-SGD epsilon after all rounds, as Opacus' RDP accountant counts it.

    Every client trains in every round (``fraction-train`` is ignored: an upper bound) on
    ``samples-per-client`` samples; Opacus samples each step with rate
    ``1 / ceil(samples / mini-batch-size)`` and takes that many steps per local epoch.

    Parameters
    ----------
    config : Mapping[str, Any]
        A resolved run config (:func:`strategies.config.resolve_run_config`).
    delta : float (default: 1e-5)
        The delta of (epsilon, delta)-DP.

    Returns
    -------
    float or None
        ``inf`` without noise; None when the point does not train with DP-SGD or Opacus
        is not importable.
    """
    if config.get("train-mode") != "dpsgd":
        return None
    noise = float(config["noise-multiplier"])
    if noise <= 0.0:
        return math.inf
    try:
        from opacus.accountants import RDPAccountant  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    samples = int(config["samples-per-client"])
    steps_per_epoch = math.ceil(samples / int(config["mini-batch-size"]))
    steps = int(config["num-server-rounds"]) * int(config["local-epochs"]) * steps_per_epoch
    accountant = RDPAccountant()
    accountant.history = [(noise, 1.0 / steps_per_epoch, steps)]
    import warnings  # pylint: disable=import-outside-toplevel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(accountant.get_epsilon(delta))


def _number(text: str | None) -> float | None:
    if text in (None, ""):
        return None
    try:
        value = float(text)  # type: ignore[arg-type]
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def leakage_of(rows: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """Leakage of one run from its ``attacks.csv`` rows (see :data:`COLUMN_DOCS`).

    Sample fractions are weighted by each update's ``num_references`` (the samples it
    contained); an attack that failed has no scored samples and counts in
    ``attack_failures`` and against ``updates_exact_fraction``.

    Parameters
    ----------
    rows : Sequence[Mapping[str, str]]
        Rows of :func:`fl_attack.results.store.load_table`.

    Returns
    -------
    dict[str, Any]
        ``attacked_updates``, ``attack_failures``, ``scored_samples``, ``exact_fraction``,
        ``approx_fraction``, ``updates_exact_fraction``, ``mean_psnr``,
        ``median_attack_seconds`` (None where undefined).
    """
    failures = sum(1 for row in rows if row.get("status") != "ok")
    samples = exact = approx = psnr_sum = 0.0
    exact_updates = 0
    for row in rows:
        if row.get("status") != "ok":
            continue
        count = _number(row.get("num_references"))
        if not count:
            continue
        samples += count
        exact += count * (_number(row.get("exact_fraction")) or 0.0)
        approx += count * (_number(row.get("approx_fraction")) or 0.0)
        mean_psnr = _number(row.get("mean_psnr"))
        psnr_sum += count * (mean_psnr if mean_psnr is not None else 0.0)
        min_psnr = _number(row.get("min_psnr"))
        if min_psnr is not None and min_psnr > EXACT_DB:
            exact_updates += 1
    seconds = [value for value in (_number(row.get("seconds")) for row in rows) if value is not None]
    attacked = len(rows)
    if samples > 0:
        exact_fraction, approx_fraction = exact / samples, approx / samples
    elif attacked:
        exact_fraction = approx_fraction = 0.0  # every attack failed: nothing recovered
    else:
        exact_fraction = approx_fraction = None
    return {
        "attacked_updates": attacked,
        "attack_failures": failures,
        "scored_samples": int(samples),
        "exact_fraction": exact_fraction,
        "approx_fraction": approx_fraction,
        "updates_exact_fraction": exact_updates / attacked if attacked else None,
        "mean_psnr": psnr_sum / samples if samples > 0 else None,
        "median_attack_seconds": statistics.median(seconds) if seconds else None,
    }


def utility_of(history: Mapping[str, Any] | None) -> dict[str, Any]:
    """Initial and final test metrics from a run's ``history.json`` (None where missing)."""
    history = history or {}
    tested = [entry for entry in history.get("rounds", []) if entry.get("test")]
    initial = next((entry["test"] for entry in tested if entry.get("round") == 0), None)
    final = history.get("final_test") or (tested[-1]["test"] if tested else None)
    return {
        "initial_test_acc": None if initial is None else initial.get("test-acc"),
        "final_test_acc": None if final is None else final.get("test-acc"),
        "final_test_loss": None if final is None else final.get("test-loss"),
        "test_examples": None if final is None else final.get("test-examples"),
    }


@dataclass
class PointResult:
    """One point of the sweep: its CSV row, keyed by :data:`SWEEP_COLUMNS`."""

    row: dict[str, Any]

    @property
    def ok(self) -> bool:
        """Whether the point's simulation finished."""
        return self.row.get("status") == "ok"


def _point_name(defense: Defense, index: int, value: float) -> str:
    return f"{index:02d}_{defense.name}={value:g}"


def _clear_run_dir(directory: Path) -> None:
    """Remove a previous run of the same point (only a directory that is a run directory)."""
    if not directory.exists():
        return
    from fl_attack.results.store import RUN_CONFIG_FILE, TABLE_FILE  # pylint: disable=import-outside-toplevel

    if not ((directory / RUN_CONFIG_FILE).exists() or (directory / TABLE_FILE).exists()):
        raise ValueError(f"{directory} exists and is not a run directory; not overwriting it")
    shutil.rmtree(directory)


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def run_point(
    defense: Defense,
    value: float,
    *,
    overrides: Mapping[str, Any],
    clients: int,
    cpus: int,
    delta: float,
    csv_dir: Path,
) -> PointResult:
    """Run one point's simulation and summarise it; never raises for a failed simulation."""
    import json  # pylint: disable=import-outside-toplevel

    from fl_attack.results.store import HISTORY_FILE, TABLE_FILE, load_table  # pylint: disable=import-outside-toplevel
    from strategies.cli import run_audit_simulation  # pylint: disable=import-outside-toplevel
    from strategies.run_config import resolve_run_config  # pylint: disable=import-outside-toplevel

    config = resolve_run_config({}, overrides)
    run_dir = Path(str(config["output-dir"]))
    epsilon = dpsgd_epsilon(config, delta=delta)
    row: dict[str, Any] = {
        "parameter": defense.name,
        "value": value,
        "status": "ok",
        "train_mode": config["train-mode"],
        "rounds": config["num-server-rounds"],
        "clients": clients,
        "epsilon": None if epsilon is None else ("inf" if math.isinf(epsilon) else round(epsilon, 4)),
        "delta": None if epsilon is None else delta,
        "run_dir": _relative(run_dir, csv_dir),
        "error": "",
    }
    start = time.perf_counter()
    try:
        _clear_run_dir(run_dir)
        run_audit_simulation(overrides, num_supernodes=clients, cpus=cpus)
    except (Exception, SystemExit) as error:  # pylint: disable=broad-exception-caught
        row["status"] = "error"
        row["error"] = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
        logging.getLogger(__name__).debug("point failed:\n%s", traceback.format_exc())
    row["seconds"] = round(time.perf_counter() - start, 1)
    table = run_dir / TABLE_FILE
    if table.exists():
        row.update(leakage_of(load_table(table)))
    history_path = run_dir / HISTORY_FILE
    if history_path.exists() and row["status"] == "ok":
        row.update(utility_of(json.loads(history_path.read_text(encoding="utf-8"))))
    return PointResult({key: _cell(row.get(key)) for key in SWEEP_COLUMNS})


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else ""
    return value


# --------------------------------------------------------------------------- the sweep


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
    output_dir: Path = RESULTS_DIR,
    name: str | None = None,
    runs_dir: Path | None = None,
    stream: TextIO | None = None,
) -> list[PointResult]:
    """Run the sweep and write ``<name>.csv``, ``.json``, ``.md`` and ``.png``.

    Parameters
    ----------
    defense : Defense
        The swept defense (:func:`get_defense`).
    values : Sequence[float]
        Its values (:func:`parse_values`).
    user_overrides : Mapping[str, Any] or None (default: None)
        The user's run-config overrides (``-c``).
    rounds : int or None (default: None)
        Federated rounds; None keeps the run config's ``num-server-rounds``.
    clients : int or None (default: None)
        Simulated clients; None means 3, or what the defense needs when more.
    cpus : int (default: 2)
        CPUs Ray may use (one per training client).
    seed : int (default: 0)
        Seed of the model, the partitioning, the clients and the attacker, shared by
        every point.
    delta : float (default: 1e-5)
        Delta of the reported DP-SGD epsilon.
    output_dir : Path (default: experiments/results)
        Folder of the sweep's files.
    name : str or None (default: None)
        File stem; None gives ``sweep_<parameter>``.
    runs_dir : Path or None (default: None)
        Folder of the points' run directories; None gives ``<output_dir>/raw/<name>``.
    stream : TextIO or None (default: None)
        Where progress goes; None means stderr.

    Returns
    -------
    list[PointResult]
        One per value, in the order given.

    Raises
    ------
    ValueError
        On invalid settings (checked for every point before any simulation starts).
    """
    from strategies.run_config import resolve_run_config  # pylint: disable=import-outside-toplevel

    out = stream if stream is not None else sys.stderr
    values = list(values)
    if not values:
        raise ValueError("a sweep needs at least one value")
    for value in values:
        defense.check(float(value))
    needed = defense.min_clients(values) if defense.min_clients is not None else 1
    if clients is None:
        clients = max(3, needed)
    if clients < needed:
        raise ValueError(
            f"{defense.name}={max(values):g} needs at least {needed} clients; pass --clients {needed}"
        )
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be positive, got {rounds}")
    if cpus < 1:
        raise ValueError(f"cpus must be positive, got {cpus}")
    name = name or f"sweep_{defense.name}"
    output_dir = Path(output_dir)
    runs_dir = Path(runs_dir) if runs_dir is not None else output_dir / "raw" / name
    user = dict(user_overrides or {})

    # Every point's run config is validated before the first simulation starts.
    plans = []
    for index, value in enumerate(values):
        overrides = point_overrides(
            defense,
            value,
            user=user,
            rounds=rounds,
            clients=clients,
            seed=seed,
            output_dir=(runs_dir / _point_name(defense, index, value)).resolve(),
        )
        config = resolve_run_config({}, overrides)
        plans.append((value, overrides, config))
    if defense.min_clients is not None:
        for value in values:
            if clients % int(value):
                print(
                    f"[{name}] note: {clients} clients are not a multiple of {defense.name}={value:g}; "
                    "the last group is smaller",
                    file=out,
                    flush=True,
                )

    first = plans[0][2]
    settings = {
        "parameter": defense.name,
        "run_config_key": defense.key,
        "description": defense.description,
        "values": values,
        "base_overrides": dict(defense.base),
        "user_overrides": user,
        "rounds": first["num-server-rounds"],
        "clients": clients,
        "cpus": cpus,
        "seed": seed,
        "dataset": first["dataset"],
        "width": first["width"],
        "train_mode": first["train-mode"],
        "attack_time_budget": first["attack-time-budget"],
        "runs_dir": str(runs_dir),
    }
    results: list[PointResult] = []
    sweep_start = time.perf_counter()
    with ResultsWriter(output_dir, name=name, fields=SWEEP_COLUMNS) as writer:
        for index, (value, overrides, _) in enumerate(plans):
            print(
                f"[{name}] point {index + 1}/{len(plans)}: {defense.name}={value:g} "
                f"({clients} clients, {settings['rounds']} rounds) ...",
                file=out,
                flush=True,
            )
            result = run_point(
                defense,
                value,
                overrides=overrides,
                clients=clients,
                cpus=cpus,
                delta=delta,
                csv_dir=output_dir,
            )
            writer.add(result.row)
            results.append(result)
            print(f"[{name}] point {index + 1}/{len(plans)}: {_progress_line(result.row)}", file=out, flush=True)
        markdown = sweep_markdown(defense, settings, [result.row for result in results])
        writer.finish(
            {
                "settings": settings,
                "columns": COLUMN_DOCS,
                "rows": [result.row for result in results],
                "seconds": round(time.perf_counter() - sweep_start, 1),
            },
            markdown,
        )
    plot_sweep(defense, [result.row for result in results], output_dir / f"{name}.png")
    print(f"[{name}] wrote {output_dir / name}.{{csv,json,md,png}}", file=out, flush=True)
    return results


def _progress_line(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"error after {row['seconds']} s: {row['error']}"
    return (
        f"{row['attacked_updates']} updates attacked ({row['attack_failures']} failed), "
        f"exact {_percent(row['exact_fraction'])} approx {_percent(row['approx_fraction'])} of "
        f"{row['scored_samples']} samples; test acc {_fixed(row['initial_test_acc'])} -> "
        f"{_fixed(row['final_test_acc'])}; {row['seconds']} s"
    )


def _percent(value: Any) -> str:
    return "—" if value in ("", None) else f"{100.0 * float(value):.0f}%"


def _fixed(value: Any, digits: int = 3) -> str:
    if value in ("", None):
        return "—"
    if isinstance(value, str):
        return value
    return f"{float(value):.{digits}f}"


def sweep_markdown(
    defense: Defense, settings: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> str:
    """The markdown report: settings, then one table row per value."""
    with_epsilon = any(row.get("epsilon") not in ("", None) for row in rows)
    headers = [defense.name]
    if with_epsilon:
        headers.append(f"epsilon (delta={rows[0].get('delta') or DEFAULT_DELTA:g})")
    headers += [
        "exact (> 90 dB)",
        "approx (> 25 dB)",
        "updates exact",
        "attacks (failed)",
        "median attack s",
        "test acc round 0",
        f"test acc round {settings['rounds']}",
        "status",
    ]
    table_rows = []
    for row in rows:
        cells = [f"{row['value']:g}" if isinstance(row["value"], (int, float)) else str(row["value"])]
        if with_epsilon:
            epsilon = row.get("epsilon")
            cells.append("—" if epsilon in ("", None) else (epsilon if isinstance(epsilon, str) else f"{epsilon:.3g}"))
        cells += [
            _percent(row["exact_fraction"]),
            _percent(row["approx_fraction"]),
            _percent(row["updates_exact_fraction"]),
            f"{row['attacked_updates'] or 0} ({row['attack_failures'] or 0})",
            _fixed(row["median_attack_seconds"], 1),
            _fixed(row["initial_test_acc"]),
            _fixed(row["final_test_acc"]),
            row["status"] if row["status"] == "ok" else f"error: {row['error']}",
        ]
        table_rows.append(cells)
    overrides = {**settings["base_overrides"], **settings["user_overrides"]}
    lines = [
        f"## Defense sweep: {defense.name}",
        "",
        f"{defense.description}. {settings['clients']} clients, {settings['rounds']} rounds, "
        f"dataset `{settings['dataset']}`, train mode `{settings['train_mode']}`, seed {settings['seed']}, "
        f"attack time budget {settings['attack_time_budget']:g} s; overrides: "
        + (" ".join(f"`{key}={value!r}`" for key, value in overrides.items()) or "none")
        + ".",
        "",
        "Leakage = share of the attacked clients' samples the server recovered (PSNR after "
        "matching), over every round and client; \"updates exact\" = share of attacked updates "
        "recovered completely. Utility = global model's accuracy on the test split.",
        "",
        markdown_table(headers, table_rows),
    ]
    return "\n".join(lines)


def plot_sweep(defense: Defense, rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Leakage fractions (top) and test accuracy (bottom) against the parameter (Agg PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

    def series(column: str) -> tuple[list[float], list[float]]:
        points = sorted(
            (float(row["value"]), float(row[column]))
            for row in rows
            if row.get("status") == "ok" and row.get(column) not in ("", None)
        )
        return [x for x, _ in points], [y for _, y in points]

    figure = Figure(figsize=(6.4, 6.0), constrained_layout=True)
    FigureCanvasAgg(figure)
    leak_axis, utility_axis = figure.subplots(2, 1, sharex=True)
    for column, label, marker in (
        ("exact_fraction", "samples exact (> 90 dB)", "o"),
        ("approx_fraction", "samples approx. (> 25 dB)", "s"),
        ("updates_exact_fraction", "updates fully exact", "^"),
    ):
        xs, ys = series(column)
        leak_axis.plot(xs, ys, marker=marker, label=label)
    leak_axis.set_ylabel("leakage (fraction recovered)")
    leak_axis.set_ylim(-0.05, 1.05)
    leak_axis.legend(loc="best", fontsize="small")
    leak_axis.grid(alpha=0.3)
    xs, ys = series("final_test_acc")
    rounds = next((row["rounds"] for row in rows if row.get("rounds") not in ("", None)), "?")
    utility_axis.plot(xs, ys, marker="o", color="tab:green", label=f"after round {rounds}")
    xs0, ys0 = series("initial_test_acc")
    utility_axis.plot(xs0, ys0, linestyle="--", color="tab:gray", label="initial model")
    accuracies = ys + ys0
    utility_axis.set_ylim(0.0, min(1.0, max(accuracies) + 0.1) if accuracies else 1.0)
    utility_axis.set_ylabel("test accuracy")
    utility_axis.set_xlabel(defense.name)
    utility_axis.legend(loc="best", fontsize="small")
    utility_axis.grid(alpha=0.3)
    if defense.kind is int:
        utility_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    values = sorted(float(row["value"]) for row in rows)
    positive = [value for value in values if value > 0]
    if positive and values[-1] / positive[0] >= 50:
        if values[0] <= 0:
            utility_axis.set_xscale("symlog", linthresh=positive[0])
            utility_axis.set_xlim(-0.2 * positive[0], 1.3 * values[-1])
        else:
            utility_axis.set_xscale("log")
    figure.suptitle(f"Privacy-utility trade-off: {defense.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.defense_sweep",
        description="Sweep a defense parameter in the Flower simulation: leakage vs test accuracy.",
    )
    parser.add_argument("--parameter", help=f"the defense to sweep: {', '.join(DEFENSES)}")
    parser.add_argument("--values", help="comma-separated values (default: the defense's defaults)")
    parser.add_argument("--rounds", type=int, help="federated rounds (default: num-server-rounds, 2)")
    parser.add_argument("--clients", type=int, help="simulated clients (default 3, or what the defense needs)")
    parser.add_argument("-c", "--run-config", default="",
                        help='run-config overrides, e.g. "dataset=\'digits\' attack-time-budget=10"')
    parser.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (default 2; 1 per client)")
    parser.add_argument("--threads", type=int, help="torch threads of the server/attacker (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model, partition, client and attack seed of every point (default 0)")
    parser.add_argument("--delta", type=float, default=DEFAULT_DELTA,
                        help=f"delta of the reported DP-SGD epsilon (default {DEFAULT_DELTA:g})")
    parser.add_argument("--output-dir", "--out", type=Path, default=RESULTS_DIR,
                        help=f"folder of the sweep's files (default {RESULTS_DIR})")
    parser.add_argument("--name", help="file stem (default sweep_<parameter>)")
    parser.add_argument("--runs-dir", type=Path,
                        help="folder of the points' run directories (default <output-dir>/raw/<name>)")
    parser.add_argument("--verbose", action="store_true", help="keep Flower's INFO log on stderr")
    parser.add_argument("--list", action="store_true", help="list the sweepable defenses and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sweep from the command line; return the exit code (2 on bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for defense in DEFENSES.values():
            values = ",".join(f"{value:g}" for value in defense.defaults)
            base = " ".join(f"{key}={value!r}" for key, value in defense.base.items()) or "-"
            print(f"{defense.name:18s} {defense.description}\n{'':18s} default values {values}; base {base}")
        return 0
    if not args.parameter:
        parser.error(f"--parameter is required; registered: {', '.join(DEFENSES)}")
    from strategies.cli import parse_overrides  # pylint: disable=import-outside-toplevel

    try:
        defense = get_defense(args.parameter)
        values = parse_values(defense, args.values)
        user = parse_overrides(args.run_config)
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
            output_dir=args.output_dir,
            name=args.name,
            runs_dir=args.runs_dir,
        )
    except ValueError as error:
        parser.error(str(error))
    name = args.name or f"sweep_{defense.name}"
    print((args.output_dir / f"{name}.md").read_text(encoding="utf-8"))
    return 0 if any(result.ok for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
