"""The Flower versions this plugin supports, checked when its Flower-facing packages are imported.

The range is the one ``pyproject.toml`` declares for ``flwr`` (a test keeps the two equal).
Outside it, importing :mod:`strategies` or :mod:`clients` fails with one line naming the range,
instead of failing later on an API that moved.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: Oldest Flower tested (CI) up to the next major version.
SUPPORTED_FLOWER = ">=1.41,<2"


class UnsupportedFlowerError(ImportError):
    """The installed Flower is outside :data:`SUPPORTED_FLOWER`."""


def check_flower_version(installed: str | None = None) -> str:
    """Return the installed Flower version when it is supported.

    Parameters
    ----------
    installed : str or None (default: None)
        The version to check; None reads the one ``import flwr`` would load.

    Raises
    ------
    UnsupportedFlowerError
        With one line naming the installed version and the supported range.
    """
    if installed is None:
        installed = _imported_flower_version()
    try:
        supported = Version(installed) in SpecifierSet(SUPPORTED_FLOWER)
    except InvalidVersion:
        supported = False
    if not supported:
        raise UnsupportedFlowerError(
            f"fl-attack supports flwr{SUPPORTED_FLOWER}, but flwr {installed} is installed: "
            f'pip install "flwr[simulation]{SUPPORTED_FLOWER}"'
        )
    return installed


def _imported_flower_version() -> str:
    """The version of the ``flwr`` package on the import path (metadata, else the package's own)."""
    import flwr  # pylint: disable=import-outside-toplevel

    own = getattr(flwr, "__version__", None)
    if isinstance(own, str):
        return own
    try:
        return version("flwr")
    except PackageNotFoundError:
        return "unknown"
