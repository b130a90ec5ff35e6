"""What the server knows of a client's training in a round: its reply's example count and the
train config the server sent it.

Both are hints, not observations of the update. ``num-examples`` is FedAvg's weight: most apps
report the samples a client trained on (the batch an exact attack recovers), some report
mini-batches (Flower's fl-tabular). It becomes the attack's batch size only where the update's
spectrum shows the same rank (:meth:`ObservedTraining.batch_size_for`); elsewhere the attack
estimates it as before. The train config (``lr``, ``local-epochs``, ``batch-size`` or
``mini-batch-size``, ``momentum``, ``weight-decay``) is what the server told the client: it narrows what the
local-epoch fit tries (:class:`fl_attack.pipeline.local_training.known.KnownTraining`), and a
client that trained otherwise leaves an update that no longer fits, so it is claimed less,
never wrongly. A key the server did not send is not known; a value of the wrong type or range
is left out with a warning, and the audit goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fl_attack.pipeline.local_training.known import KnownTraining

__all__ = ["TRAIN_CONFIG_KEYS", "ObservedTraining", "ServerTrainConfig", "read_train_config"]

logger = logging.getLogger(__name__)

#: The train-config keys the audit reads, as a Flower server sends them.
TRAIN_CONFIG_KEYS = ("lr", "local-epochs", "batch-size", "mini-batch-size", "momentum", "weight-decay")

#: Keys that name the mini-batch size, the first sent winning: an app that sends both (this
#: project's own: ``batch-size`` is its FedSGD batch) means the mini-batch by ``mini-batch-size``.
MINI_BATCH_KEYS = ("mini-batch-size", "batch-size")


@dataclass(frozen=True)
class ServerTrainConfig:
    """The valid train-config values the server sent one client; None where it sent none.

    Attributes
    ----------
    lr : float or None
        Learning rate (``lr``, > 0).
    local_epochs : int or None
        Local epochs (``local-epochs``, >= 1).
    batch_size : int or None
        Mini-batch size (``mini-batch-size``, else ``batch-size``; >= 1).
    momentum : float or None
        SGD momentum (``momentum``, in [0, 1)).
    weight_decay : float or None
        SGD weight decay (``weight-decay``, >= 0).
    """

    lr: float | None = None
    local_epochs: int | None = None
    batch_size: int | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    #: The key the mini-batch size came from (for :meth:`describe`).
    batch_size_key: str = field(default="batch-size", compare=False)

    @property
    def empty(self) -> bool:
        """Whether no key was sent (or none was valid)."""
        return self == ServerTrainConfig()

    def shaping_the_attack(self) -> ServerTrainConfig:
        """The keys that narrow the local-epoch attack: ``batch-size``, ``momentum``,
        ``weight-decay``, ``local-epochs``, and ``lr`` with ``weight-decay`` (their product is the
        per-step shrinkage; ``lr`` alone only scales the update, which the attack ignores)."""
        return ServerTrainConfig(
            lr=self.lr if self.weight_decay is not None else None,
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            batch_size_key=self.batch_size_key,
        )

    def describe(self) -> str:
        """The keys sent, as the server named them: ``"batch-size 5, momentum 0.9"``."""
        values = {
            "local-epochs": self.local_epochs,
            self.batch_size_key: self.batch_size,
            "momentum": self.momentum,
            "weight-decay": self.weight_decay,
            "lr": self.lr,
        }
        return ", ".join(f"{key} {value:g}" for key, value in values.items() if value is not None)


def _count(value: object) -> int | None:
    """A positive whole number (an int, or a float such as 5.0), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value != int(value) or value < 1:
        return None
    return int(value)


def _number(value: object, *, low: float, high: float, low_open: bool) -> float | None:
    """A finite number in ``(low, high)`` (``[low, high)`` unless ``low_open``), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if value < low or (low_open and value == low) or value >= high:
        return None
    return float(value)


def _rate(value: object) -> float | None:
    return _number(value, low=0.0, high=math.inf, low_open=True)


def _fraction(value: object) -> float | None:
    return _number(value, low=0.0, high=1.0, low_open=False)


def _non_negative(value: object) -> float | None:
    return _number(value, low=0.0, high=math.inf, low_open=False)


#: Per key: how its value is read, and what a valid one is (for the warning).
_READERS: dict[str, tuple[Callable[[object], float | int | None], str]] = {
    "lr": (_rate, "a positive number"),
    "local-epochs": (_count, "a positive whole number"),
    "batch-size": (_count, "a positive whole number"),
    "mini-batch-size": (_count, "a positive whole number"),
    "momentum": (_fraction, "a number in [0, 1)"),
    "weight-decay": (_non_negative, "a non-negative number"),
}


def read_train_config(values: Mapping[str, object], *, sender: str) -> ServerTrainConfig:
    """The valid train-config values among ``values`` (the record the server sent ``sender``).

    Keys other than :data:`TRAIN_CONFIG_KEYS` are ignored. A value of the wrong type or range
    is left out with a warning naming the client, the key and the value: the audit never
    fails on it.

    Parameters
    ----------
    values : Mapping[str, object]
        The config the server sent the client (e.g. the values of Flower's ConfigRecord).
    sender : str
        The client's name, for the warning.
    """
    read: dict[str, float | int] = {}
    for key in TRAIN_CONFIG_KEYS:
        if key not in values:
            continue
        reader, valid = _READERS[key]
        value = reader(values[key])
        if value is None:
            logger.warning(
                "The train config sent to %s has %s=%r, not %s: the audit does not use it",
                sender,
                key,
                values[key],
                valid,
            )
            continue
        read[key] = value
    batch_key = next((key for key in MINI_BATCH_KEYS if key in read), "batch-size")
    return ServerTrainConfig(
        batch_size_key=batch_key,
        lr=_as_float(read.get("lr")),
        local_epochs=_as_int(read.get("local-epochs")),
        batch_size=_as_int(read.get(batch_key)),
        momentum=_as_float(read.get("momentum")),
        weight_decay=_as_float(read.get("weight-decay")),
    )


def _as_float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def _as_int(value: float | int | None) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class ObservedTraining:
    """What the server knows of one attacked unit's training: its example count and train config.

    Attributes
    ----------
    num_examples : int or None
        The example count the client(s) reported (``num-examples``; a sum for a secure-aggregation
        unit); None when a member reported none.
    config : ServerTrainConfig
        The train config the server sent the client; empty for a sum of several clients (their
        local epochs do not add up to one client's) or when none was sent.
    """

    num_examples: int | None = None
    config: ServerTrainConfig = field(default_factory=ServerTrainConfig)

    @classmethod
    def of_members(
        cls, num_examples: Sequence[int | None], configs: Sequence[ServerTrainConfig | None]
    ) -> ObservedTraining:
        """The unit of these members (one client, or a secure-aggregation sum)."""
        total = None if any(count is None for count in num_examples) else sum(c or 0 for c in num_examples)
        config = configs[0] if len(configs) == 1 and configs[0] is not None else ServerTrainConfig()
        return cls(num_examples=total, config=config)

    def batch_size_for(self, *, spectrum_rank: int | None) -> int | None:
        """``num-examples`` as the attack's batch size, where the update's spectrum shows that rank.

        An app that reports mini-batches, or its whole dataset over several epochs, reports a count
        the spectrum does not show: the attack then estimates the batch size itself, as without
        the count. So a wrong count never reaches the attack.
        """
        if self.num_examples is None or spectrum_rank is None or spectrum_rank != self.num_examples:
            return None
        return self.num_examples

    def known_training(self, *, train_mode: str | None = None) -> KnownTraining | None:
        """The train config as the local-epoch attack takes it; None when nothing that narrows it
        was sent, or when the client reports one FedSGD step (``train_mode="fedsgd"``, this
        project's clients): its epochs and mini-batches are then not how it trained."""
        config = self.config.shaping_the_attack()
        if config.empty or train_mode == "fedsgd":
            return None
        return KnownTraining(
            mini_batch_size=config.batch_size,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            lr=config.lr,
            epochs=config.local_epochs,
        )

    def basis(self, *, batch_size: int | None, config_used: bool, spectrum_rank: int | None) -> str | None:
        """What the verdict rests on besides the update: the batch size the count gave (or why it
        gave none), and the train config the server sent; None when neither was there.

        Parameters
        ----------
        batch_size : int or None
            The batch size :meth:`batch_size_for` handed the attack.
        config_used : bool
            Whether the train config reached the attack.
        spectrum_rank : int or None
            The rank the update's spectrum shows.
        """
        parts = []
        if batch_size is not None:
            parts.append(f"a batch of {batch_size} (the client's num-examples, matching the update's rank)")
        elif self.num_examples is not None and spectrum_rank is not None:
            parts.append(
                f"the batch size from the update's rank {spectrum_rank} (the client's num-examples, "
                f"{self.num_examples}, differs, so it was not used)"
            )
        used = self.config.shaping_the_attack()
        if config_used and not used.empty:
            parts.append(f"the server's train config ({used.describe()})")
        return None if not parts else "it rests on " + " and ".join(parts)
