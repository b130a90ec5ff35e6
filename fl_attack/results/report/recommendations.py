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
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fl_attack.results.report.formatting import share_text
from fl_attack.results.report.loading import number
from fl_attack.results.report.settings import secagg_group_size, train_mode

__all__ = ["MEASURED_DEFENSES_FILE", "RECOVERY_TARGET", "Evidence", "measured_defenses", "recommendations"]

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


@dataclass(frozen=True)
class Evidence:
    """What a run shows about leakage.

    Attributes
    ----------
    leaked_share : float
        Share of the scored client samples recovered at least approximately (``basis ==
        "samples"``), or of the attacked updates whose verdict is exact or approximate
        (``basis == "verdicts"``, no ground truth).
    basis : str
        ``"samples"`` or ``"verdicts"``.
    applied : int
        Attacks that ran to the end on an update they apply to (status ok, verdict not
        ``not-applicable``): those that could have recovered samples.
    attacks : int
        Attacked updates.
    verdicts : dict[str, int]
        Attacks per verdict.
    """

    leaked_share: float
    basis: str
    applied: int
    attacks: int
    verdicts: dict[str, int]

    @property
    def counts_text(self) -> str:
        """``"4 exact, 2 not-applicable"``."""
        return ", ".join(f"{count} {verdict}" for verdict, count in self.verdicts.items() if count)


def _no_evidence_reason(evidence: Evidence) -> str | None:
    """Why a run that recovered (almost) nothing is still no evidence that a defense is unneeded."""
    if evidence.basis != "samples":
        return (
            "no ground truth was scored, and the server's own check reconstructed "
            f"{'none' if evidence.leaked_share == 0 else share_text(evidence.leaked_share)} of the "
            f"{evidence.attacks} attacked updates ({evidence.counts_text})"
        )
    if evidence.applied == 0:
        return (
            f"the attack could not recover anything from these {evidence.attacks} updates ({evidence.counts_text}): "
            "it did not apply, or did not finish, so no defense was put to the test"
        )
    return None


def recommendations(*, config: Mapping[str, Any] | None, evidence: Evidence | None) -> dict[str, Any]:
    """The recommendations for one run.

    Parameters
    ----------
    config : Mapping[str, Any] or None
        The run's ``run_config.json``.
    evidence : Evidence or None
        What the run shows about leakage; None when nothing was attacked.

    Returns
    -------
    dict[str, Any]
        ``status`` (``not-attacked``, ``no-evidence``, ``below-target``, ``shown``), ``message``,
        ``caveat``, ``rows`` (measured settings, each with ``stops``, ``recovery``, ``utility``,
        ``epsilon`` and ``source``), ``beyond_measured`` (defenses the run already had at or
        beyond the strongest measured setting) and ``local_steps`` (FedAvg findings, for
        FedAvg runs). ``below-target`` ("no further defense") is only given when ground truth
        was scored and the attack could have recovered samples (it ran on updates it applies to).
    """
    data = measured_defenses()
    result: dict[str, Any] = {
        "target_share": RECOVERY_TARGET,
        "caveat": data["caveat"],
        "rows": [],
        "beyond_measured": [],
        "local_steps": [],
    }
    if evidence is None:
        return {
            **result,
            "status": "not-attacked",
            "message": "Nothing was attacked, so nothing is recommended.",
        }
    leaked_share = evidence.leaked_share
    if leaked_share < RECOVERY_TARGET:
        unproven = _no_evidence_reason(evidence)
        if unproven is not None:
            return {
                **result,
                "status": "no-evidence",
                "message": (
                    f"This run shows no recovery, but that is no evidence that the data is safe: {unproven}. "
                    "Nothing here measures how much a defense would help."
                ),
            }
        return {
            **result,
            "status": "below-target",
            "message": (
                f"Recovery is already below {share_text(RECOVERY_TARGET)} of the scored client samples in this "
                "run, where the attack could have recovered them: the measurements call for no further defense."
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
    if evidence.basis == "samples":
        recovered = f"Recovery in this run is {share_text(leaked_share)} of the client samples."
    else:
        recovered = (
            f"In this run the server's own check reconstructed {share_text(leaked_share)} of the "
            f"{evidence.attacks} attacked updates at least approximately (no ground truth, so no sample share)."
        )
    message = (
        f"{recovered} Measured settings that brought recovery below {share_text(RECOVERY_TARGET)} of the "
        "samples are marked; each row names its source file."
    )
    return {**result, "status": "shown", "message": message}
