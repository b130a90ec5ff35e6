"""After the exact attack: the next-layer route, when the server holds the next layer's update.

For a layer whose inputs are ReLU features (layers precede it) and that is directly followed
by another linear layer, one client's update carries that layer's change too
(:attr:`fl_attack.types.LayerUpdate.next_weight_update`). The exact attack then gets
:meth:`fl_attack.pipeline.budget.budget.Budget.exact_attack_share` of the attack's one budget;
when it did not recover the batch whole, :func:`with_next_layer` runs
:func:`fl_attack.attacks.next_layer_merge.complete_with_next_layer` on it, in the same worker,
for what is left of that budget, so that both end by the budget.
Its rows are merged (those its own check confirmed are claimed, the others only kept) and
counted in the reconstruction's statistics (``next_layer_checked``, ``next_layer_unchecked``,
...), which the verdict reads.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from fl_attack.pipeline.budget.budget import Budget
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import LayerUpdate

logger = logging.getLogger(__name__)


def with_next_layer(
    reconstruction: Any, update: LayerUpdate[np.ndarray], *, budget: Budget | None, seed: int | None
) -> Any:
    """``reconstruction`` completed by the next-layer route where it applies, else unchanged.

    ``budget`` is the attack's time budget (None: no budget); the route gets what is left of it.

    It applies to a :class:`fl_attack.Reconstruction` with a self-check (an exact attack's)
    that is not complete, on an update of a layer after other layers with a finite next-layer
    change. A failure of the
    route leaves the exact attack's result as it was, with ``next_layer_error`` in its
    statistics.
    """
    following = update.next_weight_update
    if (
        following is None
        or not update.after_layers
        or not isinstance(reconstruction, Reconstruction)
        or reconstruction.complete
        or reconstruction.self_check is None
        or not np.isfinite(following).all()
    ):
        return reconstruction
    from fl_attack.attacks.next_layer_merge import complete_with_next_layer  # the attacks: only when needed

    try:
        return complete_with_next_layer(
            reconstruction, update, budget=budget, seed=0 if seed is None else seed
        )
    except (ValueError, ArithmeticError, np.linalg.LinAlgError, RuntimeError) as error:
        # the route is an extra: its failure never costs the exact attack's result
        logger.warning("the next-layer route failed: %s: %s", type(error).__name__, error)
        stats = {**reconstruction.stats, "next_layer_error": f"{type(error).__name__}: {error}"}
        return dataclasses.replace(reconstruction, stats=stats)
