"""The audit's record keeper: a finished attack becomes a scored record, stored and remembered.

The auditor and its fallback (:mod:`fl_attack.audit.fallback`) both hand their records to one
:class:`RecordKeeper`, from any pool thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_attack.results.store import AttackRecord, ReconstructionStore

from .layer import LayerKeys
from .observations import ClientUpdate
from .units import member_quality, to_numpy, unit_details
from .workers import AttackResult

if TYPE_CHECKING:
    from fl_attack.evaluation.scoring import ReconstructionScorer, Scored

logger = logging.getLogger(__name__)


class RecordKeeper:
    """Describe, score, store and remember the records of one audit (thread-safe).

    Parameters
    ----------
    store : ReconstructionStore or None
        Where records are written; None keeps them in :attr:`records` only. With a store,
        :attr:`records` keep no arrays (bounded memory).
    scorer : ReconstructionScorer or None
        Renders reconstructions and scores them when clients sent ground truth.

    Attributes
    ----------
    layer : LayerKeys or None
        The attacked layer the records describe, set once the auditor has chosen it.
    records : list[AttackRecord]
        Every record kept so far, in the order kept.
    store_failures : list[str]
        Why records could not be stored (a full disk, ...): the run must not end as a success.
    """

    def __init__(self, *, store: ReconstructionStore | None, scorer: ReconstructionScorer | None) -> None:
        self.store = store
        self.scorer = scorer
        self.layer: LayerKeys | None = None
        self.records: list[AttackRecord] = []
        self.store_failures: list[str] = []
        self._lock = threading.Lock()

    @property
    def input_space(self) -> str | None:
        """The input space of the attacked layer (None before it is chosen)."""
        return None if self.layer is None else self.layer.input_space

    def details(self, members: list[ClientUpdate]) -> dict[str, Any]:
        """``details`` of a unit's record: its members, their training mode and the attacked layer."""
        return unit_details(members, self.layer)

    def finished_record(
        self,
        fields: dict[str, Any],
        result: AttackResult,
        members: list[ClientUpdate],
        details: dict[str, Any],
    ) -> AttackRecord:
        """The record of a finished attack, scored against the members' ground truth when it returned
        inputs (a timed-out attack's partial result included).

        ``fields`` are the record's fields but its arrays and quality (a scoring failure replaces
        its ``error``); ``details`` is the dict in ``fields``, completed with each member's quality
        for a sum.
        """
        if result.reconstruction is None:
            return AttackRecord(**fields)
        inputs = np.asarray(to_numpy(result.reconstruction.inputs), dtype=np.float64)
        scored, scoring_error = self._score(inputs, members, details)
        if scoring_error is not None:
            fields["error"] = scoring_error
        return AttackRecord(
            **fields,
            inputs=inputs,
            reconstructed_images=None if scored is None else scored.reconstructed_images,
            reference_images=None if scored is None else scored.reference_images,
            quality={} if scored is None else scored.quality,
            psnr=None if scored is None else scored.psnr,
        )

    def keep(self, record: AttackRecord) -> AttackRecord:
        """Write a record to the store and remember it, without its arrays once stored.

        A store that fails (a full disk) is logged and remembered in :attr:`store_failures`;
        training goes on, but the run must report the loss (the ServerApp raises at its end).

        Returns
        -------
        AttackRecord
            The record as remembered.
        """
        with self._lock:
            if self.store is not None:
                try:
                    self.store.save(record)
                    record = dataclasses.replace(
                        record, inputs=None, reconstructed_images=None, reference_images=None
                    )
                except Exception as error:  # the FL run goes on; the failure is loud
                    message = f"round {record.server_round} {record.client}: {type(error).__name__}: {error}"
                    self.store_failures.append(message)
                    logger.error("Could not store the attack on %s", message)
            self.records.append(record)
        return record

    def _score(
        self, inputs: np.ndarray, members: list[ClientUpdate], details: dict[str, Any]
    ) -> tuple[Scored | None, str | None]:
        """Render and, with every member's ground truth, score; a failure is returned, not raised."""
        if self.scorer is None:
            return None, None
        try:
            truths = [member.ground_truth for member in members]
            if any(truth is None for truth in truths):
                return self.scorer.render(inputs), None
            references = [self.scorer.references(truth) for truth in truths if truth is not None]
            scored = self.scorer.score_against(inputs, np.concatenate(references))
            if len(members) > 1:
                details["members"] = member_quality(members, [len(r) for r in references], scored)
            return scored, None
        except Exception as failure:  # scoring is the experimenter's side: never stop the run
            error = f"scoring failed: {type(failure).__name__}: {failure}"
            logger.warning("%s", error)
            return None, error
