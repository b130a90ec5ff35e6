"""Read Flower training replies into the auditor's framework-free :class:`ClientUpdate`."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeGuard

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SType

from fl_attack.audit import ClientIdentity, ClientUpdate, GroundTruth
from fl_attack.audit.protocol import (
    AUDIT_KEY,
    GROUND_TRUTH_INPUTS,
    GROUND_TRUTH_KEY,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
    TRAIN_MODE_KEY,
)
from fl_attack.audit.training_facts import TRAIN_CONFIG_KEYS, ServerTrainConfig, read_train_config

from .npy_view import npy_view

#: Records that only the audit reads; removed before the inner strategy aggregates.
AUDIT_RECORDS = (AUDIT_KEY, GROUND_TRUTH_KEY)

logger = logging.getLogger(__name__)


def audit_record(content: RecordDict) -> ConfigRecord | None:
    """The reply's audit ConfigRecord, or None when the client sent none."""
    record = content.get(AUDIT_KEY)
    return record if isinstance(record, ConfigRecord) else None


def client_identity(content: RecordDict, node_id: int) -> ClientIdentity:
    """Identify the sender of a reply from its metadata and optional audit record."""
    record = audit_record(content)
    partition = None if record is None else record.get(PARTITION_ID_KEY)
    if isinstance(partition, bool) or not isinstance(partition, int):
        partition = None
    return ClientIdentity(node_id=node_id, partition_id=partition)


def _is_index_list(values: object) -> TypeGuard[list[int]]:
    """Whether ``values`` is a list of ints (bools excluded)."""
    return isinstance(values, list) and all(
        isinstance(value, int) and not isinstance(value, bool) for value in values
    )


def sample_indices(content: RecordDict) -> list[int] | None:
    """Dataset indices the client reports it trained on, or None when not reported."""
    record = audit_record(content)
    if record is None or SAMPLE_INDICES_KEY not in record:
        return None
    values = record[SAMPLE_INDICES_KEY]
    if isinstance(values, int) and not isinstance(values, bool):
        return [values]
    if not _is_index_list(values):
        raise ValueError(f"'{SAMPLE_INDICES_KEY}' must be a list of ints, got {values!r}")
    return [value for value in values if isinstance(value, int)]


def ground_truth(content: RecordDict) -> GroundTruth | None:
    """The ground truth a client sent for scoring (inputs or dataset indices), if any."""
    record = content.get(GROUND_TRUTH_KEY)
    if isinstance(record, ArrayRecord) and GROUND_TRUTH_INPUTS in record:
        inputs = record[GROUND_TRUTH_INPUTS].numpy()
        if inputs.ndim == 0:
            raise ValueError(
                f"'{GROUND_TRUTH_INPUTS}' must hold one row per sample, got a scalar of dtype {inputs.dtype}"
            )
        return GroundTruth(inputs=np.asarray(inputs, dtype=np.float64).reshape(len(inputs), -1))
    indices = sample_indices(content)
    return None if indices is None else GroundTruth(indices=indices)


class DecodedOnRead(Mapping[str, np.ndarray]):
    """An ArrayRecord's arrays as numpy, each decoded when it is read (in the record's order).

    The audit reads one layer of each reply; decoding the whole model of every reply on the
    round's critical path (the inner strategy decodes them again to aggregate) cost most of the
    audit's time in the round. An array is read in place, read-only, over the reply's own bytes
    (:func:`strategies.npy_view.npy_view`) where it can be, so that a waiting update holds no
    copy of what the reply already holds. A decoding failure raises ``ValueError`` naming the array.
    """

    def __init__(self, record: ArrayRecord) -> None:
        self._record = record

    def __getitem__(self, key: str) -> np.ndarray:
        array = self._record[key]
        try:
            in_place = npy_view(array.data) if array.stype == SType.NUMPY else None
            return in_place if in_place is not None else array.numpy()
        except Exception as failure:  # any undecodable payload is a malformed reply
            raise ValueError(f"array {key!r} of the reply cannot be decoded: {failure}") from failure

    def __iter__(self) -> Iterator[str]:
        return iter(self._record.keys())

    def __len__(self) -> int:
        return len(self._record)


def model_arrays(content: RecordDict) -> Mapping[str, np.ndarray]:
    """The reply's model arrays (its one ArrayRecord besides the ground truth) as numpy, decoded on read.

    Raises
    ------
    ValueError
        If the reply holds no model ArrayRecord or several.
    """
    records = [record for key, record in content.array_records.items() if key != GROUND_TRUTH_KEY]
    if len(records) != 1:
        raise ValueError(f"expected exactly one model ArrayRecord in the reply, found {len(records)}")
    return DecodedOnRead(records[0])


def reported_examples(content: RecordDict) -> int | None:
    """The example count a reply reports (FedAvg's weight), or None when absent or not a count.

    A value that is not a finite, non-negative number (NaN, infinity, a list) is no count:
    it is ignored here, and the inner strategy sees it unchanged.
    """
    count = None
    for metrics in content.metric_records.values():
        if isinstance(metrics, MetricRecord) and NUM_EXAMPLES_KEY in metrics:
            value = metrics[NUM_EXAMPLES_KEY]
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            ):
                count = int(value)
            else:
                count = None
    return count


def sent_train_config(instruction: Message) -> dict[str, object]:
    """The train-config keys (:data:`fl_attack.audit.training_facts.TRAIN_CONFIG_KEYS`) of a train
    message the server sends, from its ConfigRecords (Flower's FedAvg sends one, ``"config"``);
    empty when it sends none. The first record holding a key gives it."""
    values: dict[str, object] = {}
    if not instruction.has_content():
        return values
    for record in instruction.content.config_records.values():
        for key in TRAIN_CONFIG_KEYS:
            if key in record and key not in values:
                values[key] = record[key]
    return values


def to_client_update(reply: Message, sent_config: Mapping[str, object] | None = None) -> ClientUpdate:
    """Convert one reply; an unreadable reply becomes an update with ``arrays=None`` and its error.

    A malformed ground truth is dropped (with a warning naming the problem) and a malformed
    example count is ignored, so that one client's bad metadata never costs the audit of the
    round's other clients. ``sent_config`` is the train config the server sent this client
    (:func:`sent_train_config`); a malformed value in it is left out with a warning.
    """
    content = reply.content
    identity = client_identity(content, reply.metadata.src_node_id)
    config: ServerTrainConfig | None = None
    if sent_config:
        config = read_train_config(sent_config, sender=identity.name)
    record = audit_record(content)
    mode = None if record is None else record.get(TRAIN_MODE_KEY)
    num_examples = reported_examples(content)
    try:
        truth = ground_truth(content)
    except Exception as failure:  # scoring only: the update itself is still audited
        logger.warning(
            "Ignoring the ground truth sent by %s: %s: %s", identity.name, type(failure).__name__, failure
        )
        truth = None
    try:
        arrays: Mapping[str, np.ndarray] | None = model_arrays(content)
        error = None
    except Exception as failure:  # any malformed reply is recorded, never raised
        arrays, error = None, f"{type(failure).__name__}: {failure}"
    return ClientUpdate(
        identity=identity,
        arrays=arrays,
        error=error,
        ground_truth=truth,
        train_mode=str(mode) if isinstance(mode, str) else None,
        num_examples=num_examples,
        train_config=config,
    )


def training_replies(replies: Iterable[Message]) -> list[Message]:
    """Replies that carry content and no error (the ones a strategy aggregates)."""
    return [reply for reply in replies if not reply.has_error() and reply.has_content()]


def strip_audit_records(replies: Iterable[Message]) -> None:
    """Remove the audit-only records in place, so the inner strategy never sees them."""
    for reply in replies:
        if reply.has_error() or not reply.has_content():
            continue
        for key in AUDIT_RECORDS:
            if key in reply.content:
                del reply.content[key]
