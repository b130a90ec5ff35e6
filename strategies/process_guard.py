"""Leaving ``fl-attack-audit`` cleanly: the file-size limit Ray needs, signals, child processes, stuck threads.

The command runs Ray (the simulation runtime) and attack workers as child processes, and the
ServerApp in a thread. Nothing of that may outlive the command when it fails or is stopped:

* :func:`check_file_size_limit` refuses, before Ray starts, a file-size limit (``ulimit -f``)
  below the smallest object store Ray can run with (Ray's raylet is killed by ``SIGXFSZ``
  when it sizes that file, and Ray then waits 30 s for it before failing);
* :func:`stop_signals` turns SIGTERM and SIGINT into :class:`StopRequested` in the main thread
  (Ray replaces the SIGTERM handler while it starts with one raising ``SystemExit(15)``:
  :func:`stopping_signal` recognises both);
* :func:`adopt_orphans` keeps the command the ancestor of every process it started, even of
  one whose parent exited first;
* :func:`terminate_processes` ends the processes that a run started (:func:`run_processes`:
  SIGTERM, then SIGKILL), found through ``/proc`` (Linux; elsewhere there is nothing to list);
* :func:`lingering_threads` names the non-daemon threads that would keep the interpreter
  from exiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

#: The smallest object store Ray accepts (``ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES``):
#: its raylet creates one file of at least this size.
RAY_MIN_OBJECT_STORE_BYTES = 75 * 1024 * 1024
#: ``prctl`` option making a process the "subreaper" of its descendants (linux/prctl.h).
PR_SET_CHILD_SUBREAPER = 36
#: Conventional exit status of a process ended by a signal: 128 + the signal number.
SIGNAL_EXIT_BASE = 128
#: The signals that stop the command.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """A stop signal arrived (a BaseException, so that no ``except Exception`` swallows it).

    Attributes
    ----------
    signum : int
        The signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def file_size_limit() -> int | None:
    """The process's soft file-size limit in bytes (``ulimit -f``), or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def byte_text(count: int) -> str:
    """A byte count for people: ``64 KiB``, ``97.7 MiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns at GiB


def check_file_size_limit() -> None:
    """Fail fast when the file-size limit is too small for Ray to start.

    Raises
    ------
    ValueError
        With one line naming the limit and how to raise it.
    """
    limit = file_size_limit()
    if limit is not None and limit < RAY_MIN_OBJECT_STORE_BYTES:
        raise ValueError(
            f"the file-size limit (ulimit -f) is {byte_text(limit)}, but Ray, which runs the simulated "
            f"clients, needs a file of at least {byte_text(RAY_MIN_OBJECT_STORE_BYTES)} for its object store: "
            "raise the limit ('ulimit -f unlimited') and run again"
        )


def file_size_hint() -> str:
    """A clause naming a finite file-size limit as a possible cause, or empty."""
    limit = file_size_limit()
    if limit is None:
        return ""
    return (
        f"; the file-size limit (ulimit -f) is {byte_text(limit)}, which may be too small for Ray's "
        "object store: try 'ulimit -f unlimited'"
    )


def stopping_signal(error: BaseException) -> int | None:
    """The signal number behind ``error`` when it is a stop request, else None.

    A :class:`StopRequested`, a ``KeyboardInterrupt`` (SIGINT) or the ``SystemExit(15)`` that
    Ray's own SIGTERM handler raises.
    """
    if isinstance(error, StopRequested):
        return error.signum
    if isinstance(error, KeyboardInterrupt):
        return int(signal.SIGINT)
    if isinstance(error, SystemExit) and error.code == signal.SIGTERM:
        return int(signal.SIGTERM)
    return None


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise :class:`StopRequested` in the main thread.

    The previous handlers are restored afterwards. Outside the main thread (where Python
    cannot set handlers) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise StopRequested(signum)

    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, action in previous.items():
            signal.signal(number, action)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Within the block (a cleanup that must finish), SIGTERM and SIGINT are ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, action in previous.items():
            signal.signal(number, action)


def adopt_orphans() -> bool:
    """Make this process the parent of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    A process whose parent exits is normally handed to ``init``, out of reach of
    :func:`descendant_pids`; a subreaper gets it instead. Only for a command's own process:
    the orphans' exit statuses are collected when they are terminated, or at exit.

    Returns
    -------
    bool
        True when the kernel accepted it (False on other systems).
    """
    if not os.path.isdir("/proc"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def descendant_pids(pid: int | None = None) -> set[int]:
    """Every living descendant of ``pid`` (default: this process), read from ``/proc``.

    Returns an empty set where ``/proc`` cannot be read (not Linux).
    """
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, (parent, _) in _process_table().items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def run_processes(*, spared: set[int]) -> set[int]:
    """The processes this process started, directly or not, except ``spared``.

    Its descendants, and, when it leads its own process group (Ray makes its driver a group
    leader), every other member of that group: a process whose parent died first (Ray's
    workers, when the raylet is gone) is no descendant any more but keeps the group.
    """
    own = os.getpid()
    members = set(descendant_pids())
    if os.getpgrp() == own:
        members |= {pid for pid, (_, group) in _process_table().items() if group == own}
    return members - spared - {own}


def _process_table() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, process group)}`` of every living process (empty without ``/proc``)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    table: dict[int, tuple[int, int]] = {}
    for entry in entries:
        if entry.isdigit():
            ids = _stat_ids(int(entry))
            if ids is not None:
                table[int(entry)] = ids
    return table


def _stat_ids(pid: int) -> tuple[int, int] | None:
    """``(parent pid, process group)`` of ``pid`` from ``/proc/<pid>/stat`` (None when gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # the command name is in parentheses and may itself hold spaces or parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 3 or fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2])


def terminate_processes(pids: set[int], *, grace: float = 3.0) -> set[int]:
    """Send SIGTERM to ``pids``, wait up to ``grace`` seconds, SIGKILL those still alive.

    Returns
    -------
    set[int]
        The processes still alive after SIGKILL (normally none).
    """
    alive = {pid for pid in pids if _signal(pid, signal.SIGTERM)}
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(alive)
        alive = {pid for pid in alive if _exists(pid)}
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    time.sleep(0.05)
    _reap(alive)
    return {pid for pid in alive if _exists(pid)}


def terminate_until_quiet(*, spared: set[int], grace: float, quiet: float, limit: float) -> set[int]:
    """Terminate :func:`run_processes` until none appears for ``quiet`` seconds, for ``limit`` seconds at most.

    Threads of this process may still start processes (an attack thread that goes on to its
    next queued job starts a new worker when the last one was terminated): the sweep is
    repeated until the process tree stays empty.

    Parameters
    ----------
    spared : set[int]
        Processes that are not the run's.
    grace : float
        Seconds between SIGTERM and SIGKILL (:func:`terminate_processes`).
    quiet : float
        Seconds without a new process that end the sweep.
    limit : float
        Seconds after which the sweep ends in any case.

    Returns
    -------
    set[int]
        The run's processes alive at the end (empty unless ``limit`` was reached).
    """
    deadline = time.monotonic() + limit
    calm_since = time.monotonic()
    while True:
        found = run_processes(spared=spared)
        if found:
            terminate_processes(found, grace=grace)
            calm_since = time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return set()
        if time.monotonic() >= deadline:
            return run_processes(spared=spared)
        time.sleep(min(0.05, quiet))


def _signal(pid: int, number: signal.Signals) -> bool:
    try:
        os.kill(pid, number)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _exists(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie, dead but not yet reaped, counts as gone)."""
    return _stat_ids(pid) is not None


def _reap(pids: set[int]) -> None:
    """Collect the exit status of those of ``pids`` that are this process's own dead children."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def lingering_threads() -> list[threading.Thread]:
    """The living non-daemon threads other than the calling one and the main thread."""
    current, main = threading.current_thread(), threading.main_thread()
    return [
        thread
        for thread in threading.enumerate()
        if thread.is_alive() and not thread.daemon and thread is not current and thread is not main
    ]


def join_threads(*, timeout: float) -> list[threading.Thread]:
    """Wait up to ``timeout`` seconds in all for the :func:`lingering_threads`; return those still alive."""
    deadline = time.monotonic() + timeout
    for thread in lingering_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    return lingering_threads()
