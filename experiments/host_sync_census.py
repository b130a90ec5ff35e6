"""Count, by pipeline line, the host syncs and decompositions of one SPEAR++ attack (any device).

A host sync is a call that needs a tensor's value on the host: ``.item()``, ``float()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``, ``nonzero`` and boolean-mask indexing. On a CPU
they cost nothing, on a GPU each is a device-to-host round trip that stalls the stream; this
census finds them without a GPU. Decompositions (``torch.linalg``) are timed per call site.

    PYTHONPATH=. python experiments/host_sync_census.py --cell 20x200 --threads 1
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from experiments.config import Cell, Setting, parse_cells
from experiments.observe import draw_trial, observe
from fl_attack import SpearPlusPlus
from fl_attack.data.images import load_dataset

SYNC_CALLS = frozenset(
    {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "nonzero", "cpu", "numpy", "unique"}
)
NOT_DECOMPOSITIONS = frozenset({"norm", "vector_norm", "matrix_norm"})


def _site() -> str:
    frames = [frame for frame in traceback.extract_stack()[:-2] if "/fl_attack/" in frame.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.split('fl_attack/')[-1]}:{frame.lineno} {frame.name}"


class Census(TorchFunctionMode):
    """Counts host syncs and times ``torch.linalg`` calls by the ``fl_attack`` line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.seconds: Counter[tuple[str, str]] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        module = getattr(func, "__module__", "") or ""
        kind = None
        if name in SYNC_CALLS:
            kind = f"sync {name}"
        elif name == "__getitem__" and len(args) > 1:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                kind = "sync bool-mask index"
        elif "linalg" in module and name not in NOT_DECOMPOSITIONS:
            kind = f"linalg {name}"
        if kind is None:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        key = (kind, _site())
        self.calls[key] += 1
        self.seconds[key] += time.perf_counter() - start
        return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="20x200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-budget", type=float, default=300.0)
    parser.add_argument("--next-layer", action="store_true")
    parser.add_argument("--dataset", default="cifar10")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    (cell,) = parse_cells(args.cell)
    data = load_dataset(args.dataset, split="train" if args.dataset == "cifar10" else "all")

    def attack(cell: Cell, seed: int, census: Census | None) -> str:
        setting = Setting(section="fedsgd", cell=cell, methods=("l1",), trials=1, dataset=args.dataset)
        trial = draw_trial(data, setting, index=0, seed=seed)
        observation = observe(setting, trial, data)
        update = observation.update
        following = observation.next_weight_update if args.next_layer else None
        spear = SpearPlusPlus(device=args.device, seed=seed, time_budget=args.time_budget, progress=False)
        start = time.perf_counter()
        if census is None:
            rec = spear.invert(
                update.weight_update, update.bias_update, weight=update.weight, bias=update.bias
            )
        else:
            with census:
                rec = spear.invert(
                    update.weight_update,
                    update.bias_update,
                    weight=update.weight,
                    bias=update.bias,
                    next_weight_grad=following,
                )
        return f"{time.perf_counter() - start:.2f} s, found {rec.found}/{cell.batch_size}, complete={rec.complete}"

    attack(Cell(4, 50), 10_000, None)  # one-time set-up outside the census
    census = Census()
    print(f"{args.cell} (instrumented): {attack(cell, args.seed, census)}")
    totals: Counter[str] = Counter()
    for (kind, _), count in census.calls.items():
        totals[kind] += count
    print("totals:", dict(totals.most_common()))
    print("\nhost syncs by site:")
    for (kind, site), count in census.calls.most_common():
        if kind.startswith("sync"):
            print(f"  {count:5d}  {kind:22s} {site}")
    print("\ndecompositions by site (calls, seconds):")
    for (kind, site), seconds in census.seconds.most_common():
        if kind.startswith("linalg"):
            print(f"  {census.calls[(kind, site)]:5d} {seconds:9.3f} s  {kind:28s} {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
