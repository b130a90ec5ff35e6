"""The Cocktail Party Attack (Kariyappa et al., ICML 2023): approximate inversion by ICA.

A linear layer's weight update is a mixture of the batch's inputs: ``dW = G X = sum_i g_i x_i^T``.
Independent component analysis can unmix it from either side:

* ``inputs`` (the paper's): the ``n`` input coordinates are ICA's observations and the ``m``
  rows of ``dW`` its mixtures; the sources are the inputs ``x_i`` (centred), up to scale and
  sign. Natural images are only weakly non-Gaussian and not independent, so this separates
  them poorly.
* ``gradients``: the ``m`` neurons are the observations and the sources are the columns
  ``g_i`` of the output gradient, which a ReLU layer makes sparse (zero wherever sample ``i``
  does not activate the neuron), hence strongly non-Gaussian; the inputs follow by least
  squares, ``X = G^+ dW``. It needs many neurons per source (we measured it converging at
  ``m >= 40 b`` and failing at ``m = 20 b`` on CIFAR-10).
* ``auto`` (default): ``gradients`` when ``m >= 40 b`` and its ICA converges, else ``inputs``.

Either way the update is reduced once to its top-``b`` principal subspace and a symmetric
FastICA (:mod:`fl_attack.attacks.fast_ica`) runs on the ``(b, .)`` whitened data, checking the
time budget between iterations: out of time, it returns the unmixing it has
(``stats["stopped_by"] == "time_budget"``). The attack is approximate: it never claims an
exact or complete recovery.

Beyond the paper, the scale and sign of every source are fixed exactly as SPEAR fixes them
(Thm. 3.5): with ``G'`` the coefficients of ``dW`` on the unscaled sources, the bias update
``db = sum_i g_i = G' d`` gives the per-source scales ``d`` by one least-squares solve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fl_attack.attacks.base import LayerAttackBase
from fl_attack.attacks.fast_ica import NONLINEARITIES, IcaResult, principal_subspace, symmetric_fastica
from fl_attack.pipeline.budget.budget import Budget, Deadline
from fl_attack.pipeline.spectrum.decompose import estimate_batch_size
from fl_attack.progress import ActiveSink, active_sink
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ArrayLike, LayerUpdate, ObservedUpdate
from fl_attack.validation import check_batch_size, check_time_budget, resolve_device

#: Which side ICA unmixes (see the module docstring).
UNMIX_SIDES = ("auto", "inputs", "gradients")
#: ``auto`` tries the gradient side only with at least this many neurons per source: measured on
#: CIFAR-10 at m = 4000, it separates b <= 100 (28.6 dB at b = 10, 19.4 dB at b = 100, against
#: 12 and 9 dB on the input side) and fails from b = 200 on; with m = 20 b on independent
#: Laplace inputs (tests) the input side is the better one.
GRADIENT_SIDE_MIN_NEURONS_PER_SOURCE = 40
#: The fixed-point iterations run in float32 from this many sources on (about twice as fast;
#: the unmixing is re-orthogonalised and applied in float64).
FLOAT32_FROM_SOURCES = 64
#: Under a progress sink (:mod:`fl_attack.progress`), the current estimate is reported after the
#: first ICA iteration, then once both this many seconds and :data:`PROGRESS_COST_FACTOR` times
#: the last report's own time have passed: a report unmixes the update (with a least-squares
#: solve on the gradient side), and reports take at most 1/20 of the attack's time.
PROGRESS_EVERY_SECONDS = 1.0
PROGRESS_COST_FACTOR = 20.0


@dataclass(frozen=True)
class _Unmixed:
    inputs: torch.Tensor  # (b, n)
    sources: torch.Tensor  # (b, observations): what ICA made non-Gaussian
    ica: IcaResult
    side: str


@dataclass(frozen=True)
class _InputSide:
    """Sources are the (centred) inputs; observations are the ``n`` input coordinates."""

    whitened: torch.Tensor  # (b, n)
    left: torch.Tensor  # (m, b)
    values: torch.Tensor  # (b,)
    row_means: torch.Tensor  # (m,)
    db: torch.Tensor  # (m,)
    name: str = "inputs"

    def finish(self, unmixing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(b, n)`` inputs and ``(b, n)`` sources of ICA's ``unmixing``."""
        n = self.whitened.shape[1]
        unmixing = _nearest_orthogonal(unmixing.double())
        sources = unmixing @ self.whitened
        # dW - row_means 1^T = left diag(values / sqrt(n)) unmixing^T sources; that mixing's
        # pseudo-inverse is unmixing diag(sqrt(n) / values) left^T
        unmix_rows = unmixing @ ((math.sqrt(n) / self.values)[:, None] * self.left.T)
        source_means = unmix_rows @ self.row_means
        inputs = (sources + source_means[:, None]) / _safe(unmix_rows @ self.db)[:, None]
        return inputs, sources


@dataclass(frozen=True)
class _GradientSide:
    """Sources are the output-gradient columns ``g_i``; observations are the ``m`` neurons."""

    whitened: torch.Tensor  # (b, m)
    right_left: torch.Tensor  # (n, b): the left singular vectors of (dW - 1 mean^T)^T
    values: torch.Tensor  # (b,)
    dw: torch.Tensor  # (m, n)
    db: torch.Tensor  # (m,)
    name: str = "gradients"

    def finish(self, unmixing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(b, n)`` inputs and ``(b, m)`` sources of ICA's ``unmixing``."""
        m = self.dw.shape[0]
        unmixing = _nearest_orthogonal(unmixing.double())
        # dW - 1 mean^T = sources^T unscaled with unscaled = unmixing diag(values) V^T / sqrt(m)
        unscaled = unmixing @ (self.values[:, None] * self.right_left.T) / math.sqrt(m)  # (b, n)
        coefficients = torch.linalg.lstsq(unscaled.T, self.dw.T).solution.T  # (m, b): dW ~= G' unscaled
        inverse_scales = torch.linalg.lstsq(coefficients, self.db[:, None]).solution[:, 0]
        return unscaled / _safe(inverse_scales)[:, None], unmixing @ self.whitened


#: One side of the update prepared for ICA: its whitened data, centred, uncorrelated, unit-variance
#: ``(b, observations)`` rows, and ``finish``: the inputs and sources of an unmixing.
_Side = _InputSide | _GradientSide


class _EstimateReporter:
    """Reports the current unmixing's inputs to the installed progress sink while ICA runs.

    Only what the attack would return had its budget ended there (the same rows, statistics and
    confidences, never complete), so a run stopped at its hard limit keeps them.
    """

    def __init__(self, sink: ActiveSink, *, b: int, stats: dict[str, Any]) -> None:
        self.sink = sink
        self.b = b
        self.stats = stats
        self._next = 0.0  # perf_counter() before which no report is built

    def watch(self, side: _Side, tried: list[str]) -> Callable[[torch.Tensor, int, float], None]:
        """The ICA loop's ``after_iteration`` for ``side`` (``tried``: the sides tried so far)."""

        def after_iteration(unmixing: torch.Tensor, iterations: int, change: float) -> None:
            began = time.perf_counter()
            if began < self._next:
                return
            inputs, sources = side.finish(unmixing)
            stats = {
                **self.stats,
                "unmixed": side.name,
                "sides_tried": ",".join(tried),
                "ica_iterations": iterations,
                "ica_change": change,
                "partial": True,
            }
            self.sink.report(
                Reconstruction(
                    inputs=inputs.detach().cpu().contiguous(),
                    batch_size=self.b,
                    sparsity_matching=float("nan"),
                    complete=False,
                    confidence=_non_gaussianity(sources).detach().cpu(),
                    seconds=self.sink.seconds(),
                    stats=stats,
                )
            )
            took = time.perf_counter() - began
            self._next = began + max(PROGRESS_EVERY_SECONDS, PROGRESS_COST_FACTOR * took)

        return after_iteration


class CocktailPartyAttack(LayerAttackBase):
    """Approximate inputs of a linear layer's batch by independent component analysis.

    Parameters
    ----------
    max_iter : int (default: 200)
        FastICA fixed-point iterations at most (per side tried).
    tolerance : float (default: 1e-4)
        FastICA convergence tolerance.
    nonlinearity : str (default: "logcosh")
        ``"logcosh"`` or ``"cube"`` (:data:`fl_attack.attacks.fast_ica.NONLINEARITIES`).
    unmix : str (default: "auto")
        ``"inputs"`` (the paper's), ``"gradients"`` or ``"auto"`` (:data:`UNMIX_SIDES`).
    seed : int or None (default: 0)
        Seeds the range finder and the initial unmixing matrix (None: 0).
    time_budget : float or None (default: None)
        Seconds the attack may spend when :meth:`invert` is given none; the ICA iterations stop
        at the budget with the unmixing they have. None runs to convergence or ``max_iter``.
    device : str or torch.device (default: "cpu")
        Where to compute (``"auto"``: CUDA when available).
    """

    name = "cocktail-party"

    def __init__(
        self,
        *,
        max_iter: int = 200,
        tolerance: float = 1e-4,
        nonlinearity: str = "logcosh",
        unmix: str = "auto",
        seed: int | None = 0,
        time_budget: float | None = None,
        device: str | torch.device = "cpu",
        **_: Any,
    ) -> None:
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
        if not (isinstance(tolerance, float) and math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"tolerance must be a positive finite float, got {tolerance!r}")
        if nonlinearity not in NONLINEARITIES:
            raise ValueError(f"nonlinearity must be one of {', '.join(NONLINEARITIES)}, got {nonlinearity!r}")
        if unmix not in UNMIX_SIDES:
            raise ValueError(f"unmix must be one of {', '.join(UNMIX_SIDES)}, got {unmix!r}")
        self.max_iter = max_iter
        self.tolerance = tolerance
        self.nonlinearity = nonlinearity
        self.unmix = unmix
        self.seed = 0 if seed is None else int(seed)
        self.time_budget = check_time_budget(time_budget)
        self.device = resolve_device(device)

    def attack(
        self,
        observed: LayerUpdate[ArrayLike],
        /,
        *,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Unmix the layer's inputs from its update.

        Parameters
        ----------
        observed
            The layer's update (any scale and sign) and its parameters (validated for shape; ICA
            does not use them); none of its optional parts (:attr:`uses`).
        batch_size
            The number of sources; None estimates it from the singular-value gap.
        budget
            The attack's time budget, already started (None: the constructor's ``time_budget``,
            from this call). The decompositions run whole; the ICA iterations stop before the
            budget would be passed.

        Returns
        -------
        Reconstruction
            ``(b, n)`` approximate inputs; ``complete`` is always False and ``confidence`` is
            each source's non-Gaussianity (excess kurtosis magnitude, squashed to [0, 1)).
            ``stats`` holds ``unmixed`` (the side used), ``ica_iterations``, ``ica_change``,
            ``stopped_by`` (``converged``, ``max_iter`` or ``time_budget``) and
            ``budget_exhausted``.

        Raises
        ------
        ValueError
            On malformed input, a batch size above ``min(m, n)``, or an update whose batch size
            cannot be estimated.
        """
        budget = Budget.start(self.time_budget) if budget is None else budget
        deadline = budget.deadline
        check_batch_size(batch_size)
        update = ObservedUpdate.from_update(observed, device=self.device)
        dw, db = update.weight_update, update.bias_update
        m, n = dw.shape
        if batch_size is not None and batch_size > min(m, n):
            raise ValueError(f"batch size {batch_size} is not in [1, min(m, n) = {min(m, n)}]")
        b = batch_size if batch_size is not None else _estimated_batch_size(dw)
        generator = torch.Generator().manual_seed(self.seed)
        stats: dict[str, Any] = {
            "attack": self.name,
            "approximate": True,
            "nonlinearity": self.nonlinearity,
            "directions_found": 0,
        }
        if budget.seconds is not None:
            stats["time_budget"] = budget.seconds
        sink = active_sink()
        reporter = None if sink is None else _EstimateReporter(sink, b=b, stats=stats)
        tried: list[str] = []
        unmixed: _Unmixed | None = None
        wants_gradients = self.unmix == "gradients" or (
            self.unmix == "auto" and m >= GRADIENT_SIDE_MIN_NEURONS_PER_SOURCE * b
        )
        if wants_gradients:
            side: _Side = _gradient_side(dw, db, b, generator=generator)
            unmixed = self._unmix(side, tried, generator=generator, deadline=deadline, reporter=reporter)
        if unmixed is None or (self.unmix == "auto" and unmixed.ica.stopped_by == "max_iter"):
            side = _input_side(dw, db, b, generator=generator)
            unmixed = self._unmix(side, tried, generator=generator, deadline=deadline, reporter=reporter)
        stats.update(
            {
                "unmixed": unmixed.side,
                "sides_tried": ",".join(tried),
                "ica_iterations": unmixed.ica.iterations,
                "ica_change": unmixed.ica.change,
                "stopped_by": unmixed.ica.stopped_by,
                "budget_exhausted": unmixed.ica.stopped_by == "time_budget",
            }
        )
        return Reconstruction(
            inputs=unmixed.inputs.detach().cpu().contiguous(),
            batch_size=b,
            sparsity_matching=float("nan"),
            complete=False,
            confidence=_non_gaussianity(unmixed.sources).detach().cpu(),
            seconds=budget.elapsed(),
            stats=stats,
        )

    def _unmix(
        self,
        side: _Side,
        tried: list[str],
        *,
        generator: torch.Generator,
        deadline: Deadline,
        reporter: _EstimateReporter | None,
    ) -> _Unmixed:
        """Run ICA on ``side`` (appended to ``tried``), reporting its estimates to ``reporter``."""
        tried.append(side.name)
        whitened = side.whitened
        ica = symmetric_fastica(
            whitened.float() if whitened.shape[0] >= FLOAT32_FROM_SOURCES else whitened,
            nonlinearity=self.nonlinearity,
            max_iter=self.max_iter,
            tolerance=self.tolerance,
            generator=generator,
            deadline=deadline,
            after_iteration=None if reporter is None else reporter.watch(side, list(tried)),
        )
        inputs, sources = side.finish(ica.unmixing)
        return _Unmixed(inputs=inputs, sources=sources, ica=ica, side=side.name)


def _input_side(dw: torch.Tensor, db: torch.Tensor, b: int, *, generator: torch.Generator) -> _InputSide:
    """The input side's whitened data: the top-``b`` right singular vectors of the row-centred update."""
    n = dw.shape[1]
    row_means = dw.mean(dim=1)
    subspace = principal_subspace(dw - row_means[:, None], rank=b, generator=generator)
    values = _check_rank(subspace.singular_values, b)
    return _InputSide(
        whitened=math.sqrt(n) * subspace.right.T,
        left=subspace.left,
        values=values,
        row_means=row_means,
        db=db,
    )


def _gradient_side(
    dw: torch.Tensor, db: torch.Tensor, b: int, *, generator: torch.Generator
) -> _GradientSide:
    """The gradient side's whitened data: the top-``b`` right singular vectors of the neuron-centred
    update's transpose."""
    m = dw.shape[0]
    neuron_mean = dw.mean(dim=0)
    subspace = principal_subspace((dw - neuron_mean).T, rank=b, generator=generator)
    values = _check_rank(subspace.singular_values, b)
    return _GradientSide(
        whitened=math.sqrt(m) * subspace.right.T, right_left=subspace.left, values=values, dw=dw, db=db
    )


def _non_gaussianity(sources: torch.Tensor) -> torch.Tensor:
    """Each source's excess kurtosis magnitude, squashed to [0, 1) (the rows' confidence)."""
    centred = sources - sources.mean(dim=1, keepdim=True)
    kurtosis = ((centred**4).mean(dim=1) / centred.var(dim=1, unbiased=False) ** 2 - 3.0).abs()
    return kurtosis / (1.0 + kurtosis)


def _estimated_batch_size(dw: torch.Tensor) -> int:
    """The batch size from the spectrum (one eigenvalue solve of the smaller Gram matrix)."""
    m, n = dw.shape
    gram = dw.T @ dw if n <= m else dw @ dw.T
    spectrum = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0.0).sqrt()
    return int(estimate_batch_size(spectrum, shape=(m, n)).batch_size)


def _check_rank(values: torch.Tensor, b: int) -> torch.Tensor:
    if not bool((values > 0).all()):
        raise ValueError(f"the update has rank below the batch size {b}: nothing to unmix")
    return values


def _safe(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` with zeros replaced by the smallest float64 (a source the bias does not see)."""
    tiny = torch.finfo(torch.float64).tiny
    return torch.where(scales.abs() > tiny, scales, torch.full_like(scales, tiny))


def _nearest_orthogonal(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix nearest to ``matrix`` (polar factor), in its dtype."""
    left, _, right_t = torch.linalg.svd(matrix)
    return left @ right_t
