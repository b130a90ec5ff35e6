"""``fl-attack-audit`` under a file-size limit that keeps Ray from starting, and under SIGTERM.

Each test starts the real command in a subprocess (the console script's code,
:func:`strategies.cli.entry_point`) with an environment marker, so that every process it
starts (Ray's, the attack workers) can be found in ``/proc`` afterwards: none may be left.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fl_attack.audit.workers import WORKER_PROCESS_NAME

REPOSITORY = Path(__file__).resolve().parents[2]
#: Below Ray's smallest object store (75 MiB): refused before Ray starts.
TINY_LIMIT = 64 * 1024
#: Above Ray's smallest object store, far below the one it sizes from the memory: its raylet
#: dies of SIGXFSZ while starting, and Ray gives up after waiting 30 s for it.
SMALL_LIMIT = 100 * 1024 * 1024
SETTINGS = "num-server-rounds=1 samples-per-client=16 dataset='digits' width=50 server-evaluation=false"

#: No file-size limit.
UNLIMITED = resource.RLIM_INFINITY
#: Starts the command under a file-size limit: the process, its environment marker, its run directory.
Start = Callable[..., tuple[subprocess.Popen[str], str, Path]]

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")


def _marked(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (every process the command started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environment = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text(errors="replace")
        except OSError:
            continue
        if marker.encode() in environment and state[state.rfind(")") + 2] != "Z":
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _limit(size: int) -> Callable[[], None]:
    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))

    return apply


@pytest.fixture
def audit(tmp_path: Path) -> Iterator[Start]:
    """Start ``fl-attack-audit`` under a file-size limit; kill whatever it leaves (after the checks)."""
    started: list[tuple[subprocess.Popen[str], str]] = []

    def start(limit: int, settings: str = SETTINGS) -> tuple[subprocess.Popen[str], str, Path]:
        marker = f"FL_ATTACK_FAULT_MARKER={uuid.uuid4().hex}"
        run = tmp_path / "run"
        environment = {
            **os.environ,
            "PYTHONPATH": str(REPOSITORY),
            marker.split("=")[0]: marker.split("=")[1],
        }
        command = [
            sys.executable,
            "-c",
            "from strategies.cli import entry_point; entry_point()",
            "--num-supernodes",
            "2",
            "-c",
            f"{settings} output-dir='{run}'",
        ]
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_limit(limit),
            start_new_session=True,
        )
        started.append((process, marker))
        return process, marker, run

    yield start
    for process, marker in started:
        if process.poll() is None:
            process.kill()
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)
        process.communicate()


def _comm(pid: int) -> str:
    """The process's name (``/proc/<pid>/comm``), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _wait_for(process: subprocess.Popen[str], marker: str, needle: str, *, seconds: float) -> None:
    """Wait until a process of the run has ``needle`` in its command line, or as its name."""
    deadline = time.monotonic() + seconds
    while not any(needle in _cmdline(pid) or needle == _comm(pid) for pid in _marked(marker)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {needle} process started"
        time.sleep(0.2)


def _assert_stopped_cleanly(process: subprocess.Popen[str], marker: str, run: Path, *, within: float) -> None:
    """SIGTERM the command: it must exit with 143 in ``within`` seconds, leave no process and no half-done file."""
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, error = process.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert process.returncode == 128 + signal.SIGTERM, error[-3000:]
    # attack threads may still redraw their progress bar (no newline) around the line
    assert error.count("fl-attack-audit: ") == 1, error[-3000:]
    assert (
        "fl-attack-audit: stopped by SIGTERM: Ray and the attack workers were stopped, no history and no report "
        "were written"
    ) in error
    assert elapsed < within, elapsed
    assert _marked(marker) == []
    assert not (run / "history.json").exists() and not (run / "report.html").exists()
    leftovers = [path.name for path in run.rglob("*") if path.name.startswith(".") or ".tmp" in path.name]
    assert leftovers == []  # no temporary file of an interrupted write


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _object_store_too_large_for(limit: int) -> bool:
    """Whether Ray's default object store (30% of the memory) exceeds ``limit`` (it then cannot start)."""
    with open("/proc/meminfo", encoding="utf-8") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    return 0.3 * available > 2 * limit


def test_a_file_size_limit_below_rays_minimum_fails_before_ray_starts(audit: Start) -> None:
    process, marker, run = audit(TINY_LIMIT)
    began = time.monotonic()
    _, error = process.communicate(timeout=180)
    assert process.returncode == 1, error
    assert _last_line(error) == (
        "fl-attack-audit: the file-size limit (ulimit -f) is 64 KiB, but Ray, which runs the simulated clients, "
        "needs a file of at least 75 MiB for its object store: raise the limit ('ulimit -f unlimited') and run again"
    )
    assert "gcs_server" not in error and not run.exists()  # refused before Ray and before the store
    assert _marked(marker) == []
    assert time.monotonic() - began < 180


@pytest.mark.slow  # Ray waits 30 s (hard-coded) for the raylet that died
def test_ray_that_cannot_start_ends_the_audit_with_one_line(audit: Start) -> None:
    if not _object_store_too_large_for(SMALL_LIMIT):
        pytest.skip("this machine's memory is small enough for Ray to start under the limit")
    process, marker, run = audit(SMALL_LIMIT)
    began = time.monotonic()
    _, error = process.communicate(timeout=300)
    elapsed = time.monotonic() - began
    assert process.returncode == 1, error[-3000:]
    last = _last_line(error)
    assert last.startswith(
        "fl-attack-audit: Ray, which runs the simulated clients, could not start or crashed: "
    )
    assert last.endswith(
        "; the file-size limit (ulimit -f) is 100 MiB, which may be too small for Ray's object store: "
        "try 'ulimit -f unlimited'"
    )
    assert _marked(marker) == []  # Ray's half-started processes were stopped too
    assert not (run / "history.json").exists() and not (run / "report.html").exists()
    assert elapsed < 240  # Ray waits 30 s for its raylet; the command adds a few seconds


@pytest.mark.parametrize("delay", [1.0, 6.0])
def test_sigterm_while_ray_starts_stops_everything_within_seconds(audit: Start, delay: float) -> None:
    if not _object_store_too_large_for(SMALL_LIMIT):
        pytest.skip("this machine's memory is small enough for Ray to start under the limit")
    process, marker, run = audit(SMALL_LIMIT)
    _wait_for(process, marker, "gcs_server", seconds=150)
    # after a few seconds the main thread waits inside Ray's C++ client for a raylet that died
    # (up to 30 s), where no Python signal handler can run: the stop watchdog serves the signal
    time.sleep(delay)
    _assert_stopped_cleanly(process, marker, run, within=20)


@pytest.mark.slow  # a whole audit runs up to its first attack
def test_sigterm_while_clients_train_and_workers_attack_stops_everything(audit: Start) -> None:
    process, marker, run = audit(UNLIMITED, f"{SETTINGS} num-server-rounds=2 attack-time-budget=30")
    _wait_for(process, marker, WORKER_PROCESS_NAME, seconds=240)  # an attack worker is running
    time.sleep(1.0)
    _assert_stopped_cleanly(process, marker, run, within=30)
