"""Render the report page from the summary, the plots and the sample tiles (Jinja2, autoescaped).

Every value reaches the page through the template with autoescaping on; no HTML is built
in Python. Images are base64 data URLs and a Content-Security-Policy forbids fetching
anything, so the page opens offline and runs no script.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2

from fl_attack.results.report.formatting import format_psnr, number_text, percent, share_text
from fl_attack.results.report.gallery import SampleTiles
from fl_attack.results.report.loading import RunData
from fl_attack.results.report.settings import relevant_settings
from fl_attack.results.report.threat import threat_model_card
from fl_attack.vocabulary import (
    APPROX_PSNR_DB,
    DISPLAY_PSNR_CAP_DB,
    EXACT_PSNR_DB,
    STATUS_OK,
    VERDICT_APPROXIMATE,
    VERDICT_EXACT,
    VERDICT_MEANINGS,
)

__all__ = ["CSP", "render_page"]

TEMPLATE = "report.html.j2"
#: Nothing may be fetched; images only from data: URLs; no script at all.
CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "script-src 'none'; font-src 'none'; connect-src 'none'"
)
_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 72em; color: #222; line-height: 1.45;
       padding: 0 1em; }
h1 { font-size: 1.5em; margin-top: 0; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
#verdict { border: 2px solid #08519c; background: #eef4fb; padding: 1em 1.4em; border-radius: 6px; }
#verdict .sentence { font-size: 1.3em; font-weight: bold; margin: 0.4em 0 0.8em; }
ul.figures { margin: 0; padding-left: 1.2em; }
nav ol { columns: 2; margin: 0; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.stops td { background: #eef8ee; } tr.weak td { color: #666; }
dl.card { display: grid; grid-template-columns: 13em 1fr; gap: 0.3em 1em; border: 1px solid #ccc;
          padding: 0.8em 1em; border-radius: 6px; background: #fafafa; }
dl.card dt { font-weight: bold; } dl.card dd { margin: 0; }
.note { color: #555; font-size: 0.92em; } .warn { color: #a33; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; height: auto; } img.pixels { image-rendering: pixelated; }
.gallery { display: flex; flex-wrap: wrap; gap: 0.8em; }
figure.sample { margin: 0; border: 1px solid #ddd; padding: 0.4em; text-align: center; }
.pair { display: flex; gap: 0.3em; } .tile { display: flex; flex-direction: column; align-items: center; }
.label { font-size: 0.8em; color: #555; }
code { background: #f4f4f4; padding: 0 0.2em; }
.status-ok { color: #1a6; }
.status-error, .status-timeout, .status-out-of-memory, .status-killed { color: #a33; }
"""


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(
        {
            "b64": _base64,
            "psnr": format_psnr,
            "pct": percent,
            "share": share_text,
            "num": number_text,
        }
    )
    return environment


def _toc(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    sections = [
        ("verdict", "Verdict"),
        ("recommendations", "Recommendations"),
        ("threat-model", "Threat model"),
        ("verdicts", "Verdicts"),
        ("rounds", "Leakage and utility per round"),
        ("psnr", "PSNR distribution"),
        ("samples", "Reconstructed samples"),
        ("timing", "Attack time per client"),
        ("secagg", "Secure aggregation"),
        ("failures", "Failures"),
        ("attacks", "All attacked updates"),
        ("settings", "Settings"),
    ]
    return [(key, title) for key, title in sections if key != "secagg" or summary["secagg_members"]]


def _verdict_rows(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    derived: dict[str, int] = {}
    for attack in summary["attack_details"]:
        if attack["verdict_derived"]:
            derived[attack["verdict"]] = derived.get(attack["verdict"], 0) + 1
    attacks = summary["attacks"]
    return [
        {
            "verdict": verdict,
            "count": count,
            "share": count / attacks if attacks else None,
            "derived": derived.get(verdict, 0),
            "meaning": VERDICT_MEANINGS[verdict],
            "advice": summary["verdict_advice"].get(verdict, ""),
        }
        for verdict, count in summary["verdict_counts"].items()
    ]


def _failures(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    recovered = (VERDICT_EXACT, VERDICT_APPROXIMATE)
    return [
        attack
        for attack in summary["attack_details"]
        if attack["status"] != STATUS_OK or attack["error"] or attack["verdict"] not in recovered
    ]


def _setting_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_page(
    *,
    data: RunData,
    summary: Mapping[str, Any],
    pictures: Mapping[str, bytes | None],
    best: Sequence[SampleTiles],
    worst: Sequence[SampleTiles],
    grids: Sequence[Mapping[str, Any]],
    limits: Sequence[str],
) -> str:
    """The report page as HTML text.

    Parameters
    ----------
    data : RunData
        The loaded run.
    summary : Mapping[str, Any]
        :func:`~fl_attack.results.report.summary.build_summary` of the run.
    pictures : Mapping[str, bytes or None]
        PNG plots ``rounds``, ``psnr`` and ``attack_seconds`` (None: not drawn).
    best, worst : Sequence[SampleTiles]
        The labelled sample tiles.
    grids : Sequence[Mapping[str, Any]]
        Unscored reconstruction grids (``round``, ``client``, ``png``), shown when nothing was scored.
    limits : Sequence[str]
        The attack's time limits, for the timing caption.
    """
    settings, omitted = relevant_settings(data.config)
    recommendation = summary["recommendations"]
    scopes = list(
        dict.fromkeys((item["setting"], item["scope"], item["source"]) for item in recommendation["rows"])
    )
    context = {
        "csp": CSP,
        "css": _CSS,
        "run_name": data.directory.name,
        "run_directory": str(data.directory),
        "generated": datetime.now().isoformat(timespec="seconds"),
        "s": summary,
        "thresholds": {
            "exact": f"{EXACT_PSNR_DB:g}",
            "approx": f"{APPROX_PSNR_DB:g}",
            "cap": f"{DISPLAY_PSNR_CAP_DB:g}",
        },
        "problems": data.problems,
        "unscored_ok": sum(1 for entry in data.entries if entry.status == STATUS_OK and not entry.scored),
        "toc": _toc(summary),
        "rec": recommendation,
        "rec_scopes": scopes,
        "card": threat_model_card(data),
        "config_missing": data.config is None,
        "verdict_rows": _verdict_rows(summary),
        "pictures": {name: pictures.get(name) for name in ("rounds", "psnr", "attack_seconds")},
        "best": list(best),
        "worst": list(worst),
        "grids": list(grids),
        "limits": list(limits),
        "failures": _failures(summary),
        "spaces": any(attack["input_space"] for attack in summary["attack_details"]),
        "queued": any(attack["queue_seconds"] is not None for attack in summary["attack_details"]),
        "settings": [(key, _setting_text(value)) for key, value in settings],
        "omitted": omitted,
    }
    return _environment().get_template(TEMPLATE).render(context)
