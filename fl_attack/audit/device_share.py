"""Several attacks on one GPU: each on a CUDA stream of its own, each process under a memory cap.

With thread isolation and ``workers=k``, ``k`` clients' attacks run at once in one process on one
GPU. Each takes a stream of its own (:func:`own_stream`) for the whole attack, so their kernels can
overlap instead of queueing behind each other on the default stream, and the stream is synchronized
before the attack's results are read on the host. A process that runs attacks can be held to a
share of the device's memory (:func:`cap_gpu_memory`): an attack that needs more gets
``torch.cuda.OutOfMemoryError``, recorded with the ``"out-of-memory"`` status, instead of taking
the memory another attack (or the federation) needs. On a CPU both do nothing.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch


def check_gpu_memory_share(share: float | None, *, name: str = "attack_gpu_memory") -> None:
    """Refuse a GPU memory share that is not None or a fraction in (0, 1].

    Raises
    ------
    ValueError
        Naming ``name``, what it must be and the value given.
    """
    if share is None:
        return
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share):
        raise ValueError(f"{name} must be a fraction of the GPU's memory in (0, 1] or None, got {share!r}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{name} must be a fraction of the GPU's memory in (0, 1] or None, got {share!r}")


def cuda_device_of(attacker: Any) -> torch.device | None:
    """The CUDA device ``attacker`` runs on (its ``device`` attribute; ``"auto"`` is CUDA when this
    process sees one), or None when it runs on the CPU, names no device this process can use, or
    none at all. A device without an index means the current one, as it does for the attack."""
    device = getattr(attacker, "device", "cpu")
    if not torch.cuda.is_available():
        return None
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda")
    try:
        resolved = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError):  # the attack reports its own bad device
        return None
    return resolved if resolved.type == "cuda" else None


def cap_gpu_memory(share: float | None, attacker: Any) -> bool:
    """Hold this process to ``share`` of the memory of the CUDA device ``attacker`` runs on.

    :func:`torch.cuda.set_per_process_memory_fraction`: the cap is the process's, so every thread of
    the process shares it (with thread isolation, the server process and whatever else it runs on
    that device). Setting it again replaces it. Nothing happens for None or an attacker on the CPU.

    Returns
    -------
    bool
        Whether a cap was set.
    """
    check_gpu_memory_share(share)
    device = cuda_device_of(attacker)
    if share is None or device is None:
        return False
    # an index, or None for the current device (torch refuses a device without an index here)
    torch.cuda.set_per_process_memory_fraction(float(share), device.index)
    return True


class _StreamPool:
    """Streams not in use, per device: a stream is reused by the next attack that starts, so a
    process holds as many streams as attacks ever ran in it at once."""

    def __init__(self) -> None:
        self._free: dict[str, list[torch.cuda.Stream]] = {}
        self._lock = threading.Lock()

    def take(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            free = self._free.setdefault(str(device), [])
            if free:
                return free.pop()
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def give_back(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        with self._lock:
            self._free.setdefault(str(device), []).append(stream)


_STREAMS = _StreamPool()


@contextlib.contextmanager
def own_stream(attacker: Any) -> Iterator[torch.cuda.Stream | None]:
    """Run the block on a CUDA stream of its own when ``attacker`` runs on CUDA; yield the stream
    (None on the CPU, where nothing changes).

    The stream is the calling thread's current stream on that device for the whole block (torch's
    current stream is per thread), so concurrent attacks in one process each queue their kernels on
    their own. It first waits for what the thread had queued on its previous stream, and is
    synchronized at the end: the attack's results are complete before the host reads them.
    """
    device = cuda_device_of(attacker)
    if device is None:
        yield None
        return
    stream = _STREAMS.take(device)
    try:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream
    except BaseException:
        with contextlib.suppress(RuntimeError):  # the attack's own error is the one to report
            stream.synchronize()
        raise
    else:
        stream.synchronize()
    finally:
        _STREAMS.give_back(device, stream)
