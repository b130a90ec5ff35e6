"""What a process and all its descendants use, read from ``/proc`` (Linux only).

A Flower simulation is a tree of processes: the driver, Ray's own services and actors, and the
attack workers the auditor spawns. :class:`TreeMemory` samples the memory of the whole tree in a
background thread; :func:`tree_cpu_seconds` sums the CPU time of the tree's live members; and
:func:`load_average` reads how busy the (shared) machine is.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages of the machine (from ``/proc/loadavg``)."""
    fields = (PROC / "loadavg").read_text(encoding="ascii").split()
    return float(fields[0]), float(fields[1]), float(fields[2])


def autogroup_scheduling() -> bool | None:
    """Whether Linux schedules by autogroup (one fair CPU share per session); None when unknown."""
    try:
        return (PROC / "sys" / "kernel" / "sched_autogroup_enabled").read_text(
            encoding="ascii"
        ).strip() == "1"
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None when the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # the command name may contain spaces and parentheses: split after its last ")"
    return text.rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), from ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for member in [pid, *descendants(pid)]:
        fields = _stat_fields(member)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def process_memory_kib(pid: int) -> tuple[int, int]:
    """``(RSS, PSS)`` of one process in KiB, from ``/proc/<pid>/smaps_rollup``; zeros when gone.

    PSS (proportional set size) charges a page shared by k processes 1/k to each, so the PSS
    of a process tree counts shared libraries and Ray's shared object store once.
    """
    try:
        lines = (PROC / str(pid) / "smaps_rollup").read_text(encoding="ascii").splitlines()
    except OSError:
        return 0, 0
    values = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:] if line.endswith("kB")}
    return values.get("Rss", 0), values.get("Pss", 0)


def command_name(pid: int) -> str:
    """A short name for a process: its program, or Ray's ``ray::<role>`` title."""
    try:
        words = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    parts = [word.decode(errors="replace") for word in words if word]
    if not parts:
        return "?"
    program = parts[0].rsplit("/", 1)[-1]
    if not program.startswith("python"):
        return program[:60]
    if any("multiprocessing" in part for part in parts[1:]):
        return f"{program} (multiprocessing child)"
    if "-m" in parts[1:-1]:
        return f"{program} -m {parts[parts.index('-m', 1) + 1]}"
    scripts = [part.rsplit("/", 1)[-1] for part in parts[1:] if part.endswith(".py")]
    return f"{program} {scripts[0]}" if scripts else program


@dataclass(frozen=True)
class MemorySample:
    """The tree's memory at one moment.

    Attributes
    ----------
    time : float
        Wall-clock time (``time.time()``).
    rss_kib, pss_kib : int
        Sums over the tree's processes.
    processes : int
        Processes in the tree.
    """

    time: float
    rss_kib: int
    pss_kib: int
    processes: int


class TreeMemory:
    """Sample the memory of ``pid`` and its descendants every ``interval`` seconds, in a thread.

    Use as a context manager around the life of the process. :attr:`samples` holds every
    sample; :attr:`at_peak` the ``(PSS MiB, name)`` of each process at the highest PSS sum.

    Parameters
    ----------
    pid : int
        Root of the tree.
    interval : float (default: 0.5)
        Seconds between samples.
    """

    def __init__(self, pid: int, *, interval: float = 0.5) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.pid = pid
        self.interval = interval
        self.samples: list[MemorySample] = []
        self.at_peak: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_pss_kib(self) -> int:
        """The highest PSS sum seen (0 before the first sample)."""
        return max((sample.pss_kib for sample in self.samples), default=0)

    @property
    def peak_rss_kib(self) -> int:
        """The highest RSS sum seen (0 before the first sample)."""
        return max((sample.rss_kib for sample in self.samples), default=0)

    @property
    def peak_processes(self) -> int:
        """The most processes the tree had at once."""
        return max((sample.processes for sample in self.samples), default=0)

    def peak_pss_between(self, start: float, end: float) -> int | None:
        """The highest PSS sum sampled in ``[start, end)`` (wall-clock times); None without a sample."""
        inside = [sample.pss_kib for sample in self.samples if start <= sample.time < end]
        return max(inside) if inside else None

    def pss_timeline_mib(self, *, since: float, spacing: float) -> list[tuple[float, float]]:
        """``(seconds since `since`, PSS MiB)`` of the samples, at least ``spacing`` seconds apart."""
        timeline: list[tuple[float, float]] = []
        last: float | None = None
        for sample in self.samples:
            if last is None or sample.time - last >= spacing:
                timeline.append((round(sample.time - since, 1), round(sample.pss_kib / 1024, 1)))
                last = sample.time
        return timeline

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                return

    def _sample(self) -> None:
        members = [self.pid, *descendants(self.pid)]
        sizes = [process_memory_kib(member) for member in members]
        live = [(member, size) for member, size in zip(members, sizes, strict=True) if size != (0, 0)]
        sample = MemorySample(
            time=time.time(),
            rss_kib=sum(rss for _, (rss, _) in live),
            pss_kib=sum(pss for _, (_, pss) in live),
            processes=len(live),
        )
        if not live:
            return
        if sample.pss_kib > self.peak_pss_kib:
            self.at_peak = sorted(
                ((pss / 1024, command_name(member)) for member, (_, pss) in live), reverse=True
            )
        self.samples.append(sample)
