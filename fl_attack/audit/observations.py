"""What the auditing server receives from one client in one round, free of any FL framework.

The strategy wrapper of a framework (Flower's in :mod:`strategies`) turns its replies
into :class:`ClientUpdate` objects. The arrays are what every server observes; the ground
truth is simulation-only and is used for scoring, never by the attacker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .training_facts import ServerTrainConfig


@dataclass(frozen=True)
class ClientIdentity:
    """Who sent an update, as far as the server can tell.

    Attributes
    ----------
    node_id : int
        The framework's id of the sender.
    partition_id : int or None
        Data partition the client reported (simulation only).
    """

    node_id: int
    partition_id: int | None = None

    @property
    def name(self) -> str:
        """Directory-safe client name: ``partition-<id>`` or ``node-<id>``."""
        if self.partition_id is not None:
            return f"partition-{self.partition_id}"
        return f"node-{self.node_id}"


@dataclass(frozen=True)
class GroundTruth:
    """The samples a client trained on, for scoring only.

    Attributes
    ----------
    indices : list[int] or None
        Dataset indices, looked up in the scorer's dataset (this project's own app).
    inputs : numpy.ndarray or None
        ``(B, n)`` the attacked layer's true inputs (any app, through the client helper).
    """

    indices: list[int] | None = None
    inputs: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.indices is None and self.inputs is None:
            raise ValueError("ground truth needs sample indices or inputs")


@dataclass(frozen=True)
class ClientUpdate:
    """One client's training reply as the auditor sees it.

    Attributes
    ----------
    identity : ClientIdentity
        The sender.
    arrays : Mapping[str, numpy.ndarray] or None
        The model arrays the client sent back, in model order; None when unreadable.
    error : str or None
        Why the arrays could not be read.
    ground_truth : GroundTruth or None
        Simulation-only ground truth for scoring.
    train_mode : str or None
        How the client says it trained (simulation only; names the cause of a verdict).
    num_examples : int or None
        The example count the client reported (FedAvg's weight).
    train_config : ServerTrainConfig or None
        The train config the server sent the client this round (its valid keys), None when it
        sent none (:mod:`fl_attack.audit.training_facts`).
    """

    identity: ClientIdentity
    arrays: Mapping[str, np.ndarray] | None
    error: str | None = None
    ground_truth: GroundTruth | None = None
    train_mode: str | None = None
    num_examples: int | None = None
    train_config: ServerTrainConfig | None = None
