"""One verdict per attack, decided from what the server sees and the attack's own self-check.

The verdict never uses ground truth, so it means the same in a simulation and in a
deployment. "exact" needs a complete reconstruction of a clean (noise-free) update whose
self-check passed; "not-applicable" is only given for an update that exact inversion
cannot explain (and never when the attack in fact recovered the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fl_attack.vocabulary import (
    INPUT_SPACE_FEATURES,
    STATUS_DROPPED,
    STATUS_KILLED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    STATUS_TIMEOUT,
    VERDICT_APPROXIMATE,
    VERDICT_DROPPED,
    VERDICT_EXACT,
    VERDICT_FAILED,
    VERDICT_NOT_APPLICABLE,
    VERDICT_TIMEOUT,
)

from .signature import ADAPTIVE_CONCENTRATION, FULL_RANK_SHARE, UpdateSignature

#: On a clean update every exactly recovered sample's ReLU pattern agrees with the update
#: everywhere; a sample below this agreement may be a blend of near-identical samples.
EXACT_MIN_CONFIDENCE = 0.999


@dataclass(frozen=True)
class Verdict:
    """What the server may claim about one attacked update.

    Attributes
    ----------
    verdict : str
        One of :data:`fl_attack.vocabulary.VERDICTS`.
    reason : str
        One sentence saying why.
    """

    verdict: str
    reason: str


def not_applicable_reason(
    signature: UpdateSignature,
    *,
    train_mode: str | None = None,
    num_examples: int | None = None,
) -> str | None:
    """Why exact inversion cannot explain this update, or None when it could.

    Parameters
    ----------
    signature : UpdateSignature
        Figures of the observed update.
    train_mode : str or None (default: None)
        What the client reported about its training (simulation only), to name the cause.
    num_examples : int or None (default: None)
        The example count the client reported with its update (FedAvg's weight).
    """
    m, n = signature.shape
    if signature.zero:
        return "the client's update of this layer is zero: there is nothing to invert"
    if signature.adaptive_like:
        return (
            f"{100 * signature.magnitude_concentration:.0f}% of the update's entries have the same magnitude "
            "(within 5%): steps of an adaptive optimizer such as Adam are not one gradient, so exact "
            "inversion does not apply"
        )
    if signature.low_rank:
        return None
    if num_examples is not None and n <= m and num_examples >= n:
        return (
            f"batch of {num_examples} rows on {n} input features: a batch larger than the input dimension "
            "cannot be separated by an exact attack"
        )
    if num_examples is not None and num_examples > m:
        return (
            f"{more_samples_than_neurons(num_examples, m)}; the update agrees: it has no low-rank structure"
        )
    if train_mode == "fedavg":
        return (
            "several local steps (FedAvg) left the update without low-rank structure: it is not one "
            "gradient of a small batch, so exact inversion does not apply"
        )
    if train_mode == "dpsgd":
        return (
            f"DP noise hides the batch's low-rank structure (s_b / s_(b+1) = {signature.spectral_gap:.2f}: the "
            "noise's top singular value reaches the batch's weakest direction), so exact inversion does not apply"
        )
    if signature.rank_estimate is not None and signature.rank_estimate < FULL_RANK_SHARE * min(m, n):
        return (
            f"the update has no clear low-rank structure (s_b / s_(b+1) = {signature.spectral_gap:.2f} at an "
            f"estimated rank of {signature.rank_estimate}): it is not one gradient of a small batch; several "
            "local steps, an adaptive optimizer such as Adam, DP noise at this level"
            + (f", or a batch of {n} or more samples on {n} input features" if n <= m else "")
            + " defeat exact inversion"
        )
    if n <= m:
        return (
            f"the update has full rank on {n} input features: it is not one gradient of a small batch "
            f"(a batch of {n} or more samples, several local steps, or DP noise), which an exact attack "
            "on this layer cannot separate"
        )
    return (
        f"the update has no low-rank structure (rank close to min(m, n) = {min(m, n)}): it is not one "
        "gradient of a small batch (several local steps, DP noise, or a batch larger than the layer "
        "can separate)"
    )


def more_samples_than_neurons(num_examples: int, width: int) -> str:
    """``"5000 samples against 120 neurons: ..."``: a client count no exact attack on the layer separates."""
    return (
        f"{num_examples} samples against {width} neurons: no exact attack can separate them "
        "(the count is the client's num-examples)"
    )


def _epoch_prefix(attack: Mapping[str, Any]) -> str:
    """``"one local epoch, 4 mini-batches of 5: "`` when the samples were fitted to their own SGD steps."""
    epoch = attack.get("local_epoch")
    if not isinstance(epoch, str) or not epoch:
        return ""
    return epoch.removeprefix("fits ") + ": "


def _features_note(input_space: str | None) -> str:
    if input_space == INPUT_SPACE_FEATURES:
        return " (the layer follows other layers: these are its input features, not the raw data)"
    return ""


def decide_verdict(
    *,
    status: str,
    error: str | None,
    attack: Mapping[str, Any],
    signature: Callable[[], UpdateSignature | None],
    magnitude_concentration: float | None,
    input_space: str | None,
    train_mode: str | None = None,
    time_budget: float | None = None,
    num_examples: int | None = None,
) -> Verdict:
    """Decide the verdict of one attack.

    Parameters
    ----------
    status : str
        The job's status (:data:`fl_attack.vocabulary.STATUSES`).
    error : str or None
        The failure, when the status is not ok.
    attack : Mapping[str, Any]
        The reconstruction's own summary (``complete``, ``batch_size``, ``directions_found``,
        ``noisy``, ``stopped_by``, ...), empty when the attack did not return.
    signature : Callable[[], UpdateSignature or None]
        Computes the update's signature on demand (an SVD: only called when needed).
    magnitude_concentration : float or None
        Share of the update's entries near the median magnitude (cheap; see
        :func:`fl_attack.audit.signature.magnitude_concentration`).
    input_space : str or None
        ``"inputs"`` or ``"features"``.
    train_mode : str or None (default: None)
        Client-reported training mode (simulation only).
    time_budget : float or None (default: None)
        The attack's budget in seconds.
    num_examples : int or None (default: None)
        The example count the client(s) reported.
    """
    if status == STATUS_DROPPED:
        return Verdict(VERDICT_DROPPED, "the attack queue was full and its policy dropped this update")
    adaptive = magnitude_concentration is not None and magnitude_concentration > ADAPTIVE_CONCENTRATION
    if status == STATUS_OK:
        b = int(attack.get("batch_size", 0))
        found = int(attack.get("directions_found", 0))
        complete = bool(attack.get("complete", False))
        noisy = bool(attack.get("noisy", False))
        if adaptive:
            reason = _not_applicable(signature, train_mode, num_examples)
            if reason is not None:
                return Verdict(VERDICT_NOT_APPLICABLE, reason)
        weakest = float(attack.get("min_confidence", 1.0 if complete else 0.0))
        # a batch fitted to one local epoch was judged sample by sample at the weights of its own
        # step (fit and self-check); its agreement at W_0, which later steps leave, says nothing
        own_steps = bool(_epoch_prefix(attack))
        # rows below the bar that the next layer's update confirmed one by one no longer count
        unconfirmed = attack.get("unconfirmed_min_confidence")
        confirmed_weak = isinstance(unconfirmed, (int, float)) and float(unconfirmed) >= EXACT_MIN_CONFIDENCE
        if (
            complete
            and not noisy
            and not adaptive
            and not own_steps
            and weakest < EXACT_MIN_CONFIDENCE
            and not confirmed_weak
        ):
            return Verdict(
                VERDICT_APPROXIMATE,
                f"{_epoch_prefix(attack)}all {b} samples found, but the weakest one's ReLU pattern agrees with the update at only "
                f"{weakest:.4f} (exact needs {EXACT_MIN_CONFIDENCE}): exactness is not confirmed (near-identical "
                "samples may be blended, or the layer's float32 rounding moved a neuron)"
                + _features_note(input_space),
            )
        certificate = attack.get("self_check_certificate")
        if complete and not noisy and not adaptive and isinstance(certificate, str) and certificate:
            return Verdict(
                VERDICT_EXACT,
                f"all {b} samples recovered; their ReLU patterns at the global weights do not confirm them "
                f"(as after several local steps), but {certificate}" + _features_note(input_space),
            )
        if complete and not noisy and not adaptive:
            matching = float(attack.get("sparsity_matching", 0.0))
            precision = attack.get("estimated_max_relative_error")
            precise = (
                f", rows precise to ~{float(precision):.0e} (estimated)" if precision is not None else ""
            )
            return Verdict(
                VERDICT_EXACT,
                f"{_epoch_prefix(attack)}all {b} samples recovered; the self-check passed (sparsity matching {matching:.3f}{precise})"
                + (_confirmed_note(attack, weakest) if weakest < EXACT_MIN_CONFIDENCE else "")
                + _features_note(input_space),
            )
        merged = int(attack.get("next_layer_checked", 0) or 0) + int(
            attack.get("next_layer_unchecked", 0) or 0
        )
        if not complete and merged > 0:
            return Verdict(VERDICT_APPROXIMATE, _next_layer_reason(attack, b) + _features_note(input_space))
        reason = _not_applicable(signature, train_mode, num_examples) if (noisy or found < b) else None
        if reason is not None and not (complete and noisy):
            return Verdict(VERDICT_NOT_APPLICABLE, reason)
        if complete:
            return Verdict(
                VERDICT_APPROXIMATE,
                f"all {b} samples recovered up to the update's noise (relative noise "
                f"{float(attack.get('relative_noise', 0.0)):.2g}), not exactly" + _features_note(input_space),
            )
        all_found = b > 0 and found >= b
        if attack.get("stopped_by") == "time_budget":
            spent = f"{time_budget:g} s " if time_budget else ""
            share = attack.get("time_budget")
            if time_budget and isinstance(share, (int, float)) and 0 < share < 0.999 * time_budget:
                # the exact attack got a share: the rest was kept for the next-layer route
                spent = f"{share:g} s share of the {time_budget:g} s "
            if b <= 0:
                why = attack.get("stop_reason") or "the budget ran out before the search"
                progress = f": the batch size was not estimated ({why})"
            elif all_found:
                progress = f": {_all_found_unconfirmed(attack, b)}"
            else:
                progress = (
                    f" with {found} of {b} samples found{_certified_note(attack)}{_sparsity_note(attack, b)}"
                )
            return Verdict(VERDICT_TIMEOUT, f"the attack spent its whole {spent}budget{progress}")
        if b <= 0:  # never "0 of 0 samples": say why there was no batch to search
            why = attack.get("stop_reason") or "the attack reported no batch size"
            return Verdict(VERDICT_FAILED, f"no sample recovered: the batch size was not estimated ({why})")
        if all_found:
            return Verdict(
                VERDICT_APPROXIMATE, _all_found_unconfirmed(attack, b) + _features_note(input_space)
            )
        if found > 0:
            return Verdict(
                VERDICT_APPROXIMATE,
                f"{found} of {b} samples recovered with a consistent ReLU pattern{_certified_note(attack)}; "
                "the rest were not found"
                + _search_stop(attack)
                + _sparsity_note(attack, b)
                + _features_note(input_space),
            )
        return Verdict(
            VERDICT_FAILED,
            f"no sample recovered of an estimated batch of {b}"
            + _search_stop(attack)
            + _sparsity_note(attack, b),
        )
    if status == STATUS_TIMEOUT:
        stopped = error or "the attack did not finish within its hard limit"
        return Verdict(VERDICT_TIMEOUT, stopped + _kept_note(attack))
    reason = _not_applicable(signature, train_mode, num_examples)
    if reason is not None:
        return Verdict(VERDICT_NOT_APPLICABLE, reason)
    if status == STATUS_OUT_OF_MEMORY:
        return Verdict(VERDICT_FAILED, f"the attack ran out of memory: {error}")
    if status == STATUS_KILLED:
        return Verdict(VERDICT_FAILED, f"the attack's worker was killed: {error}{_kept_note(attack)}")
    return Verdict(VERDICT_FAILED, f"the attack failed: {error}")


def _confirmed_note(attack: Mapping[str, Any], weakest: float) -> str:
    """Why samples whose ReLU pattern agrees below the bar are still exact: the next layer's
    update confirmed each (:func:`fl_attack.pipeline.side_information.next_layer.confirm_weak_rows`)."""
    rows = int(attack.get("next_layer_confirmed_rows", 0) or 0)
    return (
        f"; {rows} sample{'s' if rows != 1 else ''} whose ReLU pattern agrees with the update at only "
        f"{weakest:.4f} (an active neuron whose gradient vanishes below the update's precision) "
        f"{'were each' if rows != 1 else 'was'} confirmed through the next layer's update"
    )


def _all_found_unconfirmed(attack: Mapping[str, Any], b: int) -> str:
    """Why a batch whose every direction was found is still not a confirmed reconstruction."""
    found = f"all {b} directions were found but not verified as the batch{_certified_note(attack)}: "
    if attack.get("self_check_passed") is False:
        reasons = attack.get("self_check_reasons")
        why = f" ({reasons})" if isinstance(reasons, str) and reasons else ""
        return found + f"the self-check against the observed update failed{why}"
    weakest = attack.get("min_confidence")
    matching = float(attack.get("sparsity_matching", 0.0))
    if attack.get("self_check_passed") is True and attack.get("drift_aware"):
        return found + (
            "every direction is consistent with both ends of the client's local steps, which one layer's "
            "update cannot tell from a blend of look-alike samples, so exactness is not claimed"
        )
    if attack.get("self_check_passed") is True and attack.get("noisy"):
        return found + (
            f"the self-check passed up to the noise, but their ReLU patterns agree with the update at a "
            f"sparsity matching of only {matching:.3f}, too close to chance for the attack to accept"
        )
    if attack.get("self_check_passed") is True and isinstance(weakest, (int, float)):
        return found + (
            f"the self-check passed, but the weakest sample's ReLU pattern agrees with the update at only "
            f"{float(weakest):.4f} (sparsity matching {matching:.3f}), below what the attack accepts"
        )
    return found + "the attack reported no self-check that confirms them"


def _next_layer_reason(attack: Mapping[str, Any], b: int) -> str:
    """Rows the next-layer route recovered (:mod:`fl_attack.audit.next_layer_stage`), checked or not."""
    checked = int(attack.get("next_layer_checked", 0) or 0)
    unchecked = int(attack.get("next_layer_unchecked", 0) or 0)
    missing = max(b - checked - unchecked, 0)
    return (
        f"{checked} of {b} samples recovered and confirmed by the next-layer route (from the following "
        f"layer's update, each checked by its own zero pattern without ground truth); {unchecked} more found "
        f"by it without that confirmation (not claimed), {missing} not found by it"
    )


def _kept_note(attack: Mapping[str, Any]) -> str:
    """What an attack stopped at its hard limit (or killed) had handed back (:mod:`fl_attack.progress`)."""
    if not attack.get("partial"):
        return "; it had handed back no partial result, so nothing it found is kept"
    b = int(attack.get("batch_size", 0) or 0)
    found = int(attack.get("directions_found", 0) or 0)
    if b <= 0:
        why = attack.get("stop_reason")
        return "; the batch size was not estimated before the limit" + (f" ({why})" if why else "")
    if attack.get("approximate"):  # an estimate of every row (the Cocktail Party's), never found one by one
        iterations = attack.get("ica_iterations")
        after = "" if iterations is None else f" after {iterations} ICA iterations"
        return f"; its last estimate of the {b} rows{after} is kept, approximate (it has no self-check)"
    if found <= 0:
        return f"; none of the {b} rows was found before the limit"
    return f"; {found} of {b} rows found so far are kept, not verified as the batch{_certified_note(attack)}"


def _certified_note(attack: Mapping[str, Any]) -> str:
    """How many of a partial batch's samples the next layer's update confirmed one by one
    (:mod:`fl_attack.pipeline.side_information.next_layer`), when it did."""
    certified = int(attack.get("next_layer_certified", 0) or 0)
    return f" ({certified} of them confirmed one by one through the next layer's update)" if certified else ""


def _sparsity_note(attack: Mapping[str, Any], b: int) -> str:
    """Why samples of a batch of ``b`` are out of the search's reach on this layer, when they are.

    A sample is found only through a gradient column with at least ``b + 1`` zeros among the
    layer's live neurons (the attack's ``informative_rows``); where that is more than half of
    them, each sample must leave most of the layer inactive, which a ReLU layer rarely does.
    """
    rows = attack.get("informative_rows")
    if not isinstance(rows, (int, float)) or isinstance(rows, bool) or b <= 1:
        return ""
    live = int(rows)
    needed = b + 1
    if needed > live:
        return (
            f": each sample must leave at least {needed} live neurons inactive to be found, "
            f"and the layer has only {live}"
        )
    if 2 * needed <= live:
        return ""
    return (
        f": each sample must leave at least {needed} of the layer's {live} live neurons inactive to be "
        "found (more than half), which a ReLU layer rarely does"
    )


def _search_stop(attack: Mapping[str, Any]) -> str:
    """Why the search ended, when the attack's statistics say and it was not its budget."""
    if attack.get("stopped_by") == "no_improvement":
        return " (the search stopped when more proposals no longer improved it)"
    return ""


def _not_applicable(
    signature: Callable[[], UpdateSignature | None], train_mode: str | None, num_examples: int | None
) -> str | None:
    computed = signature()
    if computed is None:
        return None
    return not_applicable_reason(computed, train_mode=train_mode, num_examples=num_examples)
