"""Candidate directions from the output layer that directly follows the attacked layer.

When the attacked layer's ReLU feeds the output layer (``logits = W2 relu(z) + b2``, the usual
one-hidden-layer MLP), sample ``i``'s column of the output gradient is

    dL/dz_i = relu'(z_i) * (W2^T g_i),   g_i = dL/dlogits_i  (c entries).

Every column is a masked copy of a vector from the ``c``-dimensional range of ``W2^T``, and the
server knows ``W2`` (the next layer's weight is in the same global arrays). Under cross-entropy
at a model that is not yet confident ``g_i = softmax_i - e_{y_i}`` is close to the class
prototype ``1/c - e_{y_i}`` (freshly initialised victims, 20-sample batches of CIFAR-10 and
raw MNIST: cosine 0.998 on average, above 0.98 for every sample), so every non-zero entry of a
class-``k`` sample's column carries the sign of ``u_k = W2^T (1/c - e_k)`` wherever ``u_k`` is
not small (no sample we measured contradicts it there).

Why the plain l1 search struggles there: two samples of the same class have nearly equal
``W2^T g``, so their difference is as sparse as either sample; on CIFAR-10 at (20, 200) only
~11% of the sphere search's minima round to a true direction (~80% with three hidden layers). A difference of two
class-``k`` samples carries the wrong sign wherever only the subtracted sample is active, while
a true column never does. The search here minimises the l1 norm with every wrong-signed entry
weighted ``penalty`` times, one class prototype per initialization: on the same CIFAR-10 batch
90% of its minima are a true direction of the prototype's class, on raw MNIST ~85% (plain: < 1%).

The prototypes only steer the search: every proposal is rounded to an exact kernel and filtered
by the candidate pool exactly as the sphere search's are, so a wrong prior (another loss, a
confident model, a layer that is not followed by the output layer) costs time, never exactness.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import (
    eigh_seconds,
    elementwise_seconds,
    map_rows,
    matmul_seconds,
    qr_seconds,
)
from fl_attack.pipeline.search.candidates import CandidatePool
from fl_attack.pipeline.search.sparsity import (
    ZeroTolerance,
    kernel_of_smallest,
    least_squares_kernel,
    zero_masks,
)
from fl_attack.pipeline.search.sphere import SphereSchedule, Surrogate, optimize_on_sphere, random_directions
from fl_attack.pipeline.side_information.binary_head import BinaryHead
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: Weight of an entry whose sign contradicts the class prototype, relative to a right-signed one.
#: Measured at (20, 200), share of minima on a true direction: CIFAR-10 16% at 1 (no prior), 90%
#: at 3 and at 10; raw MNIST < 1% at 1, 80% at 3, 85% at 10 but fewer distinct samples found.
SIGN_PENALTY = 3.0

#: Prototype entries smaller than this fraction of the prototype's root mean square get no sign
#: constraint: there the deviation of ``g_i`` from the prototype can flip the sign.
CONFIDENT_FRACTION = 0.25

#: Initializations per class in one search are ``max(MIN_PER_CLASS, ceil(INITS_PER_SAMPLE * b / c))``:
#: 16 per class at b = 20 and c = 10 (a search then costs a few tenths of a second on one thread).
MIN_PER_CLASS = 8
INITS_PER_SAMPLE = 8.0

#: Upper bound on one search's initializations (classes are drawn at random beyond it).
MAX_ROUND_INITIALIZATIONS = 4096

#: The sphere schedule of a head round: the sign prior makes minima converge in far fewer steps
#: than SPEAR++'s 500 (CIFAR-10 at (20, 200): the same minima after 150 steps as after 500, 286
#: instead of 288 of 320 on a true direction after 100).
HEAD_SCHEDULE = SphereSchedule(steps=100, lr=0.5, milestones=(40, 80))

#: A search point whose |cos| with a known direction exceeds this is pushed away from it, with a
#: force of this weight times the l1 gradient's scale ``sqrt(m)``. Same-class samples sit at
#: cosines 0.65-0.85 of each other on raw MNIST: a cap of 0.8 hid some of them, 0.9 none.
REPEL_COS = 0.9
REPEL_WEIGHT = 1.0

#: Starts of the second search per known direction, and their cosine with it. With these, one
#: :meth:`HeadRounds.propose` left no direction missing on 17 of 20 raw MNIST batches at
#: (20, 200) and one on the other 3 (without the second search: 7 of 10, up to 3 missing).
RING_STARTS = 4
RING_COS = 0.75

#: Head rounds stop once this many in a row added nothing to the candidate pool.
HEAD_PATIENCE = 2


@dataclass(frozen=True)
class HeadPrior:
    """Per-class sign patterns of the attacked layer's output gradient.

    Attributes
    ----------
    signs
        ``(c, m')`` float64 in ``{-1, 0, 1}``: the sign of the class prototype
        ``u_k = W2^T (1/c - e_k)`` on each informative neuron, 0 where the prototype is too
        small for its sign to be trusted (:data:`CONFIDENT_FRACTION`).
    difference
        ``(m',)`` ``W2[0] - W2[1]`` of a two-class head (:mod:`fl_attack.pipeline.side_information.binary_head`), else empty.
    """

    signs: torch.Tensor
    difference: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    @property
    def num_classes(self) -> int:
        return int(self.signs.shape[0])

    @classmethod
    def from_head_weight(
        cls,
        head_weight: np.ndarray | torch.Tensor,
        *,
        width: int,
        rows: torch.Tensor | None = None,
    ) -> HeadPrior:
        """The prior of the ``(c, m)`` output-layer weight that follows a layer of ``m`` neurons.

        Parameters
        ----------
        head_weight
            ``(c, m)`` weight of the output layer fed by the attacked layer's ReLU (the global
            weight the server sent, not the client's update): ``c >= 2`` classes, or one output
            (a single logit or regression output), treated as the two classes ``(z, 0)``.
        width
            ``m``: the attacked layer's number of neurons.
        rows
            ``(m,)`` boolean mask of the neurons the search keeps (the informative rows of
            the low-rank factor); None keeps all.

        Raises
        ------
        TypeError
            If ``head_weight`` is not a real numpy array or torch tensor.
        ValueError
            If ``head_weight`` is not a finite ``(c, m)`` matrix with ``c >= 1``, or ``rows``
            is not an ``(m,)`` boolean mask.
        """
        weight = _as_float64(head_weight)
        if weight.dim() != 2 or weight.shape[1] != width or weight.shape[0] < 1:
            raise ValueError(
                "head_weight must be the (c, m) weight of the output layer that follows the attacked "
                f"layer (c >= 1 outputs, m = {width} neurons), got shape {tuple(weight.shape)}"
            )
        if weight.shape[0] == 1:  # one logit: its sigmoid is the softmax over the logits (z, 0)
            weight = torch.cat([weight, torch.zeros_like(weight)])
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("head_weight contains NaN or Inf entries")
        if rows is not None:
            if rows.dtype != torch.bool or tuple(rows.shape) != (width,):
                raise ValueError(
                    f"rows must be an ({width},) boolean mask, got {rows.dtype} {tuple(rows.shape)}"
                )
            weight = weight[:, rows.cpu()]
        prototypes = weight.mean(dim=0, keepdim=True) - weight  # row k: W2^T (1/c - e_k)
        rms = prototypes.pow(2).mean(dim=1, keepdim=True).sqrt()
        confident = prototypes.abs() >= CONFIDENT_FRACTION * rms
        difference = weight[0] - weight[1] if weight.shape[0] == 2 else weight.new_zeros(0)
        return cls(signs=torch.sign(prototypes) * confident.to(prototypes.dtype), difference=difference)

    def to(self, device: torch.device) -> HeadPrior:
        """This prior on ``device``."""
        return HeadPrior(signs=self.signs.to(device), difference=self.difference.to(device))


def _as_float64(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``head_weight`` as a float64 CPU tensor; a TypeError for anything but real arrays."""
    if isinstance(value, np.ndarray):
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            raise TypeError(f"head_weight must hold real numbers, got dtype {value.dtype}")
        return torch.from_numpy(np.ascontiguousarray(value)).to(torch.float64)
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"head_weight must hold real numbers, got dtype {value.dtype}")
        return value.detach().to("cpu", torch.float64)
    raise TypeError(f"head_weight must be a numpy array or a torch tensor, got {type(value).__name__}")


def sign_aware_l1(
    row_signs: torch.Tensor,
    *,
    penalty: float = SIGN_PENALTY,
    left: torch.Tensor | None = None,
    repel: torch.Tensor | None = None,
    repel_cos: float = REPEL_COS,
    repel_weight: float = REPEL_WEIGHT,
) -> Surrogate:
    """The l1 surrogate with wrong-signed entries weighted ``penalty`` times, one sign row per point.

    ``row_signs`` is ``(k, m')``: row ``r`` applies to the ``r``-th point optimized (entries
    of 0 are unconstrained). The result fits :func:`fl_attack.pipeline.search.sphere.optimize_on_sphere`
    for exactly those ``k`` points.

    With ``repel`` (``(f, b)`` unit directions) and the orthonormal ``left`` factor, a point
    whose ``|cos|`` with a repelled direction exceeds ``repel_cos`` is pushed away from it
    with a force of ``repel_weight * sqrt(m')`` (the scale of the l1 gradient): a search that
    would fall into a basin already explored goes on to another one.
    """
    if not penalty >= 1:
        raise ValueError(f"penalty must be >= 1, got {penalty}")
    pushing = repel is not None and repel.shape[0] > 0
    if pushing and left is None:
        raise ValueError("repelling directions needs the left factor")
    force = repel_weight * math.sqrt(row_signs.shape[-1])
    # for s in {-1, 0, 1}: sign(v) + (penalty - 1) sign(v) [sign(v) = -s]  ==  sign(v) * scale - offset
    # (up to entries that are exactly 0), precomputed so one step costs three passes over (k, m')
    half = 0.5 * (penalty - 1.0)
    scale = 1.0 + half * row_signs * row_signs
    offset = half * row_signs

    def derivative(values: torch.Tensor, smoothing: float) -> torch.Tensor:
        slope = torch.sign(values) * scale.to(values.dtype) - offset.to(values.dtype)
        if pushing:
            assert left is not None and repel is not None
            basis, away = left.to(values.dtype), repel.to(values.dtype)
            cosines = (values @ basis) @ away.T  # left is orthonormal: values @ left is the point
            near = torch.where(cosines.abs() > repel_cos, torch.sign(cosines), torch.zeros_like(cosines))
            slope = slope + force * ((near @ away) @ basis.T)
        return slope

    return Surrogate("head-l1", derivative, needs_rounding=False)


def round_classes(num_classes: int, batch_size: int, *, generator: torch.Generator) -> torch.Tensor:
    """The class prototype of each random start of one search.

    Every class gets ``max(MIN_PER_CLASS, ceil(INITS_PER_SAMPLE * b / c))`` starts; when that
    exceeds :data:`MAX_ROUND_INITIALIZATIONS` (many classes), the search draws that many classes
    at random instead.
    """
    per_class = max(MIN_PER_CLASS, math.ceil(INITS_PER_SAMPLE * batch_size / num_classes))
    if per_class * num_classes <= MAX_ROUND_INITIALIZATIONS:
        return torch.arange(num_classes).repeat_interleave(per_class)
    return torch.randint(num_classes, (MAX_ROUND_INITIALIZATIONS,), generator=generator)


class HeadRounds:
    """Rounds of head-guided proposals for one attack, in the coordinates of its low-rank factors.

    One call of :meth:`propose` runs two searches: the first from random starts, the second from
    starts around the directions known so far. Within a class the samples with the most active
    neurons have the smallest basins (on raw MNIST at (20, 200) some get 1 in 64 random starts);
    the second search finds them in the same call, before the attack falls back on its costly
    scan for the last two directions.

    Parameters
    ----------
    factors
        Low-rank factors restricted to the informative rows.
    prior
        Class signs on the same rows.
    tolerance, min_zeros
        The candidate pool's zero tolerance and the zeros that make a minimum worth repelling.
    generator
        The attack's random generator.
    deadline
        The attack's search deadline, after which :meth:`propose`
        returns nothing; a running search and its rounding stop at it within one chunk of work
        (:mod:`fl_attack.pipeline.budget.deadline`) and return what they finished.
    noisy
        Noisy gradient: proposals stay least-squares estimates (no rounding to ``b - 1`` rows).
    schedule
        Steps and learning rate of the sphere optimization.
    repel_cos, repel_weight
        See :func:`sign_aware_l1`.
    ring_starts, ring_cos
        Starts of the second search per known direction and their cosine with it.
    polish_fraction
        Share of neurons whose rows define the least-squares kernel before exact rounding.
    """

    def __init__(
        self,
        factors: LowRankFactors,
        prior: HeadPrior,
        *,
        tolerance: ZeroTolerance,
        min_zeros: int,
        generator: torch.Generator,
        deadline: Deadline = Deadline.never(),
        noisy: bool = False,
        schedule: SphereSchedule = HEAD_SCHEDULE,
        repel_cos: float = REPEL_COS,
        repel_weight: float = REPEL_WEIGHT,
        ring_starts: int = RING_STARTS,
        ring_cos: float = RING_COS,
        polish_fraction: float = 0.3,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if ring_starts < 1 or not 0 < ring_cos < 1:
            raise ValueError(f"need ring_starts >= 1 and 0 < ring_cos < 1, got {ring_starts} and {ring_cos}")
        if prior.signs.shape[1] != factors.left.shape[0]:
            raise ValueError(
                f"the prior covers {prior.signs.shape[1]} neurons but the factors have {factors.left.shape[0]} rows"
            )
        self.factors = factors
        self.prior = prior.to(factors.left.device)
        self.tolerance = tolerance
        self.min_zeros = min_zeros
        self.generator = generator
        self.deadline = deadline
        self.noisy = noisy
        self.schedule = schedule
        self.repel_cos = repel_cos
        self.repel_weight = repel_weight
        self.ring_starts = ring_starts
        self.ring_cos = ring_cos
        self.polish_fraction = polish_fraction
        self.dtype = dtype
        self.searches = 0
        self.initializations = 0
        pair, noise = self.prior.difference, tolerance.relative_noise
        self.binary = (
            BinaryHead(factors, pair, relative_noise=noise, generator=generator, deadline=deadline)
            if pair.numel()
            else None
        )

    @classmethod
    def for_pool(
        cls,
        pool: CandidatePool,
        prior: HeadPrior,
        *,
        generator: torch.Generator,
        deadline: Deadline,
        noisy: bool,
    ) -> HeadRounds:
        """Head rounds for an attack's candidate pool: its factors, zero tolerance and weak threshold.

        ``generator``, ``deadline`` and ``noisy`` are the attack's (see the class parameters).
        """
        return cls(
            pool.factors,
            prior,
            tolerance=pool.tolerance,
            min_zeros=pool.weak_min_zeros,
            generator=generator,
            deadline=deadline,
            noisy=noisy,
        )

    def stats(self) -> dict[str, int]:
        """Searches run and initializations optimized so far, for the attack's stats."""
        binary = {} if self.binary is None else self.binary.stats()
        return {"head_searches": self.searches, "head_initializations": self.initializations, **binary}

    def propose(self, known: torch.Tensor, *, avoid: torch.Tensor | None = None) -> torch.Tensor:
        """Two searches' ``(k, b)`` float64 proposals, repelled from ``known`` and ``avoid``.

        The first starts at random points, one class prototype each. The second starts on rings
        around the ``known`` unit directions (the samples found so far) and the first search's
        sparse minima (see :meth:`_ring_starts`); ``avoid`` (e.g. sparse mixtures) is only
        repelled. Empty once the deadline has passed. A two-class head first gets the new
        two-valued directions of :class:`BinaryHead`, alone, as long as a call finds any.
        """
        left = self.factors.left
        b = left.shape[1]
        if self.deadline.expired():
            return left.new_zeros(0, b)
        if self.binary is not None and not self.binary.exhausted:  # two classes: see binary_head
            found = self.binary.propose(known, avoid=avoid)
            if found.shape[0]:
                return found
        known = known.to(torch.float64)
        repel = known if avoid is None else torch.cat([known, avoid.to(torch.float64)])
        classes = round_classes(self.prior.num_classes, b, generator=self.generator).to(left.device)
        starts = random_directions(int(classes.numel()), b, generator=self.generator, device=left.device)
        first = self._search(starts, classes, repel)
        sparse = first[zero_masks(self.factors, first, self.tolerance).sum(dim=1) >= self.min_zeros]
        centres = torch.cat([known, sparse])[: MAX_ROUND_INITIALIZATIONS // self.ring_starts]
        estimates = [first]
        if centres.shape[0] and not self.deadline.expired():
            starts, classes = self._ring_starts(centres)
            estimates.append(self._search(starts, classes, torch.cat([repel, sparse])))
        estimate = torch.cat(estimates)
        if self.noisy:
            return estimate
        # the kernel of the b - 1 smallest rows is exact only when those rows have rank b - 1;
        # with non-negative inputs many neurons are active for few samples, their rows span
        # little, and that kernel lands anywhere, while a converged estimate is already exact
        # to float precision: keep both, the pool refines on all zeros and deduplicates
        m = left.shape[0]
        rounded = map_rows(
            lambda chunk: kernel_of_smallest(self.factors, chunk, rows=b - 1),
            estimate,
            seconds_per_row=matmul_seconds(2.0 * m * b) + elementwise_seconds(2.0 * m) + qr_seconds(b),
            deadline=self.deadline,
        )
        return torch.cat([estimate, rounded])

    def classify(self, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The class and orientation (``+-1``) whose signs each ``(f, b)`` direction contradicts least.

        Contradiction is the l1 mass of the unit column's entries against the class's signs.
        """
        columns = directions @ self.factors.left.T
        columns = columns / columns.norm(dim=1, keepdim=True).clamp_min(1e-300)
        positive, negative = columns.clamp_min(0), (-columns).clamp_min(0)
        plus, minus = (self.prior.signs > 0).to(columns.dtype), (self.prior.signs < 0).to(columns.dtype)
        against_as_is = negative @ plus.T + positive @ minus.T  # (f, c)
        against_flipped = positive @ plus.T + negative @ minus.T
        flip = against_flipped < against_as_is
        against = torch.where(flip, against_flipped, against_as_is)
        classes = against.argmin(dim=1)
        orientation = torch.where(flip.gather(1, classes[:, None]).squeeze(1), -1.0, 1.0).to(directions.dtype)
        return classes, orientation

    def _ring_starts(self, centres: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ring_starts`` starts at cosine ``ring_cos`` around each centre, with the centre's class.

        A class's samples with the most active neurons have the smallest basins; they lie at
        cosines 0.65-0.85 of their classmates on raw MNIST, just outside the repelled cap, so
        starts on a ring around a found classmate fall into them.
        """
        classes, orientation = self.classify(centres)
        unit = centres * orientation[:, None]
        unit = unit / unit.norm(dim=1, keepdim=True)
        unit = unit.repeat_interleave(self.ring_starts, dim=0)
        draws = random_directions(unit.shape[0], unit.shape[1], generator=self.generator, device=unit.device)
        across = draws - (draws * unit).sum(dim=1, keepdim=True) * unit
        across = across / across.norm(dim=1, keepdim=True).clamp_min(1e-30)
        starts = self.ring_cos * unit + math.sqrt(1.0 - self.ring_cos**2) * across
        return starts, classes.repeat_interleave(self.ring_starts)

    def _search(self, starts: torch.Tensor, classes: torch.Tensor, repel: torch.Tensor) -> torch.Tensor:
        """One sign-aware search: least-squares polished unit directions of its minima.

        Both the optimization and the polish stop at the deadline; the result then holds the
        polished minima of a prefix of ``starts``.
        """
        left = self.factors.left
        m, b = left.shape
        left_fast = left.to(self.dtype)
        away = repel.to(self.dtype) if repel.shape[0] else None

        def optimize(indices: torch.Tensor) -> torch.Tensor:
            # one surrogate per chunk of starts: its sign rows must match the points optimized
            surrogate = sign_aware_l1(
                self.prior.signs[classes[indices]].to(self.dtype),
                left=left_fast,
                repel=away,
                repel_cos=self.repel_cos,
                repel_weight=self.repel_weight,
            )
            return optimize_on_sphere(
                left_fast,
                starts[indices].to(self.dtype),
                surrogate=surrogate,
                schedule=self.schedule,
                deadline=self.deadline,
            ).to(torch.float64)

        step_seconds = matmul_seconds(4.0 * m * b) + elementwise_seconds(2.0 * m)
        if away is not None:
            step_seconds += matmul_seconds(4.0 * b * (m + away.shape[0]))
        minima = map_rows(
            optimize,
            torch.arange(starts.shape[0], device=left.device),
            seconds_per_row=self.schedule.steps * step_seconds,
            deadline=self.deadline,
        )
        self.searches += 1
        self.initializations += int(minima.shape[0])
        rows = min(m, max(b - 1, int(self.polish_fraction * m)))
        return map_rows(
            lambda chunk: least_squares_kernel(self.factors, chunk, rows=rows),
            minima,
            seconds_per_row=matmul_seconds(2.0 * m * b + 2.0 * rows * b * b)
            + elementwise_seconds(2.0 * m)
            + eigh_seconds(b),
            deadline=self.deadline,
        )


def interleave_head_rounds(
    base: Iterator[torch.Tensor],
    head: HeadRounds,
    *,
    pool: CandidatePool,
    patience: int = HEAD_PATIENCE,
) -> Iterator[torch.Tensor]:
    """Yield head proposals first, then alternate with the ``base`` proposal rounds.

    Head proposals stop after ``patience`` consecutive calls that grew ``pool`` (to which the
    caller adds each yielded batch) by nothing: the prior does not fit this update, or its
    classes are exhausted. The base rounds go on until they stop themselves.
    """
    idle = 0
    while True:
        if idle < patience:
            before = len(pool)
            yield head.propose(pool.directions, avoid=pool.mixtures)
            idle = 0 if len(pool) > before else idle + 1
        try:
            yield next(base)
        except StopIteration:
            return
