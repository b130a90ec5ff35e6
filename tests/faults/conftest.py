"""Fixtures of the fault suite: a real, tiny file system that fills up."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Size of the tmpfs the full-disk tests fill.
TINY_DISK_SIZE = "64k"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted 64 KiB tmpfs (unmounted afterwards); skips when mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = shutil.which("mount")
    umount = shutil.which("umount")
    if mount is None or umount is None:
        pytest.skip("mount/umount are not installed")
    point = tmp_path / "disk"
    point.mkdir()
    result = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={TINY_DISK_SIZE},mode=0755", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"mount -t tmpfs was refused: {result.stderr.strip() or result.returncode}")
    try:
        yield point
    finally:
        subprocess.run([umount, str(point)], capture_output=True, text=True, check=True)


@pytest.fixture(autouse=True)
def no_attack_left_running() -> Iterator[None]:
    """Abandoned attack threads (thread isolation keeps a timed-out attack running until it
    returns) must not steal the CPU from the tests that follow: wait for them here."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("fl-attack") and thread is not threading.current_thread():
            thread.join(timeout=120.0)
