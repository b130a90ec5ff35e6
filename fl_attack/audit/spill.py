"""Waiting attacks keep their update in a file, not in the server's memory.

When the attacks fall behind the rounds (100 clients a round, one attack worker), the queue
grows by one float32 layer per client and round (2.4 MiB at m = 200 on CIFAR-10). Once the
waiting updates would take more than :data:`SPILL_AFTER_BYTES`, a :class:`QueueSpill` thread
moves each new one to a file of the run directory's private folder :data:`SPILL_FOLDER`, after
the round has handed it over, so that writing costs the round nothing; the attack maps the file
when it starts and removes it (:meth:`~fl_attack.audit.layer.SentLayer.take`). Pages in the
operating system's file cache are no process's memory. A short queue is never written (writing
costs the disk and the kernel's writeback CPU time that the attacks would rather have), and a
unit whose attack started first is never written.
"""

from __future__ import annotations

import itertools
import logging
import queue
import shutil
import threading
from pathlib import Path

from .layer import SentLayer

logger = logging.getLogger(__name__)

#: The private folder of the run directory that holds waiting updates (removed on close).
SPILL_FOLDER = ".attack-queue"

#: Waiting updates may take this much memory before new ones go to files (16 MiB: 6 updates at
#: m = 200 on CIFAR-10, about 4 s of SPEAR++ attacks on 2 busy cores, so the worker never waits
#: for the disk: a spilled update is read back from the file cache). Those in memory outlive
#: their round's replies: at 64 MiB the ones of one round were still held at the next round's
#: peak; the audit's whole share of a run's memory is meant to stay under 300 MiB
#: (:mod:`experiments.audit_overhead`).
SPILL_AFTER_BYTES = 16 * 1024 * 1024


class QueueSpill:
    """Move waiting updates to files in ``directory`` (created 0700 when first needed), in a thread.

    Parameters
    ----------
    directory : Path
        The folder of the spilled updates; it is removed with its content by :meth:`close`.
    after_bytes : int or None (default: None)
        Memory the waiting updates may take before new ones are spilled; None:
        :data:`SPILL_AFTER_BYTES`.
    """

    def __init__(self, directory: Path, *, after_bytes: int | None = None) -> None:
        self.directory = directory
        self.after_bytes = SPILL_AFTER_BYTES if after_bytes is None else after_bytes
        self.failures = 0
        self._pending: queue.SimpleQueue[SentLayer | None] = queue.SimpleQueue()
        self._names = itertools.count()
        self._thread = threading.Thread(target=self._run, name="fl-attack-spill", daemon=True)
        self._thread.start()

    def add(self, update: SentLayer, *, queued: int) -> None:
        """Spill ``update`` soon (unless its attack takes it first) when ``queued`` updates like it
        (itself included) would take more than :attr:`after_bytes`."""
        if queued * update.weight.nbytes > self.after_bytes:
            self._pending.put(update)

    def _run(self) -> None:
        while True:
            update = self._pending.get()
            if update is None:
                return
            try:
                self.directory.mkdir(mode=0o700, exist_ok=True)
                update.spill(self.directory / f"{next(self._names)}.layer")
            except OSError as error:  # a full disk: the update stays in memory, the audit goes on
                self.failures += 1
                if self.failures == 1:
                    logger.warning("Waiting attacks keep their updates in memory: %s", error)
            del update  # hold no update while waiting for the next one

    def close(self) -> None:
        """Stop the thread and remove the folder (the attacks have taken or dropped their updates)."""
        self._pending.put(None)
        self._thread.join()
        shutil.rmtree(self.directory, ignore_errors=True)
