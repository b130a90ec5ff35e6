"""The attack's own check of a reconstruction, from the observed update alone.

A reconstruction ``X`` (``b`` rows) is checked three ways, none of which needs ground truth:

* **Re-synthesis.** The least-squares output gradient given ``X``,
  ``G = argmin ||G X - dL/dW||``, must vanish wherever ``X``'s own pre-activations
  ``Z = W X^T + bias`` are inactive (the ReLU), and the update re-synthesised from ``X`` and
  that pattern, ``(G * [Z > 0]) X`` and ``(G * [Z > 0]) 1``, must explain the observed weight
  and bias update to within what the spectrum's noise allows. Pre-activations within their
  own noise of zero are ambiguous and may take either side.
* **Distinct rows.** No two rows may be closer than the noise lets them be told apart, and
  no two rows may share one ReLU pattern: the directions of two samples with the same pattern
  have the same zeros, so any mixture of them explains the update equally well and the batch
  is not identifiable from it; nor may two patterns nest (one sample's inactive neurons all
  inactive for the other), which leaves a family of batches that explain it equally well.
* **Rank.** ``X`` must have full rank ``b`` above the noise.

Where several local steps move the patterns away from ``W``'s, rows that lie on an 8-bit pixel
grid are certified by it in place of the re-synthesis (:func:`pixel_grid_self_check`).

Everything runs on ``b x b``, ``m x b`` and ``b x n`` matrices (the inputs are expressed in
an orthonormal basis of their rows), so the check costs ``O(m b^2 + n b^2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from fl_attack.pipeline.selection.pixel_grid import PixelGrid
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: How the re-synthesis tests' reasons start, and what the pattern tests' reasons name.
RESYNTHESISED = "re-synthesised"
PATTERN = "ReLU pattern"
NESTED = f"nested {PATTERN}s"

#: The re-synthesis residual may exceed the spectrum's noise (the energy beyond rank ``b``)
#: by this factor: a correct reconstruction leaves about the noise itself (measured ratio
#: 1.0-1.3 on clean float32 CIFAR-10 gradients), one wrong row leaves orders of magnitude more.
RESIDUAL_NOISE_FACTOR = 10.0


#: A pre-activation within this many times its noise of zero is ambiguous (either side passes).
AMBIGUITY_FACTOR = 30.0

#: Two rows closer than this many times their precision (the relative noise) are duplicates
#: that cannot be told apart. The relative noise overstates the rows' error under DP noise
#: (0.08 for ~1% errors at 0.1x the median entry; 0.53 at 0.5x, where distinct CIFAR-10 rows
#: stay 0.7 apart), so no margin is added.
DUPLICATE_FACTOR = 1.0

#: Relative precision of a reconstruction from a noise-free (float64) update: the attack
#: computes kernels through Gram matrices, which square their condition, so directions are
#: exact to ~1e-8 (measured residuals 1e-8 - 6e-8) rather than to float64 rounding.
PRECISION_FLOOR = 1e-7


@dataclass(frozen=True)
class SelfCheck:
    """The figures of a reconstruction's self-check and its outcome.

    Attributes
    ----------
    passed
        True when every check below passed (and every row came from a found direction).
    exact
        Whether an exact reconstruction was checked (clean update) or one up to the noise.
    residual, tolerance
        Relative residual ``||dL/dW - (G * [Z > 0]) X|| / ||dL/dW||`` of the weight update
        re-synthesised from the inputs and their ReLU pattern, and the most the noise allows.
    bias_residual, bias_tolerance
        The same for the bias update, relative to ``||dL/db||``.
    min_pair_distance, pair_distance_floor
        Smallest relative distance ``||x_i - x_j|| / max(||x_i||, ||x_j||)`` between two rows
        (``inf`` for one row), and the distance below which two rows are duplicates.
    pattern_twins
        Pairs of rows with one ReLU pattern (no neuron confidently active for one and inactive
        for the other); None when not checked (a noisy update).
    nested_patterns
        Pairs of rows whose patterns nest (conflicts one way only), not identifiable either; None
        when not checked.
    rank
        Rank of the inputs (above the noise when ``exact``); ``passed`` needs ``rank == b``.
    reasons
        One short phrase per failed check (empty when passed).
    ambiguous_twins
        Pairs of near-identical rows whose plane holds another batch that matches and passes as
        well (:func:`fl_attack.pipeline.selection.near_duplicates.twin_self_check`); 0 when not found or not tested.
    certificate
        What stands in for the re-synthesis where the update is not one step at ``W_0``
        (:func:`pixel_grid_self_check`); empty when the re-synthesis itself decided.
    """

    passed: bool
    exact: bool
    residual: float
    tolerance: float
    bias_residual: float
    bias_tolerance: float
    min_pair_distance: float
    pair_distance_floor: float
    pattern_twins: int | None
    nested_patterns: int | None
    rank: int
    reasons: tuple[str, ...]
    ambiguous_twins: int = 0
    certificate: str = ""

    def stats(self) -> dict[str, Any]:
        """The figures as flat ``self_check_*`` statistics (``min_pair_distance`` unprefixed)."""
        figures: dict[str, Any] = {
            "self_check_passed": self.passed,
            "self_check_exact": self.exact,
            "self_check_residual": self.residual,
            "self_check_tolerance": self.tolerance,
            "self_check_bias_residual": self.bias_residual,
            "self_check_bias_tolerance": self.bias_tolerance,
            "min_pair_distance": self.min_pair_distance,
            "self_check_pair_floor": self.pair_distance_floor,
            "self_check_rank": self.rank,
            "self_check_reasons": "; ".join(self.reasons),
        }
        if self.pattern_twins is not None:
            figures["self_check_pattern_twins"] = self.pattern_twins
        if self.nested_patterns is not None:
            figures["self_check_nested_patterns"] = self.nested_patterns
        if self.ambiguous_twins:
            figures["self_check_ambiguous_twins"] = self.ambiguous_twins
        if self.certificate:
            figures["self_check_certificate"] = self.certificate
        return figures


def self_check(
    inputs: torch.Tensor,
    *,
    factors: LowRankFactors,
    weight: torch.Tensor,
    bias: torch.Tensor,
    bias_grad: torch.Tensor,
    relative_noise: float,
    exact: bool,
    found: torch.Tensor | None = None,
    pre_activation_basis: torch.Tensor | None = None,
    own_step_inactive: torch.Tensor | None = None,
) -> SelfCheck:
    """Check ``(b, n)`` recovered inputs against the observed update (see the module docstring).

    Parameters
    ----------
    inputs
        ``(b, n)`` recovered layer inputs, one per row.
    factors
        The update's low-rank factors over all ``m`` neurons (``dL/dW ~= left @ right``) and
        its singular values.
    weight, bias
        The layer's parameters, ``(m, n)`` and ``(m,)``.
    bias_grad
        The observed ``(m,)`` bias update.
    relative_noise
        ``s_{b+1} / s_b`` of the spectrum (or the known noise level).
    exact
        Check an exact reconstruction (a clean update): every check above at the noise's
        precision. False (a noisy update, e.g. DP noise) checks consistency up to the noise
        only: the ReLU patterns cannot be read reliably there, so pattern twins are not
        counted and the rank is the numerical one.
    found
        ``(b,)`` bool, False for placeholder rows; all True when None.
    pre_activation_basis
        ``weight @ factors.right.T`` if already computed (it costs ``m n b``).
    own_step_inactive
        ``(m, b)`` bool: the neurons each sample leaves inactive at the weights of its own local
        step, for an update of one local epoch of mini-batches
        (:func:`fl_attack.pipeline.local_training.local_epochs.fit_one_epoch`, computed from these inputs); the
        re-synthesis masks with it instead of the pattern at ``weight``. Rank, distinct rows and
        pattern twins (at ``weight``) are checked as always.
    """
    b = int(inputs.shape[0])
    if factors.batch_size != b:
        raise ValueError(f"inputs have {b} rows but the factors have rank {factors.batch_size}")
    dtype, device = factors.right.dtype, factors.right.device
    x = inputs.to(device=device, dtype=dtype)
    singular = factors.singular_values.to(device=device, dtype=dtype)
    total = float(singular.square().sum().sqrt())
    tail = float(singular[b:].square().sum().sqrt())
    # relative precision of the recovered rows: the weakest sample's share of the noise
    precision = min(1.0, max(relative_noise, PRECISION_FLOOR))

    # X^T = basis @ triangle with orthonormal columns: no Gram matrix, whose condition would
    # square that of look-alike rows and cost the residual half its digits
    basis, triangle = torch.linalg.qr(x.T)  # (n, b), (b, b)
    sigma = torch.linalg.svdvals(triangle)
    numerical = max(x.shape) * torch.finfo(dtype).eps
    floor = max(10.0 * precision, numerical) if exact else numerical
    rank = int((sigma > float(sigma[0]) * floor).sum()) if float(sigma[0]) > 0 else 0
    # least squares G = dW X^T (X X^T)^+ with dW = left @ right (the tail is orthogonal to X's rows)
    right_in_basis = factors.right @ basis  # (b, b)
    output_grad = factors.left @ (right_in_basis @ torch.linalg.pinv(triangle).T)  # (m, b)
    outside = float((factors.right - right_in_basis @ basis.T).square().sum()) + tail**2

    pre_activation = _pre_activations(
        x, factors=factors, weight=weight, bias=bias, basis=pre_activation_basis
    )
    ambiguous = AMBIGUITY_FACTOR * precision * weight.norm(dim=1, keepdim=True) * x.norm(dim=1)[None, :]
    inactive = pre_activation < -ambiguous
    if own_step_inactive is not None:
        inactive = own_step_inactive.to(device=device)

    # ||(G * [Z <= 0]) X|| = ||(G * [Z <= 0]) triangle^T||, as the basis is orthonormal
    masked_energy = float(((output_grad * inactive) @ triangle.T).square().sum())
    residual = math.sqrt(masked_energy + outside) / total
    tolerance = RESIDUAL_NOISE_FACTOR * max(tail / total, PRECISION_FLOOR)
    bias_target = bias_grad.to(device=device, dtype=dtype)
    bias_norm = float(bias_target.norm())
    bias_residual = float((bias_target - (output_grad * ~inactive).sum(dim=1)).norm()) / max(
        bias_norm, 1e-300
    )
    # noise of the bias update: the weight update's relative noise (float rounding), or its
    # noise per entry (DP noise has one std for all parameters) over the m entries
    m, n = weight.shape
    entry_noise = tail / math.sqrt(max(1, (m - b) * (n - b)))
    bias_noise = max(tail / total, entry_noise * math.sqrt(m) / max(bias_norm, 1e-300), PRECISION_FLOOR)
    bias_tolerance = RESIDUAL_NOISE_FACTOR * bias_noise

    distance = _min_pair_distance(x)
    distance_floor = DUPLICATE_FACTOR * precision
    twins, nested = _pattern_twins(pre_activation, ambiguous) if exact else (None, None)

    reasons = []
    if found is not None and not bool(found.all()):
        unconfirmed = int((~found).sum())
        reasons.append(f"{unconfirmed} row{'' if unconfirmed == 1 else 's'} without a confirmed direction")
    if residual > tolerance:
        reasons.append(f"{RESYNTHESISED} weight update off by {residual:.2g} (noise allows {tolerance:.2g})")
    if bias_residual > bias_tolerance:
        reasons.append(
            f"{RESYNTHESISED} bias update off by {bias_residual:.2g} (noise allows {bias_tolerance:.2g})"
        )
    if distance <= distance_floor:
        reasons.append(f"two rows are duplicates (relative distance {distance:.2g})")
    if twins:
        reasons.append(
            f"{twins} pair{'' if twins == 1 else 's'} of rows share{'s' if twins == 1 else ''} one {PATTERN}"
        )
    if nested:
        reasons.append(
            f"{nested} pair{'' if nested == 1 else 's'} of rows with {NESTED} (every neuron one "
            "leaves inactive the other does too): a family of other batches explains the update as well"
        )
    if rank < b:
        reasons.append(f"rank {rank} < {b}" + (" above the noise" if exact else ""))
    return SelfCheck(
        passed=not reasons,
        exact=exact,
        residual=residual,
        tolerance=tolerance,
        bias_residual=bias_residual,
        bias_tolerance=bias_tolerance,
        min_pair_distance=distance,
        pair_distance_floor=distance_floor,
        pattern_twins=twins,
        nested_patterns=nested,
        rank=rank,
        reasons=tuple(reasons),
    )


def without_resynthesis(check: SelfCheck) -> list[str]:
    """``check``'s reasons other than its re-synthesis at ``W_0``'s pattern, which an update of
    several steps fails by construction (drifted patterns, samples of later steps)."""
    return [reason for reason in check.reasons if not reason.startswith(RESYNTHESISED)]


def passes_but_for_nesting(check: SelfCheck) -> bool:
    """Whether ``check`` failed, if at all, only on nested patterns: such a batch explains the
    update as well as a passing one (it is one of a family that does)."""
    return all(NESTED in reason for reason in check.reasons)


def without_patterns(check: SelfCheck) -> list[str]:
    """``check``'s reasons that do not rest on ``W_0``'s ReLU patterns at all (neither the
    re-synthesis nor twin or nested patterns): rows found, distinct, of full rank."""
    return [reason for reason in without_resynthesis(check) if PATTERN not in reason]


def bias_outside_span(factors: LowRankFactors, bias_grad: torch.Tensor) -> tuple[float, float]:
    """How far the bias update lies outside the span of the weight update's left factor
    (``db = D 1`` for any batch, whatever the pattern), relative to it, and what the noise allows."""
    left = factors.left
    bias_grad = bias_grad.to(device=left.device, dtype=left.dtype)
    residual = float((bias_grad - left @ (left.T @ bias_grad)).norm()) / max(float(bias_grad.norm()), 1e-300)
    b, singular = factors.batch_size, factors.singular_values
    tail = float(singular[b:].square().sum().sqrt()) / max(float(singular.square().sum().sqrt()), 1e-300)
    return residual, RESIDUAL_NOISE_FACTOR * max(tail, PRECISION_FLOOR)


def pixel_grid_self_check(
    check: SelfCheck,
    grid: PixelGrid,
    *,
    inputs: torch.Tensor,
    factors: LowRankFactors,
    bias_grad: torch.Tensor,
) -> SelfCheck:
    """``check`` with the rows' 8-bit pixel grid (:mod:`fl_attack.pipeline.selection.pixel_grid`) in
    place of the re-synthesis at ``W_0``'s pattern, for a clean update.

    The tests that read ``W_0``'s patterns are dropped (the re-synthesis, twin and nested patterns);
    the others still have to pass (a row for every direction, full rank, distinct rows, no twin
    ambiguity), the bias update must lie in the weight update's span, and no two
    of the ``(b, n)`` recovered ``inputs`` may be near copies whose extrapolation stays on the grid
    (:meth:`fl_attack.pipeline.selection.pixel_grid.PixelGrid.extrapolated_pairs`).
    """
    if not check.exact:
        return check
    kept = without_patterns(check)  # the grid does not read W_0's patterns; near copies are below
    bias_residual, bias_tolerance = bias_outside_span(factors, bias_grad)
    if bias_residual > bias_tolerance:
        kept.append(f"bias update outside the weight update's span by {bias_residual:.2g}")
    pairs = grid.extrapolated_pairs(inputs)
    if pairs:
        kept.append(
            f"{pairs} pair{'s' if pairs != 1 else ''} of rows whose extrapolation 2 x_i - x_j is an "
            "8-bit image too (near copies): the pixel grid cannot tell the samples from such blends"
        )
    if kept:
        return check
    return replace(
        check,
        passed=True,
        bias_residual=bias_residual,
        bias_tolerance=bias_tolerance,
        reasons=(),
        certificate=grid.describe(),
    )


def _pattern_twins(pre_activation: torch.Tensor, ambiguous: torch.Tensor) -> tuple[int, int]:
    """Pairs of columns with no neuron confidently active for one and inactive for the other
    (twins), and pairs where that happens one way only (nested).

    Samples ``x_0, x_1`` whose inactive sets nest (``Z_1`` within ``Z_0``) are not identifiable:
    the columns ``c_1 + a c_0`` and ``(1 - a) c_0`` with rows ``x_1`` and
    ``x_0 + a / (1 - a) (x_0 - x_1)`` re-synthesise the same update and keep both patterns for every
    small ``a > 0``; a multi-step update can even hold such a pair exactly where the true one drifted.
    """
    active = (pre_activation > ambiguous).to(pre_activation.dtype)
    inactive = (pre_activation < -ambiguous).to(pre_activation.dtype)
    conflicts = active.T @ inactive  # (i, j): neurons i leaves active and j inactive
    upper = torch.ones_like(conflicts, dtype=torch.bool).triu(diagonal=1)
    none_way = (conflicts == 0) & (conflicts.T == 0) & upper
    one_way = ((conflicts == 0) != (conflicts.T == 0)) & upper
    return int(none_way.sum()), int(one_way.sum())


def _pre_activations(
    x: torch.Tensor,
    *,
    factors: LowRankFactors,
    weight: torch.Tensor,
    bias: torch.Tensor,
    basis: torch.Tensor | None,
) -> torch.Tensor:
    """``W X^T + bias`` ``(m, b)``, through the row basis of ``right`` when ``X`` lies in it."""
    right = factors.right
    weight, bias = weight.to(right.dtype), bias.to(right.dtype)
    squared = right.square().sum(dim=1)  # rows of right are orthogonal: right right^T is diagonal
    coefficients = (x @ right.T) / squared.clamp_min(1e-300)  # X = coefficients @ right + rest
    rest = x.square().sum() - (coefficients.square() * squared).sum()
    if float(rest) > 1e-20 * float(x.square().sum()):
        return weight @ x.T + bias[:, None]
    basis = weight @ right.T if basis is None else basis.to(right.dtype)
    return basis @ coefficients.T + bias[:, None]


def _min_pair_distance(x: torch.Tensor) -> float:
    """Smallest relative distance between two rows (``inf`` for fewer than two rows)."""
    b = x.shape[0]
    if b < 2:
        return math.inf
    gram = x @ x.T
    squared = gram.diagonal()
    scale = torch.maximum(squared[:, None], squared[None, :]).clamp_min(1e-300)
    relative = (squared[:, None] + squared[None, :] - 2 * gram) / scale
    relative = relative + torch.diag(torch.full((b,), math.inf, dtype=x.dtype, device=x.device))
    # the Gram identity loses digits for close rows: measure the closest pair directly
    index = int(torch.argmin(relative))
    i, j = divmod(index, b)
    return float((x[i] - x[j]).norm()) / max(float(x[i].norm()), float(x[j].norm()), 1e-300)
