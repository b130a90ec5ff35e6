"""Validation of the public API's arguments, in one place: one clear line per error."""

from __future__ import annotations

import math
from typing import Any

import torch


def check_time_budget(value: Any, *, name: str = "time_budget") -> float | None:
    """A positive, finite number of seconds, or None.

    Raises
    ------
    ValueError
        On NaN, infinity, zero, a negative number, a bool or a non-number.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def check_batch_size(value: Any, *, name: str = "batch_size") -> int | None:
    """A positive integer, or None (a float such as ``10.0`` or a bool is refused).

    Raises
    ------
    ValueError
        On anything but None or a positive int.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value}")
    return value


def check_local_steps(value: Any, *, name: str = "local_steps") -> int:
    """An integer >= 1 (a float or a bool is refused).

    Raises
    ------
    ValueError
        On anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def resolve_device(device: str | torch.device) -> torch.device:
    """Map ``"auto"`` to CUDA when available and CPU otherwise; refuse devices this machine lacks.

    Raises
    ------
    ValueError
        On an unknown device name, CUDA without a CUDA device, or an accelerator torch was
        not built for (e.g. ``mps``).
    """
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'") from error
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(resolved)!r} was requested but CUDA is not available on this machine"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(resolved)!r} was requested but only {torch.cuda.device_count()} CUDA devices exist"
            )
        return resolved
    if resolved.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError("device 'mps' was requested but this torch build has no MPS support on this machine")
    if resolved.type != "mps":
        raise ValueError(f"device {str(resolved)!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
    return resolved
