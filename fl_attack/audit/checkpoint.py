"""Where a running attack's partial results wait for the runner (:mod:`fl_attack.progress`).

* :class:`CheckpointFile`, for a worker process that may be killed: each partial result is
  pickled to a temporary file beside the checkpoint and renamed over it, so the checkpoint is
  always a whole earlier result and never half of one; the parent reads it with
  :func:`read_checkpoint` once the worker is dead.
* :class:`LatestPartial`, for an attack in a thread of this process: the waiting side reads
  the latest partial result directly.

Checkpoints hold reconstructed client data: they are files of mode ``0o600`` in a directory
of mode ``0o700`` (:func:`checkpoint_directory`), removed when the job is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path

from fl_attack.reconstruction import Reconstruction

logger = logging.getLogger(__name__)

#: Suffix of the temporary file a checkpoint is written to before it is renamed into place.
TEMPORARY_SUFFIX = ".partial"


def checkpoint_directory() -> Path:
    """A new private directory (mode ``0o700``) for one runner's checkpoints."""
    return Path(tempfile.mkdtemp(prefix="fl-attack-checkpoints-"))


class CheckpointFile:
    """A progress sink that keeps the latest partial result in the file ``path``.

    A write that fails (a full disk) loses that checkpoint, never the attack: the previous
    checkpoint stays in place.

    Parameters
    ----------
    path : Path
        The checkpoint; its temporary file is ``path`` plus :data:`TEMPORARY_SUFFIX`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False

    def report(self, partial: Reconstruction) -> None:
        """Replace the checkpoint by ``partial`` (atomically: a reader sees the old or the new one)."""
        temporary = self.path.with_name(self.path.name + TEMPORARY_SUFFIX)
        try:
            payload = pickle.dumps(partial, protocol=pickle.HIGHEST_PROTOCOL)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(payload)
            # no fsync: the checkpoint must survive the worker being killed, not the machine
            os.replace(temporary, self.path)
        except OSError as error:
            if not self._failed:
                logger.warning("could not checkpoint the attack's partial result to %s: %s", self.path, error)
            self._failed = True


def read_checkpoint(path: Path) -> Reconstruction | None:
    """The partial result checkpointed at ``path``, or None when there is none (or it is unreadable).

    Only ``path`` itself is read, never its temporary file: what a worker killed in the middle
    of a write left behind is ignored.
    """
    try:
        payload = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning("could not read the attack's checkpoint %s: %s", path, error)
        return None
    try:
        partial = pickle.loads(payload)
    except Exception as error:  # a file this module did not write whole: nothing to keep
        logger.warning("the attack's checkpoint %s is unreadable: %s: %s", path, type(error).__name__, error)
        return None
    return partial if isinstance(partial, Reconstruction) else None


def remove_checkpoint(path: Path) -> None:
    """Remove the checkpoint at ``path`` and its temporary file, where they exist."""
    for name in (path, path.with_name(path.name + TEMPORARY_SUFFIX)):
        with contextlib.suppress(FileNotFoundError):
            name.unlink()


class LatestPartial:
    """A progress sink in memory, for an attack running in a thread of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Reconstruction | None = None

    def report(self, partial: Reconstruction) -> None:
        """Keep ``partial`` in place of the one before."""
        with self._lock:
            self._latest = partial

    def latest(self) -> Reconstruction | None:
        """The last partial result reported, or None."""
        with self._lock:
            return self._latest
