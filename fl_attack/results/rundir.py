"""Choosing a run's directory: never reuse a run by accident, never change a directory we did not make.

Rules (see :func:`open_run_directory`):

- a path that does not exist is created, private (mode ``0o700``);
- an existing *run* directory (it holds ``run_config.json`` or ``attacks.csv``) is refused,
  unless the caller resumes it on purpose;
- any other existing directory (``/tmp``, a shared results folder, an empty folder the user
  made) keeps its mode and contents: the run goes into a new private subdirectory
  ``<dir>/audit-<YYYYmmdd-HHMMSS>[-N]``, claimed with an exclusive ``mkdir``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fl_attack.results.files import DIRECTORY_MODE, claim_fresh_directory, write_error

RUN_CONFIG_FILE = "run_config.json"
TABLE_FILE = "attacks.csv"
#: Files whose presence makes a directory a run directory.
RUN_MARKERS: tuple[str, ...] = (RUN_CONFIG_FILE, TABLE_FILE)
#: Stem of the private subdirectory a run gets inside an existing non-run directory.
SUBDIRECTORY_PREFIX = "audit-"


class RunDirectoryExistsError(FileExistsError):
    """The output directory already holds a run, and resuming it was not asked for."""


def is_run_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding ``run_config.json`` or ``attacks.csv``."""
    directory = Path(path)
    return directory.is_dir() and any((directory / marker).exists() for marker in RUN_MARKERS)


def timestamp() -> str:
    """The local time as ``YYYYmmdd-HHMMSS``, the stem of new run directories."""
    return time.strftime("%Y%m%d-%H%M%S")


def open_run_directory(path: str | os.PathLike[str], *, resume: bool) -> tuple[Path, bool]:
    """The directory a run given ``path`` writes to, and whether it was created just now.

    Parameters
    ----------
    path : str or os.PathLike
        The output directory the user asked for.
    resume : bool
        Append to the existing run directory ``path`` instead of refusing it.

    Returns
    -------
    tuple[Path, bool]
        The absolute run directory (``path`` itself, or a new private subdirectory of it),
        and True when this call created it.

    Raises
    ------
    RunDirectoryExistsError
        When ``path`` is a run directory and ``resume`` is False.
    FileNotFoundError
        When ``resume`` is True and ``path`` is not a run directory.
    NotADirectoryError
        When ``path`` exists and is not a directory.
    StoreWriteError
        When a directory cannot be created (disk full, permissions, ...).
    """
    requested = Path(path).expanduser().resolve()
    if resume:
        if not is_run_directory(requested):
            raise FileNotFoundError(
                f"cannot resume {requested}: it is not a run directory (no {RUN_CONFIG_FILE} or {TABLE_FILE})"
            )
        return requested, False
    if not requested.exists():
        try:
            requested.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as error:
            raise NotADirectoryError(f"cannot create {requested}: a parent is not a directory") from error
        except OSError as error:
            raise write_error(requested.parent, error, action="create directory") from error
        try:
            requested.mkdir(mode=DIRECTORY_MODE)
            os.chmod(requested, DIRECTORY_MODE)  # mkdir's mode is reduced by the umask
            return requested, True
        except FileExistsError:
            pass  # created meanwhile by someone else: treat it as an existing directory below
        except OSError as error:
            raise write_error(requested, error, action="create directory") from error
    if not requested.is_dir():
        raise NotADirectoryError(f"output directory {requested} exists and is not a directory")
    if is_run_directory(requested):
        raise RunDirectoryExistsError(
            f"{requested} already holds a run ({' or '.join(RUN_MARKERS)} exists); pass resume=True "
            "to append to it, or choose another output directory"
        )
    return claim_fresh_directory(requested, SUBDIRECTORY_PREFIX + timestamp()), True
