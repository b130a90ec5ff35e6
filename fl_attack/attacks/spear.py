"""SPEAR and SPEAR++: exact recovery of a batch from a linear+ReLU layer's gradient."""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fl_attack.attacks.base import LayerAttackBase
from fl_attack.pipeline.budget.budget import Budget, Deadline
from fl_attack.pipeline.budget.out_of_time import decompose_in_time
from fl_attack.pipeline.local_training.drift import drift_self_check, polish_for, scorer_for
from fl_attack.pipeline.local_training.drift_proposals import interleave_drift_rounds
from fl_attack.pipeline.local_training.epoch_last_directions import epoch_last_directions
from fl_attack.pipeline.local_training.epoch_scorer import LocalEpochScorer, epoch_fit_for
from fl_attack.pipeline.local_training.weight_decay import (
    refined_scale,
    remove_weight_decay,
    weight_decay_scale,
)
from fl_attack.pipeline.noise.one_at_a_time import finish_noisy, trusted_selection, uses_trusted_selection
from fl_attack.pipeline.search.candidates import (
    CandidatePool,
    duplicate_cos_tolerance,
    informative_rows,
    rows_not_in,
)
from fl_attack.pipeline.search.progress import report_selection
from fl_attack.pipeline.search.sparsity import ZeroTolerance, min_sparsity
from fl_attack.pipeline.selection.near_duplicates import split_blends, twin_self_check
from fl_attack.pipeline.selection.pixel_grid import PixelGrid, pixel_grid
from fl_attack.pipeline.selection.precision import precision_stats
from fl_attack.pipeline.selection.select import (
    Selection,
    SparsityMatchingScorer,
    better_selection,
    finishing_seconds,
    select,
)
from fl_attack.pipeline.selection.self_check import pixel_grid_self_check, self_check
from fl_attack.pipeline.side_information.background_rows import background_rows, background_value
from fl_attack.pipeline.side_information.input_cone import InputSideSlot
from fl_attack.pipeline.side_information.input_rounds import interleave_input_side
from fl_attack.pipeline.side_information.missing_samples import (
    missing_direction_proposals,
    trusted_directions,
)
from fl_attack.pipeline.side_information.next_layer import (
    Deflation,
    confirm_weak_rows,
    deflation_for,
    next_layer_update,
    with_certified_rows,
)
from fl_attack.pipeline.side_information.output_layer import HeadPrior, HeadRounds, interleave_head_rounds
from fl_attack.pipeline.side_information.pixel_lattice import (
    MAX_LATTICE_BATCH,
    ClientUpdate,
    ImageLattice,
    find_lattice,
    grid_lattice,
    lattice_batch,
    left_out_rows,
)
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, noise_std, weakest_sample_margins
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ArrayLike, LayerUpdate, ObservedUpdate, resolve_device
from fl_attack.validation import check_batch_size, check_local_steps, check_time_budget

logger = logging.getLogger(__name__)

#: Above this relative noise ``s_{b+1}/s_b`` the gradient is treated as noisy (DP noise):
#: exact zeros no longer exist, directions are estimated by least squares,
#: and the search stops when the sparsity matching stops improving.
NOISY_ABOVE = 1e-3

#: Above this relative noise a clean-looking update is checked for weight decay's ``beta W_0``
#: (:mod:`fl_attack.pipeline.local_training.weight_decay`): float32 rounding alone leaves 1e-7 to 2e-5; lr 0.01
#: with weight decay 5e-4 left 5e-4, which the self-check would take for rows exact to 5e-4...
DECAY_CHECK_ABOVE = 1e-5
#: ... and it is removed when that leaves at most this fraction of the relative noise,
DECAY_GAIN = 0.1
#: after this many least-squares corrections of its scale (near-duplicate samples put their
#: eigenvalues next to it: 2e-5 relative error, rows off by 4e-4, before one correction).
DECAY_REFINEMENTS = 2

#: On a noisy gradient, b directions are reported as a complete reconstruction only when their
#: mean sparsity matching reaches this; chance is ~0.5. Measured under DP noise: 0.49-0.62 gave
#: inputs below 13 dB (CIFAR-10 (20, 200) at 2x median, (150, 4000) at 0.5x, photo patches
#: (16, 200) at 2x), 0.72 gave 16 dB, 0.76-0.81 gave 20-27 dB (CIFAR-10 (20, 200) at
#: 0.5-1x); every batch above 25 dB matched >= 0.78.
NOISY_COMPLETE_MATCHING = 0.75

#: A complete clean selection matching at least this well everywhere is kept once restarts stop improving it.
SETTLED_MATCHING = 0.9

#: Share of the search's remaining time the input side shifted by a shared background may take, once.
BACKGROUND_SHARE = 0.25

#: Share of the search's remaining time that finding the pixel lattice may take (once).
LATTICE_SHARE = 0.25

#: Share of the search's remaining time one clean selection's greedy swaps may take. Swaps among
#: weak candidates alone once took 57 of 60 s (MNIST, ten local epochs at lr 0.05), leaving the
#: background rows and the pixel lattice, which then found the batch in 3 s, no time to run.
SWAP_SHARE = 0.25


@dataclass
class SearchState:
    """Mutable bookkeeping of one ``invert`` call."""

    factors: LowRankFactors
    pool: CandidatePool
    generator: torch.Generator
    deadline: Deadline
    stats: dict[str, Any]
    active: torch.Tensor
    noisy: bool
    finish_by: Deadline = Deadline.never()
    head: HeadPrior | None = None
    incumbent: torch.Tensor | None = None  # the best complete selection's directions so far
    input_side: InputSideSlot | None = None  # set by the input-side rounds where they run
    latest: Selection | None = None  # the best selection so far (read by the drift rounds)
    deflation: Deflation | None = None  # samples certified by the next layer's update
    epoch_tried: list[torch.Tensor] = field(default_factory=list)  # known columns of the epoch scans
    grid_of: Selection | None = None  # the last complete selection whose rows were read for a pixel grid
    grid: PixelGrid | None = None  # and the grid they lie on (None: none)
    lattice: ImageLattice | None = None  # the row space's integer images, once found
    lattice_tried: bool = False  # whether the lattice was looked for
    lattice_of: Selection | None = None  # the last selection whose rows were decoded
    lattice_confirmed: Selection | None = None  # the batch the lattice made (each row left out)


def _rows_come_back(scorer: SparsityMatchingScorer, grid: PixelGrid, inputs: torch.Tensor) -> bool:
    """Whether each of a whole batch's rows on ``grid``, left out, comes back as itself from the
    others and the update (:func:`fl_attack.pipeline.side_information.pixel_lattice.left_out_rows`):
    the grid rules out blends, this rules out integer combinations of other samples that stay in
    the 256 levels (a low-contrast image plus the difference of two others)."""
    seen = _client_update(scorer)
    frame = grid_lattice(
        grid.layout, tuple(channel.step for channel in grid.channels), torch.from_numpy(seen.right)
    )
    snapped = grid.snap(inputs.detach().to(device="cpu", dtype=torch.float64)).numpy()
    offset = np.asarray([channel.offset for channel in grid.channels]) @ frame.channels
    levels = np.rint((snapped - offset) / frame.scale)
    kept = left_out_rows(frame, levels, frame.inputs(levels)[0], seen)
    return kept is not None


def _client_update(scorer: SparsityMatchingScorer) -> ClientUpdate:
    """The scorer's update as the pixel lattice reads it (host, float64)."""

    def host(tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()

    left = host(scorer.factors.left)
    return ClientUpdate(
        left=left,
        right=host(scorer.factors.right),
        bias_direction=left.T @ host(scorer.update.bias_update),
        weight=host(scorer.update.weight),
        bias=host(scorer.update.bias),
    )


def _whole_selection(scorer: SparsityMatchingScorer, directions: torch.Tensor) -> Selection:
    """The selection of ``(b, b)`` directions that make a whole batch."""
    per_sample, _ = scorer.score(directions)
    return Selection(
        directions=directions,
        found=torch.ones(directions.shape[0], dtype=torch.bool, device=directions.device),
        inputs=scorer.inputs(directions),
        per_sample=per_sample,
        sparsity_matching=float(per_sample.mean()),
    )


class GradientInversionAttack(LayerAttackBase):
    """Shared pipeline: decompose, propose directions, filter, select, rescale.

    Subclasses only say how proposals for the columns of the disaggregation matrix are made.

    Parameters
    ----------
    device
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a ``torch.device``.
    seed
        Seed of the attack's own random generator; the same seed on the same device gives
        the same reconstruction, except where the input side's rounds run (non-negative inputs
        the sphere search does not finish in its first rounds): each gets as long as the sphere
        round before it took, so how far it gets depends on the machine's speed and load.
    time_budget
        Seconds within which ``invert`` returns the best reconstruction it has, measured from its
        call (unless the call brings its own started ``budget``); None for no limit. Every stage
        checks the deadline between bounded chunks of work (:mod:`fl_attack.pipeline.budget.deadline`;
        a LAPACK call is not started when it would not fit), the search leaves time for the final
        selection and self-check, and on noisy gradients pruning
        (:func:`fl_attack.pipeline.selection.select.prune_doubtful`) may run 5% of it (30 s at most)
        past it: ``invert`` returns within 110% of the budget. Every share of the budget is the
        :class:`fl_attack.pipeline.budget.budget.Budget`'s.
    false_rejection
        Probability of wrongly discarding a correct direction by the sparsity filter
        (SPEAR Sec. 4.1); sets the minimum zero fraction ``tau``.
    accept_matching
        The search stops early once every selected sample has at least this
        sparsity-matching coefficient.
    noise_level
        Known relative noise ``s_{b+1}/s_b`` of the gradient; estimated from the spectrum when None.
    zero_tolerance_factor
        Entries below ``factor * noise`` (relative to a unit column) count as exact zeros.
    split_rounds
        Rounds of mixture splitting (:mod:`fl_attack.pipeline.search.mixtures`) after each selection that is
        not yet accepted; 0 disables it, as in the papers.
    patience
        On noisy gradients, stop after this many rounds without a better sparsity matching.
    progress
        Show a progress bar; ``None`` shows one only when stderr is a terminal.
    local_steps
        Full-batch local SGD steps behind every update this attack sees, when known (FedAvg; see
        ``invert``); 1 for FedSGD.
    image_std
        The clients' per-channel normalization ``std`` (``x = (pixel / 255 - mean) / std``; one
        value for every channel), when known: the pixel lattice
        (:mod:`fl_attack.pipeline.side_information.pixel_lattice`) tries it before reading the
        channels' steps from the update itself (which needs neither ``mean`` nor ``std``).
    """

    name = "attack"
    uses = frozenset({"head_weight", "next_weight_update", "local_steps", "noise_level", "local_training"})

    def __init__(
        self,
        *,
        device: str | torch.device = "auto",
        seed: int | None = 0,
        time_budget: float | None = 600.0,
        false_rejection: float = 1e-5,
        accept_matching: float = 0.99,
        noise_level: float | None = None,
        zero_tolerance_factor: float = 30.0,
        split_rounds: int = 4,
        patience: int = 3,
        progress: bool | None = None,
        local_steps: int = 1,
        image_std: Sequence[float] | None = None,
    ) -> None:
        check_time_budget(time_budget)
        check_local_steps(local_steps)
        if not 0 < false_rejection < 1:
            raise ValueError(f"false_rejection must be in (0, 1), got {false_rejection}")
        if not 0 < accept_matching <= 1:
            raise ValueError(f"accept_matching must be in (0, 1], got {accept_matching}")
        self.device = device
        self.seed = seed
        self.time_budget = time_budget
        self.false_rejection = false_rejection
        self.accept_matching = accept_matching
        self.noise_level = noise_level
        self.zero_tolerance_factor = zero_tolerance_factor
        self.split_rounds = split_rounds
        self.patience = patience
        self.progress = progress
        self.local_steps = local_steps
        self.image_std = _checked_image_std(image_std)

    def attack(
        self,
        observed: LayerUpdate[ArrayLike],
        /,
        *,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Recover the inputs of the batch behind the ``observed`` update (:meth:`invert` on its
        arrays); reads all of its optional parts (:attr:`uses`)."""
        budget = Budget.start(self.time_budget) if budget is None else budget
        check_batch_size(batch_size)
        device = resolve_device(self.device)
        update = ObservedUpdate.from_update(observed, device=device)
        following = next_layer_update(observed.next_weight_update, width=update.width, device=device)
        local_steps = self.local_steps if observed.local_steps is None else observed.local_steps
        factors = decompose_in_time(update, name=self.name, batch_size=batch_size, budget=budget)
        if isinstance(factors, Reconstruction):
            return factors  # the budget ran out in the decomposition
        noise = observed.noise_level if observed.noise_level is not None else self.noise_level
        known = observed.local_training
        decay_scale = 0.0
        # a client told to train without weight decay leaves none to remove
        no_decay = known is not None and known.weight_decay == 0
        if noise is None and not no_decay and factors.spectrum.relative_noise > DECAY_CHECK_ABOVE:
            cleaned = self._without_weight_decay(update, factors, batch_size=batch_size, budget=budget)
            if cleaned is not None:
                update, factors, decay_scale = cleaned
        b, m, floor = factors.batch_size, update.width, factors.spectrum.rounding_floor
        relative_noise = noise if noise is not None else factors.spectrum.relative_noise
        tolerance = ZeroTolerance.from_noise(relative_noise, width=m, factor=self.zero_tolerance_factor)
        noisy = relative_noise > NOISY_ABOVE
        entry_noise = 0.0
        if noisy:
            shape = (update.width, update.input_dim)
            entry_noise = noise_std(factors.singular_values, batch_size=b, shape=shape)
            if entry_noise > 0:
                tolerance = tolerance.with_entry_noise(entry_noise, factors.singular_values[:b])
        stats: dict[str, Any] = {
            "attack": self.name,
            "estimated_batch_size": factors.spectrum.batch_size,
            "spectral_gap": factors.spectrum.gap,
            "relative_noise": relative_noise,
            "noise_std": entry_noise,
            "rounding_floor": floor,
            "device": str(device),
            "local_steps": local_steps,
        }
        if decay_scale:
            stats["weight_decay_scale"] = decay_scale
        stats.update(weakest_sample_margins(factors, entry_noise=entry_noise, shape=(m, update.input_dim)))
        # a clean single-step update is judged by the one-epoch scorer, built without a plain one
        # first; a client told to train several epochs is not fitted as one
        one_epoch = known is None or not known.several_epochs
        if check_local_steps(local_steps) == 1 and not noisy and b > 1 and one_epoch:
            scorer: SparsityMatchingScorer = LocalEpochScorer(
                update, factors, tolerance, decay_scale=decay_scale, known=known
            )
        else:
            scorer = scorer_for(update, factors, tolerance, local_steps=local_steps, noisy=noisy)
        search_factors, active = informative_rows(factors, tolerance)
        stats["informative_rows"] = int(active.sum())
        if active.sum() < b:
            raise ValueError(
                f"only {int(active.sum())} of {m} neurons carry gradient for this batch of {b}: "
                "the layer has too little ReLU sparsity structure to attack"
            )
        tau = min_sparsity(int(active.sum()), false_rejection=self.false_rejection)
        # neurons dead for the whole batch were dropped from the count; similar inputs leave
        # true directions with fewer zeros than the binomial model expects, so candidates
        # down to half of SPEAR's tau are kept as weak ones, chosen only after confident ones
        min_zeros = max(b + 1, math.ceil(tau * int(active.sum()))) if b > 1 else 0
        weak_min_zeros = max(b + 1, math.ceil(0.5 * tau * int(active.sum()))) if b > 1 else 0
        stats.update(min_zeros=min_zeros, noisy=noisy)
        pool = CandidatePool(
            search_factors,
            tolerance,
            min_zeros=min_zeros,
            weak_min_zeros=weak_min_zeros,
            cos_tolerance=duplicate_cos_tolerance(relative_noise),
        )
        head_weight = observed.head_weight
        prior = None if head_weight is None else HeadPrior.from_head_weight(head_weight, width=m, rows=active)
        generator = torch.Generator().manual_seed(self.seed if self.seed is not None else torch.seed())
        state = SearchState(
            factors=search_factors,
            pool=pool,
            generator=generator,
            deadline=budget.search(finishing_seconds(update, batch_size=b)),
            stats=stats,
            active=active,
            noisy=noisy,
            finish_by=budget.pruning,
            head=prior,
        )
        state.deflation = deflation_for(following, pool, update, active, local_steps=local_steps, stats=stats)
        selection = self._run(state, scorer)
        accepted = self._accepted(selection, scorer)
        # rows on an 8-bit pixel grid are images whatever their patterns at W_0 (several local epochs)
        grid = None if accepted else self._pixel_grid(state, selection, scorer)
        # certified rows are exact by themselves: they go into any batch not accepted (never in a noisy
        # one, whose claim reads the selection's matching)
        keep_complete = accepted or state.noisy or grid is not None
        selection = with_certified_rows(selection, state.deflation, keep_complete=keep_complete)
        certified_stop = stats.get("stopped_by") in ("no_improvement", "pixel_grid", "pixel_lattice")
        if not accepted and not certified_stop and state.deadline.expired():
            stats["stopped_by"] = "time_budget"  # a stage stopped at the deadline
        stats.update(
            candidates=len(pool),
            proposals=pool.proposals_seen,
            rejected_by_sparsity=pool.rejected_sparsity,
            directions_found=int(selection.found.sum()),
            time_budget=budget.seconds,
            budget_exhausted=stats.get("stopped_by") == "time_budget",
        )
        epoch = epoch_fit_for(scorer, selection, accept_matching=self.accept_matching)
        confidence = selection.per_sample
        if epoch is not None:
            stats.update(local_epoch=epoch.describe(), local_batch_size=epoch.batch_size)
            stats.update(local_momentum=epoch.momentum)
            assert isinstance(scorer, LocalEpochScorer)  # epoch_fit_for fits only with it
            # later steps' samples match at their own step's weights, not at W_0: the confidence reads
            # them there; the weakest matching at W_0 stays in the stats
            stats.update(local_epoch_start_matching=float(selection.per_sample.min()))
            confidence = scorer.own_step_matching(selection, epoch)
        check = self_check(
            selection.inputs,
            factors=factors,
            weight=update.weight,
            bias=update.bias,
            bias_grad=update.bias_update,
            relative_noise=relative_noise,
            exact=not noisy,
            found=selection.found,
            pre_activation_basis=scorer.pre_activation_basis,
            own_step_inactive=None if epoch is None else epoch.inactive,
        )
        check = drift_self_check(check, scorer=scorer, selection=selection, stats=stats)
        check = twin_self_check(check, scorer=scorer, selection=selection, accept=self.accept_matching)
        inputs = selection.inputs
        if grid is not None:
            check = pixel_grid_self_check(
                check, grid, inputs=inputs, factors=factors, bias_grad=update.bias_update
            )
            if check.certificate:
                found = (
                    f"; found through the lattice of integer images in the update's row space "
                    f"({stats['pixel_lattice_decoded']} decoded from the search's rows, "
                    f"{stats['pixel_lattice_completed']} completed through the update)"
                    if selection is state.lattice_confirmed
                    else ""
                )
                check = replace(
                    check,
                    certificate=check.certificate
                    + "; each row, left out, comes back as itself from the others and the update"
                    + found,
                )
                inputs = grid.snap(inputs)  # their exact pixels
                confidence = torch.ones_like(confidence)
                stats.update(grid.stats())
        stats.update(check.stats())
        if not noisy and selection.complete:
            stats.update(precision_stats(scorer, selection))
        # b directions whose ReLU pattern contradicts the gradient (clean), or agrees with it barely above
        # chance (noisy), are no reconstruction: never complete; nor drifted ones (it admitted look-alikes once)
        claimed = selection.complete and (
            selection.sparsity_matching >= NOISY_COMPLETE_MATCHING if state.noisy else accepted
        )
        claimed = (claimed and not stats.get("drift_aware", False)) or bool(check.certificate)
        if claimed and check.passed and epoch is None and not state.noisy:
            # rows whose pattern disagrees somewhere, confirmed one by one where the next layer can
            stats.update(confirm_weak_rows(state.deflation, selection, confidence))
        elapsed = budget.elapsed()
        found, verdict = stats["directions_found"], "passed" if check.passed else "failed"
        logger.info(
            "%s: b=%d found=%d/%d lambda=%.4f self-check %s in %.2fs",
            *(self.name, b, found, b, selection.sparsity_matching, verdict, elapsed),
        )
        return Reconstruction(
            inputs=inputs.detach().cpu(),
            batch_size=b,
            sparsity_matching=selection.sparsity_matching,
            complete=claimed and check.passed,
            confidence=confidence.clamp_min(0).detach().cpu(),
            seconds=elapsed,
            stats=stats,
            self_check=check,
        )

    def _run(self, state: SearchState, scorer: SparsityMatchingScorer) -> Selection:
        b = state.factors.batch_size
        best: Selection | None = None
        rounds = 0
        stale = 0
        rows_tried = b < 2
        show = self.progress
        head: HeadRounds | None = None
        bar = tqdm(
            total=b, desc=self.name, unit="dir", disable=(not show) if show is not None else None, leave=False
        )
        try:
            single = iter([torch.ones(1, 1, dtype=torch.float64, device=state.factors.left.device)])
            proposals_iter = interleave_input_side(self._proposals(state), state, scorer) if b > 1 else single
            proposals_iter = interleave_drift_rounds(proposals_iter, state, scorer)
            if state.head is not None and b > 1:
                head = HeadRounds.for_pool(
                    state.pool,
                    state.head,
                    generator=state.generator,
                    deadline=state.deadline,
                    noisy=state.noisy,
                )
                proposals_iter = interleave_head_rounds(proposals_iter, head, pool=state.pool)
            for proposals in proposals_iter:
                rounds += 1
                new = state.pool.add(proposals, deadline=state.deadline)
                if new == 0 and best is not None:
                    stale += 1
                    if self._settled(state, best, stale):
                        state.stats["stopped_by"] = "no_improvement"
                        break
                    if state.deadline.expired():
                        state.stats["stopped_by"] = "time_budget"
                        break
                    continue
                if len(state.pool) >= 1 or (not state.noisy and state.pool.weak()[0].shape[0] > 0):
                    # weak candidates alone (the sweep's, on deep layers' alike inputs) are worth a selection
                    state.incumbent = best.directions if best is not None and best.complete else None
                    candidate = self._select_and_split(state, scorer)
                    if best is None or self._accepted(candidate, scorer) or better_selection(candidate, best):
                        improved = best is None or candidate.sparsity_matching > best.sparsity_matching + 1e-3
                        best = candidate
                        state.latest = best
                        report_selection(best, stats=state.stats, deflation=state.deflation)
                        stale = 0 if improved else stale + 1
                    else:
                        stale += 1
                    bar.n = int(best.found.sum())
                    bar.set_postfix(candidates=len(state.pool), matching=f"{best.sparsity_matching:.4f}")
                    bar.refresh()
                    if self._accepted(best, scorer):
                        break
                    if self._pixel_grid(state, best, scorer) is not None:
                        state.stats["stopped_by"] = "pixel_grid"
                        break
                    if not rows_tried and not state.noisy:
                        # the first selection falls short: try the whole batch from the input side
                        rows_tried = True
                        from_rows = self._background_selection(state, scorer)
                        if from_rows is not None and self._pixel_grid(state, from_rows, scorer) is not None:
                            best = state.latest = from_rows
                            state.stats["stopped_by"] = "pixel_grid"
                            break
                    from_lattice = self._lattice_selection(state, scorer, best)
                    if from_lattice is not None and self._pixel_grid(state, from_lattice, scorer) is not None:
                        best = state.latest = from_lattice
                        state.stats["stopped_by"] = "pixel_lattice"
                        break
                    if self._settled(state, best, stale):
                        state.stats["stopped_by"] = "no_improvement"
                        break
                if state.deadline.expired():
                    state.stats["stopped_by"] = "time_budget"
                    break
        finally:
            bar.close()
        state.stats["rounds"] = rounds
        if head is not None:
            state.stats.update(head.stats())
        if best is None:
            best = self._select(state, scorer)
        if state.noisy and b > 1:
            found = int(best.found.sum())
            # pruning is worth a little time past the deadline: a wrong row spoils every sample
            width = state.factors.left.shape[0]  # the last steps: pruning, a joint re-fit on wide layers
            best = finish_noisy(scorer, best, width=width, deadline=state.finish_by)
            state.stats["pruned"] = found - int(best.found.sum())
        if state.noisy or epoch_fit_for(scorer, best, accept_matching=self.accept_matching) is not None:
            return best  # a local epoch's samples hold their patterns at their own steps, not at W_0
        if state.grid_of is best and state.grid is not None:
            return best  # images on their pixel grid; a re-fit on W_0's patterns could only blur them
        return polish_for(scorer, best)

    def _background_selection(self, state: SearchState, scorer: SparsityMatchingScorer) -> Selection | None:
        """The batch reached from the input side shifted by a background its inputs share
        (:mod:`fl_attack.pipeline.side_information.background_rows`), within a share of the search's time; None
        where there is no such background or not every sample was reached."""
        update, factors = scorer.update, scorer.factors
        b = factors.batch_size
        value = background_value(update, relative_noise=state.pool.tolerance.relative_noise, batch_size=b)
        if value is None:
            return None
        state.stats["background_value"] = value
        directions = background_rows(
            update,
            factors,
            value=value,
            tolerance=state.pool.tolerance,
            generator=torch.Generator().manual_seed(self.seed or 0),
            deadline=state.deadline.within(BACKGROUND_SHARE * max(0.0, state.deadline.remaining())),
        )
        state.stats["background_rows"] = (
            "every sample reached" if directions is not None else "not every sample reached"
        )
        if directions is None:
            return None
        return _whole_selection(scorer, directions)

    def _lattice_selection(
        self, state: SearchState, scorer: SparsityMatchingScorer, selection: Selection
    ) -> Selection | None:
        """The batch from the integer images of the row space
        (:mod:`fl_attack.pipeline.side_information.pixel_lattice`): ``selection``'s rows decoded,
        the rest completed through the update; None where it gives no whole batch. The lattice is
        looked for once, within a share of the search's time; each selection is decoded once."""
        b = scorer.factors.batch_size
        if state.noisy or state.lattice_of is selection or b < 2:
            return None
        if b > MAX_LATTICE_BATCH:
            state.stats["pixel_lattice"] = (
                f"not looked for: a batch of {b} is above {MAX_LATTICE_BATCH}, where the reduction "
                "takes longer than the search's share and loses precision"
            )
            return None
        state.lattice_of = selection
        seen = _client_update(scorer)
        right = torch.from_numpy(seen.right)
        approximate = selection.inputs.detach().to(device="cpu", dtype=torch.float64)
        if not state.lattice_tried:
            state.lattice_tried = True
            state.lattice = find_lattice(
                right,
                approximate,
                image_std=self.image_std,
                generator=np.random.default_rng(self.seed or 0),
                deadline=state.deadline.within(LATTICE_SHARE * max(0.0, state.deadline.remaining())),
                constant=torch.from_numpy(seen.bias_direction),
            )
            state.stats["pixel_lattice"] = (
                "none: no 8-bit lattice in the row space (a row's grid, image_std, the channels' "
                "steps read from it and grey tried)"
                if state.lattice is None
                else f"{state.lattice.layout}, steps {', '.join(f'{s:.6g}' for s in state.lattice.steps)}"
            )
        if state.lattice is None:
            return None
        batch = lattice_batch(state.lattice, approximate.numpy(), seen)
        if batch is None:
            return None
        state.stats["pixel_lattice_decoded"] = batch.decoded
        state.stats["pixel_lattice_completed"] = batch.completed
        rows = torch.from_numpy(batch.inputs @ seen.pseudo)  # rows of Q^{-1}
        directions = torch.linalg.inv(rows).T
        directions = (directions / directions.norm(dim=1, keepdim=True)).to(scorer.factors.left)
        state.lattice_confirmed = _whole_selection(scorer, directions)  # its rows were left out already
        return state.lattice_confirmed

    @staticmethod
    def _pixel_grid(
        state: SearchState, selection: Selection, scorer: SparsityMatchingScorer
    ) -> PixelGrid | None:
        """The 8-bit pixel grid a complete clean selection's rows lie on, once each row, left out,
        came back as itself from the others and the update
        (:func:`fl_attack.pipeline.side_information.pixel_lattice.left_out_rows`; a batch from the
        lattice was judged so already). Read once per selection."""
        if state.noisy or not selection.complete or not bool(selection.found.all()):
            return None
        if state.grid_of is not selection:
            grid = pixel_grid(selection.inputs)
            if (
                grid is not None
                and state.lattice_confirmed is not selection
                and not _rows_come_back(scorer, grid, selection.inputs)
            ):
                state.stats["pixel_grid_left_out"] = (
                    "rows on an 8-bit grid, but one, left out, does not come back as itself from the "
                    "others and the update: not certified"
                )
                grid = None
            state.grid_of, state.grid = selection, grid
        return state.grid

    def _without_weight_decay(
        self,
        update: ObservedUpdate,
        factors: LowRankFactors,
        *,
        batch_size: int | None,
        budget: Budget,
    ) -> tuple[ObservedUpdate, LowRankFactors, float] | None:
        """The update less weight decay's ``beta W_0`` (:mod:`fl_attack.pipeline.local_training.weight_decay`) and
        its factors, when removing it leaves a clean update; None otherwise."""
        scale = weight_decay_scale(update, batch_size=factors.batch_size, seed=self.seed or 0)
        if scale is None:
            return None
        best: tuple[ObservedUpdate, LowRankFactors, float] | None = None
        for _ in range(DECAY_REFINEMENTS + 1):
            cleaned = remove_weight_decay(update, scale)
            refactored = decompose_in_time(cleaned, name=self.name, batch_size=batch_size, budget=budget)
            if isinstance(refactored, Reconstruction):
                break
            noise = refactored.spectrum.relative_noise
            if noise <= DECAY_GAIN * factors.spectrum.relative_noise and (
                best is None or noise < best[1].spectrum.relative_noise
            ):
                best = (cleaned, refactored, scale)
            scale = refined_scale(update, scale, left=refactored.left)
        return best

    def _settled(self, state: SearchState, best: Selection, stale: int) -> bool:
        """Whether more rounds are unlikely to help a complete selection.

        On noisy gradients the matching cannot reach 1. On clean FedAvg updates the ReLU pattern
        drifts over the steps, so exact directions match just below 1; a clearly wrong column keeps searching.
        """
        if not best.complete:
            return False
        if state.noisy:
            return stale >= self.patience
        return stale >= 2 * self.patience and float(best.per_sample.min()) >= SETTLED_MATCHING

    def _accepted(self, selection: Selection, scorer: SparsityMatchingScorer) -> bool:
        return scorer.accepts(selection, accept_matching=self.accept_matching)

    def _select_and_split(self, state: SearchState, scorer: SparsityMatchingScorer) -> Selection:
        """Select; while not accepted, split remembered mixtures into new directions and retry."""
        pool = state.pool
        selection = self._select(state, scorer)
        if state.noisy or (state.deflation is not None and state.deflation.progressing):
            return selection  # the deflated search still certifies samples: no mixtures to split yet
        for _ in range(self.split_rounds):
            if self._accepted(selection, scorer) or state.deadline.expired():
                break
            unselected = rows_not_in(pool.directions, selection.directions[selection.found])
            doubtful = selection.directions[selection.found & (selection.per_sample < self.accept_matching)]
            mixtures = torch.cat([pool.mixtures, unselected, doubtful], dim=0)
            proposals = split_blends(state.factors, mixtures, pool, doubtful, state.deadline)
            state.stats["split_proposals"] = state.stats.get("split_proposals", 0) + int(proposals.shape[0])
            added = pool.add(proposals, deadline=state.deadline)
            added += pool.add(
                self._last_direction_proposals(state, scorer, selection), deadline=state.deadline
            )
            if added == 0:
                break
            selection = self._select(state, scorer)
        return selection

    def _select(self, state: SearchState, scorer: SparsityMatchingScorer) -> Selection:
        """Select from confident then weak candidates, swapping only until the deadline.

        Weak candidates rank after every confident one in the sparsest-first stage; on noisy
        gradients only the ``3 b`` confident candidates with the largest excess of zeros over a
        dense column are considered, and on wide noisy layers each by its own matching instead.
        """
        pool, (m, b) = state.pool, state.factors.left.shape
        if uses_trusted_selection(
            noisy=state.noisy, width=m, batch_size=b
        ):  # fl_attack.pipeline.noise.one_at_a_time
            return trusted_selection(scorer, pool.directions, pool.excess, deadline=state.finish_by)
        directions, counts = pool.directions, pool.zero_counts
        if state.noisy:
            counts = pool.excess
            if len(pool) > 3 * b:
                top = torch.topk(counts, k=3 * b).indices
                directions, counts = directions[top], counts[top]
        elif not state.noisy:
            weak, weak_counts = pool.weak()
            directions = torch.cat([directions, weak], dim=0)
            counts = torch.cat([counts, weak_counts - state.factors.left.shape[0]], dim=0)
        # clean gradients: a direction matching at the acceptance level is not swapped out
        good_enough, start = (1.0 if state.noisy else self.accept_matching), state.incumbent
        deadline = state.deadline
        if not state.noisy:
            deadline = deadline.within(SWAP_SHARE * max(0.0, deadline.remaining()))
        return select(scorer, directions, counts, deadline=deadline, good_enough=good_enough, incumbent=start)

    def _last_direction_proposals(
        self, state: SearchState, scorer: SparsityMatchingScorer, selection: Selection
    ) -> torch.Tensor:
        """Proposals for the directions missing (or doubtful) in an otherwise good selection."""
        trusted = trusted_directions(state, selection, accept_matching=self.accept_matching)
        proposals = missing_direction_proposals(state, scorer, trusted)
        if proposals.shape[0] == 0:  # a later step's samples of one local epoch miss their W_0 patterns
            proposals = epoch_last_directions(state, scorer, selection, accept_matching=self.accept_matching)
            if proposals.shape[0]:
                state.stats["epoch_last_directions"] = int(proposals.shape[0])
        return proposals

    @abstractmethod
    def _proposals(self, state: SearchState) -> Iterator[torch.Tensor]:
        """Yield batches of ``(k, b)`` candidate directions until the budget is spent."""


def _checked_image_std(image_std: Sequence[float] | None) -> tuple[float, ...] | None:
    if image_std is None:
        return None
    values = tuple(float(v) for v in image_std)
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(
            f"image_std must be one or more positive finite numbers (one per channel), got {image_std!r}"
        )
    return values
