"""The Cocktail Party Attack (Kariyappa et al., ICML 2023): approximate inversion by ICA.

A linear layer's weight update is a mixture of the batch's inputs: ``dW = sum_i g_i x_i^T``,
so every row of ``dW`` is a linear combination of the ``b`` inputs. Independent component
analysis unmixes the rows back into ``b`` maximally non-Gaussian sources, which are the
inputs up to scale and sign. Unlike SPEAR it needs no ReLU sparsity and no ``b < m``
structure beyond ``b <= min(m, n)``, but it is approximate: it never claims an exact or
complete recovery.

Beyond the paper, the scale and sign of every source are fixed exactly as SPEAR fixes them
(Thm. 3.5): with ``G'`` the least-squares coefficients of ``dW`` on the unscaled sources,
the bias update ``db = sum_i g_i`` gives the per-source scales by one least-squares solve.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
import torch
from sklearn.decomposition import FastICA
from sklearn.exceptions import ConvergenceWarning

from fl_attack.pipeline.decompose import estimate_batch_size
from fl_attack.reconstruction import Reconstruction
from fl_attack.types import ArrayLike, ObservedUpdate
from fl_attack.validation import check_batch_size, check_time_budget


class CocktailPartyAttack:
    """Approximate inputs of a linear layer's batch by independent component analysis.

    Parameters
    ----------
    max_iter : int (default: 1000)
        FastICA iterations.
    tolerance : float (default: 1e-6)
        FastICA convergence tolerance.
    seed : int or None (default: 0)
        Seeds FastICA's initial unmixing matrix.
    time_budget : float or None (default: None)
        Accepted for the attack protocol; FastICA runs to convergence or ``max_iter``.
    """

    name = "cocktail-party"

    def __init__(
        self,
        *,
        max_iter: int = 1000,
        tolerance: float = 1e-6,
        seed: int | None = 0,
        time_budget: float | None = None,
        **_: Any,
    ) -> None:
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
        if not (isinstance(tolerance, float) and math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"tolerance must be a positive finite float, got {tolerance!r}")
        self.max_iter = max_iter
        self.tolerance = tolerance
        self.seed = seed
        self.time_budget = time_budget

    def invert(
        self,
        weight_grad: ArrayLike,
        bias_grad: ArrayLike,
        *,
        weight: ArrayLike,
        bias: ArrayLike,
        batch_size: int | None = None,
        time_budget: float | None = None,
    ) -> Reconstruction:
        """Unmix the layer's inputs from its update.

        Parameters
        ----------
        weight_grad, bias_grad
            ``(m, n)`` and ``(m,)``: the update (any scale and sign).
        weight, bias
            The layer's parameters (validated for shape; ICA does not use them).
        batch_size
            The number of sources; None estimates it from the singular-value gap.
        time_budget
            Unused (see the class docstring).

        Returns
        -------
        Reconstruction
            ``(b, n)`` approximate inputs; ``complete`` is always False and ``confidence`` is
            each source's non-Gaussianity (excess kurtosis magnitude, squashed to [0, 1)).

        Raises
        ------
        ValueError
            On malformed input or a batch size above ``min(m, n)``.
        """
        start = time.perf_counter()
        update = ObservedUpdate.from_arrays(
            weight_grad, bias_grad, weight=weight, bias=bias, device=torch.device("cpu")
        )
        dw = update.weight_grad.numpy()
        db = update.bias_grad.numpy()
        m, n = dw.shape
        check_time_budget(time_budget)
        check_batch_size(batch_size)
        if batch_size is None:
            singular_values = torch.linalg.svdvals(update.weight_grad)
            b = int(estimate_batch_size(singular_values, shape=(m, n)).batch_size)
        else:
            b = batch_size
        if not 1 <= b <= min(m, n):
            raise ValueError(f"batch size {b} is not in [1, min(m, n) = {min(m, n)}]")
        # the n input coordinates are ICA's observations, the m rows of dW its mixtures
        ica = FastICA(
            n_components=b,
            whiten="unit-variance",
            max_iter=self.max_iter,
            tol=self.tolerance,
            random_state=self.seed,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            sources = ica.fit_transform(dw.T).T  # (b, n): unit-variance sources, centred per row of dW
        mixing = ica.mixing_  # (m, b): dW ~= mixing @ sources + mean 1^T
        inputs = _restore_means_and_scales(mixing, sources, ica.mean_, db)
        kurtosis = np.abs(
            ((sources - sources.mean(1, keepdims=True)) ** 4).mean(1) / (sources.var(1) ** 2) - 3.0
        )
        confidence = kurtosis / (1.0 + kurtosis)
        return Reconstruction(
            inputs=torch.from_numpy(np.ascontiguousarray(inputs)),
            batch_size=b,
            sparsity_matching=float("nan"),
            complete=False,
            confidence=torch.from_numpy(confidence.astype(np.float64)),
            seconds=time.perf_counter() - start,
            stats={
                "attack": self.name,
                "approximate": True,
                "ica_iterations": int(getattr(ica, "n_iter_", 0)),
                "directions_found": 0,
            },
        )


def _restore_means_and_scales(
    mixing: np.ndarray, sources: np.ndarray, row_means: np.ndarray, db: np.ndarray
) -> np.ndarray:
    """Inputs from ICA's centred, unit-scale sources.

    ICA centres every row of ``dW = G X`` over the input coordinates, so its sources are
    ``x_i - mean(x_i)`` up to scale; the row means ``G mean(X)`` give the means back through
    the mixing matrix. The bias update ``db = sum_i g_i = G' d`` then gives each source's
    scale and sign (SPEAR Thm. 3.5): ``x_i = x'_i / d_i``.
    """
    source_means = np.linalg.lstsq(mixing, row_means, rcond=None)[0]
    unscaled = sources + source_means[:, None]
    inverse_scales = np.linalg.lstsq(mixing, db, rcond=None)[0]
    safe = np.where(np.abs(inverse_scales) > 1e-300, inverse_scales, 1e-300)
    return unscaled / safe[:, None]
