"""Pictures of a reconstruction: ground truth above the matched reconstruction, as one PNG.

:func:`grid_layout` gives the pixel geometry of the picture, so that a reader (the report) can
crop any sample's tiles back out of ``reconstruction.png``; :func:`grid_document` records that
geometry and every column's PSNR in ``metrics.json``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

#: File name of the picture inside an attack's directory.
GRID_FILE = "reconstruction.png"

#: Upper bound of a per-tile PSNR (mirrors ``fl_attack.evaluation.metrics.PSNR_CAP_DB``).
_PSNR_CAP_DB = 300.0


def grid_layout(
    image_shape: Sequence[int],
    *,
    rows: int,
    columns: int,
    min_tile: int = 64,
    padding: int = 2,
) -> dict[str, int]:
    """Pixel geometry of a picture drawn by :func:`image_grid`.

    Tile ``(row, column)`` of the picture occupies the box
    ``left = padding + column * (tile_width + padding)``,
    ``top = padding + row * (tile_height + padding)``, of size
    ``tile_width x tile_height``.

    Parameters
    ----------
    image_shape : Sequence[int]
        ``(C, H, W)`` or ``(H, W)`` of one image.
    rows : int
        Rows of tiles (2 with ground truth, else 1).
    columns : int
        Columns of tiles.
    min_tile : int (default: 64)
        As in :func:`image_grid`.
    padding : int (default: 2)
        As in :func:`image_grid`.

    Returns
    -------
    dict[str, int]
        ``rows``, ``columns``, ``tile_height``, ``tile_width``, ``padding``, ``scale``,
        ``height`` and ``width`` (of the whole picture).
    """
    height, width = (int(size) for size in tuple(image_shape)[-2:])
    scale = max(1, math.ceil(min_tile / max(height, width)))
    tile_h, tile_w = height * scale, width * scale
    return {
        "rows": int(rows),
        "columns": int(columns),
        "tile_height": tile_h,
        "tile_width": tile_w,
        "padding": int(padding),
        "scale": scale,
        "height": rows * tile_h + (rows + 1) * padding,
        "width": columns * tile_w + (columns + 1) * padding,
    }


def image_grid(
    reconstructed: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    min_tile: int = 64,
    padding: int = 2,
) -> np.ndarray:
    """Tile images into one ``uint8`` RGB picture: ground truth on top, reconstructions below.

    Parameters
    ----------
    reconstructed : numpy.ndarray
        ``(k, C, H, W)`` images in ``[0, 1]`` with ``C`` in ``{1, 3}``.
    reference : numpy.ndarray or None
        ``(k', C, H, W)`` ground truth drawn in a first row; column ``i`` pairs
        ``reference[i]`` with ``reconstructed[i]``.
    min_tile : int (default: 64)
        Images are enlarged by an integer factor (nearest neighbour) to at least
        this many pixels per side.
    padding : int (default: 2)
        White pixels between tiles.

    Returns
    -------
    numpy.ndarray
        ``(height, width, 3)`` ``uint8`` array.
    """
    rows = [reconstructed] if reference is None else [reference, reconstructed]
    for images in rows:
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"expected (k, C, H, W) images with C in {{1, 3}}, got {images.shape}")
    height, width = rows[0].shape[2:]
    if any(images.shape[2:] != (height, width) for images in rows):
        raise ValueError("all images of a grid must share their height and width")
    columns = max(1, max(len(images) for images in rows))
    layout = grid_layout(rows[0].shape, rows=len(rows), columns=columns, min_tile=min_tile, padding=padding)
    scale, tile_h, tile_w = layout["scale"], layout["tile_height"], layout["tile_width"]
    canvas = np.full((layout["height"], layout["width"], 3), 255, dtype=np.uint8)
    for row_index, images in enumerate(rows):
        for column, image in enumerate(images):
            rgb = np.repeat(image, 3, axis=0) if image.shape[0] == 1 else image
            pixels = np.clip(np.nan_to_num(rgb.transpose(1, 2, 0), nan=0.0), 0.0, 1.0)
            pixels = np.kron(pixels, np.ones((scale, scale, 1)))
            top = padding + row_index * (tile_h + padding)
            left = padding + column * (tile_w + padding)
            canvas[top : top + tile_h, left : left + tile_w] = np.round(pixels * 255).astype(np.uint8)
    return canvas


def encode_png(picture: np.ndarray) -> bytes:
    """Encode a ``(height, width, 3)`` ``uint8`` array as PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(picture, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def grid_document(
    reconstructed: np.ndarray, *, reference: np.ndarray | None, psnr: Sequence[float] | None
) -> dict[str, Any]:
    """Where each sample lies in ``reconstruction.png``, and its PSNR per column.

    ``column_psnr[i]`` scores column ``i`` (ground truth above its matched
    reconstruction). When every ground-truth sample has a column, these are the scores
    in ``psnr`` (``column_psnr_source = "scores"``); otherwise (some samples were not
    matched) they are recomputed from the drawn images (``"images"``).

    Parameters
    ----------
    reconstructed : numpy.ndarray
        ``(k, C, H, W)`` reconstructions drawn in the picture.
    reference : numpy.ndarray or None
        ``(k', C, H, W)`` ground truth drawn above them, when scored.
    psnr : Sequence[float] or None
        The attack's PSNR per ground-truth sample.

    Returns
    -------
    dict[str, Any]
        The ``grid`` entry of ``metrics.json``.
    """
    rows = 1 if reference is None else 2
    columns = max(len(reconstructed), 0 if reference is None else len(reference))
    document: dict[str, Any] = {
        "file": GRID_FILE,
        "row_names": ["reconstruction"] if reference is None else ["reference", "reconstruction"],
        "image_shape": [int(size) for size in reconstructed.shape[1:]],
        **grid_layout(reconstructed.shape, rows=rows, columns=columns),
        "column_psnr": None,
        "column_psnr_source": None,
    }
    if reference is None:
        return document
    paired = min(len(reference), len(reconstructed))
    if psnr is not None and len(psnr) == paired == len(reference):
        document["column_psnr"] = [float(value) for value in psnr]
        document["column_psnr_source"] = "scores"
    else:
        difference = np.clip(reconstructed[:paired], 0.0, 1.0) - np.clip(reference[:paired], 0.0, 1.0)
        mse = np.mean(np.square(difference).reshape(paired, -1), axis=1)
        with np.errstate(divide="ignore"):
            values = np.minimum(-10.0 * np.log10(mse), _PSNR_CAP_DB)
        document["column_psnr"] = [float(value) for value in values]
        document["column_psnr_source"] = "images"
    return document
