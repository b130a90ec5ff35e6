"""The words the audit uses, defined once: terminal, CSV, JSON and report all take them from here.

An attack on one observed update ends with a *status* (what happened to the job) and, when it
ran, a *verdict* (what the server can claim about the client's data). Quality thresholds on
PSNR are named here too, so that "exact" means the same everywhere.
"""

from __future__ import annotations

#: The attack returned a reconstruction (its verdict says how good it is).
STATUS_OK = "ok"
#: The attack raised an exception, or its update could not be read.
STATUS_ERROR = "error"
#: The attack was stopped at its hard limit (or spent its whole budget without a result).
STATUS_TIMEOUT = "timeout"
#: The attack ran out of host or accelerator memory.
STATUS_OUT_OF_MEMORY = "out-of-memory"
#: The attack's worker was killed by a signal (not known to be memory).
STATUS_KILLED = "killed"
#: The attack was never run: its queue was full and the queue policy dropped it.
STATUS_DROPPED = "dropped"
#: The attack was not run: the update's spectrum showed it cannot apply (verdict ``not-applicable``).
STATUS_NOT_RUN = "not-run"

STATUSES: tuple[str, ...] = (
    STATUS_OK,
    STATUS_ERROR,
    STATUS_TIMEOUT,
    STATUS_OUT_OF_MEMORY,
    STATUS_KILLED,
    STATUS_DROPPED,
    STATUS_NOT_RUN,
)

VERDICT_EXACT = "exact"
VERDICT_APPROXIMATE = "approximate"
VERDICT_NOT_APPLICABLE = "not-applicable"
VERDICT_FAILED = "failed"
VERDICT_TIMEOUT = "timeout"
VERDICT_DROPPED = "dropped"

#: One sentence per verdict, as the README and the report define them.
VERDICT_MEANINGS: dict[str, str] = {
    VERDICT_EXACT: (
        "every sample of the client's batch was recovered, and the attack's own self-check "
        "(re-synthesised update, ReLU pattern, rank) confirms it without any ground truth"
    ),
    VERDICT_APPROXIMATE: (
        "some samples, or all of them up to noise, were recovered; the self-check does not "
        "confirm an exact recovery of the whole batch"
    ),
    VERDICT_NOT_APPLICABLE: (
        "what the server observed cannot be inverted exactly (for example several optimizer "
        "steps, an adaptive optimizer, heavy noise, or a batch larger than the layer can separate)"
    ),
    VERDICT_FAILED: (
        "the attack applies to this update but did not recover the batch, or crashed; the reason says which"
    ),
    VERDICT_TIMEOUT: "the attack spent its whole time budget before it could finish",
    VERDICT_DROPPED: "the attack was never run because its queue was full",
}

VERDICTS: tuple[str, ...] = tuple(VERDICT_MEANINGS)

#: The attacked layer is the model's first: its inputs are the client's data.
INPUT_SPACE_INPUTS = "inputs"
#: The attacked layer follows other layers (e.g. convolutions): its inputs are features.
INPUT_SPACE_FEATURES = "features"
INPUT_SPACES: tuple[str, ...] = (INPUT_SPACE_INPUTS, INPUT_SPACE_FEATURES)

#: A sample is recovered *exactly* above this PSNR (float64 recovery reaches 150+ dB).
EXACT_PSNR_DB = 90.0
#: A sample is recovered *approximately* (recognisably) above this PSNR.
APPROX_PSNR_DB = 25.0
#: PSNR values above this are shown to people as "> 150 dB" (they only measure rounding).
DISPLAY_PSNR_CAP_DB = 150.0

#: A reconstructed feature vector is exact when its relative error is below this.
EXACT_RELATIVE_ERROR = 1e-4
#: ... and approximate below this.
APPROX_RELATIVE_ERROR = 0.1

#: Meaning of ``complete``, the attacker's own claim (no ground truth involved).
COMPLETE_MEANING = (
    "the attack found one verified direction per sample of the estimated batch size and its "
    "self-check passed; it is computed from the observed update alone"
)


def format_psnr(value: float | None) -> str:
    """A PSNR for people: one decimal, ``"> 150 dB"`` above the display cap, ``"-"`` when missing."""
    if value is None or value != value:  # None or NaN
        return "-"
    if value > DISPLAY_PSNR_CAP_DB:
        return f"> {DISPLAY_PSNR_CAP_DB:.0f} dB"
    return f"{value:.1f} dB"
