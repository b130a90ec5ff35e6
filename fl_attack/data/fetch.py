"""``fl-attack-data``: download the datasets that are not bundled, and show where data is.

Commands::

    fl-attack-data fetch cifar10|mnist|adult|tiny-imagenet [--root DIR]
    fl-attack-data list [--root DIR]
    fl-attack-data path NAME [--root DIR]

``fetch`` writes ``<root>/<dataset>/`` (layout in :mod:`fl_attack.data.locate`), by default
under ``$FL_ATTACK_DATA`` or ``~/.cache/fl_attack/data``, which the loaders search without
being told. ``list`` shows every dataset and where it was found, ``path`` prints the directory
a loader reads. Errors are one line on stderr. Exit codes: 0 done, 1 failed or not found,
2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fl_attack.data.downloads import FETCHABLE, FetchError, fetch_dataset, fetch_plan
from fl_attack.data.locate import (
    BUNDLED_DATASETS,
    DATA_ENV_VAR,
    DATASET_FOLDERS,
    DatasetNotFoundError,
    data_search_paths,
    dataset_candidates,
    default_data_root,
    locate_dataset,
    probe_dataset,
)

__all__ = ["entry_point", "main"]

PROG = "fl-attack-data"
_FOLDER = "folder"
_ALL_NAMES: tuple[str, ...] = (*BUNDLED_DATASETS, *DATASET_FOLDERS, _FOLDER)


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 1


def _is_searched_by_default(directory: Path) -> bool:
    return directory.parent in data_search_paths()


def _fetch(name: str, root: str | None) -> int:
    try:
        directory, downloaded = fetch_dataset(name, root=root)
    except FetchError as error:
        return _fail(f"could not fetch {name}: {error}")
    except OSError as error:
        return _fail(f"could not fetch {name}: {' '.join(str(error).split())}")
    except KeyboardInterrupt:
        return _fail(f"fetching {name} was interrupted; run the command again to resume")
    state = "fetched into" if downloaded else "already in"
    hint = "" if _is_searched_by_default(directory) else f"; use it with data-root={directory.parent}"
    print(f"{name} {state} {directory}{hint}")
    return 0


def _found_at(name: str, root: str | None) -> list[tuple[Path, str]]:
    hits = []
    for directory in dataset_candidates(name, root=root):
        presence = probe_dataset(name, directory)
        if presence.found:
            hits.append((directory, presence.form))
    return hits


def _list(root: str | None) -> int:
    if root is None:
        print("searched: " + ", ".join(str(p) for p in data_search_paths()))
        print(f"fetch writes to: {default_data_root()} (set {DATA_ENV_VAR} or pass --root to change)")
    else:
        print(f"searched: {Path(root).expanduser()} (alone)")
    width = max(len(n) for n in _ALL_NAMES) + 2
    for name in BUNDLED_DATASETS:
        print(f"{name:<{width}}bundled (offline, no files needed)")
    for name in DATASET_FOLDERS:
        hits = _found_at(name, root)
        if not hits:
            size = fetch_plan(name).size
            print(f"{name:<{width}}missing: run `{PROG} fetch {name}` ({size})")
            continue
        first, form = hits[0]
        print(f"{name:<{width}}{first} [{form}]")
        for directory, other in hits[1:]:
            print(f"{'':<{width}}also {directory} [{other}] (not used: found first above)")
    print(f"{_FOLDER:<{width}}any directory of images: pass data-root=DIR")
    return 0


def _path(name: str, root: str | None) -> int:
    if name in BUNDLED_DATASETS:
        return _fail(f"{name} is bundled with scikit-learn / scikit-image: it has no directory")
    if name == _FOLDER:
        return _fail("folder is a directory of your own images: pass it as data-root=DIR")
    try:
        print(locate_dataset(name, root=root))
    except DatasetNotFoundError as error:
        return _fail(str(error))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fetch the datasets fl-attack does not bundle, and show where data is found.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fetch = commands.add_parser("fetch", help="download a dataset into the data root")
    fetch.add_argument("name", choices=FETCHABLE, metavar="NAME", help=" | ".join(FETCHABLE))
    show = commands.add_parser("list", help="which datasets are present, and where")
    path = commands.add_parser("path", help="print the directory a dataset is read from")
    path.add_argument("name", choices=_ALL_NAMES, metavar="NAME", help=" | ".join(_ALL_NAMES))
    for command in (fetch, show, path):
        command.add_argument(
            "--root",
            metavar="DIR",
            default=None,
            help=f"data root (default for fetch: ${DATA_ENV_VAR}, else ~/.cache/fl_attack/data; "
            "for list and path: search the usual places)",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fl-attack-data`` with ``argv`` (default: the command line); return the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "fetch":
        return _fetch(args.name, args.root)
    if args.command == "list":
        return _list(args.root)
    return _path(args.name, args.root)


def entry_point() -> None:
    """Console-script entry (``fl-attack-data``)."""
    raise SystemExit(main())


if __name__ == "__main__":
    entry_point()
