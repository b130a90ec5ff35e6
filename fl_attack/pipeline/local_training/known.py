"""What the server knows of a client's local training, because it configured it (its train config).

The attack searches the mini-batch size and momentum of a local epoch, and whether weight decay
shrank the update, when it does not know them; a server that sent them to its clients (Flower's
train config: ``batch-size``, ``momentum``, ``weight-decay``, ``lr``, ``local-epochs``) makes
that search smaller. A value the server sent is what the client was told, not a proof of what
it did: a known value only narrows what the attack tries, and a client that trained otherwise
leaves an update that no longer fits, so it is claimed less, never wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KnownTraining"]


@dataclass(frozen=True)
class KnownTraining:
    """The client's local training as its server configured it; None where not known.

    Attributes
    ----------
    mini_batch_size
        Samples per local SGD step.
    momentum
        SGD momentum, in ``[0, 1)``.
    weight_decay
        SGD weight decay (``>= 0``).
    lr
        Learning rate (``> 0``).
    epochs
        Local epochs over the client's samples.
    """

    mini_batch_size: int | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    lr: float | None = None
    epochs: int | None = None

    @property
    def decay(self) -> float | None:
        """``lr * weight_decay``, the per-step shrinkage of the weights, when both are known."""
        if self.lr is None or self.weight_decay is None:
            return None
        return self.lr * self.weight_decay

    @property
    def several_epochs(self) -> bool:
        """Whether the client was told to train more than one local epoch."""
        return self.epochs is not None and self.epochs > 1
