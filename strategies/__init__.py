"""Flower server side of fl-attack: the honest-but-curious strategy wrapper and the ServerApp.

One line audits any Message-API strategy::

    strategy = HonestButCuriousStrategy.from_context(FedAvg(...), context)

Everything the audit does lives in the framework-free :class:`fl_attack.audit.Auditor`.
"""

from .factory import build_attacker, build_auditor, build_store
from .honest_but_curious import HonestButCuriousStrategy
from .run_config import (
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
    "build_attacker",
    "build_auditor",
    "build_store",
    "resolve_audit_config",
    "resolve_run_config",
]
