"""What the auditor attacks: one unit (a client's update, or a secure-aggregation sum), its name and figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_attack.vocabulary import APPROX_PSNR_DB, EXACT_PSNR_DB

from .layer import LayerDelta
from .observations import ClientUpdate
from .workers import AttackResult


@dataclass(frozen=True)
class Prepared:
    """One unit's observed update, ready for a worker."""

    server_round: int
    members: list[ClientUpdate]
    delta: LayerDelta


def unit_name(members: Sequence[ClientUpdate]) -> str:
    """Name of an attacked update: the client's, or ``secagg-<a>_<b>...`` for a sum."""
    if len(members) == 1:
        return members[0].identity.name
    return "secagg-" + "_".join(member.identity.name for member in members)


def total_examples(members: Sequence[ClientUpdate]) -> int | None:
    counts = [member.num_examples for member in members]
    return None if any(count is None for count in counts) else sum(count or 0 for count in counts)


def attack_summary(result: AttackResult) -> dict[str, Any]:
    reconstruction = result.reconstruction
    if reconstruction is None or not hasattr(reconstruction, "summary"):
        return {}
    return dict(reconstruction.summary())


def member_quality(
    members: list[ClientUpdate], sizes: list[int], psnr: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Per-client recovery inside a secure-aggregation sum (references were concatenated)."""
    report: dict[str, dict[str, Any]] = {}
    start = 0
    for member, size in zip(members, sizes, strict=True):
        values = [float(value) for value in psnr[start : start + size]]
        start += size
        report[member.identity.name] = {
            "samples": len(values),
            "mean_psnr": float(np.mean(values)) if values else None,
            "exact_fraction": float(np.mean([v > EXACT_PSNR_DB for v in values])) if values else None,
            "approx_fraction": float(np.mean([v > APPROX_PSNR_DB for v in values])) if values else None,
        }
    return report


def to_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        return np.asarray(values.detach().cpu().numpy())
    return np.asarray(values)
