"""Self-contained audit report of a run directory, and its machine-readable summary.

:func:`write_report` reads a run directory written by
:class:`~fl_attack.results.store.ReconstructionStore` (``run_config.json``, ``attacks.csv``,
``history.json`` and every attack's ``metrics.json`` / ``reconstruction.png``) and writes

* ``<run>/report.html``: one page that opens offline (images embedded, no script, a
  Content-Security-Policy that forbids fetching anything). It opens with the verdict
  (``<section id="verdict">``: one sentence built from the data), then measured defense
  recommendations, the threat-model card, verdict counts, leakage and utility per round,
  the PSNR distribution, labelled reconstructions, timing, failures with their reasons,
  every attack, and the settings that played a part;
* ``<run>/report.json``: the same figures for CI (:func:`load_summary` computes them);
* ``<run>/report/*.png``: the plots as PNG files.

``fl-attack-report RUN_DIR [-o FILE]`` runs :func:`write_report` (:func:`entry_point`).
No Flower import lives here.
"""

from __future__ import annotations

from fl_attack.results.report.cli import entry_point, main
from fl_attack.results.report.loading import AttackEntry, NotARunDirectoryError, RunData, load_run
from fl_attack.results.report.summary import build_summary, load_summary
from fl_attack.results.report.writer import REPORT_DIRECTORY, REPORT_FILE, SUMMARY_FILE, write_report

__all__ = [
    "REPORT_DIRECTORY",
    "REPORT_FILE",
    "SUMMARY_FILE",
    "AttackEntry",
    "NotARunDirectoryError",
    "RunData",
    "build_summary",
    "entry_point",
    "load_run",
    "load_summary",
    "main",
    "write_report",
]
