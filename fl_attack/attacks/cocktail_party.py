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
from dataclasses import dataclass
from typing import Any

import torch

from fl_attack.attacks.base import LayerAttackBase
from fl_attack.attacks.fast_ica import NONLINEARITIES, IcaResult, principal_subspace, symmetric_fastica
from fl_attack.pipeline.budget.budget import Budget, Deadline
from fl_attack.pipeline.spectrum.decompose import estimate_batch_size
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


@dataclass(frozen=True)
class _Unmixed:
    inputs: torch.Tensor  # (b, n)
    sources: torch.Tensor  # (b, observations): what ICA made non-Gaussian
    ica: IcaResult
    side: str


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
        tried: list[str] = []
        unmixed: _Unmixed | None = None
        wants_gradients = self.unmix == "gradients" or (
            self.unmix == "auto" and m >= GRADIENT_SIDE_MIN_NEURONS_PER_SOURCE * b
        )
        if wants_gradients:
            unmixed = self._unmix_gradients(dw, db, b, generator=generator, deadline=deadline)
            tried.append(unmixed.side)
        if unmixed is None or (self.unmix == "auto" and unmixed.ica.stopped_by == "max_iter"):
            unmixed = self._unmix_inputs(dw, db, b, generator=generator, deadline=deadline)
            tried.append(unmixed.side)
        centred = unmixed.sources - unmixed.sources.mean(dim=1, keepdim=True)
        kurtosis = ((centred**4).mean(dim=1) / centred.var(dim=1, unbiased=False) ** 2 - 3.0).abs()
        stats: dict[str, Any] = {
            "attack": self.name,
            "approximate": True,
            "unmixed": unmixed.side,
            "sides_tried": ",".join(tried),
            "ica_iterations": unmixed.ica.iterations,
            "ica_change": unmixed.ica.change,
            "stopped_by": unmixed.ica.stopped_by,
            "budget_exhausted": unmixed.ica.stopped_by == "time_budget",
            "nonlinearity": self.nonlinearity,
            "directions_found": 0,
        }
        if budget.seconds is not None:
            stats["time_budget"] = budget.seconds
        return Reconstruction(
            inputs=unmixed.inputs.detach().cpu().contiguous(),
            batch_size=b,
            sparsity_matching=float("nan"),
            complete=False,
            confidence=(kurtosis / (1.0 + kurtosis)).detach().cpu(),
            seconds=budget.elapsed(),
            stats=stats,
        )

    def _ica(self, whitened: torch.Tensor, *, generator: torch.Generator, deadline: Deadline) -> IcaResult:
        return symmetric_fastica(
            whitened.float() if whitened.shape[0] >= FLOAT32_FROM_SOURCES else whitened,
            nonlinearity=self.nonlinearity,
            max_iter=self.max_iter,
            tolerance=self.tolerance,
            generator=generator,
            deadline=deadline,
        )

    def _unmix_inputs(
        self,
        dw: torch.Tensor,
        db: torch.Tensor,
        b: int,
        *,
        generator: torch.Generator,
        deadline: Deadline,
    ) -> _Unmixed:
        """Sources are the (centred) inputs; observations are the ``n`` input coordinates."""
        n = dw.shape[1]
        row_means = dw.mean(dim=1)
        subspace = principal_subspace(dw - row_means[:, None], rank=b, generator=generator)
        left, values = subspace.left, _check_rank(subspace.singular_values, b)
        whitened = math.sqrt(n) * subspace.right.T  # (b, n): centred, uncorrelated, unit-variance rows
        ica = self._ica(whitened, generator=generator, deadline=deadline)
        unmixing = _nearest_orthogonal(ica.unmixing.double())
        sources = unmixing @ whitened
        # dW - row_means 1^T = left diag(values / sqrt(n)) unmixing^T sources; that mixing's
        # pseudo-inverse is unmixing diag(sqrt(n) / values) left^T
        unmix_rows = unmixing @ ((math.sqrt(n) / values)[:, None] * left.T)
        source_means = unmix_rows @ row_means
        inputs = (sources + source_means[:, None]) / _safe(unmix_rows @ db)[:, None]
        return _Unmixed(inputs=inputs, sources=sources, ica=ica, side="inputs")

    def _unmix_gradients(
        self,
        dw: torch.Tensor,
        db: torch.Tensor,
        b: int,
        *,
        generator: torch.Generator,
        deadline: Deadline,
    ) -> _Unmixed:
        """Sources are the output-gradient columns ``g_i``; observations are the ``m`` neurons."""
        m = dw.shape[0]
        neuron_mean = dw.mean(dim=0)
        subspace = principal_subspace((dw - neuron_mean).T, rank=b, generator=generator)
        values = _check_rank(subspace.singular_values, b)
        whitened = math.sqrt(m) * subspace.right.T  # (b, m)
        ica = self._ica(whitened, generator=generator, deadline=deadline)
        unmixing = _nearest_orthogonal(ica.unmixing.double())
        # dW - 1 mean^T = sources^T unscaled with unscaled = unmixing diag(values) V^T / sqrt(m)
        unscaled = unmixing @ (values[:, None] * subspace.left.T) / math.sqrt(m)  # (b, n)
        coefficients = torch.linalg.lstsq(unscaled.T, dw.T).solution.T  # (m, b): dW ~= G' unscaled
        inverse_scales = torch.linalg.lstsq(coefficients, db[:, None]).solution[:, 0]
        return _Unmixed(
            inputs=unscaled / _safe(inverse_scales)[:, None],
            sources=unmixing @ whitened,
            ica=ica,
            side="gradients",
        )


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
