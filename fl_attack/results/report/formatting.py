"""Numbers as the report shows them: shares that never round to a false 0% or 100%.

PSNR values are shown with :func:`fl_attack.vocabulary.format_psnr` (re-exported here for
the template), never formatted anew.
"""

from __future__ import annotations

from typing import Any

from fl_attack.vocabulary import format_psnr

__all__ = ["format_psnr", "number_text", "percent", "share_text", "short_name"]

_MISSING = "–"


def share_text(value: float | None) -> str:
    """A share in whole percent: ``"94%"``; ``"<1%"`` / ``">99%"`` rather than a rounded 0% / 100%."""
    if value is None:
        return _MISSING
    text = f"{100.0 * value:.0f}%"
    if 0.0 < value and text == "0%":
        return "<1%"
    if value < 1.0 and text == "100%":
        return ">99%"
    return text


def percent(value: float | None) -> str:
    """A share with one decimal: ``"42.9%"``; ``"<0.1%"`` / ``">99.9%"`` near the ends."""
    if value is None:
        return _MISSING
    text = f"{100.0 * value:.1f}%"
    if 0.0 < value and text == "0.0%":
        return "<0.1%"
    if value < 1.0 and text == "100.0%":
        return ">99.9%"
    return text


def number_text(value: Any, digits: int = 1) -> str:
    """A table cell: floats with ``digits`` decimals, booleans as yes / no, missing as a dash."""
    if value is None or value == "":
        return _MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value in ("True", "False"):
        return "yes" if value == "True" else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def short_name(name: str, limit: int = 22) -> str:
    """A label of at most ``limit`` characters (``secagg-partition-0_partition-1``: ``sum p0+p1``)."""
    if name.startswith("secagg-"):
        name = "sum " + "+".join(
            member.replace("partition-", "p").replace("node-", "n")
            for member in name[len("secagg-") :].split("_")
        )
    return name if len(name) <= limit else name[: limit - 1] + "…"
