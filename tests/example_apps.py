"""Run a Flower app of ``examples/`` in-process, with the run config ``flwr run`` would give it.

``flwr.simulation.run_simulation`` passes an empty run config, so the apps are wrapped: the
ServerApp and every ClientApp call get a Context whose run config is the example's
``[tool.flwr.app.config]`` with the test's overrides on top. The example's own app objects
run unchanged (Message-API or legacy alike). Ray's workers import the example's package
through ``PYTHONPATH``, set to the example's folder and this repository while the run lasts.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from strategies.run_config import AUDIT_KEYS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: The quickstart CNN's clients taking one SGD step on a batch of 8 at lr 0.1 (FedSGD-like: the
#: example's defaults before its clients trained whole epochs as Flower's quickstart does); the
#: first batch of the whole partition, as before, so the seeds give the same batches.
CNN_ONE_STEP = {"samples-per-client": 0, "local-steps": 1, "batch-size": 8, "lr": 0.1}


@dataclass(frozen=True)
class Example:
    """An example app: its folder, its components (``module:attribute``) and its run config."""

    folder: Path
    serverapp: str
    clientapp: str
    config: dict[str, Any]


def load_example(name: str, *, root: Path = EXAMPLES) -> Example:
    """Read ``<root>/<name>/pyproject.toml`` (``examples/`` by default); a missing app is an error naming it."""
    folder = root / name
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        raise FileNotFoundError(f"no example app at {folder} (expected {pyproject.name})")
    app = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["flwr"]["app"]
    return Example(
        folder, app["components"]["serverapp"], app["components"]["clientapp"], dict(app["config"])
    )


def _attribute(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _with_config(context: Context, config: Mapping[str, Any]) -> Context:
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=context.node_config,
        state=context.state,
        run_config=dict(config),
    )


def configured_apps(example: Example, overrides: Mapping[str, Any]) -> tuple[ServerApp, ClientApp]:
    """A ServerApp and a ClientApp that run the example's apps with its run config and ``overrides``."""
    # audit keys may be set on any app (from_context reads them, with defaults, from the run config)
    unknown = sorted(set(overrides) - set(example.config) - set(AUDIT_KEYS))
    if unknown:
        raise KeyError(
            f"{unknown} are not run-config keys of {example.folder.name}: {sorted(example.config)}"
        )
    config = {**example.config, **overrides}
    serverapp, clientapp = example.serverapp, example.clientapp

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        _attribute(serverapp)(grid, _with_config(context, config))

    client = ClientApp()

    def forward(message: Message, context: Context) -> Message:
        reply: Message = _attribute(clientapp)(message, _with_config(context, config))
        return reply

    client.train()(forward)
    client.evaluate()(forward)
    client.query()(forward)
    return server, client


@contextmanager
def example_on_path(example: Example) -> Iterator[None]:
    """The example's package importable here and in Ray's workers (``PYTHONPATH``) while inside."""
    paths = [str(example.folder), str(ROOT)]
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    before = set(sys.modules)
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([saved_env] if saved_env else []))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
        package = example.serverapp.split(".", 1)[0]
        for name in set(sys.modules) - before:
            if name == package or name.startswith(package + "."):
                del sys.modules[name]


def run_example(
    name: str, overrides: Mapping[str, Any], *, num_supernodes: int = 2, root: Path = EXAMPLES
) -> None:
    """Run ``<root>/<name>`` in-process with ``flwr.simulation.run_simulation`` (1 CPU per client)."""
    from flwr.simulation import run_simulation

    example = load_example(name, root=root)
    with example_on_path(example):
        server, client = configured_apps(example, overrides)
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=num_supernodes,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": 2, "num_gpus": 0},
            },
        )
