"""Defense recommendations backed by measured results, and only those relevant to what leaked.

The measurements live in ``measured_defenses.json`` beside this module: values copied from
result files under ``experiments/results/``, each with its source file. A setting is
recommended when it brought recovery (exact and approximate) below
:data:`RECOVERY_TARGET` in its measurement and is stronger than what the run already had.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from fl_attack.results.report.formatting import share_text
from fl_attack.results.report.loading import number
from fl_attack.results.report.settings import secagg_group_size, train_mode

__all__ = ["MEASURED_DEFENSES_FILE", "RECOVERY_TARGET", "measured_defenses", "recommendations"]

#: The data file of measured defense results.
MEASURED_DEFENSES_FILE = Path(__file__).with_name("measured_defenses.json")


@lru_cache(maxsize=1)
def measured_defenses() -> dict[str, Any]:
    """The content of :data:`MEASURED_DEFENSES_FILE`."""
    document: dict[str, Any] = json.loads(MEASURED_DEFENSES_FILE.read_text(encoding="utf-8"))
    return document


#: Recovery below this share of samples counts as stopped (1%).
RECOVERY_TARGET: float = float(measured_defenses()["target_share"])


def _point(sweep: Mapping[str, Any], point: Mapping[str, Any]) -> dict[str, Any]:
    values = point["values"]
    baseline = sweep["baseline"]["values"]
    exact, approx = float(values["exact_fraction"]), float(values["approx_fraction"])
    attacks, failures = int(values["attacked_updates"]), int(values["attack_failures"])
    if attacks and failures == attacks:
        recovery = f"the attack failed on all {attacks} updates: no sample was recovered"
    else:
        recovery = (
            f"{share_text(exact)} of {int(values['scored_samples'])} scored samples recovered exactly, "
            f"{share_text(approx)} approximately"
        )
    accuracy, reference = float(values["final_test_acc"]), float(baseline["final_test_acc"])
    utility = (
        f"{sweep['utility_metric']} {accuracy:.3f} against {reference:.3f} without the defense "
        f"({100.0 * (accuracy - reference):+.1f} points)"
    )
    epsilon = number(values.get("epsilon"))
    return {
        "defense": sweep["defense"],
        "parameter": sweep["parameter"],
        "label": sweep["label"],
        "value": point["match"]["value"],
        "stops": exact < RECOVERY_TARGET and approx < RECOVERY_TARGET,
        "exact_share": exact,
        "approximate_share": approx,
        "recovery": recovery,
        "utility": utility,
        "epsilon": (
            None
            if epsilon is None
            else f"ε = {epsilon:.3g}" + (f" (δ = {float(values['delta']):g})" if "delta" in values else "")
        ),
        "setting": sweep["setting"],
        "scope": sweep["scope"],
        "source": sweep["source"],
    }


def _local_steps_findings() -> list[dict[str, Any]]:
    findings = []
    for finding in measured_defenses()["local_steps"]:
        batches = [batch["values"] for batch in finding["batches"]]
        exact = " / ".join(share_text(float(batch["exact_fraction"])) for batch in batches)
        approx = " / ".join(share_text(float(batch["approx_fraction"])) for batch in batches)
        findings.append(
            {
                "setting": finding["setting"],
                "text": f"per batch, {exact} of the samples recovered exactly and {approx} approximately",
                "source": finding["source"],
            }
        )
    return findings


def recommendations(*, config: Mapping[str, Any] | None, leaked_share: float | None) -> dict[str, Any]:
    """The recommendations for one run.

    Parameters
    ----------
    config : Mapping[str, Any] or None
        The run's ``run_config.json``.
    leaked_share : float or None
        Share of the client samples recovered at least approximately (or, without scores,
        of the attacks whose verdict is exact or approximate); None when nothing was attacked.

    Returns
    -------
    dict[str, Any]
        ``status`` (``not-attacked``, ``below-target``, ``shown``), ``message``, ``caveat``,
        ``rows`` (measured settings, each with ``stops``, ``recovery``, ``utility``,
        ``epsilon`` and ``source``), ``beyond_measured`` (defenses the run already had at or
        beyond the strongest measured setting) and ``local_steps`` (FedAvg findings, for
        FedAvg runs).
    """
    data = measured_defenses()
    result: dict[str, Any] = {
        "target_share": RECOVERY_TARGET,
        "caveat": data["caveat"],
        "rows": [],
        "beyond_measured": [],
        "local_steps": [],
    }
    if leaked_share is None:
        return {
            **result,
            "status": "not-attacked",
            "message": "Nothing was attacked, so nothing is recommended.",
        }
    if leaked_share < RECOVERY_TARGET:
        return {
            **result,
            "status": "below-target",
            "message": (
                f"Recovery is already below {share_text(RECOVERY_TARGET)} in this run: the measurements "
                "call for no further defense."
            ),
        }
    current = {
        "dpsgd": (number(config.get("noise-multiplier")) or 0.0)
        if config is not None and train_mode(config) == "dpsgd"
        else -math.inf,
        "secagg": float(secagg_group_size(config)),
    }
    for sweep in data["sweeps"]:
        stronger = [
            point for point in sweep["points"] if float(point["match"]["value"]) > current[sweep["defense"]]
        ]
        if not stronger:
            result["beyond_measured"].append(sweep["label"])
        result["rows"] += [_point(sweep, point) for point in stronger]
    if train_mode(config) == "fedavg":
        result["local_steps"] = _local_steps_findings()
    message = (
        f"Recovery in this run is {share_text(leaked_share)} of the client samples. Measured settings "
        f"that brought it below {share_text(RECOVERY_TARGET)} are marked; each row names its source file."
    )
    return {**result, "status": "shown", "message": message}
