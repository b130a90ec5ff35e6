"""One attack on one observed update, as the store keeps it: :class:`AttackRecord` and the table columns."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_attack.results.files import jsonable
from fl_attack.results.recovery import sample_recovery
from fl_attack.vocabulary import INPUT_SPACES, STATUSES, VERDICTS

#: Columns of the run table (``attacks.csv``), in order.
TABLE_COLUMNS: tuple[str, ...] = (
    "round",
    "client",
    "status",
    "verdict",
    "verdict_reason",
    "input_space",
    "seconds",
    "batch_size",
    "complete",
    "sparsity_matching",
    "num_references",
    "mean_psnr",
    "min_psnr",
    "exact_fraction",
    "approx_fraction",
    "batch_exact",
    "error",
    "directory",
    "queued_at",
    "started_at",
    "finished_at",
    "attack",
    "fallback_after",
)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TIMESTAMP_FIELDS = ("queued_at", "started_at", "finished_at")


@dataclass(frozen=True)
class AttackRecord:
    """Everything stored about one attack on one client's update.

    Attributes
    ----------
    server_round : int
        Federated round (starting at 1) in which the update was sent.
    client : str
        Client name of letters, digits, ``_``, ``.`` and ``-`` (not starting with ``.`` or
        ``-``), e.g. ``"partition-3"``, ``"node-81723"`` or ``"secagg-partition-0_partition-1"``;
        any length (the store shortens long names for its directories).
    status : str
        What happened to the attack job, one of :data:`fl_attack.vocabulary.STATUSES`.
    seconds : float
        Wall-clock time spent on the attack (finite, non-negative).
    inputs : numpy.ndarray or None
        ``(b, n)`` reconstructed layer inputs, in the attacker's order.
    reconstructed_images : numpy.ndarray or None
        ``(k, C, H, W)`` reconstructions in ``[0, 1]`` for the PNG grid; when
        ``reference_images`` is given, row ``i`` is matched to reference ``i``.
    reference_images : numpy.ndarray or None
        ``(k, C, H, W)`` ground-truth images in ``[0, 1]`` (only when scored).
    attack : Mapping[str, Any]
        What the attacker itself reports (batch size, sparsity-matching coefficient,
        completeness, ...), computed without the ground truth.
    quality : Mapping[str, Any]
        Scalar quality against the ground truth (mean PSNR, exact fraction, ...).
    psnr : Sequence[float] or None
        PSNR in dB of every ground-truth sample against its matched reconstruction.
    error : str or None
        Why the attack failed, when ``status`` is not ``"ok"``.
    details : Mapping[str, Any]
        Further JSON-serialisable facts (node id, partition id, training mode, ...).
    verdict : str or None
        What the server can claim about the client's data, one of
        :data:`fl_attack.vocabulary.VERDICTS`, or None when not judged.
    verdict_reason : str
        Why that verdict (empty when there is nothing to add).
    input_space : str or None
        What the attacked layer's inputs are, one of :data:`fl_attack.vocabulary.INPUT_SPACES`.
    queued_at, started_at, finished_at : float or None
        Unix times (seconds) at which the attack was queued, started and finished.
    """

    server_round: int
    client: str
    status: str
    seconds: float
    inputs: np.ndarray | None = None
    reconstructed_images: np.ndarray | None = None
    reference_images: np.ndarray | None = None
    attack: Mapping[str, Any] = field(default_factory=dict)
    quality: Mapping[str, Any] = field(default_factory=dict)
    psnr: Sequence[float] | None = None
    error: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    verdict: str | None = None
    verdict_reason: str = ""
    input_space: str | None = None
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        """Validate every field that ends up in paths, tables or JSON; one line per problem."""
        problems = self._problems()
        if problems:
            raise ValueError("invalid AttackRecord:\n" + "\n".join(f"  {line}" for line in problems))

    def _problems(self) -> list[str]:
        problems: list[str] = []
        if not _is_integer(self.server_round) or self.server_round < 0:
            problems.append(f"server_round must be a non-negative integer, got {self.server_round!r}")
        if not isinstance(self.client, str) or not _SAFE_NAME.match(self.client):
            problems.append(
                f"client name {self.client!r} is not directory-safe "
                "(letters, digits, '_', '.', '-'; not starting with '.' or '-')"
            )
        if self.status not in STATUSES:
            problems.append(f"status must be one of {STATUSES}, got {self.status!r}")
        if not _is_time(self.seconds):
            problems.append(f"seconds must be a finite non-negative number, got {self.seconds!r}")
        if self.verdict is not None and self.verdict not in VERDICTS:
            problems.append(f"verdict must be one of {VERDICTS} or None, got {self.verdict!r}")
        if not isinstance(self.verdict_reason, str):
            problems.append(f"verdict_reason must be a string, got {type(self.verdict_reason).__name__}")
        if self.input_space is not None and self.input_space not in INPUT_SPACES:
            problems.append(f"input_space must be one of {INPUT_SPACES} or None, got {self.input_space!r}")
        for name in _TIMESTAMP_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_time(value):
                problems.append(f"{name} must be None or unix seconds (finite, >= 0), got {value!r}")
        if self.error is not None and not isinstance(self.error, str):
            problems.append(f"error must be a string or None, got {type(self.error).__name__}")
        if self.psnr is not None and not _is_number_sequence(self.psnr):
            problems.append(f"psnr must be None or a sequence of numbers, got {self.psnr!r}")
        for name in ("attack", "quality", "details"):
            if not isinstance(getattr(self, name), Mapping):
                problems.append(f"{name} must be a mapping, got {type(getattr(self, name)).__name__}")
        return problems

    def metrics(self) -> dict[str, Any]:
        """The JSON document stored as ``metrics.json`` (no arrays)."""
        document: dict[str, Any] = jsonable(
            {
                "round": self.server_round,
                "client": self.client,
                "status": self.status,
                "verdict": self.verdict,
                "verdict_reason": self.verdict_reason,
                "input_space": self.input_space,
                "seconds": self.seconds,
                "queued_at": self.queued_at,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "error": self.error,
                "complete": self.attack.get("complete"),
                "sparsity_matching": self.attack.get("sparsity_matching"),
                "batch_size": self.attack.get("batch_size"),
                "attack": dict(self.attack),
                "quality": dict(self.quality),
                "psnr": None if self.psnr is None else [float(v) for v in self.psnr],
                "details": dict(self.details),
            }
        )
        return document

    def table_row(self, directory: str) -> dict[str, Any]:
        """One row of the run table; ``directory`` is the attack's directory relative to the run."""
        psnr = None if self.psnr is None else [float(v) for v in self.psnr]
        recovery = sample_recovery(quality=self.quality, psnr=psnr)
        row = {
            "round": self.server_round,
            "client": self.client,
            "status": self.status,
            "verdict": self.verdict,
            "verdict_reason": self.verdict_reason,
            "input_space": self.input_space,
            "seconds": round(float(self.seconds), 4),
            "batch_size": self.attack.get("batch_size"),
            "complete": self.attack.get("complete"),
            "sparsity_matching": self.attack.get("sparsity_matching"),
            "num_references": None if recovery is None else recovery.scored,
            "mean_psnr": self.quality.get("mean_psnr"),
            "min_psnr": min(psnr) if psnr else None,
            "exact_fraction": self.quality.get("exact_fraction"),
            "approx_fraction": self.quality.get("approx_fraction"),
            "batch_exact": self.quality.get("batch_exact"),
            "error": self.error,
            "directory": directory,
            "queued_at": _unix_time(self.queued_at),
            "started_at": _unix_time(self.started_at),
            "finished_at": _unix_time(self.finished_at),
            "attack": self.attack.get("attack"),
            "fallback_after": fallback_after(self.details),
        }
        return {key: "" if value is None else value for key, value in row.items()}


def _is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number_sequence(values: object) -> bool:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        return False
    return all(
        isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
        for value in values
    )


def _is_time(value: object) -> bool:
    """A finite, non-negative real number (booleans are not numbers here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(float(value)) and float(value) >= 0.0


def _unix_time(value: float | None) -> str | None:
    """Unix seconds with microsecond resolution, as written in the table."""
    return None if value is None else f"{float(value):.6f}"


def fallback_after(details: Mapping[str, Any]) -> str | None:
    """The exact attack's verdict when this record is a fallback attack's, else None."""
    after = details.get("fallback_after")
    return str(after.get("verdict")) if isinstance(after, Mapping) else None


def is_fallback_row(row: Mapping[str, str]) -> bool:
    """Whether a row of ``attacks.csv`` is a fallback attack's (a second, approximate attack on an
    update the exact attack did not recover exactly: :mod:`fl_attack.audit.fallback`)."""
    return bool(row.get("fallback_after"))
