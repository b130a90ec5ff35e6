"""Stopping an in-process audit: the stoppable Grid, the closed store, the exit codes and failure lines."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import strategies.cli as cli
import strategies.process_guard as guard
from fl_attack.results.store import AttackRecord, ReconstructionStore, StoreClosedError
from strategies.run_control import AuditStopped, RunControl, StoppableGrid
from strategies.stuck_stop import stuck_stop_watchdog


class _RepliesLater:
    """A Grid whose replies to the pushed messages arrive on the ``arrive_at``-th pull (never when 0)."""

    def __init__(self, arrive_at: int) -> None:
        self.arrive_at = arrive_at
        self.pulls = 0

    def push_messages(self, messages: Iterable[Any]) -> list[str]:
        return [f"m{index}" for index, _ in enumerate(messages)]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Any]:
        self.pulls += 1
        if self.pulls != self.arrive_at:
            return []
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=key)) for key in message_ids]


def _record(client: str) -> AttackRecord:
    return AttackRecord(server_round=1, client=client, status="ok", seconds=1.0, inputs=np.eye(2))


def test_the_grid_returns_replies_and_stops_when_asked() -> None:
    stop = threading.Event()
    replies = StoppableGrid(_RepliesLater(arrive_at=3), stop).send_and_receive([object(), object()])  # type: ignore[arg-type]
    assert sorted(reply.metadata.reply_to_message_id for reply in replies) == ["m0", "m1"]

    waiting = StoppableGrid(_RepliesLater(arrive_at=0), stop)  # type: ignore[arg-type]
    threading.Timer(0.3, stop.set).start()
    began = time.monotonic()
    with pytest.raises(AuditStopped, match="the audit was stopped before it finished"):
        waiting.send_and_receive([object()], timeout=3600)  # type: ignore[list-item]
    assert time.monotonic() - began < 2.0
    with pytest.raises(AuditStopped):
        waiting.get_node_ids()


def test_a_closed_store_finishes_the_write_in_progress_and_refuses_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReconstructionStore(tmp_path / "run")
    control = RunControl()
    control.register(store)
    release, writing = threading.Event(), threading.Event()
    original = ReconstructionStore._write_files

    def slow_write(*args: Any, **kwargs: Any) -> None:
        writing.set()
        release.wait(10)
        original(*args, **kwargs)

    monkeypatch.setattr(ReconstructionStore, "_write_files", staticmethod(slow_write))
    saver = threading.Thread(target=store.save, args=(_record("partition-0"),))
    saver.start()
    assert writing.wait(10)
    assert control.request_stop(store_timeout=0.2) is False  # a record is still being written
    assert control.stop.is_set() and store.closed
    release.set()
    saver.join(10)
    assert store.close(timeout=5.0) is True
    assert [row["client"] for row in store.rows()] == ["partition-0"]  # the write in progress completed
    with pytest.raises(
        StoreClosedError, match=r"the attack on partition-1 in round 1 was not stored: the store of"
    ):
        store.save(_record("partition-1"))
    with pytest.raises(StoreClosedError, match="the history was not stored"):
        store.save_history({"rounds": []})
    late = ReconstructionStore(tmp_path / "late")
    control.register(late)  # opened after the stop: closed at once
    assert late.closed


def _raise_in_module(module: str, error: BaseException) -> None:
    namespace: dict[str, Any] = {"__name__": module, "error": error}
    exec("def fail():\n    raise error\n", namespace)  # a frame that belongs to ``module``
    namespace["fail"]()


def _flower_chain(root: BaseException, module: str) -> RuntimeError:
    """Flower's wrapping of a runtime failure: two RuntimeErrors raised from the root cause."""
    try:
        try:
            try:
                _raise_in_module(module, root)
            except Exception as cause:
                raise RuntimeError("Simulation Runtime crashed.") from cause
        except RuntimeError as crashed:
            raise RuntimeError("An error was encountered. Ending simulation.") from crashed
    except RuntimeError as wrapped:
        return wrapped
    raise AssertionError("unreachable")


def test_failure_lines_name_the_root_cause_and_a_finite_file_size_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray_error = _flower_chain(
        Exception("The current node timed out during startup.\nmore"), "ray._private.node"
    )
    monkeypatch.setattr(guard, "file_size_limit", lambda: None)
    assert cli.failure_text(ray_error) == (
        "Ray, which runs the simulated clients, could not start or crashed: The current node timed out during startup."
    )
    monkeypatch.setattr(guard, "file_size_limit", lambda: 100 * 1024 * 1024)
    assert cli.failure_text(ray_error).endswith(
        "startup.; the file-size limit (ulimit -f) is 100 MiB, which may be too small for Ray's object store: "
        "try 'ulimit -f unlimited'"
    )
    other = _flower_chain(KeyError("fc1.weight"), "strategies.server_app")
    assert cli.failure_text(other) == "the simulation failed: KeyError: 'fc1.weight'"
    assert cli.failure_text(RuntimeError("2 attack results could not be stored")) == (
        "2 attack results could not be stored"
    )


@pytest.mark.parametrize(
    ("error", "code", "name"),
    [
        (guard.StopRequested(signal.SIGTERM), 143, "SIGTERM"),
        (SystemExit(signal.SIGTERM), 143, "SIGTERM"),  # what Ray's own SIGTERM handler raises
        (KeyboardInterrupt(), 130, "SIGINT"),
    ],
)
def test_a_stop_signal_exits_with_128_plus_its_number(
    error: BaseException,
    code: int,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def interrupted(overrides: Any, **options: Any) -> Path:
        raise error

    monkeypatch.setattr(cli, "run_audit_simulation", interrupted)
    assert cli.main(["-c", "num-server-rounds=1"]) == code
    assert capsys.readouterr().err == (
        f"fl-attack-audit: stopped by {name}: Ray and the attack workers were stopped, no history and no report "
        "were written\n"
    )


def test_the_stop_handler_turns_sigterm_into_stop_requested() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(guard.StopRequested) as raised, guard.stop_signals():
        signal.raise_signal(signal.SIGTERM)
    assert raised.value.signum == signal.SIGTERM and guard.stopping_signal(raised.value) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert guard.stopping_signal(SystemExit(1)) is None and guard.stopping_signal(ValueError()) is None


def test_byte_text() -> None:
    assert [guard.byte_text(size) for size in (512, 65536, 104857600, 1610612736, 3 * 1024**4)] == [
        "512 B",
        "64 KiB",
        "100 MiB",
        "1.5 GiB",
        "3072 GiB",
    ]


def test_the_stop_line_says_what_the_stores_hold(tmp_path: Path) -> None:
    control = RunControl()
    assert cli.stop_text(signal.SIGTERM, control) == (
        "stopped by SIGTERM: Ray and the attack workers were stopped, no history and no report were written"
    )
    unfinished = ReconstructionStore(tmp_path / "unfinished")
    control.register(unfinished)
    assert cli.stop_text(signal.SIGINT, control).endswith(
        f"no history and no report were written; {unfinished.directory} keeps the attacks stored so far"
    )
    finished = ReconstructionStore(tmp_path / "finished")
    finished.save_history({"rounds": []})
    assert cli.stop_text(signal.SIGTERM, RunControl(stores=[finished])) == (
        "stopped by SIGTERM: Ray and the attack workers were stopped, the run had finished and written its results"
    )


def test_the_stop_watchdog_calls_back_when_nobody_took_up_the_signal() -> None:
    calls: list[tuple[int, float]] = []
    called = threading.Event()

    def when_stuck(signum: int) -> None:
        calls.append((signum, time.monotonic()))
        called.set()

    before_handler = signal.signal(signal.SIGTERM, lambda *_: None)  # caught, then nothing happens
    try:
        with stuck_stop_watchdog(when_stuck, grace=0.3):
            sent = time.monotonic()
            signal.raise_signal(signal.SIGTERM)
            assert called.wait(5.0)
        assert signal.set_wakeup_fd(-1) == -1  # the wakeup pipe was taken back
    finally:
        signal.signal(signal.SIGTERM, before_handler)
    assert [signum for signum, _ in calls] == [signal.SIGTERM]
    assert calls[0][1] - sent >= 0.3


def test_the_stop_watchdog_stays_quiet_when_the_block_is_left_within_the_grace() -> None:
    calls: list[int] = []
    before_handler = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        began = time.monotonic()
        with stuck_stop_watchdog(calls.append, grace=2.0):
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.1)
        left = time.monotonic() - began
        time.sleep(0.3)
    finally:
        signal.signal(signal.SIGINT, before_handler)
    assert calls == [] and left < 1.5  # leaving does not wait out the grace


def test_the_stop_watchdog_refuses_a_negative_grace() -> None:
    with pytest.raises(ValueError, match="grace must be non-negative seconds, got -1"):
        with stuck_stop_watchdog(lambda _: None, grace=-1.0):
            pass


def test_exactly_one_thread_claims_the_stop() -> None:
    control = RunControl()
    others: list[bool] = []
    assert control.claim_stop() and control.claim_stop()  # the winner may ask again
    thread = threading.Thread(target=lambda: others.append(control.claim_stop()))
    thread.start()
    thread.join()
    assert others == [False]
