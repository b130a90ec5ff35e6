"""Samples certified by the next layer's update, and the sphere search deflated by them.

The attacked layer's ReLU outputs ``h_i = relu(W x_i + b)`` are the inputs of the linear layer
that follows it, and the server sees that layer's update too (FedSGD sends every layer's
gradient): ``dW' = dZ' H^T``, whose row space is ``span{h_i}``, ``b`` dimensions of the attacked
layer's ``m`` neurons (:func:`activation_span`).

*One direction, one sample.* A direction ``q`` found by the search is one sample's gradient
column ``left @ q``, which vanishes on the neurons that sample leaves inactive: exactly where its
``h_i`` vanishes. So ``h_i`` spans the kernel of the span's basis on those ~m/2 neurons, and the
sample's input follows from ``h_i`` on its active neurons by one least-squares fit,
``alpha h_P = W_P x + b_P`` with ``x`` in the row space of ``dW`` (~m/2 equations, ``b + 1``
unknowns). The fit's relative residual ``||relu(W x + b) - alpha h|| / ||relu(W x + b)||``, with
the ReLU pattern of ``x`` agreeing with the zeros, certifies the sample: on CIFAR-10 float32
gradients at (400, 4000) every one of the 400 true directions certifies at 3e-7 to 5e-7 (inputs
within 2.4e-6 of the truth), while mixtures and spurious minima leave residuals of 3e-4 and more.
About one sample in eight at m = 4000 has an active neuron whose gradient vanishes by chance
(a wrong zero): it is the outlier of the kernel and is dropped before the fit.

*Deflation.* With ``X^T = Q^{-1} right``, a certified input ``x_i`` gives its row ``r_i`` of
``Q^{-1}`` (``right^T r_i = x_i``), and every direction still missing is orthogonal to ``r_i``.
Later rounds search only the orthogonal complement of the certified rows: each sample removes
one dimension, no start can fall into a found sample's basin again, and a crowded layer gets
easier as it is solved. Rounding stays in the full space (the minima are mapped back), since the
complement holds the missing directions only to the rounding of the certified inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import DeadlineReached, chunked_product
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.sparsity import ZeroTolerance
from fl_attack.pipeline.selection.select import Selection
from fl_attack.pipeline.spectrum.decompose import LowRankFactors
from fl_attack.types import ArrayLike, ObservedUpdate, as_float64

#: The next layer's update spans the batch's activations when its spectrum drops past rank b by
#: at least this factor (``s_{b+1} / s_b`` below it: the clean-gradient bound of the attack).
MAX_SPAN_NOISE = 1e-3

#: The sketch of the next layer's row space: extra columns and power iterations. With a clean
#: rank-b update the subspace error shrinks like ``(s_{b+11} / s_b)^5``.
SPAN_OVERSAMPLE = 10
SPAN_ITERATIONS = 2

#: A fit certifies a sample when its relative residual is below this many times the two updates'
#: relative noise ``s_{b+1} / s_b`` (at least ``RESIDUAL_FLOOR``). At (400, 4000) on CIFAR-10:
#: samples 3e-7 to 5e-7 at relative noise 4e-6 (the layer) + 3e-6 (the next one); true
#: directions read with one wrong zero 3e-4 and more.
RESIDUAL_PER_NOISE = 10.0
RESIDUAL_FLOOR = 1e-10

#: Neurons whose fitted pre-activation contradicts the zeros by more than this fraction of the
#: median ``|W x + b|`` are pattern errors; a certified sample may have at most
#: ``MAX_PATTERN_ERRORS`` (an active neuron whose gradient vanishes by chance is one).
PATTERN_MARGIN = 1e-3
MAX_PATTERN_ERRORS = 2

#: Kernel fits per direction: while the zero rows have no common kernel, the row of largest
#: leverage is a wrong zero (an active neuron with a vanishing gradient), dropped and refitted.
OUTLIER_ROUNDS = 4

#: Two certified directions with ``|cos|`` above this are the same sample.
SAME_SAMPLE_COS = 1.0 - 1e-6
#: Two certified inputs closer than this many times the larger of their fits' residuals
#: (relative to the larger input) are one sample reached from two directions: on float32 updates
#: one sample's directions from different starts differ by more than ``SAME_SAMPLE_COS`` allows
#: (a tabular MLP: 8 certifications of 6 samples, which left no direction to search for the
#: other 2, 1 row of 8 recovered where the attack without the next layer recovers 8).
SAME_SAMPLE_RESIDUALS = 100.0


@dataclass(frozen=True)
class ActivationSpan:
    """An orthonormal basis of the batch's activations ``span{h_i}`` and how clean it is.

    Attributes
    ----------
    basis
        ``(m, b)`` orthonormal columns over the attacked layer's neurons.
    relative_noise
        ``s_{b+1} / s_b`` of the next layer's update.
    """

    basis: torch.Tensor
    relative_noise: float


def activation_span(next_weight_grad: torch.Tensor, *, batch_size: int, deadline: Deadline) -> ActivationSpan:
    """The row space of the next layer's ``(k, m)`` update at rank ``batch_size``.

    A randomized sketch with ``SPAN_ITERATIONS`` power iterations: five products with the update
    instead of its SVD (at ``k = m = 4000``, ``b = 400``: about 3 s against 13 s).

    Raises
    ------
    ValueError
        If the update has fewer than ``batch_size + 1`` rows (it cannot hold ``b`` activations) or
        is zero at rank ``batch_size``.
    fl_attack.pipeline.budget.deadline.DeadlineReached
        If ``deadline`` passes during the products.
    """
    rows, width = next_weight_grad.shape
    b = batch_size
    if rows <= b:
        raise ValueError(
            f"the next layer's update has {rows} rows: it cannot span the activations of {b} samples"
        )
    columns = min(b + SPAN_OVERSAMPLE, rows, width)
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(rows, columns, generator=generator, dtype=next_weight_grad.dtype)
    transposed = next_weight_grad.T.contiguous()
    sketch = chunked_product(transposed, probe.to(next_weight_grad.device), deadline=deadline)
    basis = torch.linalg.qr(sketch).Q
    for _ in range(SPAN_ITERATIONS):
        image = torch.linalg.qr(chunked_product(next_weight_grad, basis, deadline=deadline)).Q
        basis = torch.linalg.qr(chunked_product(transposed, image, deadline=deadline)).Q
    _, values, vh = torch.linalg.svd(
        chunked_product(next_weight_grad, basis, deadline=deadline), full_matrices=False
    )
    if not values[b - 1] > 0:
        raise ValueError(f"the next layer's update has rank below {b}")
    noise = float(values[b] / values[b - 1]) if b < values.numel() else 0.0
    return ActivationSpan(basis=(basis @ vh[:b].T).contiguous(), relative_noise=noise)


@dataclass(frozen=True)
class CertifiedSample:
    """One sample recovered exactly from a direction and the next layer's update.

    Attributes
    ----------
    direction
        ``(b,)`` unit direction in the search's coordinates (the ``q`` of ``left @ q``).
    inputs
        ``(n,)`` the sample's input ``x``.
    dual
        ``(b,)`` its row of ``Q^{-1}`` (``right^T dual = inputs``); missing directions are orthogonal to it.
    residual
        The fit's relative residual.
    agreement
        Share of the layer's neurons where the input's ReLU pattern agrees with the direction's zeros.
    """

    direction: torch.Tensor
    inputs: torch.Tensor
    dual: torch.Tensor
    residual: float
    agreement: float = 1.0


def next_layer_update(
    next_weight_grad: ArrayLike | None, *, width: int, device: torch.device
) -> torch.Tensor | None:
    """The next layer's ``(k, m)`` update as a float64 tensor, validated against the attacked
    layer (None when none is given).

    Raises
    ------
    ValueError
        If it is not 2-D with ``m`` columns, holds NaN/Inf, or is all zeros.
    TypeError
        If it is not a real numpy array or torch tensor.
    """
    if next_weight_grad is None:
        return None
    update = as_float64(next_weight_grad, name="next_weight_grad", device=device)
    if update.ndim != 2 or update.shape[1] != width:
        raise ValueError(
            f"next_weight_grad must be the (k, m) update of the layer fed by this layer's ReLU, with "
            f"m = {width} columns, got shape {tuple(update.shape)}"
        )
    if not bool((update != 0).any()):
        raise ValueError("next_weight_grad is all zeros: it holds no activations of the batch")
    return update


class Deflation:
    """Certifies the search's directions through the next layer and gives the space still to search.

    Nothing is computed until the first :meth:`certify`: an attack that finishes in its first
    round pays nothing for it.

    Parameters
    ----------
    factors
        The search's factors (informative rows only).
    next_weight_grad
        The next layer's ``(k, m)`` update (:func:`next_layer_update`).
    weight, bias
        The attacked layer's ``(m, n)`` weight and ``(m,)`` bias.
    active
        ``(m,)`` the informative rows of ``factors`` (neurons some sample activates).
    tolerance
        The zero tolerance of unit gradient columns.
    relative_noise
        ``s_{b+1} / s_b`` of the attacked layer's update.
    min_zeros
        Directions with fewer zeros are not tried (the pool's confident count).
    stats
        The attack's statistics, kept up to date here (:meth:`stats`).

    Attributes
    ----------
    off
        Why the next layer cannot certify samples (None while it can, or before the setup).
    """

    def __init__(
        self,
        factors: LowRankFactors,
        next_weight_grad: torch.Tensor,
        *,
        weight: torch.Tensor,
        bias: torch.Tensor,
        active: torch.Tensor,
        tolerance: ZeroTolerance,
        relative_noise: float,
        min_zeros: int,
        stats: dict[str, Any] | None = None,
    ) -> None:
        b = factors.batch_size
        self.left = factors.left
        self.singular_values = factors.singular_values[:b].to(factors.right)
        # the row space of dW: x = V c, and right = S V^T
        self.row_basis = (factors.right / self.singular_values[:, None]).T.contiguous()  # (n, b)
        self._next, self._weight, self._bias_all, self._active = next_weight_grad, weight, bias, active
        self.threshold = tolerance.absolute
        self.min_zeros = max(min_zeros, b)
        self.relative_noise = relative_noise
        self.residual_bound = math.inf
        self.samples: list[CertifiedSample] = []
        self.tried = 0
        self.repeats = 0  # certifications of an already certified sample, dropped
        self.off: str | None = None
        self._ready = False
        self._held = self.left.new_zeros(0, b)
        self.last_added = 0
        self._stats = {} if stats is None else stats
        self._stats.update(self.stats())

    def _setup(self, deadline: Deadline) -> bool:
        """Build the activation span and the pre-activation coordinates once; False when unusable.

        Raises
        ------
        fl_attack.pipeline.budget.deadline.DeadlineReached
            If ``deadline`` passes first (the setup is tried again at the next call).
        """
        if self._ready or self.off is not None:
            return self._ready
        b = self.left.shape[1]
        try:
            span = activation_span(self._next, batch_size=b, deadline=deadline)
        except ValueError as error:
            self.off = str(error)
            return False
        if span.relative_noise > MAX_SPAN_NOISE:
            self.off = (
                f"the next layer's update is not of rank {b} (s_b+1/s_b = {span.relative_noise:.2g} > "
                f"{MAX_SPAN_NOISE:g}): noise, or more than one step"
            )
            return False
        active = self._active
        # (m, b): the pre-activations of x = V c are coordinates @ c + bias
        coordinates = chunked_product(self._weight, self.row_basis, deadline=deadline)
        self.coordinates, self.bias = coordinates[active], self._bias_all[active]
        self.dead_coordinates, self.dead_bias = coordinates[~active], self._bias_all[~active]
        self.span = span.basis[active]
        self.span_noise: float = span.relative_noise
        self.residual_bound = max(
            RESIDUAL_FLOOR, RESIDUAL_PER_NOISE * (self.relative_noise + span.relative_noise)
        )
        self._next = self._next.new_zeros(0, 0)  # the update is no longer needed
        self._ready = True
        return True

    def stats(self) -> dict[str, float | int | str]:
        """What the attack reports of the deflation."""
        if self.off is not None:
            return {"next_layer": f"off: {self.off}"}
        if not self._ready:
            return {"next_layer": "not needed"}
        residuals = [sample.residual for sample in self.samples]
        return {
            "next_layer": "on",
            "next_layer_certified": self.found,
            "next_layer_tried": self.tried,
            "next_layer_repeats": self.repeats,
            "next_layer_max_residual": max(residuals) if residuals else 0.0,
            "next_layer_relative_noise": self.span_noise,
        }

    def hold(self, directions: torch.Tensor) -> None:
        """Keep a round's ``(k, b)`` directions to certify when the search asks for its next space."""
        self._held = torch.cat([self._held, directions], dim=0)

    def space(self, *, deadline: Deadline) -> torch.Tensor | None:
        """Certify the held directions; the ``(b, b')`` space still to search (:meth:`complement`),
        or None while no sample is certified (then the whole space)."""
        held, self._held = self._held, self._held[:0]
        if held.shape[0]:
            self.last_added = self.certify(held, deadline=deadline)
        return self.complement() if self.samples else None

    @property
    def progressing(self) -> bool:
        """Whether the last :meth:`space` certified a new sample: other proposal stages may wait."""
        return self.last_added > 0

    @property
    def found(self) -> int:
        """How many samples are certified."""
        return len(self.samples)

    def directions(self) -> torch.Tensor:
        """``(k, b)`` the certified unit directions."""
        b = self.left.shape[1]
        if not self.samples:
            return self.left.new_zeros(0, b)
        return torch.stack([sample.direction for sample in self.samples])

    def complement(self) -> torch.Tensor:
        """``(b, b - k)`` orthonormal basis of the directions orthogonal to every certified dual row."""
        b = self.left.shape[1]
        if not self.samples:
            return torch.eye(b, dtype=self.left.dtype, device=self.left.device)
        duals = torch.stack([sample.dual for sample in self.samples], dim=1)  # (b, k)
        q, _ = torch.linalg.qr(duals, mode="complete")
        return q[:, duals.shape[1] :].contiguous()

    def certify(self, directions: torch.Tensor, *, deadline: Deadline = Deadline.never()) -> int:
        """Certify the ``(k, b)`` directions that are new samples; returns how many were added.

        Directions with fewer than ``min_zeros`` zeros, or repeating a certified one, are skipped
        unfitted; the fits stop at ``deadline``.
        """
        if directions.shape[0] == 0:
            return 0
        try:
            ready = self._setup(deadline)
        except DeadlineReached:
            return 0
        self._stats.update(self.stats())
        if not ready:
            return 0
        unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
        columns = unit @ self.left.T  # (k, m_active)
        sparse = (columns.abs() <= self.threshold).sum(dim=1) >= self.min_zeros
        unit, columns = unit[sparse], columns[sparse]
        added = 0
        for index in range(unit.shape[0]):
            if deadline.expired():
                break
            known = self.directions()
            if known.shape[0] and float((known @ unit[index]).abs().max()) > SAME_SAMPLE_COS:
                continue
            self.tried += 1
            try:
                sample = self._certify_one(unit[index], columns[index])
            except torch.linalg.LinAlgError:  # type: ignore[attr-defined]  # a degenerate fit certifies nothing
                sample = None
            if sample is not None and self._repeats(sample):
                self.repeats += 1
            elif sample is not None:
                self.samples.append(sample)
                added += 1
        self._stats.update(self.stats())
        return added

    def _repeats(self, sample: CertifiedSample) -> bool:
        """Whether ``sample`` is a certified one again (its input within the fits' precision)."""
        for known in self.samples:
            scale = max(float(known.inputs.norm()), float(sample.inputs.norm()), 1e-300)
            precision = SAME_SAMPLE_RESIDUALS * max(known.residual, sample.residual, RESIDUAL_FLOOR)
            if float((known.inputs - sample.inputs).norm()) <= precision * scale:
                return True
        return False

    def inputs(self) -> torch.Tensor:
        """``(k, n)`` the certified inputs."""
        if not self.samples:
            return self.row_basis.new_zeros(0, self.row_basis.shape[0])
        return torch.stack([sample.inputs for sample in self.samples])

    def _certify_one(self, direction: torch.Tensor, column: torch.Tensor) -> CertifiedSample | None:
        zeros = column.abs() <= self.threshold
        activations = self._kernel(zeros)
        if activations is None:
            return None
        kept, h = activations
        fitted = ~kept
        system = torch.cat([h[fitted, None], -self.coordinates[fitted]], dim=1)  # [alpha; c]
        solution = torch.linalg.lstsq(system, self.bias[fitted, None]).solution.squeeze(1)
        alpha, coordinates = float(solution[0]), solution[1:]
        if not alpha > 0:
            return None
        pre = self.coordinates @ coordinates + self.bias
        relu = pre.clamp_min(0)
        residual = float((relu - alpha * h).norm() / relu.norm().clamp_min(1e-300))
        margin = PATTERN_MARGIN * float(pre.abs().median())
        errors = int(((pre < -margin) & fitted).sum()) + int(((pre > margin) & kept).sum())
        if self.dead_bias.numel():
            errors += int(((self.dead_coordinates @ coordinates + self.dead_bias) > margin).sum())
        if not residual <= self.residual_bound or errors > MAX_PATTERN_ERRORS:
            return None
        inputs = self.row_basis @ coordinates
        dual = coordinates / self.singular_values
        width = self.coordinates.shape[0] + self.dead_coordinates.shape[0]
        return CertifiedSample(direction, inputs, dual, residual, agreement=1.0 - errors / width)

    def _kernel(self, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The zero rows kept and the unit activation vector ``h`` vanishing on them (sign: sum >= 0).

        While the span's basis on the kept rows has no kernel (its smallest singular value above
        the residual bound), one row is a wrong zero (an active neuron with a vanishing gradient):
        the others share the kernel ``h``, so removing it leaves a singular Gram matrix, which
        makes its leverage ``a^T G^{-1} a`` exactly 1, the largest any row can have. It is dropped,
        ``OUTLIER_ROUNDS - 1`` times at most. None when fewer than ``b`` rows remain.
        """
        b = self.span.shape[1]
        kept = zeros.clone()
        h = self.span.new_zeros(self.span.shape[0])
        for round_index in range(OUTLIER_ROUNDS):
            if int(kept.sum()) < b:
                return None
            rows = self.span[kept]
            values, vectors = torch.linalg.eigh(rows.T @ rows)
            h = self.span @ vectors[:, 0]
            # the smallest singular value from the residual itself: the Gram's eigenvalue is its square
            consistent = float((rows @ vectors[:, 0]).norm()) <= self.residual_bound
            if consistent or round_index == OUTLIER_ROUNDS - 1:
                break
            leverage = ((rows @ vectors).square() / values.clamp_min(1e-300)).sum(dim=1)
            kept[torch.nonzero(kept).flatten()[int(torch.argmax(leverage))]] = False
        if float(h.sum()) < 0:
            h = -h
        return kept, h


def deflation_for(
    following: torch.Tensor | None,
    pool: CandidatePool,
    update: ObservedUpdate,
    active: torch.Tensor,
    *,
    local_steps: int,
    stats: dict[str, Any],
) -> Deflation | None:
    """The attack's :class:`Deflation` when the next layer's update can certify samples (it keeps
    ``stats`` up to date), else None with the reason in ``stats["next_layer"]``.

    It needs one clean gradient step: under noise no zero is exact (the pool's tolerance is then
    per direction), and after several local steps the next layer's update spans every step's
    activations. ``pool`` holds the search's factors, tolerance and confident zero count;
    ``active`` marks its rows among the ``update``'s neurons.
    """
    if following is None:
        return None
    b = pool.factors.batch_size
    reason = None
    if pool.tolerance.per_direction or pool.tolerance.relative_noise > MAX_SPAN_NOISE:
        reason = "the update is noisy: no zero is exact"
    elif local_steps > 1:
        reason = f"{local_steps} local steps: the next layer's update spans every step's activations"
    elif b < 2:
        reason = "a single sample needs no search"
    if reason is not None:
        stats["next_layer"] = f"off: {reason}"
        return None
    return Deflation(
        pool.factors,
        following,
        weight=update.weight,
        bias=update.bias,
        active=active,
        tolerance=pool.tolerance,
        relative_noise=pool.tolerance.relative_noise,
        min_zeros=pool.min_zeros,
        stats=stats,
    )


def with_certified_rows(
    selection: Selection, deflation: Deflation | None, *, keep_complete: bool = False
) -> Selection:
    """``selection`` with the certified samples' inputs in its rows, unless it is complete and
    ``keep_complete`` (an accepted batch is kept as it is).

    In a partial selection ``X^T = Q^{-1} R`` mixes every row with the orthonormal completion that
    stands for the unfound directions, so even its found rows are off; a certified sample's input
    is exact by itself. Each certified sample replaces the row of its direction, or takes the row
    of an unfound one (then found), or, in a complete selection that was not accepted (near-twins
    can leave one nearly singular, every row of ``Q^{-1} R`` off), the row that matches the update
    worst; its pattern agreement becomes the row's matching. A row takes one certified sample.
    """
    if deflation is None or not deflation.samples or (selection.complete and keep_complete):
        return selection
    directions, found = selection.directions.clone(), selection.found.clone()
    inputs, per_sample = selection.inputs.clone(), selection.per_sample.clone()
    unit = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    certified = torch.zeros_like(found)
    for sample in deflation.samples:
        same = found & ~certified & ((unit @ sample.direction).abs() > SAME_SAMPLE_COS)
        if bool(same.any()):
            row = int(torch.nonzero(same).flatten()[0])
        elif bool((~found).any()):
            row = int(torch.nonzero(~found).flatten()[0])
        elif bool((~certified).any()):
            weakest = torch.where(certified, torch.full_like(per_sample, math.inf), per_sample)
            row = int(torch.argmin(weakest))
        else:
            continue
        directions[row], unit[row], found[row] = sample.direction, sample.direction, True
        inputs[row] = sample.inputs.to(inputs)
        per_sample[row] = sample.agreement
        certified[row] = True
    matching = float(per_sample.mean())
    return Selection(directions, found, inputs, per_sample, matching)


#: A certified input confirms a selection's row for the same sample when they agree to this
#: relative error (both are exact; they differ by rounding).
CONFIRM_RELATIVE_ERROR = 1e-4


def confirm_weak_rows(
    deflation: Deflation | None, selection: Selection, confidence: torch.Tensor
) -> dict[str, float | int]:
    """Certify through the next layer the rows of an accepted ``selection`` whose ReLU pattern
    does not agree with the update everywhere (``confidence < 1``).

    Such a row is usually a sample with an active neuron whose gradient vanishes below the
    update's precision (the certification drops that wrong zero as the row of leverage 1). A
    row is confirmed when a sample certified on its direction has its input to
    :data:`CONFIRM_RELATIVE_ERROR`.

    Returns
    -------
    dict
        Empty without a deflation or without such rows; else ``weak_rows``,
        ``next_layer_confirmed_rows`` and ``unconfirmed_min_confidence`` (the weakest matching
        of the rows not confirmed, 1 when every one was).
    """
    weak = torch.nonzero(confidence < 1.0).flatten().tolist()
    if deflation is None or not weak:
        return {}
    directions = selection.directions[weak]
    deflation.certify(directions)
    confirmed, unconfirmed = 0, 1.0
    for row, direction in zip(weak, directions, strict=True):
        unit = direction / direction.norm().clamp_min(1e-300)
        row_inputs = selection.inputs[row]
        scale = float(row_inputs.norm().clamp_min(1e-300))
        agrees = any(
            abs(float(sample.direction.to(unit) @ unit)) > SAME_SAMPLE_COS
            and float((sample.inputs.to(row_inputs) - row_inputs).norm()) <= CONFIRM_RELATIVE_ERROR * scale
            for sample in deflation.samples
        )
        confirmed += int(agrees)
        if not agrees:
            unconfirmed = min(unconfirmed, float(confidence[row]))
    return {
        "weak_rows": len(weak),
        "next_layer_confirmed_rows": confirmed,
        "unconfirmed_min_confidence": unconfirmed,
    }
