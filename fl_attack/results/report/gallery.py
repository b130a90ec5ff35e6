"""Reconstructed samples beside their ground truth, cut out of the attacks' ``reconstruction.png``.

The page shows each sample as two tiles (truth, recovered) with HTML labels; the files under
``report/`` get the same samples as one labelled picture (``best.png``, ``worst.png``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fl_attack.results.report.formatting import short_name
from fl_attack.results.report.loading import AttackEntry
from fl_attack.vocabulary import format_psnr

__all__ = ["Sample", "SampleTiles", "best_and_worst", "gallery_png", "sample_tiles", "scored_samples"]

#: Side in pixels of the longer edge of one tile.
TILE_PIXELS = 96


@dataclass(frozen=True)
class Sample:
    """One drawn column of an attack's ``reconstruction.png``: ground truth above its match."""

    entry: AttackEntry
    column: int
    psnr: float


@dataclass(frozen=True)
class SampleTiles:
    """A sample's two tiles as PNG bytes, with what its caption says."""

    sample: Sample
    truth: bytes
    recovered: bytes

    @property
    def caption(self) -> str:
        """``"round 1, partition-0, sample 2: > 150 dB"``."""
        sample = self.sample
        where = f"round {sample.entry.server_round}, {sample.entry.client}, sample {sample.column}"
        return f"{where}: {format_psnr(sample.psnr)}"


def scored_samples(entries: Sequence[AttackEntry]) -> list[Sample]:
    """Every drawn (ground truth, reconstruction) column that has a finite PSNR."""
    samples = []
    for entry in entries:
        grid = entry.grid or {}
        values = grid.get("column_psnr")
        if entry.grid_png is None or not isinstance(values, list) or int(grid.get("rows", 0)) != 2:
            continue
        for column, value in enumerate(values):
            if isinstance(value, (int, float)) and math.isfinite(value):
                samples.append(Sample(entry, column, float(value)))
    return samples


def best_and_worst(samples: Sequence[Sample], size: int) -> tuple[list[Sample], list[Sample]]:
    """The ``size`` best and ``size`` worst samples, never showing one twice (worst first)."""
    ordered = sorted(samples, key=lambda s: (-s.psnr, s.entry.server_round, s.entry.client, s.column))
    best = ordered[: min(size, math.ceil(len(ordered) / 2))]
    worst = ordered[len(best) :][::-1][:size]
    return best, worst


def _crop(picture: Image.Image, grid: Mapping[str, Any], row: int, column: int) -> Image.Image:
    padding = int(grid.get("padding", 2))
    tile_h, tile_w = int(grid["tile_height"]), int(grid["tile_width"])
    top = padding + row * (tile_h + padding)
    left = padding + column * (tile_w + padding)
    tile = picture.crop((left, top, left + tile_w, top + tile_h))
    scale = TILE_PIXELS / max(tile_w, tile_h)
    size = (max(1, round(tile_w * scale)), max(1, round(tile_h * scale)))
    return tile.resize(size, Image.Resampling.NEAREST)


def _encode(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def _pairs(samples: Sequence[Sample]) -> list[tuple[Image.Image, Image.Image]]:
    opened: dict[Path, Image.Image] = {}
    try:
        pairs = []
        for sample in samples:
            path = sample.entry.grid_png
            if path is None:
                raise ValueError(f"sample {sample.column} of {sample.entry.client} has no reconstruction.png")
            if path not in opened:
                with Image.open(path) as picture:
                    opened[path] = picture.convert("RGB")
            grid = sample.entry.grid or {}
            pairs.append(
                (_crop(opened[path], grid, 0, sample.column), _crop(opened[path], grid, 1, sample.column))
            )
        return pairs
    finally:
        for image in opened.values():
            image.close()


def sample_tiles(samples: Sequence[Sample]) -> list[SampleTiles]:
    """The truth and recovered tiles of each sample, as PNG bytes."""
    return [
        SampleTiles(sample=sample, truth=_encode(truth), recovered=_encode(recovered))
        for sample, (truth, recovered) in zip(samples, _pairs(samples), strict=True)
    ]


def gallery_png(samples: Sequence[Sample], title: str) -> bytes | None:
    """One labelled picture of ``samples``: ground truth row above the recovered row, PSNR per column."""
    if not samples:
        return None
    pairs = _pairs(samples)
    try:
        font: Any = ImageFont.load_default(size=12)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        font = ImageFont.load_default()
    gap, label_h, left, title_h = 8, 34, 104, 24
    width = left + len(pairs) * (TILE_PIXELS + gap)
    height = title_h + label_h + 2 * TILE_PIXELS + gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), title, fill="black", font=font)
    draw.text((4, title_h + label_h + TILE_PIXELS // 2), "ground truth", fill="black", font=font)
    draw.text((4, title_h + label_h + gap + TILE_PIXELS * 3 // 2), "recovered", fill="black", font=font)
    for index, (sample, (truth, recovered)) in enumerate(zip(samples, pairs, strict=True)):
        x = left + index * (TILE_PIXELS + gap)
        draw.text(
            (x, title_h),
            f"r{sample.entry.server_round} {short_name(sample.entry.client, 14)}",
            fill="black",
            font=font,
        )
        draw.text((x, title_h + 15), f"#{sample.column} {format_psnr(sample.psnr)}", fill="black", font=font)
        canvas.paste(truth, (x, title_h + label_h))
        canvas.paste(recovered, (x, title_h + label_h + TILE_PIXELS + gap))
    return _encode(canvas)
