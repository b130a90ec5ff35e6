"""The measurements of :mod:`experiments.audit_overhead`, each run in a fresh child process.

``python -m experiments.overhead_children MODE SPEC RESULT`` reads a JSON spec, measures, and
writes a JSON result; the parent samples the child's process tree meanwhile. Modes:

``simulate``
    The default app (``fl-attack-audit``'s in-process Flower simulation,
    :func:`strategies.cli.run_audit_simulation`) with the spec's clients, CPUs and run-config
    overrides. Round times come from Flower's own log, the same way whether the run is audited or
    not: a round lasts from its ``[ROUND r/n]`` line to the next one (the last round to "Strategy
    execution finished"), so it covers training, aggregation, federated and server evaluation.
``throughput``
    Attacks per second of an :class:`fl_attack.audit.Auditor` with 1 and with 2 local worker
    processes on the same queue of default-app updates (SPEAR++ victim, photo patches, FedSGD
    batch 8), after warm-up attacks that start every worker.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.process_tree import load_average, tree_cpu_seconds

MODES = ("simulate", "throughput")


class RoundClock(logging.Handler):
    """Records when Flower's strategy logs the start of each round and the end of the run."""

    def __init__(self) -> None:
        super().__init__()
        self.round_starts: list[float] = []
        self.finished: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the time of a ``[ROUND r/n]`` or "Strategy execution finished" record."""
        message = record.getMessage()
        if message.startswith("[ROUND "):
            self.round_starts.append(record.created)
        elif message.startswith("Strategy execution finished"):
            self.finished = record.created

    def round_seconds(self) -> list[float]:
        """Seconds of every completed round, in order."""
        ends = [*self.round_starts[1:], *([self.finished] if self.finished is not None else [])]
        return [end - start for start, end in zip(self.round_starts, ends, strict=False)]


def simulate(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run the default app with ``spec``'s ``clients``, ``cpus`` and run-config ``overrides``.

    Returns
    -------
    dict[str, Any]
        ``round_seconds``, ``round_starts`` and ``finished`` (wall-clock), ``run_seconds``,
        ``after_rounds_seconds`` (waiting for the attack queue, writing the report),
        ``attacks`` (rows of ``attacks.csv`` by verdict), ``run_dir`` and, for an audited run,
        ``train_phase_seconds`` (the strategy's own per-round clock in ``history.json``).
    """
    from fl_attack.results.store import HISTORY_FILE, TABLE_FILE, load_table
    from strategies.cli import AuditSimulationError, run_audit_simulation

    overrides = dict(spec["overrides"])
    audited = bool(overrides.get("attack-enabled", True))
    clock = RoundClock()
    logging.getLogger("flwr").addHandler(clock)
    started = time.time()
    run_dir: Path | None = None
    try:
        run_dir = run_audit_simulation(overrides, num_supernodes=int(spec["clients"]), cpus=int(spec["cpus"]))
    except AuditSimulationError:
        if audited:
            raise
        # without the audit there is no attacks table: expected
    ended = time.time()
    # a run without the audit ends normally and writes no attacks table
    rows = load_table(run_dir / TABLE_FILE) if run_dir is not None and (run_dir / TABLE_FILE).exists() else []
    verdicts: dict[str, int] = {}
    for row in rows:
        verdicts[row["verdict"] or row["status"]] = verdicts.get(row["verdict"] or row["status"], 0) + 1
    train_phase: list[float] | None = None
    if run_dir is not None and (run_dir / HISTORY_FILE).exists():
        stored = json.loads((run_dir / HISTORY_FILE).read_text(encoding="utf-8")).get("round_seconds", {})
        train_phase = [float(stored[key]) for key in sorted(stored, key=int)]
    if clock.finished is None:
        raise RuntimeError("Flower never logged 'Strategy execution finished': the run did not complete")
    return {
        "audited": audited,
        "round_seconds": clock.round_seconds(),
        "round_starts": clock.round_starts,
        "finished": clock.finished,
        "run_seconds": ended - started,
        "after_rounds_seconds": ended - clock.finished,
        "attacks": verdicts,
        "attacked_updates": len(rows),
        "run_dir": None if run_dir is None else str(run_dir),
        "train_phase_seconds": train_phase,
    }


def default_app_updates(count: int, *, first_seed: int) -> tuple[dict[str, Any], list[Any]]:
    """``count`` client updates of the default app's first round, and the global arrays.

    Each update is what a default-app client sends: the model after one SGD step (lr
    ``local-lr``) on a batch of ``batch-size`` photo patches drawn with seed ``first_seed + i``.
    """
    import numpy as np

    from fl_attack.audit import ClientIdentity, ClientUpdate
    from fl_attack.data.images import load_dataset, sample_batch
    from fl_attack.simulate.gradients import client_gradient
    from fl_attack.simulate.models import build_victim, first_linear
    from strategies.run_config import resolve_run_config

    config = resolve_run_config({})
    data = load_dataset(str(config["dataset"]), split="train")
    model = build_victim(
        str(config["architecture"]),
        input_dim=int(data.input_dim),
        width=int(config["width"]),
        num_classes=int(data.num_classes),
        seed=int(config["model-seed"]),
    )
    name, layer = first_linear(model)
    global_arrays = {key: value.detach().numpy() for key, value in model.state_dict().items()}
    lr = float(config["local-lr"])
    updates = []
    for index in range(count):
        seed = first_seed + index
        inputs, labels, _ = sample_batch(data, int(config["batch-size"]), seed=seed)
        weight_grad, bias_grad = client_gradient(model, inputs, labels)
        arrays = dict(global_arrays)
        arrays[f"{name}.weight"] = (layer.weight.detach() - lr * weight_grad).numpy().astype(np.float32)
        arrays[f"{name}.bias"] = (layer.bias.detach() - lr * bias_grad).numpy().astype(np.float32)
        updates.append(ClientUpdate(identity=ClientIdentity(node_id=seed, partition_id=seed), arrays=arrays))
    return global_arrays, updates


def throughput(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Attacks per second with each of ``spec['workers']`` local workers, interleaved ``repeats`` times.

    Every measurement uses a new :class:`~fl_attack.audit.Auditor` (worker processes, the
    default app's attacker and budget), first runs ``warmup_per_worker`` attacks per worker so
    that every worker process has started, then times ``jobs`` attacks from queueing the first
    to the end of the last.
    """
    import torch

    from fl_attack.audit import AttackSettings, Auditor, ExecutionSettings
    from strategies.factory import build_attacker
    from strategies.run_config import attack_timeout, resolve_run_config

    torch.set_num_threads(1)
    config = resolve_run_config({})
    jobs, warmup = int(spec["jobs"]), int(spec["warmup_per_worker"])
    global_arrays, timed_updates = default_app_updates(jobs, first_seed=1000)
    _, warmup_updates = default_app_updates(warmup * max(spec["workers"]), first_seed=0)
    measurements: list[dict[str, Any]] = []
    for repeat in range(int(spec["repeats"])):
        for workers in spec["workers"]:
            auditor = Auditor(
                build_attacker(config),
                attack=AttackSettings(
                    time_budget=float(config["attack-time-budget"]), timeout=attack_timeout(config)
                ),
                execution=ExecutionSettings(isolation="process", workers=int(workers)),
            )
            try:
                auditor.start_round(1, global_arrays)
                auditor.audit_round(1, warmup_updates[: warmup * int(workers)])
                auditor.drain()
                auditor.start_round(2, global_arrays)
                cpu_before, started = tree_cpu_seconds(os.getpid()), time.perf_counter()
                auditor.audit_round(2, timed_updates)
                auditor.drain()
                seconds = time.perf_counter() - started
                cpu_seconds = tree_cpu_seconds(os.getpid()) - cpu_before
            finally:
                auditor.close()
            timed = [record for record in auditor.records if record.server_round == 2]
            statuses: dict[str, int] = {}
            for record in timed:
                statuses[record.status] = statuses.get(record.status, 0) + 1
            measurements.append(
                {
                    "repeat": repeat,
                    "workers": int(workers),
                    "attacks": len(timed),
                    "seconds": seconds,
                    "attacks_per_second": len(timed) / seconds,
                    "cpu_seconds_per_attack": cpu_seconds / len(timed),
                    "statuses": statuses,
                    "load": load_average()[0],
                }
            )
            print(json.dumps(measurements[-1]), flush=True)
    return {"measurements": measurements}


def main(argv: Sequence[str] | None = None) -> int:
    """``MODE SPEC RESULT``: run one measurement and write its JSON result; 2 on bad arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] not in MODES:
        print(
            f"usage: python -m experiments.overhead_children {{{','.join(MODES)}}} SPEC RESULT",
            file=sys.stderr,
        )
        return 2
    mode, spec_path, result_path = args
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    result = simulate(spec) if mode == "simulate" else throughput(spec)
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
