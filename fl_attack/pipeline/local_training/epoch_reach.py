"""A proof, before any search, that no order of the samples fits one local epoch.

Without weight decay, sample ``i``'s pre-activation at its own step ``t`` is
``z_i + sum_j w_j c_j (x_j . x_i + 1)`` over the other samples ``j``, with ``w_j`` the share
``e_{t,s} / e_{T,s}`` of the step ``s`` that holds ``j`` if it comes earlier and 0 otherwise.
For momentum in ``[0, 1)`` each share lies in ``[0, 1]`` (a step's contribution to the weights
only grows, to its final size at ``T``), so every entry lies between ``z`` plus the negative
terms and ``z`` plus the positive ones, whatever the order, mini-batch size and momentum. An
entry whose column is non-zero (the neuron must be active) but whose upper bound is inactive
beyond the ambiguity, or more quiet entries per column than allowed that are active at their
lower bound, rule every fit out:
:func:`fl_attack.pipeline.local_training.local_epochs.fit_one_epoch` would search until its nodes
run out and refuse. FedSGD meets this with complete but wrong (blended) selections, which plain matching
refuses and whose mismatches no share of the other samples can repair.
"""

from __future__ import annotations

import torch

from fl_attack.pipeline.local_training.local_epochs import QUIET_FRACTION, EpochPatterns

__all__ = ["reach_bounds", "unreachable"]

#: Relative room for rounding: the search adds the same terms in another order (each sum off by
#: about ``1e-16`` of its absolute terms per term), so a bound decides an entry only this far (of
#: the entry's absolute terms) beyond the ambiguity. The scorer's ambiguity is already at least
#: ``3e-6`` of the other samples' absolute terms.
ROUNDING_ROOM = 1e-9


def reach_bounds(patterns: EpochPatterns) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, N)`` lower and upper bounds of every sample's pre-activations at its own step, over
    all orders, mini-batch sizes and momenta in ``[0, 1)`` without weight decay, and the room
    (ambiguity plus rounding) a pre-activation must clear beyond them to decide its side."""
    columns, gram = patterns.columns, patterns.gram
    # a product c_rj g_ji is positive when both signs agree: split each factor into its parts
    c_up, c_down = columns.clamp_min(0.0), (-columns).clamp_min(0.0)
    g_up, g_down = gram.clamp_min(0.0), (-gram).clamp_min(0.0)
    own = columns * gram.diagonal()[None, :]  # a sample takes no share of its own step
    rising = c_up @ g_up + c_down @ g_down - own.clamp_min(0.0)
    falling = c_up @ g_down + c_down @ g_up - (-own).clamp_min(0.0)
    size = patterns.start.abs() + columns.abs() @ gram.abs()
    room = patterns.ambiguity + ROUNDING_ROOM * size
    return patterns.start - falling, patterns.start + rising, room


def unreachable(patterns: EpochPatterns) -> bool:
    """Whether no order of the samples into steps, of any mini-batch size and momentum in
    ``[0, 1)`` without weight decay, can make every sample match at its own step."""
    lower, upper, room = reach_bounds(patterns)
    never_active = ~patterns.zero & (upper < -room)
    always_quiet = patterns.zero & (lower > room)
    allowed = int(QUIET_FRACTION * patterns.zero.shape[0])
    return bool((never_active.any(dim=0) | (always_quiet.sum(dim=0) > allowed)).any())
