"""Many clients' updates audited at once on one device: the Auditor with ``workers=k``.

One FedSGD round of ``clients`` clients of the SPEAR++ victim (one global model, each client one
full-batch SGD step on its own batch, sending float32 weights), audited by
:class:`fl_attack.audit.Auditor` with thread isolation and ``k`` pool workers: ``k`` attacks at a
time in this one process, on CUDA each on a stream of its own
(:mod:`fl_attack.audit.device_share`). Per ``k``: the wall time from handing the round to the
auditor until every attack has finished, clients per second, how many reconstructions are exact
against the true batches (and the auditor's own verdicts), and the peak GPU memory on CUDA. Run through
``experiments/gpu_bench.py --clients C --workers 1 4 8``.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from experiments.config import Cell, Setting
from experiments.observe import draw_trial
from fl_attack import SpearPlusPlus
from fl_attack.audit import AttackSettings, Auditor, ClientIdentity, ClientUpdate, ExecutionSettings
from fl_attack.data.images import ImageData
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.simulate.victims import LOSSES

#: The clients' learning rate: FedSGD sending weights, as the audited simulations do.
CLIENT_LR = 0.1


@dataclass(frozen=True)
class ClientRound:
    """One round of one cell: the global arrays, the clients' updates and their true batches ``(b, n)``."""

    cell: str
    global_arrays: dict[str, np.ndarray]
    updates: list[ClientUpdate]
    references: list[torch.Tensor]


@dataclass
class ManyClientsRun:
    """One round audited with ``workers`` attacks at a time on ``device``."""

    device: str
    cell: str
    clients: int
    workers: int
    seconds: float
    clients_per_second: float
    exact: int
    verdicts: dict[str, int]
    statuses: dict[str, int]
    peak_gpu_mib: float | None

    def row(self) -> dict[str, Any]:
        """The run as a JSON-ready dict."""
        return asdict(self)


def client_round(data: ImageData, cell: Cell, *, clients: int, seed: int) -> ClientRound:
    """``clients`` clients' FedSGD updates of one global victim (drawn from ``seed``), client ``k``
    on the batch of trial ``k`` (seed ``seed + k``)."""
    setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1)
    trials = [draw_trial(data, setting, index=k, seed=seed + k) for k in range(clients)]
    model = trials[0].model
    global_arrays = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    updates = []
    for k, trial in enumerate(trials):
        client = copy.deepcopy(model)
        with torch.enable_grad():
            loss = LOSSES["ce"](client(trial.inputs), trial.labels)
            gradients = torch.autograd.grad(loss, list(client.parameters()))
        with torch.no_grad():
            for parameter, gradient in zip(client.parameters(), gradients, strict=True):
                parameter.sub_(CLIENT_LR * gradient)
        arrays = {key: value.detach().numpy().copy() for key, value in client.state_dict().items()}
        updates.append(ClientUpdate(identity=ClientIdentity(node_id=k + 1, partition_id=k), arrays=arrays))
    return ClientRound(cell.label, global_arrays, updates, [trial.reference for trial in trials])


def audit_round(
    device: str, round_: ClientRound, data: ImageData, *, workers: int, budget: float, seed: int
) -> ManyClientsRun:
    """Audit ``round_`` with ``workers`` attacks at a time (thread isolation) on ``device``."""
    cuda = device.startswith("cuda")
    auditor = Auditor(
        SpearPlusPlus(device=device, seed=seed, time_budget=budget, progress=False),
        attack=AttackSettings(time_budget=budget, timeout=2 * budget + 30.0, fallback="none"),
        execution=ExecutionSettings(isolation="thread", workers=workers),
    )
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    auditor.start_round(1, round_.global_arrays)
    auditor.audit_round(1, round_.updates)
    auditor.close()  # waits for every attack
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    by_client = {record.client: record for record in auditor.records}
    exact = 0
    for k, reference in enumerate(round_.references):
        record = by_client.get(f"partition-{k}")
        if record is None or record.inputs is None:
            continue
        quality = evaluate_reconstruction(
            record.inputs, reference, denormalize=data.denormalize, image_shape=data.image_shape
        )
        exact += int(quality.exact_fraction == 1.0 and bool(record.attack.get("complete")))
    clients = len(round_.updates)
    return ManyClientsRun(
        device=device,
        cell=round_.cell,
        clients=clients,
        workers=workers,
        seconds=seconds,
        clients_per_second=clients / seconds,
        exact=exact,
        verdicts=dict(Counter(str(record.verdict) for record in auditor.records)),
        statuses=dict(Counter(record.status for record in auditor.records)),
        peak_gpu_mib=peak,
    )


def measure(
    device: str,
    data: ImageData,
    cell: Cell,
    *,
    clients: int,
    workers: Sequence[int],
    budget: float,
    seed: int,
    measured: Callable[[ManyClientsRun], None] | None = None,
) -> list[ManyClientsRun]:
    """The same round audited with each number of ``workers``, after one untimed warm-up round of
    as many clients as the most workers (so each stream's first use is not timed); ``measured`` is
    called with each run as it finishes (a run cut short keeps what it measured)."""
    warm_up = client_round(data, cell, clients=max(workers), seed=seed + 50_000)
    audit_round(device, warm_up, data, workers=max(workers), budget=budget, seed=seed)
    round_ = client_round(data, cell, clients=clients, seed=seed)
    runs = []
    for count in workers:
        run = audit_round(device, round_, data, workers=count, budget=budget, seed=seed)
        runs.append(run)
        if measured is not None:
            measured(run)
        peak = "-" if run.peak_gpu_mib is None else f"{run.peak_gpu_mib:.0f} MiB"
        print(
            f"many clients {run.cell} {device} workers={count}: {run.clients} clients in {run.seconds:.2f} s "
            f"({run.clients_per_second:.2f}/s), exact {run.exact}/{run.clients} "
            f"against the true batches, verdicts {run.verdicts}, statuses {run.statuses}, peak GPU {peak}",
            flush=True,
        )
    return runs


def markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The many-clients table (empty when nothing was measured)."""
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        f"## Many clients on one device ({first['clients']} clients of {first['cell']}, "
        "thread isolation, one stream per attack on CUDA)",
        "",
        "| device | workers | seconds | clients / s | exact | verdicts | statuses | peak GPU MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peak = "-" if row["peak_gpu_mib"] is None else f"{row['peak_gpu_mib']:.0f}"
        verdicts, statuses = (
            ", ".join(f"{key} {value}" for key, value in sorted(row[name].items()))
            for name in ("verdicts", "statuses")
        )
        lines.append(
            f"| {row['device']} | {row['workers']} | {row['seconds']:.2f} | {row['clients_per_second']:.2f} | "
            f"{row['exact']}/{row['clients']} | {verdicts} | {statuses} | {peak} |"
        )
    return lines
