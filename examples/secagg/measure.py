"""Per-member recovery under real SecAgg+ against the simulated secure aggregation, on the same batches.

For every trial (a seed: the initial model and every client's batch), four clients of this
example train one FedSGD step on 8 images each (``--batch-size``; photo patches by default),
and the server attacks the first layer of what it observes:

* ``real SecAgg+``: the example app under ``flwr.simulation.run_simulation`` (Flower's
  ``secaggplus_mod`` and ``SecAggPlusWorkflow``); the audit sees what ``aggregate_fit`` gets.
* ``simulated, float sum``: the same four updates, replayed here, summed in float64 by the
  :class:`fl_attack.audit.Auditor` (``secagg-group-size = 4``).
* ``simulated, SecAgg+ quantization``: the same, with ``secagg_quantization`` (clipping,
  stochastic quantization, modular sum and dequantization of
  :mod:`fl_attack.simulate.secagg`).

Every setting is scored per member against the batches the clients report. Run from the
repository root::

    PYTHONPATH=.:examples/secagg python3 examples/secagg/measure.py --trials 3 --max-weights 1000,8
    PYTHONPATH=.:examples/secagg python3 examples/secagg/measure.py --trials 3 --batch-size 2 --max-weights 1000,8
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from secagg_example.task import app_config, draw_batch, fedsgd_step, load_data, make_model, partition

from fl_attack import get_attack
from fl_attack.audit import (
    AttackSettings,
    Auditor,
    ClientIdentity,
    ClientUpdate,
    ExecutionSettings,
    GroundTruth,
    SecAggSettings,
)
from fl_attack.evaluation.scoring import ReconstructionScorer
from fl_attack.pipeline.budget.budget import hard_limit
from fl_attack.results.store import load_table
from fl_attack.simulate.secagg import SecAggPlusQuantization

NUM_CLIENTS = 4


def _member_rows(members: Any, batch_size: int) -> list[dict[str, Any]]:
    """Per-member quality; an attack that returned nothing scored recovers none of the members' samples."""
    if not isinstance(members, dict):
        names = members if isinstance(members, list) else [f"member-{index}" for index in range(NUM_CLIENTS)]
        return [
            {"member": name, "samples": batch_size, "exact_fraction": 0.0, "approx_fraction": 0.0}
            for name in names
        ]
    return [{"member": name, **quality} for name, quality in sorted(members.items())]


def real_secagg(
    app: Mapping[str, Any], *, max_weight: float, time_budget: float, output: Path
) -> dict[str, Any]:
    """One round of the example app (``app``: its run-config overrides) under real SecAgg+, from its store."""
    from flwr.simulation import run_simulation
    from secagg_example.client_app import create_client_app
    from secagg_example.server_app import create_server_app

    overrides = {
        **app,
        "num-server-rounds": 1,
        "max-weight": max_weight,
        "attack-time-budget": time_budget,
        "attack-isolation": "thread",
        "output-dir": str(output),
    }
    run_simulation(
        server_app=create_server_app(overrides),
        client_app=create_client_app(overrides),
        num_supernodes=NUM_CLIENTS,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "num_gpus": 0},
        },
    )
    rows = load_table(output / "attacks.csv")
    if len(rows) != 1:
        raise RuntimeError(f"expected one attacked aggregate in {output}, found {len(rows)}")
    metrics = json.loads((output / rows[0]["directory"] / "metrics.json").read_text())
    members = _member_rows(metrics["details"].get("members"), int(app_config({}, app)["batch-size"]))
    return {"verdict": rows[0]["verdict"], "members": members}


def replayed_updates(app: Mapping[str, Any]) -> tuple[dict[str, Any], list[ClientUpdate]]:
    """The initial arrays and the clients' replies in round 1, computed as the example's clients do."""
    config = app_config({}, app)
    seed, data = int(config["seed"]), load_data(str(config["dataset"]))
    shape = {"input_dim": data.input_dim, "num_classes": data.num_classes, "width": int(config["width"])}
    initial = make_model(**shape, seed=seed)
    start = {key: value.detach().numpy().copy() for key, value in initial.state_dict().items()}
    updates = []
    for partition_id in range(NUM_CLIENTS):
        indices = partition(
            len(data),
            partition_id=partition_id,
            num_partitions=NUM_CLIENTS,
            size=int(config["samples-per-client"]),
            seed=seed,
        )
        batch = draw_batch(indices, batch_size=int(config["batch-size"]), seed=seed + 1000 + partition_id)
        model = make_model(**shape, seed=seed)
        selected = torch.as_tensor(batch)
        fedsgd_step(model, data.images[selected], data.labels[selected], lr=float(config["lr"]))
        updates.append(
            ClientUpdate(
                identity=ClientIdentity(node_id=partition_id + 1, partition_id=partition_id),
                arrays={key: value.detach().numpy().copy() for key, value in model.state_dict().items()},
                ground_truth=GroundTruth(indices=batch.tolist()),
                train_mode="fedsgd",
                num_examples=len(batch),
            )
        )
    return start, updates


def simulated(
    app: Mapping[str, Any],
    *,
    quantization: SecAggPlusQuantization | None,
    time_budget: float,
    scorer: ReconstructionScorer,
) -> dict[str, Any]:
    """The replayed updates attacked as one simulated secure-aggregation group."""
    start, updates = replayed_updates(app)
    auditor = Auditor(
        get_attack("spear++", device="cpu", seed=0, time_budget=time_budget, progress=False),
        scorer=scorer,
        attack=AttackSettings(time_budget=time_budget, timeout=hard_limit(time_budget)),
        execution=ExecutionSettings(isolation="thread"),
        secagg=SecAggSettings(group_size=NUM_CLIENTS, quantization=quantization),
    )
    try:
        auditor.start_round(1, start)
        (record,) = auditor.audit_round(1, updates)
    finally:
        auditor.close()
    members = _member_rows(record.details.get("members"), int(app_config({}, app)["batch-size"]))
    return {"verdict": record.verdict, "members": members}


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Share of the members' samples recovered exactly (> 90 dB) and approximately (> 25 dB), mean PSNR."""
    samples = exact = approx = psnr_sum = psnr_samples = 0.0
    for result in results:
        for member in result["members"]:
            samples += member["samples"]
            exact += member["samples"] * (member["exact_fraction"] or 0.0)
            approx += member["samples"] * (member["approx_fraction"] or 0.0)
            if member.get("mean_psnr") is not None:
                psnr_sum += member["samples"] * member["mean_psnr"]
                psnr_samples += member["samples"]
    return {
        "samples": int(samples),
        "exact_share": exact / samples if samples else None,
        "approx_share": approx / samples if samples else None,
        "mean_psnr": psnr_sum / psnr_samples if psnr_samples else None,
        "verdicts": [result["verdict"] for result in results],
    }


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    lines = [
        "| setting | samples | exact (> 90 dB) | approximate (> 25 dB) | mean PSNR (dB) | verdicts |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        psnr = "-" if row["mean_psnr"] is None else f"{row['mean_psnr']:.1f}"
        lines.append(
            f"| {name} | {row['samples']} | {row['exact_share']:.0%} | {row['approx_share']:.0%} | {psnr} | "
            f"{', '.join(row['verdicts'])} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print a markdown table (and write it as JSON with ``--json``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3, help="seeds 0 .. trials-1")
    parser.add_argument("--dataset", default="photo-patches", help="photo-patches or digits (bundled)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per client")
    parser.add_argument("--time-budget", type=float, default=60.0, help="attack budget per aggregate (s)")
    parser.add_argument(
        "--max-weights", default="1000", help="SecAgg+ max_weight values, comma-separated (Flower: 1000)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    max_weights = [float(value) for value in args.max_weights.split(",") if value.strip()]
    scorer = ReconstructionScorer.from_image_data(load_data(args.dataset))
    budget = args.time_budget
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="secagg-measure-") as scratch:
        for seed in range(args.trials):
            app = {"seed": seed, "dataset": args.dataset, "batch-size": args.batch_size}
            results.setdefault("simulated, float sum", []).append(
                simulated(app, quantization=None, time_budget=budget, scorer=scorer)
            )
            for max_weight in max_weights:
                quantization = SecAggPlusQuantization(max_weight=max_weight)
                results.setdefault(f"simulated, SecAgg+ quantization, max_weight {max_weight:g}", []).append(
                    simulated(app, quantization=quantization, time_budget=budget, scorer=scorer)
                )
                output = Path(scratch) / f"real-{seed}-{max_weight:g}"
                results.setdefault(f"real SecAgg+ (Flower), max_weight {max_weight:g}", []).append(
                    real_secagg(app, max_weight=max_weight, time_budget=budget, output=output)
                )
    summary = {name: summarize(runs) for name, runs in results.items()}
    print(
        f"\n{args.dataset}: {args.trials} trials x {NUM_CLIENTS} members x {args.batch_size} samples, "
        f"budget {budget:g} s, {time.time() - started:.0f} s\n"
    )
    print(table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
