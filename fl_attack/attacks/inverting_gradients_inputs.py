"""Validation of what :class:`~fl_attack.attacks.inverting_gradients.InvertingGradients` is given.

Each check turns one argument of ``invert`` into the tensor the optimization uses, or raises
a ``ValueError`` that names the problem: the observed gradients (one per model parameter),
the labels, the input shape, the normalization that bounds the valid inputs, and the time
budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fl_attack.types import ArrayLike

__all__ = ["GradientsLike", "check_budget", "check_labels", "check_shape", "gradient_list", "input_box"]

GradientsLike = Sequence[ArrayLike] | Mapping[str, ArrayLike]


def check_budget(budget: float | None) -> None:
    """Raise unless ``budget`` is None (no limit) or a positive number of seconds."""
    if budget is not None and not budget > 0:
        raise ValueError(f"time_budget must be positive, got {budget}")


def check_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """``input_shape`` as a tuple of positive ints, e.g. ``(C, H, W)``.

    Raises
    ------
    ValueError
        If it is empty, holds a non-integer, or a size below 1.
    """
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"input_shape must be a sequence of positive integers, got {input_shape!r}") from exc
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"input_shape must be a non-empty sequence of positive integers, got {input_shape!r}"
        )
    return shape


def _to_tensor(value: ArrayLike, *, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
        tensor = value.detach()
    else:
        raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")
    tensor = tensor.to(device=device, dtype=dtype)
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} contains {int((~torch.isfinite(tensor)).sum())} NaN or Inf entries")
    return tensor


def gradient_list(
    gradients: GradientsLike,
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Validate the observed gradients against the model's parameters, in parameter order.

    Parameters
    ----------
    gradients
        One gradient per parameter: a sequence in ``model.parameters()`` order or a mapping
        from parameter names.
    named
        The model's ``(name, parameter)`` pairs, in order.
    device, dtype
        Where and in which precision the returned gradients live.

    Returns
    -------
    list[torch.Tensor]
        The gradients in parameter order, each of its parameter's shape.

    Raises
    ------
    ValueError
        On missing, extra, misshapen, non-real, NaN/Inf or all-zero gradients.
    """
    names = [name for name, _ in named]
    if isinstance(gradients, Mapping):
        missing = [name for name in names if name not in gradients or gradients[name] is None]
        if missing:
            raise ValueError(f"missing gradients for parameters {missing}; the attack matches all of {names}")
        unknown = sorted(str(key) for key in gradients if key not in names)
        if unknown:
            raise ValueError(f"gradients for unknown parameters {unknown}; the model has {names}")
        values = [gradients[name] for name in names]
    elif isinstance(gradients, (str, bytes)) or not isinstance(gradients, Sequence):
        raise ValueError(
            "gradients must be a sequence in model.parameters() order or a mapping of parameter "
            f"names, got {type(gradients).__name__}"
        )
    else:
        if len(gradients) != len(named):
            raise ValueError(
                f"got {len(gradients)} gradients but the model has {len(named)} parameters {names}: "
                "missing gradients (the attack matches every parameter)"
            )
        values = list(gradients)
        missing = [name for name, value in zip(names, values, strict=True) if value is None]
        if missing:
            raise ValueError(f"missing gradients for parameters {missing}")
    target = []
    for (name, param), value in zip(named, values, strict=True):
        tensor = _to_tensor(value, name=f"gradient of {name}", device=device, dtype=dtype)
        if tensor.shape != param.shape:
            raise ValueError(
                f"gradient of {name} has shape {tuple(tensor.shape)} but the parameter has shape "
                f"{tuple(param.shape)}"
            )
        target.append(tensor)
    if not any(bool(torch.any(t != 0)) for t in target):
        raise ValueError("the gradients are all zeros: the client sent no information about its batch")
    return target


def check_labels(
    labels: ArrayLike | Sequence[int], *, batch_size: int | None, device: torch.device
) -> torch.Tensor:
    """The batch's labels as a non-empty 1-D int64 tensor of non-negative class indices.

    Raises
    ------
    ValueError
        On labels that are not a non-empty 1-D sequence of non-negative integers, or a
        ``batch_size`` other than their count.
    """
    if isinstance(labels, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(labels))
    elif isinstance(labels, torch.Tensor):
        tensor = labels.detach()
    else:
        try:
            tensor = torch.as_tensor(list(labels))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"labels must be a 1-D sequence of integer class indices: {exc}") from exc
    if tensor.dim() != 1 or tensor.numel() == 0:
        raise ValueError(
            f"labels must be a non-empty 1-D sequence of class indices, got shape {tuple(tensor.shape)}"
        )
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {tensor.dtype}")
    if int(tensor.min()) < 0:
        raise ValueError(f"labels must be non-negative class indices, got {int(tensor.min())}")
    if batch_size is not None and batch_size != tensor.numel():
        raise ValueError(
            f"labels has {tensor.numel()} entries but batch_size is {batch_size}: one label per sample"
        )
    return tensor.to(device=device, dtype=torch.int64)


def input_box(
    shape: tuple[int, ...],
    data_mean: Sequence[float] | None,
    data_std: Sequence[float] | None,
    *,
    boxed: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Bounds of the valid inputs: the normalized image of the pixel range ``[0, 1]``.

    Parameters
    ----------
    shape
        Shape of one input; ``(C, H, W)`` takes one mean and std per channel (or one for all).
    data_mean, data_std
        The normalization ``x = (pixel - mean) / std``; both None means no normalization.
    boxed
        Whether the inputs are boxed at all; the normalization is validated either way.
    device, dtype
        Where and in which precision the bounds live.

    Returns
    -------
    tuple[torch.Tensor | None, torch.Tensor | None]
        ``(low, high)`` shaped to broadcast against a ``(b, *shape)`` batch, or
        ``(None, None)`` when ``boxed`` is False.

    Raises
    ------
    ValueError
        If only one of ``data_mean`` and ``data_std`` is given, on a count other than 1 or
        the channel count, NaN/Inf values, or a non-positive std.
    """
    if (data_mean is None) != (data_std is None):
        raise ValueError("give both data_mean and data_std, or neither")
    mean = np.zeros(1) if data_mean is None else np.asarray(data_mean, dtype=np.float64).reshape(-1)
    std = np.ones(1) if data_std is None else np.asarray(data_std, dtype=np.float64).reshape(-1)
    channels = shape[0] if len(shape) == 3 else 1
    for name, values in (("data_mean", mean), ("data_std", std)):
        if values.size not in (1, channels):
            raise ValueError(f"{name} needs 1 or {channels} values (one per channel), got {values.size}")
        if not np.isfinite(values).all():
            raise ValueError(f"{name} contains NaN or Inf")
    if (std <= 0).any():
        raise ValueError(f"data_std must be positive, got {std.tolist()}")
    if not boxed:
        return None, None
    # (1, C, 1, 1) for images, all-ones (a single value broadcast) for other inputs
    view = (1, -1, 1, 1) if len(shape) == 3 else (1,) * (len(shape) + 1)
    low = torch.as_tensor((0.0 - mean) / std, dtype=dtype, device=device).reshape(view)
    high = torch.as_tensor((1.0 - mean) / std, dtype=dtype, device=device).reshape(view)
    return low, high
