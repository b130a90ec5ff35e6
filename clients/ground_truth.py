"""Opt-in ground truth for scoring an audit: the one helper a client may call.

A client never has to change for its server to audit it. To let the audit *score* its
reconstructions (simulations and consenting test deployments), a client adds one line to
its train function::

    attach_ground_truth(reply.content, context, inputs=batch_x, model=model)

It sends the attacked layer's true inputs only when the client itself enabled it: its node
config says ``audit-ground-truth=true`` (``flower-supernode --node-config
"audit-ground-truth=true"``), or the ClientApp was built for a simulation with
ground truth on. A server's message can never turn it on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict
from torch import nn

from fl_attack.audit.protocol import GROUND_TRUTH_INPUTS, GROUND_TRUTH_KEY, NODE_GROUND_TRUTH_KEY
from fl_attack.simulate.victims import first_linear


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def ground_truth_enabled(context: Context, *, simulation: bool = False) -> bool:
    """Whether this client sends ground truth: its node config opts in, or its own app does.

    Parameters
    ----------
    context : Context
        The client's context; only ``node_config`` (set on the client's machine) is read.
    simulation : bool (default: False)
        The ClientApp's own switch for simulations, where node configs cannot be set.
    """
    return simulation or _truthy(context.node_config.get(NODE_GROUND_TRUTH_KEY, False))


def layer_inputs(model: nn.Module, inputs: torch.Tensor, *, layer: nn.Linear | None = None) -> torch.Tensor:
    """The inputs of ``layer`` (default: the first linear layer with a bias) for a batch.

    For an MLP these are the flattened samples; after convolutions they are the features
    the layer sees, which is what an attack on that layer recovers.
    """
    target = layer if layer is not None else first_linear(model)[1]
    captured: list[torch.Tensor] = []

    def capture(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0].detach().reshape(args[0].shape[0], -1).cpu())

    handle = target.register_forward_pre_hook(capture)
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        handle.remove()
    if not captured:
        raise ValueError("the attacked layer was not called in the model's forward pass")
    return captured[0]


def attach_ground_truth(
    content: RecordDict,
    context: Context,
    *,
    inputs: torch.Tensor | np.ndarray,
    model: nn.Module | None = None,
    simulation: bool = False,
) -> bool:
    """Add the batch's attacked-layer inputs to a reply, if this client opted in.

    Parameters
    ----------
    content : RecordDict
        The reply's content; gains an ArrayRecord under ``fl-attack-ground-truth``.
    context : Context
        The client's context (its node config decides).
    inputs : torch.Tensor or numpy.ndarray
        The batch the client trained on, as the model takes it.
    model : torch.nn.Module or None (default: None)
        The model: its first linear layer's inputs are sent (features after convolutions).
        None sends ``inputs`` flattened (right for a model whose first layer is linear).
    simulation : bool (default: False)
        The ClientApp's own switch for simulations.

    Returns
    -------
    bool
        Whether ground truth was attached.
    """
    if not ground_truth_enabled(context, simulation=simulation):
        return False
    batch = torch.as_tensor(inputs)
    values = layer_inputs(model, batch) if model is not None else batch.reshape(batch.shape[0], -1)
    content[GROUND_TRUTH_KEY] = ArrayRecord({GROUND_TRUTH_INPUTS: Array(values.to(torch.float64).numpy())})
    return True
