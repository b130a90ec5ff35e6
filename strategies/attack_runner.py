"""Run an attacker on one observed update without ever letting it break the FL run."""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .layer import LayerUpdate

STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_TIMEOUT = "timeout"
STATUS_OUT_OF_MEMORY = "out-of-memory"


class Attacker(Protocol):
    """What the strategy needs from a gradient-inversion attack (e.g. ``SpearPlusPlus``)."""

    def invert(
        self,
        weight_grad: np.ndarray,
        bias_grad: np.ndarray,
        *,
        weight: np.ndarray,
        bias: np.ndarray,
        batch_size: int | None = None,
        time_budget: float | None = None,
    ) -> Any:
        """Recover the layer inputs behind ``(weight_grad, bias_grad)``.

        Returns an object with an ``inputs`` attribute holding the ``(b, n)``
        reconstructed inputs (a :class:`fl_attack.Reconstruction`).
        """


@dataclass(frozen=True)
class AttackResult:
    """Outcome of one guarded attack.

    Attributes
    ----------
    status : str
        ``"ok"``, ``"error"``, ``"timeout"`` or ``"out-of-memory"``.
    reconstruction : Any
        What the attacker returned (None unless ``status`` is ``"ok"``).
    seconds : float
        Wall-clock time until the attack returned, failed or was given up.
    error : str or None
        Description of the failure.
    traceback : str or None
        Formatted traceback of an exception raised by the attacker.
    """

    status: str
    reconstruction: Any
    seconds: float
    error: str | None = None
    traceback: str | None = None


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _release_accelerator_memory() -> None:
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_attack(
    attacker: Attacker,
    update: LayerUpdate,
    *,
    batch_size: int | None = None,
    time_budget: float | None = None,
    timeout: float | None = None,
) -> AttackResult:
    """Invert one update, turning every failure into an :class:`AttackResult`.

    The attacker receives only the observed update and the global layer parameters.
    It runs in a daemon thread; ``time_budget`` is passed on so that it stops itself,
    and ``timeout`` is a hard wall-clock limit after which the attack is given up
    (the thread is abandoned and its eventual result discarded).

    Parameters
    ----------
    attacker : Attacker
        The attack, e.g. ``fl_attack.SpearPlusPlus``.
    update : LayerUpdate
        The client's first-layer update and the global layer it started from.
    batch_size : int or None (default: None)
        Batch size handed to the attacker; None lets it estimate the batch size.
    time_budget : float or None (default: None)
        Seconds the attacker is asked to stay within.
    timeout : float or None (default: None)
        Hard limit in seconds; None waits until the attacker returns.

    Returns
    -------
    AttackResult
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = attacker.invert(
                update.weight_delta,
                update.bias_delta,
                weight=update.weight,
                bias=update.bias,
                batch_size=batch_size,
                time_budget=time_budget,
            )
        except BaseException as error:  # pylint: disable=broad-exception-caught
            outcome["error"] = error
            outcome["traceback"] = traceback.format_exc()

    start = time.perf_counter()
    worker = threading.Thread(target=target, name="fl-attack-inversion", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - start
    if worker.is_alive():
        return AttackResult(
            status=STATUS_TIMEOUT,
            reconstruction=None,
            seconds=seconds,
            error=f"attack did not finish within the {timeout:g} s timeout",
        )
    if "error" in outcome:
        error = outcome["error"]
        if _is_out_of_memory(error):
            _release_accelerator_memory()
            status = STATUS_OUT_OF_MEMORY
        else:
            status = STATUS_ERROR
        return AttackResult(
            status=status,
            reconstruction=None,
            seconds=seconds,
            error=f"{type(error).__name__}: {error}",
            traceback=outcome.get("traceback"),
        )
    reconstruction = outcome.get("value")
    if getattr(reconstruction, "inputs", None) is None:
        return AttackResult(
            status=STATUS_ERROR,
            reconstruction=None,
            seconds=seconds,
            error=f"attacker returned {type(reconstruction).__name__} without inputs",
        )
    return AttackResult(status=STATUS_OK, reconstruction=reconstruction, seconds=seconds)
