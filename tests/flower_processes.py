"""Run Flower's own launchers from a test: ``flwr run``, ``flower-superlink``, ``flower-supernode``.

Every run gets its own Flower home (``FLWR_HOME``) and free ports, so that it never talks to
a SuperLink that another run (or a user) started. :class:`FlowerProcesses` remembers the
processes a test started, including the SuperLink that ``flwr run`` leaves in the background,
and stops them, and whatever they started, by pid: never by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from strategies.process_guard import descendant_pids, terminate_processes

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a SuperLink or SuperNode may take to come up on a loaded machine.
START_TIMEOUT = 60.0
#: ``flower-supernode`` sending heartbeats at Flower's shortest accepted interval (10 s, not the
#: default 30 s; Flower has no flag for it): the SuperLink calls the node unavailable 2 x 10 s
#: after its last heartbeat instead of 60 s. It fails at start if Flower no longer reads the constant.
SHORT_HEARTBEAT_SUPERNODE = """
import flwr.common.constant as constant
constant.HEARTBEAT_DEFAULT_INTERVAL = constant.HEARTBEAT_MIN_INTERVAL
from flwr.supercore import heartbeat
from flwr.supernode import fleet_http_connection
from flwr.supernode.cli import flower_supernode
used = {heartbeat.HEARTBEAT_DEFAULT_INTERVAL, fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL}
assert used == {constant.HEARTBEAT_MIN_INTERVAL}, f"heartbeat interval not shortened: {used}"
flower_supernode()
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def flower_env(home: Path, *, python_paths: tuple[Path, ...] = ()) -> dict[str, str]:
    """This process's environment with its own Flower home, no update check, no runtime installs.

    ``PYTHONPATH`` starts with ``python_paths`` and this repository, so that the Flower
    processes import the code under test, not another installed copy.
    """
    env = dict(os.environ)
    paths = [str(path) for path in (*python_paths, ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        {
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONPATH": os.pathsep.join(paths),
            "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
        }
    )
    home.mkdir(parents=True, exist_ok=True)
    return env


def write_flower_config(home: Path, connections: dict[str, str]) -> None:
    """Write ``<home>/config.toml``: the named SuperLink connections (``name -> TOML body``)."""
    default = next(iter(connections))
    text = f'[superlink]\ndefault = "{default}"\n'
    for name, body in connections.items():
        text += f"\n[superlink.{name}]\n{body.strip()}\n"
    (home / "config.toml").write_text(text, encoding="utf-8")


def supernode_command(superlink_port: int, node_config: str, *, short_heartbeat: bool = False) -> list[str]:
    """``flower-supernode --insecure`` on a free port, connected to the SuperLink on ``superlink_port``.

    ``short_heartbeat`` starts it with :data:`SHORT_HEARTBEAT_SUPERNODE`, for a node a test kills:
    the SuperLink then notices its death in at most 20 s.
    """
    launcher = [sys.executable, "-c", SHORT_HEARTBEAT_SUPERNODE] if short_heartbeat else ["flower-supernode"]
    return [
        *launcher,
        "--insecure",
        "--superlink",
        f"127.0.0.1:{superlink_port}",
        "--port",
        str(free_port()),
        "--node-config",
        node_config,
    ]


def superlink_pid(port: int) -> int | None:
    """The pid of the ``flower-superlink`` serving on ``port`` (read from ``/proc``), or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            arguments = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names = [Path(argument.decode(errors="replace")).name for argument in arguments[:2]]
        if "flower-superlink" in names and any(
            option == b"--port" and value == str(port).encode()
            for option, value in zip(arguments, arguments[1:], strict=False)
        ):
            return int(entry)
    return None


class FlowerProcesses:
    """Processes a test started, stopped with everything they started when the test ends.

    Parameters
    ----------
    directory : Path
        Where each process's output is written (``<name>.log``).
    env : dict[str, str]
        The environment of every process started.
    """

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.directory = directory
        self.env = env
        self._roots: dict[str, int] = {}
        self._handles: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        """Start ``command`` in the background, its output in ``<directory>/<name>.log``."""
        with open(self.directory / f"{name}.log", "wb") as log:
            process = subprocess.Popen(command, env=self.env, cwd=self.directory, stdout=log, stderr=log)
        self._handles.append(process)
        self._roots[name] = process.pid
        return process

    def adopt(self, name: str, pid: int) -> None:
        """Take charge of a process some launcher left behind (``flwr run``'s SuperLink)."""
        self._roots[name] = pid

    def pid(self, name: str) -> int:
        """The pid of the process started or adopted as ``name``."""
        return self._roots[name]

    def log(self, name: str) -> str:
        """What ``name`` wrote so far."""
        return (self.directory / f"{name}.log").read_text(encoding="utf-8", errors="replace")

    def wait_for_log(self, name: str, text: str, *, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``name``'s output holds ``text``; fail with its output when it exits or times out."""
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            process = next((handle for handle in self._handles if handle.pid == self._roots[name]), None)
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} did not print {text!r} in {timeout:.0f} s:\n{self.log(name)[-3000:]}"
                )
            time.sleep(0.2)

    def kill(self, name: str) -> set[int]:
        """SIGKILL ``name`` and everything it started at once, as a machine that dies; return the survivors."""
        pids = _started_by({self._roots[name]})
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for handle in self._handles:
            if handle.pid in pids:
                handle.wait(timeout=5.0)
        return _still_running(pids, timeout=10.0)

    def stop(self, name: str | None = None) -> set[int]:
        """Stop ``name`` (default: every process) and everything it started; return those that survived.

        Everything it started: its descendants, and the members of the sessions they lead (a
        SuperLink's SuperExec leads its own session; Ray's workers stay in it when their
        parent is gone).
        """
        roots = {self._roots[name]} if name is not None else set(self._roots.values())
        pids = _started_by(roots)
        terminate_processes(pids, grace=5.0)
        for handle in self._handles:
            if handle.pid in pids:
                handle.wait(timeout=5.0)
        return _still_running(pids, timeout=10.0)


def _started_by(roots: set[int]) -> set[int]:
    """``roots``, their descendants and the members of the sessions any of them leads, to a fixed point."""
    found = set(roots)
    while True:
        grown = set(found)
        for pid in found:
            grown |= descendant_pids(pid)
        sessions = {pid for pid in grown if _session(pid) == pid}
        grown |= {pid for pid in _living_pids() if _session(pid) in sessions}
        if grown == found:
            return found
        found = grown


def _still_running(pids: set[int], *, timeout: float) -> set[int]:
    """Those of ``pids`` still running after up to ``timeout`` seconds (a zombie has ended: it only awaits its reaper)."""
    deadline = time.monotonic() + timeout
    running = {pid for pid in pids if _state(pid) not in (None, "Z")}
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = {pid for pid in running if _state(pid) not in (None, "Z")}
    return running


def _living_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); empty when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def _state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _session(pid: int) -> int | None:
    """The session id of ``pid``, None when it is gone."""
    fields = _stat_fields(pid)
    return int(fields[3]) if len(fields) > 3 else None


def run_flwr(arguments: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> str:
    """Run ``flwr <arguments>`` to its end and return its output (stdout and stderr together)."""
    completed = subprocess.run(
        ["flwr", *arguments],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        check=False,
    )
    return completed.stdout.decode(errors="replace")
