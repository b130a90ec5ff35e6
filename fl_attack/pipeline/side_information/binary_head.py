"""Two-valued proposals for a layer that feeds a two-class output layer.

With one hidden layer and ``c = 2`` classes, sample ``i``'s column of the attacked layer's output
gradient is

    dL/dz_i = relu'(z_i) * (W2^T (p_i - e_{y_i})) / B = a_i * (mask_i * v),   v = W2[0] - W2[1],

because ``p_i - e_{y_i} = (p_i0 - y_i0) * (1, -1)`` for two classes: a known vector ``v`` (the
global head the server sent) masked by the sample's ReLU pattern and scaled by one number
``a_i`` (its sign is the class). Every true direction ``q_i`` of the low-rank factor ``left``
therefore makes ``(left @ q_i) / v`` take exactly two values, ``{0, a_i}``, while a mixture of
two samples takes three or four (``{0, a_i, a_k, a_i + a_k}``) even when their ReLU patterns
differ on few neurons. This holds for any input distribution; on one-hot tabular rows (UCI
Adult), whose patterns are close to each other, differences of two samples are sparser than
either sample, so the l1 and sign-guided searches converge to mixtures, and with two classes
the sign prior cannot reject a (+class 0, -class 1) mixture.

The search here looks for two-valued vectors in the span of ``left``: alternating projection
from random starts (snap ``left @ q`` to ``{0, c v}`` neuron by neuron, fit the scale ``c`` by
least squares, project the snapped vector back onto the span, until the snapped support stops
changing). Each step costs ``O(m b)`` per start. Fixed points whose relative residual is at the
noise level are two-valued (on Adult at (20, 200): below 1e-6 for every true direction, above
0.13 for every fixed point that is not two-valued). Masks found so far deflate the later rounds:
the snap is applied after removing the best combination of a random share of the known masks,
so a start drawn towards a mixture with a known sample still reaches the unknown one.

Two-valued is not a certificate of a sample: a binary combination of masks in the span, such
as ``m_k + m_i - m_j`` where ``m_i`` and ``m_j`` differ only where ``m_k`` is 0, is two-valued
too (one of 8 Adult batches at (20, 200) had one). Such a vector and ``m_k`` stand in for each
other, so the known masks are also closed under these combinations (which recovers ``m_k``
once the impostor and ``m_i``, ``m_j`` are known), and every two-valued vector is only a
proposal: the attack's candidate pool refines and filters it, the selection chooses ``b`` of
them, and the self-check decides whether the result is complete.

Measured (Adult, one hidden layer, (20, 200), 8 batches, 500 starts a round): every sample
found in 4-8 rounds on 7 batches (0.6-1.5 s on one core of a loaded machine), 19 of 20 in 11
rounds on the last, whose missing direction the attack's scan for the last directions found.
A head that does not fit the update (another loss, several local steps) costs
:data:`ROUND_PATIENCE` rounds, never exactness.

Only ``c = 2`` has this structure. For ``c > 2`` a column is ``mask_i * (W2^T g_i)`` with
``g_i`` in a ``(c - 1)``-dimensional space and unknown per sample, so its non-zero entries do
not share one value: :class:`BinaryHead` is built for two-class heads only, and wider heads
keep the sign-guided search of :mod:`fl_attack.pipeline.side_information.output_layer`. The same alternation
would extend to them (fit ``mask * (U alpha)`` with ``U`` the ``(m, c - 1)`` range of the head
and ``alpha`` per start: a small eigenproblem per start and step) but is not built: with more
than two classes the class signs already tell mixtures apart (CIFAR-10 and raw MNIST at
(20, 200): 10 of 10 batches exact), while with two they cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.pipeline.budget.budget import Deadline
from fl_attack.pipeline.budget.deadline import elementwise_seconds, map_rows, matmul_seconds
from fl_attack.pipeline.search.sparsity import deduplicate, normalize_columns
from fl_attack.pipeline.search.sphere import random_directions
from fl_attack.pipeline.spectrum.decompose import LowRankFactors

#: Neurons where ``|v|`` is below this fraction of its root mean square are left free: a snap
#: there is decided by rounding noise, and a wrong one would hold a fixed point off its sample.
SURE_FRACTION = 0.05

#: A fixed point is two-valued when its relative residual is below this many times the relative
#: noise of the gradient, and never above :data:`MAX_RESIDUAL`. Float32 gradients (relative noise
#: ~2e-6): true directions 4e-8 to 7e-7, every other fixed point above 0.13.
RESIDUAL_PER_NOISE = 100.0
MIN_RESIDUAL = 1e-6
MAX_RESIDUAL = 0.05

#: Random starts per round are ``max(MIN_STARTS, STARTS_PER_SAMPLE * b)``.
MIN_STARTS = 256
STARTS_PER_SAMPLE = 25

#: Alternating-projection steps per start (Adult at (20, 200): fixed points after 15-30).
MAX_STEPS = 60

#: Each round deflates by a random share of the known masks (see :meth:`BinaryHead.iterate`).
DEFLATION_SHARE = 0.75

#: :meth:`BinaryHead._close_under_combinations` runs while its ``f^3 m'`` entries (f known masks)
#: stay below this: 32 MB of float64, f = 25 at m' = 200 (larger batches are not closed).
MAX_COMBINATION_ENTRIES = 4e6

#: One :meth:`BinaryHead.propose` stops after this many rounds in a row found no new mask.
ROUND_PATIENCE = 4


@dataclass(frozen=True)
class FixedPoints:
    """Where alternating projection ended, for ``k`` starts.

    Attributes
    ----------
    directions
        ``(k, b)`` least-squares directions of the snapped masks.
    masks
        ``(k, m')`` boolean snapped supports.
    residuals
        ``(k,)`` relative residual of ``left @ direction`` against ``v * mask`` on the sure
        neurons (``inf`` for an empty mask).
    """

    directions: torch.Tensor
    masks: torch.Tensor
    residuals: torch.Tensor


class BinaryHead:
    """Rounds of two-valued proposals for one attack, in the coordinates of its low-rank factors.

    Parameters
    ----------
    factors
        Low-rank factors restricted to the informative rows (``left`` is ``(m', b)``).
    difference
        ``(m',)`` ``W2[0] - W2[1]`` of the two-class output layer, on the same rows.
    relative_noise
        The gradient's relative noise ``s_{b+1}/s_b``: sets the residual a fixed point may have.
    generator
        The attack's random generator.
    deadline
        Deadline after which no round starts; a running round stops within
        one chunk of work (:mod:`fl_attack.pipeline.budget.deadline`).
    starts
        Random starts per round; None: ``max(MIN_STARTS, STARTS_PER_SAMPLE * b)``.

    Raises
    ------
    ValueError
        If ``difference`` does not match the rows of ``factors`` or is not finite. A difference
        usable on ``b`` neurons or fewer is accepted, and :meth:`propose` then proposes nothing.
    """

    def __init__(
        self,
        factors: LowRankFactors,
        difference: torch.Tensor,
        *,
        relative_noise: float,
        generator: torch.Generator,
        deadline: Deadline = Deadline.never(),
        starts: int | None = None,
    ) -> None:
        left = factors.left
        m, b = left.shape
        if difference.dim() != 1 or difference.shape[0] != m:
            raise ValueError(
                f"difference must be an ({m},) vector on the factors' rows, got shape {tuple(difference.shape)}"
            )
        if not bool(torch.isfinite(difference).all()):
            raise ValueError("difference contains NaN or Inf entries")
        if not relative_noise >= 0:
            raise ValueError(f"relative_noise must be >= 0, got {relative_noise}")
        if starts is not None and starts < 1:
            raise ValueError(f"starts must be >= 1, got {starts}")
        self.left = left
        self.difference = difference.to(left)
        rms = float(self.difference.square().mean().sqrt())
        self.sure = (self.difference.abs() >= SURE_FRACTION * rms) & (self.difference != 0)
        self.sure_left, self.sure_difference = left[self.sure].contiguous(), self.difference[self.sure]
        sure_left = self.sure_left
        # least squares onto the span over the sure rows: q = solve(L_S^T L_S, L_S^T target_S);
        # with b or fewer sure rows (a head that is almost constant) there is nothing to pin
        self.usable = int(self.sure.sum()) > b
        gram = sure_left.T @ sure_left if self.usable else torch.eye(b, dtype=left.dtype, device=left.device)
        self.projector = torch.linalg.solve(gram, sure_left.T)  # (b, m_sure)
        self.limit = min(MAX_RESIDUAL, max(MIN_RESIDUAL, RESIDUAL_PER_NOISE * relative_noise))
        self.generator = generator
        self.deadline = deadline
        self.starts = starts if starts is not None else max(MIN_STARTS, STARTS_PER_SAMPLE * b)
        self.known = left.new_zeros(0, b)
        self.known_columns = left.new_zeros(int(self.sure.sum()), 0)
        self.deflation = self.known_columns
        self.deflation_inverse = left.new_zeros(0, 0)
        self.rounds = 0
        self.started = 0
        self.exhausted = False

    @property
    def batch_size(self) -> int:
        return int(self.left.shape[1])

    def stats(self) -> dict[str, int]:
        """Rounds run, starts iterated and two-valued directions found, for the attack's stats."""
        return {
            "binary_rounds": self.rounds,
            "binary_starts": self.started,
            "binary_directions": int(self.known.shape[0]),
        }

    def propose(self, known: torch.Tensor, *, avoid: torch.Tensor | None = None) -> torch.Tensor:
        """``(k, b)`` float64 two-valued directions not found by earlier calls.

        The first round also starts from ``known`` and ``avoid`` (the pool's directions and
        mixtures): a true one not found here yet is a fixed point at once and deflates the
        rounds after it. Rounds
        run until :data:`ROUND_PATIENCE` rounds in a row (one, once ``b`` are known) found no new
        two-valued direction, or the deadline passes.
        """
        b = self.batch_size
        before = self.known.shape[0]
        if not self.usable:
            return self.known[before:]
        extra = [known.to(self.left)] + ([avoid.to(self.left)] if avoid is not None else [])
        idle = 0
        # b two-valued directions need not be b samples (a binary combination of masks is
        # two-valued too): go on past b, by one idle round only
        while idle < (ROUND_PATIENCE if self.known.shape[0] < b else 1) and not self.deadline.expired():
            # half the starts avoid the known directions: their columns are orthogonal to the known
            # masks, a mixture of the unknown ones only (once b - 1 are known, the last one's basin)
            device = self.left.device
            half = self.starts // 2
            starts = torch.cat(
                [
                    random_directions(self.starts - half, b, generator=self.generator, device=device),
                    random_directions(half, b, generator=self.generator, avoid=self.known, device=device),
                ]
            )
            if extra:
                starts, extra = torch.cat([*extra, starts]), []
            points = self.iterate(starts)
            self.rounds += 1
            self.started += int(points.directions.shape[0])
            if self._remember(points.directions, points.masks, points.residuals <= self.limit):
                idle = 0
                self._close_under_combinations()
            else:
                idle += 1
        self.exhausted = self.known.shape[0] == before
        return self.known[before:]

    def iterate(self, starts: torch.Tensor) -> FixedPoints:
        """Alternating projection from ``(k, b)`` starts, deflated by the masks found so far.

        Runs in chunks of starts until the deadline: the result covers a prefix of ``starts``.
        """
        m, b = self.left.shape
        # deflate by a random part of the known masks: a binary combination of known masks
        # with an unknown one (e.g. m_k + m_i - m_j when m_i and m_j differ where m_k is 0)
        # is two-valued too, and would hide m_k from every round deflated by all of them
        chosen = torch.rand(self.known_columns.shape[1], generator=self.generator) < DEFLATION_SHARE
        self.deflation = self.known_columns[:, chosen.to(self.left.device)]
        # pseudo-inverse: an impostor and the masks it combines are linearly dependent
        self.deflation_inverse = torch.linalg.pinv(self.deflation.T @ self.deflation, hermitian=True)
        f = self.deflation.shape[1]
        seconds = MAX_STEPS * (matmul_seconds(4.0 * m * b + 6.0 * m * f) + elementwise_seconds(8.0 * m))
        masks = map_rows(
            self._converged_masks, starts.to(self.left), seconds_per_row=seconds, deadline=self.deadline
        )
        return self._fixed_points(masks)

    def _converged_masks(self, q: torch.Tensor) -> torch.Tensor:
        """The 0/1 supports at which one chunk of starts stops changing (the last one after
        :data:`MAX_STEPS`); converged starts leave the iteration."""
        v, left = self.sure_difference, self.sure_left
        y = q @ left.T
        # the scale starts as the mean of the side (positive or negative) holding more energy
        positive = (y * v > 0).to(y.dtype)
        energy = y * y
        larger = (energy * positive).sum(dim=1) >= (energy * (1.0 - positive)).sum(dim=1)
        scale, beta = self._fit(y, torch.where(larger[:, None], positive, 1.0 - positive))
        mask = self._snap(y, scale, beta)
        result = mask.clone()
        live = torch.arange(q.shape[0], device=q.device)
        for _ in range(MAX_STEPS):
            scale, beta = self._fit(y, mask)
            y = ((mask * v * scale[:, None] + beta @ self.deflation.T) @ self.projector.T) @ left.T
            snapped = self._snap(y, scale, beta)
            moving = (snapped != mask).any(dim=1)
            result[live] = snapped
            live, y, mask = live[moving], y[moving], snapped[moving]
            if live.numel() == 0:
                break
        return result

    def _snap(self, y: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """``(k, m_sure)`` 0/1 supports: where ``y`` minus the known masks is nearer ``scale * v`` than 0."""
        rest = y - beta @ self.deflation.T
        return ((rest - scale[:, None] * self.sure_difference).abs() < rest.abs()).to(y.dtype)

    def _fit(self, y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Least-squares ``scale`` and known-mask weights ``beta`` of ``y ~ scale v mask + K beta``.

        The known columns ``K`` are fixed, so the normal equations are solved by their Schur
        complement: one ``(f, f)`` pseudo-inverse for all starts.
        """
        column = mask * self.sure_difference
        along, energy = (column * y).sum(dim=1), (column * column).sum(dim=1)
        known = self.deflation
        if known.shape[1] == 0:
            return along / energy.clamp_min(1e-300), y.new_zeros(y.shape[0], 0)
        cross, onto = column @ known, y @ known
        weighted = cross @ self.deflation_inverse
        shrunk = (energy - (weighted * cross).sum(dim=1)).clamp_min(1e-300)
        scale = (along - (weighted * onto).sum(dim=1)) / shrunk
        return scale, (onto - scale[:, None] * cross) @ self.deflation_inverse

    def _fixed_points(self, masks: torch.Tensor) -> FixedPoints:
        """Least-squares directions of the 0/1 ``masks`` and their relative residuals."""
        target = masks * self.sure_difference
        directions = target @ self.projector.T
        error = (directions @ self.sure_left.T - target).norm(dim=1)
        size = target.norm(dim=1)
        residuals = torch.where(size > 0, error / size.clamp_min(1e-300), torch.full_like(size, math.inf))
        return FixedPoints(directions=normalize_columns(directions), masks=masks > 0.5, residuals=residuals)

    def _remember(self, directions: torch.Tensor, masks: torch.Tensor, good: torch.Tensor) -> bool:
        """Add the ``good`` two-valued directions (and their masks) not known yet; whether any was new."""
        if not bool(good.any()):
            return False
        before = self.known.shape[0]
        merged = torch.cat([self.known, directions[good]])
        columns = torch.cat([self.known_columns.T, masks[good].to(self.left.dtype) * self.sure_difference])
        kept = deduplicate(merged, cos_tolerance=1e-6)
        kept = kept[kept >= before]
        self.known = torch.cat([self.known, merged[kept]])
        self.known_columns = torch.cat([self.known_columns.T, columns[kept]]).T.contiguous()
        return kept.numel() > 0

    def _close_under_combinations(self) -> None:
        """Add the binary masks ``m_i - m_j`` and ``m_i + m_k - m_j`` of known masks ``m``.

        They lie in the span, as every combination of known masks does; when one known mask is
        such a combination involving a sample not found yet, that sample's mask is one too.
        """
        masks = (self.known_columns.T != 0).to(self.left.dtype)  # (f, m_sure)
        f, m = masks.shape
        if f < 2 or f**3 * m > MAX_COMBINATION_ENTRIES:
            return
        pairs = (masks[:, None, :] - masks[None, :, :]).reshape(f * f, m)
        sums = (masks[:, None, :] + masks[None, :, :]).reshape(f * f, m)
        triples = (sums[:, None, :] - masks[None, :, :]).reshape(f * f * f, m)
        found = torch.cat([pairs, triples])
        binary = ((found == 0) | (found == 1)).all(dim=1) & (found.sum(dim=1) > 0)
        if bool(binary.any()):
            points = self._fixed_points(found[binary])
            self._remember(points.directions, points.masks, points.residuals <= self.limit)
