"""Where the DP-noise gap between the attack and the oracle comes from, batch by batch.

::

    python -m experiments.dp_gap --noise-factor 1 --seeds 0-9 --time-budget 60
    python -m experiments.dp_gap --cell 150x4000 --noise-factor 0.5 --seeds 0-2 --time-budget 240 --threads 2

Attacks the batches of the DP table (CIFAR-10, the SPEAR++ victim, by default b = 20, m = 200,
trial t = seed t, as ``python -m experiments run spearpp-t3``) and scores, against the ground truth:

- ``ours``: the attack's reconstruction, and ``rows_above``: how many of its rows (matched to
  the true inputs) are above 25 dB; ``rescaled``: each row times its best factor against
  the truth (a diagnostic: what a perfect scale would give); ``in_span``: the share of the
  rescaled rows' error energy inside the span of the true inputs (other samples mixed in);
- ``subspace``: the true ``dL/dZ`` columns projected onto the rank-b left factor of the noisy
  update (the attack's search space), scales from the noisy bias gradient: the ceiling of an
  attack that finds every direction as well as that factor allows;
- ``bias_scale``: the true ``dL/dZ`` directions with scales from the noisy bias gradient, and
  ``scale_err``: the rms relative error of those scales; ``oracle``: the true ``dL/dZ``;
- the image prior step by step: ``clip`` (pixel range only), ``tv`` (luma/chroma TV and range)
  and ``denoised`` (box-fill scale prior, TV and range: the table's *denoised*);
- the directions: ``missing``, the rows the attack left unclaimed (confidence 0); ``blends``,
  the claimed rows whose implied ``dL/dZ`` column (least squares of the update on the recovered
  rows) has a cosine below :data:`BLEND_COSINE` to the true column of the sample it is matched
  to, projected onto the left factor (on CIFAR-10 at (150, 4000), DP 0.5x, such rows mix 3-4
  look-alike samples of one class); ``column_cos``: the median cosine of the other claimed rows.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence

import torch

from experiments.config import Cell, Setting, parse_cells
from experiments.dp_prior import denoised_attack, tv_and_range
from experiments.observe import draw_trial, observe
from experiments.runner import invert, load_data
from fl_attack.data.images import ImageData
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.image_priors.denoise import row_noise_std
from fl_attack.pipeline.spectrum.decompose import LowRankFactors, decompose
from fl_attack.simulate.victims import output_gradient

_THRESHOLD_DB = 25.0
_DEFAULT_CELL = Cell(20, 200)

#: Cosine below which a claimed row's implied column counts as a blend of samples, not a noisy
#: copy of its own. On CIFAR-10 at (150, 4000), DP 0.5x, seed 0 (24.2 dB), the claimed rows' median
#: is 0.998 and 7 rows fall below 0.95 (down to 0.38); the attack's own directions checked against
#: the truth showed 7 blends there too, at cosines 0.56-0.94 to their nearest true direction.
BLEND_COSINE = 0.95

#: Scores that are counts or ratios, not PSNRs: left out of the "above 25 dB" line.
_NOT_PSNR = ("in_span", "scale_err", "rows_above", "missing", "blends", "column_cos")


def parse_seeds(text: str) -> list[int]:
    """``"0-9"`` or ``"0,3,5"`` (or both, comma-separated) as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad seed range {part!r} (use e.g. 0-9 or 0,3,5)") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad seed range {part!r}")
        seeds.extend(range(first, last + 1))
    return seeds


def _psnr(inputs: torch.Tensor, reference: torch.Tensor, data: ImageData) -> float:
    return evaluate_reconstruction(
        inputs, reference, denormalize=data.denormalize, image_shape=data.image_shape
    ).mean_psnr


def subspace_ceiling(
    *,
    columns: torch.Tensor,
    weight_grad: torch.Tensor,
    bias_grad: torch.Tensor,
    factors: LowRankFactors | None = None,
) -> torch.Tensor:
    """Inputs from the true ``(b, m)`` columns projected onto the noisy update's rank-b left factor,
    each scaled by least squares on the noisy bias gradient: ``X = Q^{-1} R`` for those directions.
    ``factors``: the update's rank-b decomposition, when already computed."""
    if factors is None:
        factors = decompose(weight_grad, batch_size=columns.shape[0])
    directions = columns @ factors.left
    directions = directions / directions.norm(dim=1, keepdim=True)
    unit_columns = factors.left @ directions.T  # (m, b)
    scales = torch.linalg.lstsq(unit_columns, bias_grad[:, None]).solution.squeeze(1)
    inputs: torch.Tensor = torch.linalg.solve(directions.T * scales, factors.right)
    return inputs


def implied_column_cosines(
    *, inputs: torch.Tensor, columns: torch.Tensor, weight_grad: torch.Tensor, left: torch.Tensor
) -> torch.Tensor:
    """``(b,)``: for each row of ``inputs`` (matched, row ``i`` to true sample ``i``), the cosine
    between the ``dL/dZ`` column the rows imply (least squares of ``weight_grad = D X``) and the
    true column ``columns[i]`` projected onto ``left``, the update's rank-b left factor (the
    attack's search space: no direction can be closer to the truth than that projection)."""
    if inputs.shape[0] != columns.shape[0]:
        raise ValueError(f"need one true column per row: {inputs.shape[0]} rows, {columns.shape[0]} columns")
    implied = torch.linalg.lstsq(inputs.T, weight_grad.T).solution  # (b, m)
    projected = columns @ left @ left.T
    return torch.nn.functional.cosine_similarity(implied, projected, dim=1)


def direction_census(cosines: torch.Tensor, claimed: torch.Tensor) -> dict[str, float]:
    """``missing``, ``blends`` and ``column_cos`` (module docstring) from the rows' implied-column
    cosines and which rows the attack claimed (``confidence > 0``)."""
    blend = claimed & (cosines < BLEND_COSINE)
    right = claimed & ~blend
    return {
        "missing": float((~claimed).sum()),
        "blends": float(blend.sum()),
        "column_cos": float(cosines[right].median()) if bool(right.any()) else math.nan,
    }


def batch_gap(
    seed: int, *, factor: float, budget: float, data: ImageData, cell: Cell = _DEFAULT_CELL
) -> dict[str, float]:
    """The scores of one batch (see the module docstring)."""
    setting = Setting("dp", cell, ("l1",), 1, params={"noise_factor": factor}, threshold_db=_THRESHOLD_DB)
    trial = draw_trial(data, setting, index=seed, seed=seed)
    observation = observe(setting, trial, data)
    options = {
        "known_batch_size": True,
        "time_budget": budget,
        "hard_limit_slack": 30.0,
        "known_local_steps": False,
        "next_layer": False,
    }
    rec = invert("l1", observation, trial=trial, data=data, options=options)
    ref, ours = observation.reference, rec.inputs.to(torch.float64)
    grad = observation.update.weight_update.double()
    bias = observation.update.bias_update.double()
    noise_std = float(rec.stats["noise_std"])
    quality = evaluate_reconstruction(ours, ref, denormalize=data.denormalize, image_shape=data.image_shape)
    aligned = ours[quality.order.clamp_min(0)]
    best = (aligned * ref).sum(dim=1) / aligned.square().sum(dim=1)
    error = aligned * best[:, None] - ref
    in_span = error @ ref.T @ torch.linalg.solve(ref @ ref.T, ref)
    d = output_gradient(trial.model, trial.inputs, trial.labels)
    unit = d / d.norm(dim=1, keepdim=True)
    scales = torch.linalg.lstsq(unit.T, bias[:, None]).solution.squeeze(1)
    scaled = unit * scales[:, None]
    noise = row_noise_std(weight_grad=grad, inputs=ours, noise_std=noise_std)
    tv = tv_and_range(ours, noise, data)
    clip = data.normalize(data.denormalize(ours).clamp(0.0, 1.0)).reshape(ours.shape[0], -1)
    denoised = denoised_attack(ours, weight_grad=grad, bias_grad=bias, noise_std=noise_std, data=data)
    matched = quality.order >= 0
    factors = decompose(grad, batch_size=d.shape[0])
    cosines = implied_column_cosines(inputs=aligned, columns=d.double(), weight_grad=grad, left=factors.left)
    claimed = matched & (rec.confidence.to(torch.float64)[quality.order.clamp_min(0)] > 0)
    return {
        "ours": quality.mean_psnr,
        "rows_above": float((quality.psnr > _THRESHOLD_DB).sum()),
        "subspace": _psnr(
            subspace_ceiling(columns=d.double(), weight_grad=grad, bias_grad=bias, factors=factors), ref, data
        ),
        "rescaled": _psnr(aligned * best[:, None], ref, data),
        "in_span": float(in_span.square().sum() / error.square().sum()),
        "bias_scale": _psnr(torch.linalg.solve(scaled @ scaled.T, scaled @ grad), ref, data),
        "scale_err": float((scales / d.norm(dim=1) - 1).square().mean().sqrt()),
        "oracle": _psnr(torch.linalg.solve(d @ d.T, d @ grad), ref, data),
        "clip": _psnr(clip, ref, data),
        "tv": _psnr(tv, ref, data),
        "denoised": _psnr(denoised, ref, data),
        **direction_census(cosines, claimed),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--noise-factor", type=float, default=1.0, help="noise std / median |dL/dW|")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-9"), help="e.g. 0-9 or 0,3,5")
    parser.add_argument("--time-budget", type=float, default=60.0, help="attack budget, s per batch")
    parser.add_argument("--data-root", default=None, help="root of the datasets (default: searched)")
    parser.add_argument("--cell", default="20x200", help="<b>x<m> of the attacked layer (default 20x200)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    if not args.noise_factor > 0:
        parser.error(f"--noise-factor must be positive, got {args.noise_factor}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    try:
        cells = parse_cells(args.cell)
    except ValueError as error:
        parser.error(f"--cell: {error}")
    if len(cells) != 1:
        parser.error(f"--cell must be exactly one cell, e.g. 150x4000, got {args.cell!r}")
    torch.set_num_threads(args.threads)
    setting = Setting("dp", cells[0], ("l1",), 1, data_root=args.data_root)
    data = load_data([setting])[setting.data_key]
    if not isinstance(data, ImageData):
        raise TypeError("the DP table runs on CIFAR-10 images")
    rows = []
    for seed in args.seeds:
        row = batch_gap(seed, factor=args.noise_factor, budget=args.time_budget, data=data, cell=cells[0])
        rows.append(row)
        print(f"seed {seed}: " + " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    means = {key: statistics.fmean(row[key] for row in rows) for key in rows[0]}
    passed = {key: sum(row[key] > _THRESHOLD_DB for row in rows) for key in rows[0] if key not in _NOT_PSNR}
    print("mean: " + " ".join(f"{k}={v:.3g}" for k, v in means.items()))
    print(f"above {_THRESHOLD_DB:g} dB (of {len(rows)}): " + " ".join(f"{k}={v}" for k, v in passed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
