"""Recovered rows on an 8-bit pixel grid: images, certified without the ReLU patterns.

Images are stored as 8-bit pixels and normalized per channel, so every input a client trains on
has, in each channel, the values ``(k / 255 - mean) / std`` for integers ``0 <= k <= 255``: a
lattice ``offset + step * k`` of at most 256 levels. A recovered row is an affine combination
``sum_i a_i x_i`` (``sum_i a_i = 1``, the bias) of the client's inputs. On the lattice of a batch
of natural images this holds only for integer ``a``: a blend (``0 < a_i < 1``) puts pixels
between levels (``1/2`` halves the step, and a batch spanning 128 levels or more no longer fits in
256), and an integer extrapolation such as ``2 x_1 - x_2`` leaves the 256 levels wherever the two
images differ by much. So when a complete, full-rank reconstruction puts every value of every row
within a tenth of a level of one lattice per channel that spans at least half of the 256 levels,
its rows are the client's images, and rounding them to the lattice gives their exact pixels. This
certificate needs neither ``W_0``'s patterns nor the training's steps, which several local epochs
blur; the lattice (``mean`` and ``std``) is read from the rows themselves.

Inputs that are not 8-bit images (features of a deeper layer, tabular data, images resized or
colour-jittered by augmentation) fit no such lattice: they get no certificate from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PixelGrid", "pixel_grid"]

#: Levels of an 8-bit pixel.
LEVELS = 256

#: Largest distance of a value from its level, in levels: a right row's rounding sits far below
#: it (float32 weights after 100 local steps left at most 0.03 on CIFAR-10 and MNIST) and it keeps
#: the rounding away from the next level by many times the spread, so snapping is exact.
MAX_DEVIATION = 0.1

#: The lattice must span at least this many levels, so that a half-blend (half the step) cannot
#: fit in :data:`LEVELS` and a few-valued input (binary, one-hot) is never taken for pixels.
MIN_SPAN = 128

#: A channel needs at least this many values for the lattice to say anything.
MIN_VALUES = 256

#: Rows whose extrapolations against all others are formed at once.
PAIR_CHUNK = 16

#: Channel counts tried: grey, then colour laid out channels-first and channels-last.
CHANNELS = (1, 3)


@dataclass(frozen=True)
class ChannelLattice:
    """One channel's lattice ``offset + step * k``: its levels spanned and the largest deviation."""

    offset: float
    step: float
    span: int
    deviation: float


@dataclass(frozen=True)
class PixelGrid:
    """An 8-bit lattice per channel on which every recovered value lies.

    Attributes
    ----------
    layout
        ``"grey"``, ``"channels-first"`` or ``"channels-last"``.
    channels
        One lattice per channel.
    """

    layout: str
    channels: tuple[ChannelLattice, ...]

    @property
    def deviation(self) -> float:
        """Largest distance of a value from its level, in levels."""
        return max(channel.deviation for channel in self.channels)

    @property
    def span(self) -> int:
        """Fewest levels a channel spans."""
        return min(channel.span for channel in self.channels)

    def snap(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` rounded to the nearest level of their channel's lattice (same shape and dtype)."""
        blocks = _channel_view(inputs, self.layout, len(self.channels))
        snapped = torch.empty_like(blocks)
        for index, lattice in enumerate(self.channels):
            values = _channel(blocks, index, self.layout)
            levels = torch.round((values - lattice.offset) / lattice.step)
            _set_channel(snapped, index, self.layout, lattice.offset + lattice.step * levels)
        return snapped.reshape(inputs.shape)

    def extrapolated_pairs(self, inputs: torch.Tensor) -> int:
        """Pairs ``(i, j)`` of rows whose integer extrapolation ``2 x_i - x_j`` is an 8-bit image too.

        Two samples that are near copies span a plane with more grid points in range than the two
        (``2 x_1 - x_2``, ``3 x_1 - 2 x_2``, ...): a basis of such points is an affine
        combination on the grid, which the grid cannot tell from the samples. Where the rows do not
        span all 256 levels, the range is every window of 256 levels that holds them (the widest).
        """
        blocks = _channel_view(
            inputs.detach().to(device="cpu", dtype=torch.float64), self.layout, len(self.channels)
        )
        b = blocks.shape[0]
        within = torch.ones(b, b, dtype=torch.bool)
        for index, lattice in enumerate(self.channels):
            levels = torch.round((_channel(blocks, index, self.layout) - lattice.offset) / lattice.step)
            low, high = float(levels.max()) - (LEVELS - 1), float(levels.min()) + (LEVELS - 1)
            for start in range(0, b, PAIR_CHUNK):
                rows = levels[start : start + PAIR_CHUNK]
                extrapolated = 2 * rows[:, None, :] - levels[None, :, :]
                inside = ((extrapolated >= low) & (extrapolated <= high)).all(dim=-1)
                within[start : start + PAIR_CHUNK] &= inside
        within.fill_diagonal_(False)
        return int(within.sum())

    def describe(self) -> str:
        """``"every value lies on an 8-bit pixel grid (3 channels, channels-first; ...)"``."""
        where = "1 channel" if self.layout == "grey" else f"{len(self.channels)} channels, {self.layout}"
        return (
            f"every value of every row lies on an 8-bit pixel grid ({where}; at least {self.span} of "
            f"{LEVELS} levels spanned, at most {self.deviation:.2g} of a level off): the rows are "
            "the client's images, rounded to their exact pixels"
        )

    def stats(self) -> dict[str, object]:
        return {
            "pixel_grid": self.layout,
            "pixel_grid_deviation": self.deviation,
            "pixel_grid_span": self.span,
        }


def pixel_grid(inputs: torch.Tensor) -> PixelGrid | None:
    """The 8-bit lattice of each channel that every row of ``(b, n)`` ``inputs`` lies on, or None.

    Grey (one lattice for all ``n`` values) is tried first, then three channels laid out
    channels-first (``C, H, W`` flattened, as torchvision's tensors) and channels-last.
    """
    if inputs.ndim != 2 or inputs.shape[0] == 0:
        raise ValueError(f"inputs must be a non-empty (b, n) matrix, got shape {tuple(inputs.shape)}")
    x = inputs.detach().to(device="cpu", dtype=torch.float64)  # sorts and a few passes: the host's work
    if not bool(torch.isfinite(x).all()):
        return None
    n = x.shape[1]
    for count in CHANNELS:
        if n % count:
            continue
        layouts = ("grey",) if count == 1 else ("channels-first", "channels-last")
        for layout in layouts:
            blocks = _channel_view(x, layout, count)
            lattices = []
            for index in range(count):
                lattice = _lattice(_channel(blocks, index, layout))
                if lattice is None:
                    break
                lattices.append(lattice)
            else:
                return PixelGrid(layout, tuple(lattices))
    return None


def _lattice(values: torch.Tensor) -> ChannelLattice | None:
    """The 8-bit lattice all ``values`` lie on, or None."""
    if values.numel() < MIN_VALUES:
        return None
    ordered = values.flatten().sort().values
    extent = float(ordered[-1] - ordered[0])
    if not extent > 0:
        return None
    # neighbouring levels lie at least extent / 255 apart; a value within a quarter of that of the
    # last one is on its level (a spread that wide fails the deviation bound below anyway)
    cuts = ordered.diff() > 0.25 * extent / (LEVELS - 1)
    label = torch.cat([torch.zeros(1, dtype=torch.long), cuts.long().cumsum(0)])
    occupied = int(label[-1]) + 1
    if occupied < 2:
        return None
    sizes = torch.bincount(label, minlength=occupied).to(ordered.dtype)
    centres = torch.zeros(occupied, dtype=ordered.dtype).index_add_(0, label, ordered) / sizes
    gaps = centres.diff()
    smallest = float(gaps.min())
    if extent / smallest > 4 * LEVELS:
        return None  # far finer than 8 bits: not pixels
    # each gap between occupied levels is a small multiple of the step: count the levels gap by gap
    # (rounding each gap is robust where rounding the distance from the first level is not)
    step = float(gaps[gaps < 1.5 * smallest].mean())
    k = torch.cat([torch.zeros(1, dtype=gaps.dtype), torch.round(gaps / step).cumsum(0)])
    design = torch.stack([torch.ones_like(k), k], dim=1) * sizes.sqrt()[:, None]
    solution = torch.linalg.lstsq(design, centres * sizes.sqrt()).solution
    offset, step = float(solution[0]), float(solution[1])
    if not step > 0:
        return None
    levels = torch.round((ordered - offset) / step)
    # the lattice's own rounding error reaches the top level 255 times over: refit it on every value
    centred = levels - levels.mean()
    step = float((centred * ordered).sum() / centred.square().sum().clamp_min(1e-300))
    offset = float((ordered - step * levels).mean())
    if not step > 0:
        return None
    deviation = float(((ordered - offset - step * levels).abs() / step).max())
    span = int(levels[-1] - levels[0]) + 1
    if deviation > MAX_DEVIATION or not MIN_SPAN <= span <= LEVELS:
        return None
    return ChannelLattice(offset=offset, step=step, span=span, deviation=deviation)


def _channel_view(x: torch.Tensor, layout: str, count: int) -> torch.Tensor:
    if layout == "channels-last":
        return x.reshape(x.shape[0], -1, count)
    return x.reshape(x.shape[0], count, -1)


def _channel(blocks: torch.Tensor, index: int, layout: str) -> torch.Tensor:
    return blocks[:, :, index] if layout == "channels-last" else blocks[:, index, :]


def _set_channel(blocks: torch.Tensor, index: int, layout: str, values: torch.Tensor) -> None:
    if layout == "channels-last":
        blocks[:, :, index] = values
    else:
        blocks[:, index, :] = values
