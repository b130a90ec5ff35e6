"""SPEAR++ (search on the sphere) and SPEAR (sampling): the proposal sources of the exact attack.

Both share :class:`fl_attack.attacks.spear.GradientInversionAttack` (decompose -> search ->
select -> scale); they differ only in how candidate directions are proposed. Both propose in
chunks that stop at the attack's deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fl_attack.attacks.spear import GradientInversionAttack, SearchState
from fl_attack.pipeline.budget.deadline import map_rows, qr_seconds
from fl_attack.pipeline.noise.one_at_a_time import round_plan, uses_trusted_selection
from fl_attack.pipeline.search.aimed_rounds import AimedRound, aimed_round, exact_found, ordinary_lr
from fl_attack.pipeline.search.sparsity import round_minima
from fl_attack.pipeline.search.sphere import (
    OPTIMIZERS,
    SettledPruning,
    SphereSchedule,
    get_surrogate,
    optimize_on_sphere,
    random_directions,
    sampling_rounding,
    sparse_minima,
)

#: Batches from this size on save search work where it is costly: points that settle next to an
#: exact direction or next to each other stop early (:class:`fl_attack.pipeline.search.sphere.SettledPruning`),
#: and only the minima with enough vanishing entries are rounded
#: (:func:`fl_attack.pipeline.search.sphere.sparse_minima`): at b = 400 rounding 300 minima took 25 s,
#: longer than optimizing them, and 262 of them were spurious. Smaller batches keep every point:
#: on 10 look-alike face patches at m = 200, stopping points that were within |cos| 0.999 of each
#: other at step 250 left the first round without a complete selection (main completes there).
LARGE_BATCH = 50

#: Starts of a round deflated past certified samples: at most ``b / 2``, at least this many. At
#: (400, 4000) on CIFAR-10 rounds of 200 certified 5-10 new samples each while 350-400 were
#: missing, and 30-70 each once fewer than 250 were (fl_attack.pipeline.side_information.next_layer).
MIN_DEFLATED_STARTS = 64


class SpearPlusPlus(GradientInversionAttack):
    """SPEAR++: sparse directions by dictionary learning on the sphere.

    Thousands of random initializations are optimized at once on the sphere; their minima
    are rounded to exact kernels of ``b - 1`` rows, filtered and selected. Restarts draw new
    initializations from the orthogonal complement of the directions already found until
    ``b`` directions are selected with full sparsity matching, or the budget is spent.

    Parameters
    ----------
    surrogate
        ``"l1"`` (default, no rounding needed), ``"logcosh"`` or ``"neg_l4"`` (both rounded by
        sampling, SPEAR++ Sec. 4.4).
    optimizer
        ``"radam"`` (Riemannian Adam, geoopt) or ``"pgd"`` (projected subgradient descent).
    initializations
        Initializations optimized together per round; ``None`` scales with the batch size.
    max_initializations
        Total initialization budget over all rounds; ``None`` means only the time budget applies.
    schedule
        Steps and learning-rate decay of the optimization; when given, its ``lr`` is used in
        every round instead of ``learning_rates``.
    learning_rates
        Initial learning rates cycled over rounds. Large steps (Riemannian Adam at 0.5-2 on
        the unit sphere) escape the shallow spurious minima that trap small ones at
        ``m / b ~ 10``; small ones reach the narrow basins of a crowded ``m / b ~ 7``.
    complement_fraction
        Fraction of the initializations of later rounds drawn orthogonally to found directions.
    polish_fraction
        Fraction of neurons whose rows define the least-squares kernel that precedes exact
        rounding of ``l1`` minima.
    rounding_samples, rounding_pool
        For smooth surrogates: proposals per minimum and the fraction of smallest entries
        they are sampled from.
    **kwargs
        See :class:`GradientInversionAttack`.
    """

    name = "spear++"

    def __init__(
        self,
        *,
        surrogate: str = "l1",
        optimizer: str = "radam",
        initializations: int | None = None,
        max_initializations: int | None = None,
        schedule: SphereSchedule | None = None,
        learning_rates: tuple[float, ...] = (0.5, 2.0, 0.15),
        complement_fraction: float = 0.5,
        polish_fraction: float = 0.3,
        rounding_samples: int = 4,
        rounding_pool: float = 0.4,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.surrogate = get_surrogate(surrogate)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; available: {list(OPTIMIZERS)}")
        if initializations is not None and initializations < 1:
            raise ValueError(f"initializations must be >= 1, got {initializations}")
        if not 0 <= complement_fraction <= 1:
            raise ValueError(f"complement_fraction must be in [0, 1], got {complement_fraction}")
        self.optimizer = optimizer
        self.initializations = initializations
        self.max_initializations = max_initializations
        self.schedule = schedule
        if not learning_rates or min(learning_rates) <= 0:
            raise ValueError(f"learning_rates must be positive, got {learning_rates}")
        self.learning_rates = tuple(learning_rates)
        self.polish_fraction = polish_fraction
        self.complement_fraction = complement_fraction
        self.rounding_samples = rounding_samples
        self.rounding_pool = rounding_pool
        self.dtype = dtype

    def _initializations_per_round(self, b: int, m: int) -> int:
        if self.initializations is not None:
            return self.initializations
        # one optimization step costs ~ 4 k m b flops; larger layers take fewer initializations
        return int(max(256, min(32 * b, 4096, 1.5e9 // (m * b))))

    def _proposals(self, state: SearchState) -> Iterator[torch.Tensor]:
        left = state.factors.left
        m, b = left.shape
        per_round = self._initializations_per_round(b, m)
        left_fast = left.to(self.dtype)
        used = 0
        rounds = 0
        stalled_at = -1  # exact directions known when the last aimed round began
        large = b >= LARGE_BATCH
        while self.max_initializations is None or used < self.max_initializations:
            count = (
                per_round
                if self.max_initializations is None
                else min(per_round, self.max_initializations - used)
            )
            # past the samples the next layer certified (fl_attack.pipeline.side_information.next_layer); None: everywhere
            space = None if state.deflation is None else state.deflation.space(deadline=state.deadline)
            if space is not None and space.shape[1] == 0:
                return  # every sample is certified
            found: torch.Tensor | None = state.pool.directions
            n_complement = int(count * self.complement_fraction) if len(state.pool) else 0
            lr = self.learning_rates[rounds % len(self.learning_rates)]
            if not state.noisy:
                lr = ordinary_lr(self.learning_rates, rounds_done=rounds, width=m, batch_size=b)
            if uses_trusted_selection(noisy=state.noisy, width=m, batch_size=b):
                # heavy noise on a wide layer: aim past the trusted directions (fl_attack.pipeline.noise.one_at_a_time)
                planned, found = round_plan(per_round, rounds_done=rounds, latest=state.latest)
                count = min(count, planned)
                n_complement = count if found is not None else 0
            elif space is not None:  # smaller, more frequent rounds
                count, n_complement = min(count, max(MIN_DEFLATED_STARTS, b // 2)), 0
            elif (aimed := self._aimed_round(state, per_round, rounds, stalled_at)) is not None:
                # clean: aim past the exact directions (fl_attack.pipeline.search.aimed_rounds)
                count = n_complement = min(count, aimed.starts)
                found, lr = aimed.avoid, aimed.lr
                stalled_at = int(found.shape[0])
                state.stats["aimed_rounds"] = state.stats.get("aimed_rounds", 0) + 1
            size = b if space is None else space.shape[1]
            inits = [
                random_directions(
                    count - n_complement,
                    size,
                    generator=state.generator,
                    dtype=self.dtype,
                    device=left.device,
                )
            ]
            if n_complement:
                inits.append(
                    random_directions(
                        n_complement,
                        b,
                        generator=state.generator,
                        avoid=found,
                        dtype=self.dtype,
                        device=left.device,
                    )
                )
            schedule = self.schedule or SphereSchedule(lr=lr)
            rounds += 1
            known = self._exact(state) if space is None else left.new_zeros(0, size)
            minima = optimize_on_sphere(
                left_fast if space is None else left_fast @ space.to(self.dtype),
                torch.cat(inits),
                surrogate=self.surrogate,
                optimizer=self.optimizer,
                schedule=schedule,
                deadline=state.deadline,
                prune=SettledPruning(known=known) if large and not state.noisy else None,
            ).to(torch.float64)
            if space is not None:
                minima = minima @ space.T  # back to the full space, where the rounding is exact
            used += count
            state.stats["initializations"] = used
            if state.deadline.expired():
                return  # no time left to round the minima
            if self.surrogate.needs_rounding:
                rounded = sampling_rounding(
                    left,
                    minima,
                    pool_fraction=self.rounding_pool,
                    samples=self.rounding_samples,
                    generator=state.generator,
                    deadline=state.deadline,
                )
            else:
                rows = min(m, max(b - 1, int(self.polish_fraction * m)))
                if large and not state.noisy:
                    # round only minima sparse enough to be pool candidates (fl_attack.pipeline.search.sphere)
                    minima = sparse_minima(left_fast, minima, min_small=state.pool.weak_min_zeros)
                # without exact zeros, rounding to b - 1 rows would only amplify the noise
                rounded = round_minima(
                    state.factors, minima, rows=rows, exact=not state.noisy, deadline=state.deadline
                )
            if state.deflation is not None:
                state.deflation.hold(rounded)  # certified only if the search goes on
            yield rounded
            if state.deadline.expired():
                return

    def _exact(self, state: SearchState) -> torch.Tensor:
        """The exact directions of the latest clean selection (:func:`exact_found`)."""
        return exact_found(state.latest, state.pool.directions, accept_matching=self.accept_matching)

    def _aimed_round(
        self, state: SearchState, per_round: int, rounds: int, stalled_at: int
    ) -> AimedRound | None:
        """A clean round aimed past the exact directions, unless the last aimed round began with
        as many exact directions as there are now (it found nothing new: then an ordinary round)."""
        if state.noisy:
            return None
        aimed = aimed_round(
            per_round,
            rounds_done=rounds,
            latest=state.latest,
            pool_directions=state.pool.directions,
            accept_matching=self.accept_matching,
            lr=min(self.learning_rates) if self.schedule is None else self.schedule.lr,
        )
        if aimed is None or int(aimed.avoid.shape[0]) == stalled_at:
            return None
        return aimed


class Spear(GradientInversionAttack):
    """SPEAR: directions as kernels of randomly sampled ``(b-1)``-row submatrices.

    Its expected cost grows like ``2^b``: use it for small batches (``b <= 20``) or as a
    reference for SPEAR++.

    Parameters
    ----------
    samples_per_batch
        Submatrices whose kernels are computed together in one batched QR.
    max_samples
        Total sampling budget; ``None`` means only the time budget applies.
    **kwargs
        See :class:`GradientInversionAttack`.
    """

    name = "spear"

    def __init__(
        self, *, samples_per_batch: int = 4096, max_samples: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if samples_per_batch < 1:
            raise ValueError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
        self.samples_per_batch = samples_per_batch
        self.max_samples = max_samples

    def _proposals(self, state: SearchState) -> Iterator[torch.Tensor]:
        left = state.factors.left
        m, b = left.shape
        used = 0
        while self.max_samples is None or used < self.max_samples:
            count = (
                self.samples_per_batch
                if self.max_samples is None
                else min(self.samples_per_batch, self.max_samples - used)
            )
            keys = torch.rand(count, m, generator=state.generator, dtype=torch.float64)
            rows = torch.argsort(keys, dim=1)[:, : b - 1].to(left.device)
            used += count
            state.stats["samples"] = used
            yield map_rows(
                _kernel_of_rows(left), rows, seconds_per_row=qr_seconds(b), deadline=state.deadline
            )
            if state.deadline.expired():
                return


def _kernel_of_rows(left: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """For ``(k, b - 1)`` row indices, the kernels of those rows of ``left`` (SPEAR Thm. 3.3)."""

    def kernels(rows: torch.Tensor) -> torch.Tensor:
        q, _ = torch.linalg.qr(left[rows].transpose(1, 2), mode="complete")
        return q[:, :, -1]

    return kernels
