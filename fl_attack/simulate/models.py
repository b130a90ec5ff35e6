"""The victim networks of the SPEAR papers and where their attackable linear layers are.

SPEAR attacks a ``nn.Linear`` layer followed by a ReLU: its weight gradient
``dL/dW = dL/dZ @ X^T`` is low-rank and ``dL/dZ`` is sparse wherever the ReLU is off. This
module builds the fully connected ReLU networks of the papers and finds such layers in any
model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "VICTIMS",
    "build_victim",
    "first_linear",
    "followed_by_relu",
    "linear_layers",
    "relu_linear_layers",
    "spear_mlp",
    "spear_plus_plus_mlp",
]


def _relu_mlp(input_dim: int, width: int, num_classes: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    in_features = input_dim
    for _ in range(depth - 1):
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


def spear_plus_plus_mlp(
    input_dim: int, width: int, num_classes: int, depth: int | None = None
) -> nn.Sequential:
    """SPEAR++ victim: ``depth`` linear layers (default 4: three hidden ReLU layers of width m)."""
    return _relu_mlp(input_dim, width, num_classes, 4 if depth is None else depth)


def spear_mlp(input_dim: int, width: int, num_classes: int, depth: int | None = None) -> nn.Sequential:
    """SPEAR victim: ``depth`` linear layers (default 6: five hidden ReLU layers of width m)."""
    return _relu_mlp(input_dim, width, num_classes, 6 if depth is None else depth)


VICTIMS: dict[str, Callable[..., nn.Sequential]] = {
    "spear++": spear_plus_plus_mlp,
    "spear": spear_mlp,
}
"""Victim architectures by name; each builder takes ``(input_dim, width, num_classes, depth)``."""


def build_victim(
    architecture: str = "spear++",
    *,
    input_dim: int,
    width: int,
    num_classes: int = 10,
    depth: int | None = None,
    seed: int | None = None,
) -> nn.Sequential:
    """Build a victim network from :data:`VICTIMS`.

    Parameters
    ----------
    architecture
        ``"spear++"`` (``Flatten, Linear(n, m), ReLU, Linear(m, m), ReLU, Linear(m, m), ReLU,
        Linear(m, C)``) or ``"spear"`` (the same pattern with 6 linear layers).
    input_dim
        Number of input features n (``C * H * W`` for images; inputs are flattened).
    width
        Hidden width m.
    num_classes
        Output classes C.
    depth
        Number of linear layers, overriding the architecture's default; at least 2 so that
        the attacked first layer is followed by a ReLU.
    seed
        Seeds PyTorch's default initialisation; the global RNG is left untouched. None draws
        from the global RNG.

    Returns
    -------
    torch.nn.Sequential
        A float32 CPU model; ``model[1]`` is the attacked first linear layer.
    """
    if architecture not in VICTIMS:
        raise ValueError(f"unknown victim architecture {architecture!r}; available: {sorted(VICTIMS)}")
    for name, value, minimum in (
        ("input_dim", input_dim, 1),
        ("width", width, 1),
        ("num_classes", num_classes, 2),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if depth is not None and (not isinstance(depth, int) or depth < 2):
        raise ValueError(f"depth must be an integer >= 2 (linear layers), got {depth!r}")
    builder = VICTIMS[architecture]
    if seed is None:
        model = builder(input_dim, width, num_classes, depth)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = builder(input_dim, width, num_classes, depth)
    return model.to(torch.float32)


def first_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The first ``nn.Linear`` layer with a bias: the layer SPEAR attacks.

    Returns
    -------
    tuple[str, nn.Linear]
        Its qualified name (the ``state_dict`` prefix, e.g. ``"1"`` for
        ``model[1].weight``) and the module itself.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            return name, module
    raise ValueError(f"{type(model).__name__} has no nn.Linear layer with a bias")


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` in registration (forward) order.

    Returns
    -------
    list[tuple[str, nn.Linear]]
        ``(qualified name, module)`` pairs; layer ``l`` of
        :func:`fl_attack.simulate.gradients.layer_gradient` is entry ``l - 1``.
    """
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if not any(True for _ in module.children())
    ]


def followed_by_relu(model: nn.Module, layer: nn.Linear) -> bool:
    """Whether the next leaf module registered after ``layer`` in ``model`` is an ``nn.ReLU``.

    That is how :func:`build_victim` (and any ``nn.Sequential`` MLP) is laid out; False when
    ``layer`` is not a module of ``model``.
    """
    leaves = _leaf_modules(model)
    for position, (_, module) in enumerate(leaves):
        if module is layer:
            return position + 1 < len(leaves) and isinstance(leaves[position + 1][1], nn.ReLU)
    return False


def relu_linear_layers(model: nn.Module) -> list[tuple[int, str, nn.Linear]]:
    """The linear layers whose output goes straight into a ReLU: the layers SPEAR can attack.

    A layer counts as followed by a ReLU when the next leaf module registered after it is an
    ``nn.ReLU`` (:func:`followed_by_relu`). Layers without a bias are left out: the attack
    needs the bias gradient.

    Parameters
    ----------
    model
        The victim network.

    Returns
    -------
    list[tuple[int, str, nn.Linear]]
        ``(l, qualified name, module)`` with ``l`` the 1-based index among *all* linear
        layers, as :func:`fl_attack.simulate.gradients.layer_gradient` takes it. For the
        6-layer SPEAR victim these are ``l = 1..5``; the output layer 6 is not followed by a
        ReLU.
    """
    return [
        (index, name, module)
        for index, (name, module) in enumerate(linear_layers(model), start=1)
        if module.bias is not None and followed_by_relu(model, module)
    ]
