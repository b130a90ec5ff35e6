"""Give the memory of freed layer updates back to the operating system (glibc only).

glibc serves a large allocation from ``mmap`` and returns it to the system when it is freed,
but after the first such free it raises that threshold (up to 32 MiB) and serves later ones
from its heaps, which it can only shrink from the top. The server frees one float32 layer
update (2.4 MiB at m = 200 on CIFAR-10) per finished attack, in whatever order the attacks
finish, so those heaps keep hundreds of MiB that no array uses any more. A fixed threshold
keeps every array of at least :data:`LARGE_ALLOCATION_BYTES` on ``mmap``.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

#: Allocations of at least this many bytes get pages of their own, returned when freed.
LARGE_ALLOCATION_BYTES = 1 << 20

#: ``M_MMAP_THRESHOLD`` of glibc's ``mallopt`` (malloc.h).
_M_MMAP_THRESHOLD = -3

_state: dict[str, bool] = {}


def return_large_allocations() -> bool:
    """Fix glibc's mmap threshold at :data:`LARGE_ALLOCATION_BYTES` for this process (once).

    Returns
    -------
    bool
        Whether the threshold is set; False where the C library is not glibc (nothing changes).
    """
    if "done" not in _state:
        _state["done"] = _set_threshold()
    return _state["done"]


def _set_threshold() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl does not)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))
    logger.debug("glibc mmap threshold fixed at %d bytes: %s", LARGE_ALLOCATION_BYTES, done)
    return done
