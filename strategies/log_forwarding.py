"""Show the audit's own log lines (verdicts, warnings) where Flower shows its own.

The ``fl_attack`` logger has no handler of its own: a Flower process would print only its
WARNING lines (through Python's last-resort handler, on stderr) and drop the INFO ones, such
as each attack's verdict. Forwarding its records to Flower's logger gives them Flower's
console handler, whose output ``flwr run``'s run log mirrors.
"""

from __future__ import annotations

import logging

from flwr.supercore.logger import FLOWER_LOGGER

#: The logger of the attack library.
AUDIT_LOGGER = "fl_attack"


class _ToFlowerLogger(logging.Handler):
    """Hand every record to the handlers of Flower's logger (its console handler).

    Only Flower's own handlers: the record still propagates to the root logger by itself, so
    handing it to Flower's parents too would print it twice wherever the root has a handler.
    """

    def emit(self, record: logging.LogRecord) -> None:
        for handler in FLOWER_LOGGER.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def forward_audit_log() -> None:
    """Send the audit's INFO and higher records to Flower's logger (once per process)."""
    audit = logging.getLogger(AUDIT_LOGGER)
    audit.setLevel(logging.INFO)
    if not any(isinstance(handler, _ToFlowerLogger) for handler in audit.handlers):
        audit.addHandler(_ToFlowerLogger(logging.INFO))
