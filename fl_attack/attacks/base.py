"""What the bundled layer attacks share: :meth:`LayerAttackBase.invert`, the arrays-in entry point."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.pipeline.local_training.known import KnownTraining
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ArrayLike, LayerUpdate

#: ``invert``'s keyword for each optional part of :class:`fl_attack.types.LayerUpdate`.
_KEYWORDS = {
    "head_weight": "head_weight",
    "next_weight_update": "next_weight_grad",
    "local_steps": "local_steps",
    "noise_level": "noise_level",
    "local_training": "local_training",
}


class LayerAttackBase(ABC):
    """A :class:`fl_attack.LayerAttack` that can also be called on arrays (:meth:`invert`).

    Subclasses implement :meth:`attack` and declare in :attr:`uses` the optional parts of the
    update they read.
    """

    #: The optional fields of :class:`fl_attack.LayerUpdate` the attack reads.
    uses: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def attack(
        self,
        update: LayerUpdate[ArrayLike],
        /,
        *,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Recover the batch of inputs behind ``update`` (see :meth:`invert` for the parameters)."""

    def invert(
        self,
        weight_grad: ArrayLike,
        bias_grad: ArrayLike,
        *,
        weight: ArrayLike,
        bias: ArrayLike,
        batch_size: int | None = None,
        budget: Budget | None = None,
        noise_level: float | None = None,
        head_weight: ArrayLike | None = None,
        local_steps: int | None = None,
        next_weight_grad: ArrayLike | None = None,
        local_training: KnownTraining | None = None,
    ) -> Reconstruction:
        """Recover the inputs of the batch that produced a first-layer update.

        :meth:`attack` on the :class:`fl_attack.LayerUpdate` of these arrays.

        Parameters
        ----------
        weight_grad
            ``(m, n)`` gradient of the loss w.r.t. the layer's weight, or any update
            proportional to it (sign and scale do not matter).
        bias_grad
            ``(m,)`` gradient w.r.t. the bias, with the same proportionality.
        weight, bias
            The layer's parameters at which the gradient was taken.
        batch_size
            The batch size, if known; otherwise estimated from the singular-value gap.
        budget
            The attack's time budget, already started
            (:meth:`fl_attack.pipeline.budget.budget.Budget.start`; an audit starts it once per
            attack); None: ``Budget.start(time_budget)`` with the attack's own ``time_budget``,
            from this call.
        noise_level
            Overrides the attack's known relative noise level for this call.
        head_weight
            ``(c, m)`` global weight of the output layer fed directly by this layer's ReLU: adds
            proposals guided by its classes (:mod:`fl_attack.pipeline.side_information.output_layer`) under the
            same deadline, filters, selection and self-check; one that does not fit costs time only.
        local_steps
            Full-batch local SGD steps (FedAvg) if known: above 1 the update must be ``W_E - W_0``
            itself, matched against both ends (:mod:`fl_attack.pipeline.local_training.drift`); None: the
            attack's own ``local_steps``.
        next_weight_grad
            ``(k, m)`` gradient (or one-step update) of the linear layer fed by this layer's ReLU,
            from the same step: each direction found is certified as one sample through it, and
            later rounds search past those (:mod:`fl_attack.pipeline.side_information.next_layer`; clean updates only).
        local_training
            The client's local training as its server configured it (mini-batch size, momentum,
            weight decay, learning rate, epochs): the one-epoch fit tries only those
            (:mod:`fl_attack.pipeline.local_training.known`).

        ``noise_level``, ``head_weight``, ``local_steps``, ``next_weight_grad`` and
        ``local_training`` are accepted by the attacks that use them (:attr:`uses`: SPEAR and
        SPEAR++ use all five).

        Returns
        -------
        Reconstruction
            ``inputs`` of shape ``(b, n)``; ``complete`` is False when fewer than ``b``
            directions were found, and then placeholder rows have confidence 0.

        Raises
        ------
        ValueError
            On malformed input (shapes, NaN/Inf, all-zero gradient, a ``head_weight`` not ``(c, m)``,
            ``c >= 1``, a ``next_weight_grad`` not ``(k, m)``) or a batch size that the attack
            cannot invert (``b >= min(m, n)`` for the exact attacks).
        TypeError
            If an array is not a real numpy array or torch tensor, or an optional part is given
            to an attack that does not use it.
        """
        update = LayerUpdate(
            weight_grad,
            bias_grad,
            weight=weight,
            bias=bias,
            head_weight=head_weight,
            next_weight_update=next_weight_grad,
            local_steps=local_steps,
            noise_level=noise_level,
            local_training=local_training,
        )
        unused = [
            keyword
            for part, keyword in _KEYWORDS.items()
            if getattr(update, part) is not None and part not in self.uses
        ]
        if unused:
            raise TypeError(f"{type(self).__name__}.invert() does not take {', '.join(unused)}")
        return self.attack(update, batch_size=batch_size, budget=budget)
