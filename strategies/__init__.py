"""Flower server side of fl-attack: the honest-but-curious strategy wrapper and the ServerApp.

One line audits any Message-API strategy::

    strategy = HonestButCuriousStrategy.from_context(FedAvg(...), context)

Everything the audit does lives in the framework-free :class:`fl_attack.audit.Auditor`.
Importing the package checks the installed Flower version first (:mod:`.flower_version`).
"""

from .flower_version import SUPPORTED_FLOWER, check_flower_version

check_flower_version()

# the modules below use Flower's API: imported only once its version is known to be supported
from .factory import build_attacker, build_auditor, build_store  # noqa: E402
from .honest_but_curious import HonestButCuriousStrategy  # noqa: E402
from .run_config import (  # noqa: E402
    AUDIT_KEYS,
    CLIENT_KEYS,
    DEFAULT_RUN_CONFIG,
    SETTINGS,
    RunConfigError,
    resolve_audit_config,
    resolve_run_config,
)

__all__ = [
    "AUDIT_KEYS",
    "CLIENT_KEYS",
    "DEFAULT_RUN_CONFIG",
    "HonestButCuriousStrategy",
    "RunConfigError",
    "SETTINGS",
    "SUPPORTED_FLOWER",
    "build_attacker",
    "build_auditor",
    "build_store",
    "check_flower_version",
    "resolve_audit_config",
    "resolve_run_config",
]
