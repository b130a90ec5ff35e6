"""What the server can tell about an update before or after attacking it, without ground truth.

An exact attack on a linear layer needs the update to be one gradient of a small batch: a
matrix of rank ``b`` (a clear singular-value gap), with ReLU-sparse left factors. These
figures explain a verdict in one sentence when the attack does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fl_attack.pipeline.spectrum.decompose import estimate_batch_size

#: Share of non-zero entries within 5% of the median magnitude above which an update is
#: sign-like, the mark of per-coordinate scaled steps (Adam & co.): a gradient's entries
#: spread over orders of magnitude (a few percent of them lie that close to the median).
ADAPTIVE_CONCENTRATION = 0.5
#: An estimated rank above this share of ``min(m, n)`` is "no low-rank structure".
FULL_RANK_SHARE = 0.9
#: Without a clean float32 gap, ``s_b / s_{b+1}`` must reach this for a noisy low-rank structure.
NOISY_MIN_GAP = 2.0


@dataclass(frozen=True)
class UpdateSignature:
    """Figures read off one observed layer update.

    Attributes
    ----------
    shape : tuple[int, int]
        ``(m, n)``: neurons and input features of the layer.
    zero : bool
        The update is exactly zero.
    rank_estimate : int or None
        The batch size the spectrum suggests (None when no structure was found).
    spectral_gap : float
        ``s_b / s_{b+1}`` at that estimate (1.0 when none was found).
    relative_noise : float
        ``s_{b+1} / s_b``: about 1e-7 for a clean float32 gradient, near 1 under heavy noise.
    noisy : bool
        No clean gap was found (noise-threshold estimate instead).
    magnitude_concentration : float
        Share of the non-zero entries within 5% of the median magnitude.
    """

    shape: tuple[int, int]
    zero: bool
    rank_estimate: int | None
    spectral_gap: float
    relative_noise: float
    noisy: bool
    magnitude_concentration: float

    @property
    def adaptive_like(self) -> bool:
        """Entries of near-equal magnitude: the mark of an adaptive optimizer such as Adam."""
        return self.magnitude_concentration > ADAPTIVE_CONCENTRATION

    @property
    def low_rank(self) -> bool:
        """Whether the update shows the low-rank structure of one small batch's gradient."""
        if self.rank_estimate is None:
            return False
        if self.noisy and self.spectral_gap < NOISY_MIN_GAP:
            return False
        return self.rank_estimate < FULL_RANK_SHARE * min(self.shape)

    def as_dict(self) -> dict[str, float | int | bool | None]:
        """JSON-ready figures."""
        return {
            "rank_estimate": self.rank_estimate,
            "spectral_gap": self.spectral_gap,
            "relative_noise": self.relative_noise,
            "noisy": self.noisy,
            "magnitude_concentration": self.magnitude_concentration,
        }


#: :func:`magnitude_concentration` reads at most this many entries, evenly strided: a share
#: estimated from 65536 entries is within +-0.004 (one standard error at 0.5) of the whole
#: layer's, far finer than the gap between gradients (a few %) and Adam steps (> 50%).
CONCENTRATION_SAMPLE = 1 << 16


def magnitude_concentration(values: np.ndarray) -> float:
    """Share of the non-zero entries of ``values`` whose magnitude is within 5% of the median one.

    Large arrays are read at an even stride of at most :data:`CONCENTRATION_SAMPLE` entries
    (this runs in the server for every finished attack).
    """
    flat = np.asarray(values).reshape(-1)
    magnitudes = np.abs(flat[:: max(1, flat.size // CONCENTRATION_SAMPLE)].astype(np.float64))
    magnitudes = magnitudes[magnitudes != 0]
    if magnitudes.size == 0:
        return 0.0
    median = float(np.median(magnitudes))
    return float(np.mean(np.abs(magnitudes - median) <= 0.05 * median))


def update_signature(weight_update: np.ndarray) -> UpdateSignature:
    """Read the rank, gap, noise and magnitude figures of an ``(m, n)`` layer update.

    Raises
    ------
    ValueError
        If ``weight_update`` is not a finite 2-D array.
    """
    delta = np.asarray(weight_update, dtype=np.float64)
    if delta.ndim != 2:
        raise ValueError(f"a layer update must be a 2-D (m, n) matrix, got shape {delta.shape}")
    if not np.isfinite(delta).all():
        raise ValueError(f"the layer update contains {int((~np.isfinite(delta)).sum())} NaN or Inf entries")
    shape = (int(delta.shape[0]), int(delta.shape[1]))
    magnitudes = np.abs(delta[delta != 0])
    if magnitudes.size == 0:
        return UpdateSignature(shape, True, None, 1.0, 1.0, True, 0.0)
    spread = magnitude_concentration(magnitudes)
    singular_values = torch.linalg.svdvals(torch.from_numpy(delta))
    try:
        spectrum = estimate_batch_size(singular_values, shape=shape)
    except ValueError:
        return UpdateSignature(shape, False, None, 1.0, 1.0, True, spread)
    return UpdateSignature(
        shape,
        False,
        int(spectrum.batch_size),
        float(spectrum.gap),
        float(spectrum.relative_noise),
        bool(spectrum.noisy),
        spread,
    )
