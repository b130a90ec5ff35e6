"""Serving a stop signal while the main thread is stuck inside native code.

Python runs a signal handler only when its main thread executes bytecode again. While
``ray.init`` waits in Ray's C++ client for a raylet that died (up to 30 s) or any other
native call blocks, a SIGTERM would wait as long. :func:`stuck_stop_watchdog` closes that gap:
the interpreter's C-level handler writes every caught signal's number to a wakeup pipe
(``signal.set_wakeup_fd``) even while the main thread is blocked, and a daemon thread reading
that pipe calls back when a stop signal was not taken up by anyone within ``grace`` seconds
(the callback decides, through :meth:`strategies.run_control.RunControl.claim_stop`, whether
the main thread already is at it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

from .process_guard import STOP_SIGNALS

#: Seconds the main thread gets to take up a stop signal before the watchdog acts itself.
STUCK_GRACE = 3.0


@contextlib.contextmanager
def stuck_stop_watchdog(when_stuck: Callable[[int], None], *, grace: float = STUCK_GRACE) -> Iterator[None]:
    """Within the block, call ``when_stuck(signum)`` from a thread ``grace`` seconds after a stop signal.

    Only in the main thread (where Python sets the wakeup pipe); elsewhere the block runs
    unchanged. A wakeup pipe set before is restored afterwards. The signals' Python handlers
    are not touched: install them too (:func:`strategies.process_guard.stop_signals`).

    Parameters
    ----------
    when_stuck : Callable[[int], None]
        Called with the signal's number; it must return at once when the stop is already
        being served (the watchdog cannot tell).
    grace : float (default: STUCK_GRACE)
        Seconds between the signal and the call.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if grace < 0:
        raise ValueError(f"grace must be non-negative seconds, got {grace}")
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    stop_numbers = {int(number) for number in STOP_SIGNALS}
    closing = threading.Event()  # the block is left: whoever leaves it serves any stop

    def watch() -> None:
        while True:
            try:
                received = os.read(reader, 64)
            except OSError:
                return
            if not received:
                return
            for number in received:
                if number in stop_numbers:
                    if closing.wait(grace):
                        return
                    when_stuck(number)

    previous = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="fl-attack-stop-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        closing.set()
        signal.set_wakeup_fd(previous)
        os.close(writer)  # the watcher reads end-of-file and ends
        watcher.join(timeout=grace + 1.0)
        if not watcher.is_alive():
            os.close(reader)
