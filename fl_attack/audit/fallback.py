"""A second, approximate attack on every update the exact attack did not recover exactly.

When the exact attack's verdict is ``approximate``, ``failed``, ``timeout`` or
``not-applicable``, the auditor runs the fallback attack (by default the Cocktail Party
Attack, ``cocktail-party``) on the same observed update, in the same worker (off the round's
critical path when the auditor has a pool), and stores it as a record of its own: same round
and client, ``attack = <fallback name>``, verdict ``approximate`` when it returned inputs and
``failed`` otherwise, never ``exact``. It is scored by the auditor's scorer like any attack.

An update with nothing to unmix gets no fallback: one the exact attack recovered exactly, a
dropped or unreadable one (never attacked), an all-zero one, one whose spectrum already ruled
the exact attack out (no batch of per-sample gradients in it), and one with more samples than
ICA can separate from the layer (``min(m, n)``); the last two say so in the exact attack's
record (``details["fallback_skipped"]``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_attack.results.store import AttackRecord
from fl_attack.types import LayerAttack
from fl_attack.vocabulary import (
    STATUS_ERROR,
    STATUS_NOT_RUN,
    STATUS_OK,
    VERDICT_APPROXIMATE,
    VERDICT_FAILED,
    VERDICT_NOT_APPLICABLE,
    VERDICT_TIMEOUT,
)

from .units import Prepared, attack_summary, total_examples, unit_name
from .workers import AttackResult, AttackRunner, make_runner

if TYPE_CHECKING:
    from .auditor import Auditor

logger = logging.getLogger(__name__)

#: The default fallback attack, and the names that switch the fallback off.
DEFAULT_FALLBACK = "cocktail-party"
NO_FALLBACK = ("", "none")
#: Verdicts of the exact attack after which the fallback runs.
FALLBACK_AFTER = (VERDICT_APPROXIMATE, VERDICT_FAILED, VERDICT_TIMEOUT, VERDICT_NOT_APPLICABLE)


def build_fallback(
    fallback: str | LayerAttack | None, *, seed: int = 0, time_budget: float | None = None
) -> AttackFallback:
    """The fallback named ``fallback`` (a registered attack), an attacker object, or none (disabled).

    Parameters
    ----------
    fallback : str or LayerAttack or None
        ``"cocktail-party"``, another registered attack's name, an attack object,
        or ``None`` / ``""`` / ``"none"`` for no fallback.
    seed : int (default: 0)
        Seeds a fallback built by name.
    time_budget : float or None (default: None)
        Its default time budget (the auditor passes its own with every attack).

    Raises
    ------
    ValueError
        On a name that is not a registered attack (the message lists them).
    """
    if fallback is None or (isinstance(fallback, str) and fallback.strip().lower() in NO_FALLBACK):
        return AttackFallback(None, name="")
    if isinstance(fallback, str):
        from fl_attack.attacks import get_attack  # the registry imports every attack: only when needed

        name = fallback.strip()
        return AttackFallback(get_attack(name, seed=seed, time_budget=time_budget), name=name)
    if not isinstance(fallback, LayerAttack):
        raise ValueError(f"fallback must be an attack name, a LayerAttack or None, got {fallback!r}")
    return AttackFallback(fallback, name=str(getattr(fallback, "name", type(fallback).__name__)))


class AttackFallback:
    """Run one fallback attack after the exact attack, with one runner per pool thread.

    Parameters
    ----------
    attacker : LayerAttack or None
        The fallback attack; None disables the fallback (:meth:`run` does nothing).
    name : str
        Its name, written to the record's ``attack`` summary.
    """

    def __init__(self, attacker: LayerAttack | None, *, name: str) -> None:
        self.attacker = attacker
        self.name = name
        self._runners = threading.local()

    def skip_reason(self, prepared: Prepared, primary: AttackRecord) -> str | None:
        """Why the fallback does not run on this unit, or None when it does."""
        if self.attacker is None:
            return "the fallback is disabled"
        if primary.verdict not in FALLBACK_AFTER:
            return f"the exact attack's verdict is {primary.verdict}"
        if primary.attack.get("attack") == self.name:
            return f"the exact attack already is {self.name}"
        if primary.status == STATUS_NOT_RUN and primary.attack.get("low_rank") is False:
            return (
                "the update's spectrum shows no batch of per-sample gradients (see the verdict), so there "
                "are no sources to unmix"
            )
        weight_update = prepared.delta.weight_update
        if not np.any(weight_update):
            return "the update of the attacked layer is zero"
        return None

    def applicability(self, auditor: Auditor, prepared: Prepared, primary: AttackRecord) -> str | None:
        """Why the fallback cannot say anything about this unit (it is not run), or None when it can.

        Beyond :meth:`skip_reason`: ICA separates at most ``min(m, n)`` sources of an ``(m, n)``
        update, so a batch larger than that (e.g. the example count of many local steps) is left alone.
        """
        reason = self.skip_reason(prepared, primary)
        if reason is not None:
            return reason
        m, n = prepared.delta.weight_update.shape
        sources = self.batch_size(auditor, prepared, primary)
        if sources is not None and sources > min(m, n):
            return (
                f"{sources} samples cannot be unmixed from a {m} x {n} layer update (at most min(m, n) = "
                f"{min(m, n)} sources)"
            )
        return None

    def annotate(self, auditor: Auditor, prepared: Prepared, primary: AttackRecord) -> AttackRecord:
        """``primary`` with ``details["fallback_skipped"]`` saying why the fallback does not run, when
        it would have run after this verdict but cannot say anything here (:meth:`applicability`)."""
        if self.attacker is None or primary.verdict not in FALLBACK_AFTER:
            return primary
        if primary.attack.get("attack") == self.name:
            return primary
        try:
            reason = self.applicability(auditor, prepared, primary)
        except Exception as error:  # an unreadable unit: the fallback's own run records it
            logger.debug("fallback applicability of %s: %r", unit_name(prepared.members), error)
            return primary
        if reason is None:
            return primary
        return dataclasses.replace(
            primary, details={**primary.details, "fallback_skipped": f"{self.name}: {reason}"}
        )

    def batch_size(self, auditor: Auditor, prepared: Prepared, primary: AttackRecord) -> int | None:
        """Sources to unmix: the configured batch size, the exact attack's estimate, the clients' count.

        None leaves the fallback to estimate it from the update's spectrum.
        """
        if auditor.batch_size is not None:
            return auditor.batch_size * len(prepared.members)
        estimate = primary.attack.get("batch_size")
        if isinstance(estimate, int) and not isinstance(estimate, bool) and estimate > 0:
            return estimate
        return total_examples(prepared.members) or None

    def run(self, auditor: Auditor, prepared: Prepared, primary: AttackRecord) -> list[AttackRecord]:
        """Attack ``prepared`` again after ``primary`` and keep the record with the auditor's store.

        Returns
        -------
        list[AttackRecord]
            The fallback's record (as kept), or nothing when the fallback does not apply.
            Never raises: a failure of the fallback is its record's ``failed`` verdict.
        """
        if primary.details.get("fallback_skipped") or self.skip_reason(prepared, primary) is not None:
            return []
        queued_at = started_at = time.time()
        try:
            batch_size = self.batch_size(auditor, prepared, primary)
            runner = self._runner(auditor)
            started_at = time.time()
            result = runner.run(
                prepared.delta,
                batch_size=batch_size,
                time_budget=auditor.time_budget,
                timeout=auditor.timeout,
            )
            record = self._record(auditor, prepared, primary, result, (queued_at, started_at, time.time()))
        except Exception as error:  # the fallback never stops the audit: its failure is recorded
            failure = AttackResult(
                status=STATUS_ERROR,
                reconstruction=None,
                seconds=0.0,
                error=f"{type(error).__name__}: {error}",
            )
            try:
                record = self._record(
                    auditor, prepared, primary, failure, (queued_at, started_at, time.time())
                )
            except Exception as unrecordable:  # e.g. a member the auditor cannot describe: log, never raise
                logger.error(
                    "the %s fallback on %s failed: %r", self.name, unit_name(prepared.members), unrecordable
                )
                return []
        return [auditor._keep(record)]

    def _runner(self, auditor: Auditor) -> AttackRunner:
        """This thread's runner (each pool thread has its own), registered for the auditor's close()."""
        runner: AttackRunner | None = getattr(self._runners, "value", None)
        if runner is None:
            assert self.attacker is not None
            if auditor.backend == "ray":
                from .ray_runner import RayAttackRunner

                runner = RayAttackRunner(
                    self.attacker,
                    address=auditor.ray_address,
                    num_cpus=auditor.attack_cpus,
                    num_gpus=auditor.attack_gpus,
                )
            else:
                runner = make_runner(self.attacker, auditor.isolation, priority=auditor.priority)
            self._runners.value = runner
            with auditor._store_lock:
                auditor._runners.append(runner)
        return runner

    def _record(
        self,
        auditor: Auditor,
        prepared: Prepared,
        primary: AttackRecord,
        result: AttackResult,
        times: tuple[float, float, float],
    ) -> AttackRecord:
        summary = {**attack_summary(result), "attack": self.name}
        details = auditor._details(prepared.members)
        details["fallback_after"] = {"attack": primary.attack.get("attack"), "verdict": primary.verdict}
        if result.traceback:
            details["traceback"] = result.traceback
        verdict, reason = fallback_verdict(self.name, result, summary, primary_verdict=primary.verdict)
        fields: dict[str, Any] = {
            "server_round": prepared.server_round,
            "client": unit_name(prepared.members),
            "status": result.status,
            "seconds": result.seconds,
            "error": result.error,
            "attack": summary,
            "details": details,
            "verdict": verdict,
            "verdict_reason": reason,
            "input_space": None if auditor.layer is None else auditor.layer.input_space,
            "queued_at": times[0],
            "started_at": times[1],
            "finished_at": times[2],
        }
        return auditor._finished_record(fields, result, prepared.members, details)


def fallback_verdict(
    name: str, result: AttackResult, summary: Mapping[str, Any], *, primary_verdict: str | None
) -> tuple[str, str]:
    """The fallback's verdict and reason: ``approximate`` when it returned inputs, else ``failed``.

    It is never ``exact``: an approximate attack has no self-check that could confirm one.
    """
    after = f"after the exact attack's verdict {primary_verdict}"
    if result.status != STATUS_OK:
        return VERDICT_FAILED, f"the {name} fallback ({after}) failed: {result.error}"
    b = summary.get("batch_size", "?")
    how = ""
    if "ica_iterations" in summary:
        how = f", {summary['ica_iterations']} ICA iterations, stopped by {summary.get('stopped_by', '?')}"
    return (
        VERDICT_APPROXIMATE,
        f"{name} fallback {after}: an approximate reconstruction of {b} inputs{how}; it has no "
        "self-check, so how close it is can only be measured against ground truth",
    )
