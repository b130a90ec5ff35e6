"""The search's best selection so far, reported as a partial result (:mod:`fl_attack.progress`).

Only built when a sink is installed: an attack called directly pays one lookup per improved
selection and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fl_attack.pipeline.selection.select import Selection
from fl_attack.pipeline.side_information.next_layer import Deflation, with_certified_rows
from fl_attack.progress import active_sink
from fl_attack.reconstruction import Reconstruction


def report_selection(selection: Selection, *, stats: Mapping[str, Any], deflation: Deflation | None) -> None:
    """Report ``selection`` as the attack's partial result to the installed sink, if any.

    Parameters
    ----------
    selection
        The search's best selection so far.
    stats
        The attack's statistics so far (its scalar entries are copied).
    deflation
        The samples certified one by one through the next layer's update, or None: their rows
        take the certified inputs, exact by their own check (as in the attack's final result).
    """
    active = active_sink()
    if active is None:
        return
    active.report(
        partial_reconstruction(selection, stats=stats, deflation=deflation, seconds=active.seconds())
    )


def partial_reconstruction(
    selection: Selection, *, stats: Mapping[str, Any], deflation: Deflation | None, seconds: float
) -> Reconstruction:
    """``selection`` as a reconstruction that claims nothing: never complete, no self-check.

    Its found rows are found but not verified (in an incomplete selection even they are mixed
    with the placeholders' completion); rows certified through the next layer's update are
    counted in ``stats["next_layer_certified"]``.
    """
    kept = with_certified_rows(selection, deflation)
    scalars = {key: value for key, value in stats.items() if isinstance(value, (int, float, str, bool))}
    return Reconstruction(
        # copies: the search goes on and must not change what was reported
        inputs=kept.inputs.detach().cpu().clone(),
        batch_size=int(kept.found.shape[0]),
        sparsity_matching=float(kept.sparsity_matching),
        complete=False,
        confidence=kept.per_sample.clamp_min(0).detach().cpu().clone(),
        seconds=seconds,
        stats={**scalars, "directions_found": int(kept.found.sum()), "partial": True},
    )
