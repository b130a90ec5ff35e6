"""Where the DP-noise gap between the attack and the oracle comes from, batch by batch.

::

    python -m experiments.dp_gap --noise-factor 1 --seeds 0-9 --time-budget 60

Attacks the batches of the DP table (CIFAR-10, the SPEAR++ victim, b = 20, m = 200, trial t =
seed t, as ``python -m experiments run spearpp-t3``) and scores, against the ground truth:

- ``ours``: the attack's reconstruction; ``rescaled``: each row times its best factor against
  the truth (a diagnostic: what a perfect scale would give); ``in_span``: the share of the
  rescaled rows' error energy inside the span of the true inputs (other samples mixed in);
- ``bias_scale``: the true ``dL/dZ`` directions with scales from the noisy bias gradient, and
  ``scale_err``: the rms relative error of those scales; ``oracle``: the true ``dL/dZ``;
- the image prior step by step: ``clip`` (pixel range only), ``tv`` (TV and range) and
  ``denoised`` (size prior, TV and range: the table's *denoised*).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch

from experiments.config import Cell, Setting
from experiments.dp_prior import denoised_attack
from experiments.observe import draw_trial, observe
from experiments.runner import invert, load_data
from fl_attack.data.images import ImageData
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.denoise import denoise_images, row_noise_std
from fl_attack.simulate.victims import output_gradient

_THRESHOLD_DB = 25.0


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


def batch_gap(seed: int, *, factor: float, budget: float, data: ImageData) -> dict[str, float]:
    """The scores of one batch (see the module docstring)."""
    setting = Setting(
        "dp", Cell(20, 200), ("l1",), 1, params={"noise_factor": factor}, threshold_db=_THRESHOLD_DB
    )
    trial = draw_trial(data, setting, index=seed, seed=seed)
    observation = observe(setting, trial, data)
    options = {"known_batch_size": True, "time_budget": budget, "hard_limit_slack": 30.0}
    rec = invert("l1", observation, trial=trial, data=data, options=options)
    ref, ours = observation.reference, rec.inputs.to(torch.float64)
    grad = observation.update.weight_grad.double()
    bias = observation.update.bias_grad.double()
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
    c, h, w = data.image_shape
    tv = denoise_images(ours, row_noise=noise, image_shape=(c, h, w), mean=data.mean, std=data.std)
    clip = data.normalize(data.denormalize(ours).clamp(0.0, 1.0)).reshape(ours.shape[0], -1)
    denoised = denoised_attack(ours, weight_grad=grad, bias_grad=bias, noise_std=noise_std, data=data)
    return {
        "ours": quality.mean_psnr,
        "rescaled": _psnr(aligned * best[:, None], ref, data),
        "in_span": float(in_span.square().sum() / error.square().sum()),
        "bias_scale": _psnr(torch.linalg.solve(scaled @ scaled.T, scaled @ grad), ref, data),
        "scale_err": float((scales / d.norm(dim=1) - 1).square().mean().sqrt()),
        "oracle": _psnr(torch.linalg.solve(d @ d.T, d @ grad), ref, data),
        "clip": _psnr(clip, ref, data),
        "tv": _psnr(tv, ref, data),
        "denoised": _psnr(denoised, ref, data),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--noise-factor", type=float, default=1.0, help="noise std / median |dL/dW|")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-9"), help="e.g. 0-9 or 0,3,5")
    parser.add_argument("--time-budget", type=float, default=60.0, help="attack budget, s per batch")
    parser.add_argument("--data-root", default=None, help="root of the datasets (default: searched)")
    args = parser.parse_args(argv)
    if not args.noise_factor > 0:
        parser.error(f"--noise-factor must be positive, got {args.noise_factor}")
    torch.set_num_threads(1)
    setting = Setting("dp", Cell(20, 200), ("l1",), 1, data_root=args.data_root)
    data = load_data([setting])[setting.data_key]
    if not isinstance(data, ImageData):
        raise TypeError("the DP table runs on CIFAR-10 images")
    rows = []
    for seed in args.seeds:
        row = batch_gap(seed, factor=args.noise_factor, budget=args.time_budget, data=data)
        rows.append(row)
        print(f"seed {seed}: " + " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    means = {key: statistics.fmean(row[key] for row in rows) for key in rows[0]}
    passed = {
        key: sum(row[key] > _THRESHOLD_DB for row in rows)
        for key in rows[0]
        if key not in ("in_span", "scale_err")
    }
    print("mean: " + " ".join(f"{k}={v:.3g}" for k, v in means.items()))
    print(f"above {_THRESHOLD_DB:g} dB (of {len(rows)}): " + " ".join(f"{k}={v}" for k, v in passed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
