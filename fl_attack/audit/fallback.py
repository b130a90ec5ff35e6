"""A second, approximate attack on every update the exact attack did not recover exactly.

When the exact attack's verdict is ``approximate``, ``failed``, ``timeout`` or
``not-applicable``, the auditor runs the fallback attack (by default the Cocktail Party
Attack, ``cocktail-party``) on the same observed update, in the same worker (off the round's
critical path when the auditor has a pool), and stores it as a record of its own: same round
and client, ``attack = <fallback name>``, verdict ``approximate`` when it returned inputs,
``timeout`` when it was stopped at its hard limit with an estimate kept (the Cocktail Party
Attack hands back its current estimate while ICA iterates, :mod:`fl_attack.progress`), and
``failed`` otherwise; never ``exact``. It is scored by the auditor's scorer like any attack.

An update with nothing to unmix gets no fallback: one the exact attack recovered exactly, a
dropped or unreadable one (never attacked), an all-zero one, one whose spectrum already ruled
the exact attack out (no batch of per-sample gradients in it), and one with more samples than
ICA can separate from the layer (``min(m, n)``); the last two say so in the exact attack's
record (``details["fallback_skipped"]``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fl_attack.results.store import AttackRecord
from fl_attack.types import LayerAttack
from fl_attack.vocabulary import (
    STATUS_ERROR,
    STATUS_NOT_RUN,
    STATUS_OK,
    STATUS_TIMEOUT,
    VERDICT_APPROXIMATE,
    VERDICT_FAILED,
    VERDICT_NOT_APPLICABLE,
    VERDICT_TIMEOUT,
)

from .records import RecordKeeper
from .settings import AttackSettings, ExecutionSettings
from .thread_runners import RunnerPerThread
from .units import Prepared, attack_summary, total_examples, unit_name
from .workers import AttackResult, AttackRunner

logger = logging.getLogger(__name__)

#: The default fallback attack, and the names that switch the fallback off.
DEFAULT_FALLBACK = "cocktail-party"
NO_FALLBACK = ("", "none")
#: Verdicts of the exact attack after which the fallback runs.
FALLBACK_AFTER = (VERDICT_APPROXIMATE, VERDICT_FAILED, VERDICT_TIMEOUT, VERDICT_NOT_APPLICABLE)


def build_fallback(
    settings: AttackSettings, *, seed: int, execution: ExecutionSettings, keeper: RecordKeeper
) -> AttackFallback:
    """The fallback ``settings.fallback`` names (a registered attack), an attacker object, or none.

    Parameters
    ----------
    settings : AttackSettings
        Its ``fallback`` (``"cocktail-party"``, another registered attack's name, an attack
        object (:class:`fl_attack.types.LayerAttack`), or ``None`` / ``""`` / ``"none"`` for no
        fallback), and what every attack is told and allowed.
    seed : int
        Seeds a fallback built by name.
    execution : ExecutionSettings
        Where the fallback's attacks run.
    keeper : RecordKeeper
        Describes, scores and keeps the fallback's records, as it does the exact attack's.

    Raises
    ------
    ValueError
        On a name that is not a registered attack (the message lists them).
    """
    fallback = settings.fallback
    attacker: LayerAttack | None
    if fallback is None or (isinstance(fallback, str) and fallback.strip().lower() in NO_FALLBACK):
        attacker, name = None, ""
    elif isinstance(fallback, str):
        from fl_attack.attacks import get_attack  # the registry imports every attack: only when needed

        name = fallback.strip()
        attacker = get_attack(name, seed=seed, time_budget=settings.time_budget)
    else:
        attacker, name = fallback, str(getattr(fallback, "name", type(fallback).__name__))
    return AttackFallback(attacker, name=name, settings=settings, execution=execution, keeper=keeper)


class AttackFallback:
    """Run one fallback attack after the exact attack, with one runner per pool thread.

    Parameters
    ----------
    attacker : LayerAttack or None
        The fallback attack; None disables the fallback (:meth:`run` does nothing).
    name : str
        Its name, written to the record's ``attack`` summary.
    settings : AttackSettings
        The batch size, time budget and timeout every attack gets.
    execution : ExecutionSettings
        Where its attacks run.
    keeper : RecordKeeper
        Describes, scores and keeps its records.
    """

    def __init__(
        self,
        attacker: LayerAttack | None,
        *,
        name: str,
        settings: AttackSettings,
        execution: ExecutionSettings,
        keeper: RecordKeeper,
    ) -> None:
        self.attacker = attacker
        self.name = name
        self.settings = settings
        self.execution = execution
        self.keeper = keeper
        self._runners = RunnerPerThread(self._make_runner)

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

    def applicability(self, prepared: Prepared, primary: AttackRecord) -> str | None:
        """Why the fallback cannot say anything about this unit (it is not run), or None when it can.

        Beyond :meth:`skip_reason`: ICA separates at most ``min(m, n)`` sources of an ``(m, n)``
        update, so a batch larger than that (e.g. the example count of many local steps) is left alone.
        """
        reason = self.skip_reason(prepared, primary)
        if reason is not None:
            return reason
        m, n = prepared.delta.weight_update.shape
        sources = self.batch_size(prepared, primary)
        if sources is not None and sources > min(m, n):
            return (
                f"{sources} samples cannot be unmixed from a {m} x {n} layer update (at most min(m, n) = "
                f"{min(m, n)} sources)"
            )
        return None

    def annotate(self, prepared: Prepared, primary: AttackRecord) -> AttackRecord:
        """``primary`` with ``details["fallback_skipped"]`` saying why the fallback does not run, when
        it would have run after this verdict but cannot say anything here (:meth:`applicability`)."""
        if self.attacker is None or primary.verdict not in FALLBACK_AFTER:
            return primary
        if primary.attack.get("attack") == self.name:
            return primary
        try:
            reason = self.applicability(prepared, primary)
        except Exception as error:  # an unreadable unit: the fallback's own run records it
            logger.debug("fallback applicability of %s: %r", unit_name(prepared.members), error)
            return primary
        if reason is None:
            return primary
        return dataclasses.replace(
            primary, details={**primary.details, "fallback_skipped": f"{self.name}: {reason}"}
        )

    def batch_size(self, prepared: Prepared, primary: AttackRecord) -> int | None:
        """Sources to unmix: the configured batch size, the exact attack's estimate, the clients' count.

        None leaves the fallback to estimate it from the update's spectrum.
        """
        if self.settings.batch_size is not None:
            return self.settings.batch_size * len(prepared.members)
        estimate = primary.attack.get("batch_size")
        if isinstance(estimate, int) and not isinstance(estimate, bool) and estimate > 0:
            return estimate
        return total_examples(prepared.members) or None

    def run(
        self, prepared: Prepared, primary: AttackRecord, *, beside: AttackRunner | None = None
    ) -> list[AttackRecord]:
        """Attack ``prepared`` again after ``primary`` and hand the record to the record keeper.

        ``beside`` is the exact attack's runner: the fallback runs in its worker where it has one
        for the fallback (:meth:`AttackRunner.sharing`), else in a runner of its own.

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
            batch_size = self.batch_size(prepared, primary)
            shared = None if beside is None or self.attacker is None else beside.sharing(self.attacker)
            runner = shared if shared is not None else self._runners.get()
            started_at = time.time()
            result = runner.run(
                prepared.delta,
                batch_size=batch_size,
                time_budget=self.settings.time_budget,
                timeout=self.settings.timeout,
            )
            record = self._record(prepared, primary, result, (queued_at, started_at, time.time()))
        except Exception as error:  # the fallback never stops the audit: its failure is recorded
            failure = AttackResult(
                status=STATUS_ERROR,
                reconstruction=None,
                seconds=0.0,
                error=f"{type(error).__name__}: {error}",
            )
            try:
                record = self._record(prepared, primary, failure, (queued_at, started_at, time.time()))
            except Exception as unrecordable:  # e.g. a member the keeper cannot describe: log, never raise
                logger.error(
                    "the %s fallback on %s failed: %r", self.name, unit_name(prepared.members), unrecordable
                )
                return []
        return [self.keeper.keep(record)]

    @property
    def companions(self) -> tuple[LayerAttack, ...]:
        """What the exact attack's workers should also run (:meth:`AttackRunner.sharing`): the
        fallback attack, or nothing when it is disabled."""
        return () if self.attacker is None else (self.attacker,)

    def close(self) -> None:
        """Stop the fallback's own runners (each pool thread's), where it made any."""
        self._runners.close()

    def _make_runner(self) -> AttackRunner:
        assert self.attacker is not None  # run() makes none for a disabled fallback
        return self.execution.make_runner(self.attacker)

    def _record(
        self,
        prepared: Prepared,
        primary: AttackRecord,
        result: AttackResult,
        times: tuple[float, float, float],
    ) -> AttackRecord:
        summary = {**attack_summary(result), "attack": self.name}
        details = self.keeper.details(prepared.members)
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
            "input_space": self.keeper.input_space,
            "queued_at": times[0],
            "started_at": times[1],
            "finished_at": times[2],
        }
        return self.keeper.finished_record(fields, result, prepared.members, details)


def fallback_verdict(
    name: str, result: AttackResult, summary: Mapping[str, Any], *, primary_verdict: str | None
) -> tuple[str, str]:
    """The fallback's verdict and reason: ``approximate`` when it returned inputs, ``timeout`` when
    it was stopped at its hard limit with its last estimate kept, else ``failed``.

    It is never ``exact``: an approximate attack has no self-check that could confirm one.
    """
    after = f"after the exact attack's verdict {primary_verdict}"
    b = summary.get("batch_size", "?")
    if result.status != STATUS_OK:
        if result.reconstruction is None:
            return VERDICT_FAILED, f"the {name} fallback ({after}) failed: {result.error}"
        iterations = summary.get("ica_iterations")
        kept = (
            f"; its last estimate of {b} inputs"
            + ("" if iterations is None else f" after {iterations} ICA iterations")
            + " is kept, approximate (it has no self-check)"
        )
        if result.status == STATUS_TIMEOUT:
            return VERDICT_TIMEOUT, f"the {name} fallback ({after}) did not finish: {result.error}{kept}"
        return VERDICT_FAILED, f"the {name} fallback ({after}) failed: {result.error}{kept}"
    how = ""
    if "ica_iterations" in summary:
        how = f", {summary['ica_iterations']} ICA iterations, stopped by {summary.get('stopped_by', '?')}"
    return (
        VERDICT_APPROXIMATE,
        f"{name} fallback {after}: an approximate reconstruction of {b} inputs{how}; it has no "
        "self-check, so how close it is can only be measured against ground truth",
    )
