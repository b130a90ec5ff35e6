"""What an update the exact attack cannot apply to costs the audit: the quickstart CNN after many local steps.

::

    python -m experiments.not_applicable_cost                     # 13 and 64 local steps, process isolation
    python -m experiments.not_applicable_cost --steps 13 --isolation thread --repeats 3

Flower's quickstart-pytorch CNN (``examples/quickstart_cnn``) trains ``steps`` SGD steps
(momentum 0.9) of 32 photo patches; the server audits the change of ``fc1`` (120 x 400) with
SPEAR++ and the Cocktail Party fallback, as a ``from_context`` wrap would. Such an update has no
low-rank structure: its verdict is ``not-applicable``. Prints, per repeat, the wall time of
``Auditor.audit_round`` and the records it produced (attack, status, verdict). The machine may be
shared: the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_cnn"


def measure(steps: int, *, isolation: str, repeats: int, time_budget: float) -> list[float]:
    """Wall seconds of ``audit_round`` on one client's update after ``steps`` local steps."""
    sys.path.insert(0, str(EXAMPLE))
    from cnn_example.task import Net, train  # pylint: disable=import-outside-toplevel

    from fl_attack import get_attack  # pylint: disable=import-outside-toplevel
    from fl_attack.audit import (  # pylint: disable=import-outside-toplevel
        AttackSettings,
        Auditor,
        ClientIdentity,
        ClientUpdate,
        ExecutionSettings,
    )
    from fl_attack.data.images import load_dataset  # pylint: disable=import-outside-toplevel

    data = load_dataset("photo-patches", split="train")
    batch = 32
    torch.manual_seed(0)
    net = Net()
    received = {key: value.detach().clone().numpy() for key, value in net.state_dict().items()}
    images, labels = data.images[: steps * batch], data.labels[: steps * batch]
    train(
        net,
        [(images[i * batch : (i + 1) * batch], labels[i * batch : (i + 1) * batch]) for i in range(steps)],
        lr=0.1,
    )
    sent = {key: value.detach().numpy() for key, value in net.state_dict().items()}
    attacker = get_attack("spear++", device="cpu", seed=0, time_budget=time_budget, progress=False)
    auditor = Auditor(
        attacker,
        attack=AttackSettings(time_budget=time_budget, fallback="cocktail-party"),
        execution=ExecutionSettings(isolation=isolation),
    )
    seconds = []
    for server_round in range(1, repeats + 1):
        auditor.start_round(server_round, received)
        start = time.perf_counter()
        records = auditor.audit_round(
            server_round, [ClientUpdate(ClientIdentity(1), sent, num_examples=steps * batch)]
        )
        seconds.append(time.perf_counter() - start)
        produced = [(record.attack.get("attack"), record.status, record.verdict) for record in records]
        print(f"steps {steps}, repeat {server_round}: {seconds[-1]:.2f} s {produced}", flush=True)
    auditor.close()
    return seconds


def main(argv: list[str] | None = None) -> None:
    """Run the measurement and print it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", default="13,64", help="comma-separated local step counts")
    parser.add_argument("--isolation", default="process", choices=("process", "thread"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=30.0)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for steps in (int(item) for item in options.steps.split(",")):
        measure(steps, isolation=options.isolation, repeats=options.repeats, time_budget=options.time_budget)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
