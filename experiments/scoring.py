"""Scoring one attack against the ground truth, and summarising the batches of a setting.

Images are scored by :func:`fl_attack.evaluation.metrics.evaluate_reconstruction` (Hungarian
matching, PSNR on de-normalized ``[0, 1]`` images; a batch is recovered when its mean PSNR
beats the setting's threshold), the inputs of deeper layers by the same matching on their own
scale (recovered when every input is exact), tabular rows by
:meth:`fl_attack.data.tabular.TabularData.score` (recovered when every row is exact).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from experiments.config import Setting
from experiments.dp_prior import denoised_attack
from experiments.observe import Data, Observation
from fl_attack.data.images import ImageData
from fl_attack.data.tabular import TabularData
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.reconstruction import Reconstruction

_IMAGE_METRICS = ("mean_psnr", "min_psnr", "exact_fraction", "approx_fraction", "lpips", "proposals")
_LAYER_METRICS = ("mae", "max_abs_error", "mean_psnr", "min_psnr", "exact_fraction", "approx_fraction")
_SECAGG_METRICS = ("client_recovery", "clients_full", "client_fractions")
_BASELINE_METRICS = ("cosine_similarity", "iterations")
_DP_METRICS = ("denoised_mean_psnr", "denoised_success")
Metrics = dict[str, Any]
_MEDIANS = ("mae", "proposals")
"""Metrics whose median over the batches is reported beside their mean."""


@dataclass
class Outcome:
    """One attacked batch: how the attack went and its scores.

    ``metrics`` holds the scores (absent when the attack failed) and the facts of the
    observed update (present either way); ``ok`` is the setting's batch criterion.
    """

    method: str
    batch_size: int
    seconds: float
    cpu_seconds: float = 0.0
    ok: bool = False
    found: int = 0
    complete: bool = False
    sparsity_matching: float = math.nan
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def record(self) -> dict[str, Any]:
        """The CSV fields of this batch."""
        rounded = {key: _significant(value) for key, value in self.metrics.items()}
        timing = {
            key: _significant(getattr(self, key)) for key in ("seconds", "cpu_seconds", "sparsity_matching")
        }
        counts = {
            "ok": int(self.ok),
            "found": self.found,
            "batch_size": self.batch_size,
            "complete": int(self.complete),
        }
        return {"method": self.method, **counts, **rounded, **timing, "error": self.error}


def _significant(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.7g}")
    return value


def metric_fields(setting: Setting, data: Data) -> tuple[str, ...]:
    """The metrics (and facts, see :data:`experiments.observe.FACTS`) a setting's rows carry."""
    if isinstance(data, TabularData):
        features = tuple(f"mae_{feature.name}" for feature in data.schema.continuous)
        return ("discrete_accuracy", "continuous_mae", "exact_fraction", *features)
    if setting.section == "layer":
        return _LAYER_METRICS
    extra = {"secagg": _SECAGG_METRICS, "full": _BASELINE_METRICS, "dp": _DP_METRICS}.get(setting.section, ())
    return (*_IMAGE_METRICS, *extra)


def client_recovery(psnr: torch.Tensor | None, setting: Setting) -> dict[str, Any]:
    """Secure aggregation: the share of each client's samples above the threshold (0 on failure)."""
    clients, size = setting.params["clients"], setting.params["client_batch"]
    if psnr is None:
        fractions = [0.0] * clients
    else:
        fractions = [
            float((psnr[c * size : (c + 1) * size] > setting.threshold_db).double().mean())
            for c in range(clients)
        ]
    return {
        "client_recovery": statistics.fmean(fractions),
        "clients_full": statistics.fmean(f == 1.0 for f in fractions),
        "client_fractions": ";".join(f"{f:.2f}" for f in fractions),
    }


def score(setting: Setting, rec: Reconstruction, observed: Observation, data: Data) -> tuple[bool, Metrics]:
    """The batch criterion and the scores of one reconstruction."""
    reference = observed.reference
    if isinstance(data, TabularData):
        scored = data.score(rec.inputs, reference)
        metrics = {
            name: getattr(scored, name) for name in ("discrete_accuracy", "continuous_mae", "exact_fraction")
        }
        metrics |= {f"mae_{name}": value for name, value in scored.feature_mae.items()}
        return scored.exact_fraction == 1.0, metrics
    layer = setting.section == "layer"
    images = None if layer or isinstance(data, TabularData) else data  # layer inputs: on their own scale
    denormalize, shape = (images.denormalize, images.image_shape) if images else (None, None)
    quality = evaluate_reconstruction(rec.inputs, reference, denormalize=denormalize, image_shape=shape)
    metrics = {"mean_psnr": quality.mean_psnr, "min_psnr": float(quality.psnr.min())}
    metrics |= {"exact_fraction": quality.exact_fraction, "approx_fraction": quality.approx_fraction}
    if layer:  # Table 4: errors on the layer's own scale; recovered when every input is exact
        matched = quality.order >= 0
        if bool(matched.all()):
            errors = (rec.inputs.to(torch.float64)[quality.order] - reference).abs()
            metrics |= {"mae": float(errors.mean()), "max_abs_error": float(errors.max())}
        return quality.exact_fraction == 1.0, metrics
    if quality.lpips is not None:
        metrics["lpips"] = float(quality.lpips.nanmean())
    for key in ("proposals", *_BASELINE_METRICS):
        if key in rec.stats:
            metrics[key] = float(rec.stats[key])
    if setting.section == "secagg":
        metrics |= client_recovery(quality.psnr, setting)
    if setting.section == "dp" and isinstance(data, ImageData):
        metrics |= _denoised(setting, rec, observed, data)
    return quality.mean_psnr > setting.threshold_db, metrics


def _denoised(setting: Setting, rec: Reconstruction, observed: Observation, data: ImageData) -> Metrics:
    """The DP table's second score: the reconstruction under the image prior (a prior, never exact).

    Absent (NaN) when the attack read no noise off the spectrum or its rows are linearly
    dependent (no gradient columns fit them).
    """
    noise_std = float(rec.stats.get("noise_std", 0.0))
    update = observed.update
    try:
        denoised = denoised_attack(
            rec.inputs,
            weight_grad=update.weight_update,
            bias_grad=update.bias_update,
            noise_std=noise_std,
            data=data,
        )
    except ValueError:
        return {"denoised_mean_psnr": math.nan, "denoised_success": math.nan}
    quality = evaluate_reconstruction(
        denoised, observed.reference, denormalize=data.denormalize, image_shape=data.image_shape
    )
    return {
        "denoised_mean_psnr": quality.mean_psnr,
        "denoised_success": float(quality.mean_psnr > setting.threshold_db),
    }


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Aggregate the batches of one (setting, method).

    Returns
    -------
    dict
        ``trials``, ``successes`` and ``accuracy`` (% meeting the batch criterion),
        ``errors`` (attacks that raised or overran the hard limit), ``complete`` (% reported
        complete), ``mean_found_fraction``, ``median_seconds`` and ``median_cpu_seconds`` over
        all batches, and each metric's mean over the batches that have it (None when none
        does); ``median_mae`` and ``median_proposals`` too.
    """
    if not outcomes:
        raise ValueError("summarize needs at least one outcome")
    count = len(outcomes)
    successes = sum(o.ok for o in outcomes)
    row: dict[str, Any] = {
        "trials": count,
        "successes": successes,
        "accuracy": 100.0 * successes / count,
        "errors": sum(bool(o.error) for o in outcomes),
        "complete": 100.0 * sum(o.complete for o in outcomes) / count,
        "mean_found_fraction": statistics.fmean(o.found / o.batch_size for o in outcomes),
        "median_seconds": statistics.median(o.seconds for o in outcomes),
        "median_cpu_seconds": statistics.median(o.cpu_seconds for o in outcomes),
    }
    for key in dict.fromkeys(key for o in outcomes for key in o.metrics):
        values = [o.metrics[key] for o in outcomes if key in o.metrics]
        if any(isinstance(value, str) for value in values):
            continue  # per-batch text (secure aggregation's client fractions)
        values = _finite(values)
        row[key] = statistics.fmean(values) if values else None
        if key in _MEDIANS:
            row[f"median_{key}"] = statistics.median(values) if values else None
    return row
