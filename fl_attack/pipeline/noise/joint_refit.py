"""Re-fitting the found directions of a noisy selection on the zeros their inputs predict.

Under DP noise a direction is a least-squares kernel of the entries of its gradient column that
look like zeros (:func:`fl_attack.pipeline.search.sparsity.refine_on_zeros`): those within 2.5 noise
deviations of 0. On CIFAR-10 at (b, m) = (150, 4000) with noise 0.5x the median entry, 29% of a
column's non-zero entries fall below that threshold too, and the kernel leans towards making
them vanish: the found directions keep a median cosine of 0.997 to the truth, which costs about
3 dB of PSNR on a complete batch.

The inputs a selection implies predict which neurons each sample leaves inactive (their ReLU
pattern, right on about 96% of the neurons). An entry that is both small and predicted inactive
is a zero far more surely than a small one alone, and a wrongly predicted entry is left out by
the size test (it carries a large entry). :func:`joint_refit` re-fits every found direction on
those zeros at once, with the other directions' inputs fixed, and iterates. On the 99 true
directions one attack found on the batch above (completed, for the measurement, by the 51 true
ones it missed) 3 iterations raised the median cosine to the truth from 0.9971 to 0.9985 (10%
quantile 0.9906 to 0.9951) and the batch from 27.0 to 28.0 dB; re-fitting on the true zeros
reaches 0.9990.
"""

from __future__ import annotations

import time

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.search.sparsity import zero_masks
from fl_attack.pipeline.selection.select import Selection, SparsityMatchingScorer, orthonormal_completion

#: Re-fits of the whole set (each from the inputs of the one before).
REFIT_ITERATIONS = 3

#: A re-fitted row further than this (cosine) from the row it re-fits is kept as it was: on CIFAR-10
#: (150, 4000) a re-fit moves a direction by a cosine of about 0.998; on a synthetic layer whose
#: pattern was mostly wrong one moved to 0.81 of the truth from 0.995.
MIN_COS = 0.98


def predicted_zeros(
    scorer: SparsityMatchingScorer, directions: torch.Tensor, found: torch.Tensor
) -> torch.Tensor:
    """``(k, m)``: for each found direction the entries of its unit column that are small (within the
    scorer's zero tolerance) on neurons its implied input leaves inactive.

    Parameters
    ----------
    scorer
        The attack's scorer.
    directions
        ``(b, b)`` unit directions of a selection, completion rows included.
    found
        ``(b,)`` which rows are found directions; the others are the completion.
    """
    _, q_inv = scorer.score(directions)
    inactive = scorer.inactive(q_inv).T[found]  # (k, m)
    return inactive & zero_masks(scorer.factors, directions[found], scorer.tolerance)


def refit_on(scorer: SparsityMatchingScorer, directions: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The unit vector minimising the norm of each direction's gradient column on its ``zeros``
    (``(k, m)`` masks), signed like the direction; a direction with fewer than ``b - 1`` zeros is kept."""
    left = scorer.factors.left
    b = left.shape[1]
    enough = zeros.sum(dim=1) >= b - 1
    refitted = directions.clone()
    if not bool(enough.any()):
        return refitted
    masked = zeros[enough].to(left.dtype)
    gram = torch.einsum("km,mi,mj->kij", masked, left, left)
    _, vectors = torch.linalg.eigh(gram)
    kernel = vectors[:, :, 0]
    sign = torch.sign((kernel * directions[enough]).sum(dim=1, keepdim=True))
    refitted[enough] = kernel * torch.where(sign == 0, 1.0, sign)
    return refitted


def joint_refit(
    scorer: SparsityMatchingScorer,
    selection: Selection,
    *,
    iterations: int = REFIT_ITERATIONS,
    deadline: Deadline = Deadline.never(),
) -> Selection:
    """The selection with its found directions re-fitted on their predicted zeros (module docstring).

    The completion rows (not found) are recomputed against the re-fitted directions. An iteration
    is kept only when it raises the mean sparsity matching (on the batch above it rose from 0.811
    to 0.820 over 3 iterations, with the PSNR from 27.0 to 28.0 dB); stops at ``deadline``
    (between iterations). Returns ``selection`` itself when nothing was found or kept.

    Raises
    ------
    ValueError
        If ``iterations`` is negative.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    found = selection.found
    k, b = int(found.sum()), selection.directions.shape[1]
    if k == 0:
        return selection
    best = selection
    directions = selection.directions / selection.directions.norm(dim=1, keepdim=True)
    seconds = 0.0
    for _ in range(iterations):
        if not deadline.fits(seconds):
            break  # the next iteration would not fit: each costs about as much as the one before
        started = time.perf_counter()
        previous = directions[found]
        refitted = refit_on(scorer, previous, predicted_zeros(scorer, directions, found))
        # a row that moved this far was re-fitted on another sample's pattern, not refined
        moved = (refitted * previous).sum(dim=1).abs() < MIN_COS
        refitted = torch.where(moved[:, None], previous, refitted)
        completion = orthonormal_completion(refitted, b).to(refitted.dtype) if k < b else refitted[:0]
        directions = torch.cat([refitted, completion], dim=0)
        found = torch.arange(b, device=directions.device) < k
        per_sample, q_inv = scorer.score(directions)
        per_sample = torch.where(found, per_sample, torch.zeros_like(per_sample))
        if not float(per_sample.mean()) > best.sparsity_matching:
            break  # the matching rose with the precision on every batch measured: stop where it does not
        inputs = q_inv @ scorer.factors.right
        best = Selection(directions, found, inputs, per_sample, float(per_sample.mean()))
        seconds = time.perf_counter() - started
    return best
