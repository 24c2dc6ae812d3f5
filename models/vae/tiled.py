"""Tiled VAE decoding: overlapping latent-resolution tiles, each upsampled alone, blended with cosine ramps.

numpy only: the torch decoder and the VAE-pack backends (ONNX Runtime, the NPU) share this one plan and blend."""
from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_TILE = 32                # latent pixels per tile side (256 image pixels)
DEFAULT_OVERLAP = 0.5            # fraction of a tile shared with its neighbour


def tile_starts(n: int, tile: int, stride: int) -> list:
    """Start offsets of tiles of size `tile` covering [0, n); the last one flush with the end."""
    if n <= tile:
        return [0]
    starts = list(range(0, n - tile, stride))
    starts.append(n - tile)
    return starts


def _ramp(length: int, up: int, down: int) -> np.ndarray:
    """1D weights [length]: cosine rise over the first `up` samples, fall over the last `down`, 1 elsewhere.

    A fall and the neighbour's rise over the same samples add up to 1 (cos² + sin²)."""
    w = np.ones(length, np.float64)
    if up > 0:
        u = (np.arange(up) + 0.5) / up
        w[:up] *= np.sin(0.5 * math.pi * u) ** 2
    if down > 0:
        u = (np.arange(down) + 0.5) / down
        w[length - down:] *= np.cos(0.5 * math.pi * u) ** 2
    return w


def axis_plan(n: int, tile: int, stride: int, scale: int) -> list:
    """[(latent start, latent size, image weights [size*scale])] along one axis."""
    t = min(tile, n)
    starts = tile_starts(n, t, stride)
    plan = []
    for i, s in enumerate(starts):
        up = (starts[i - 1] + t - s) * scale if i > 0 else 0
        down = (s + t - starts[i + 1]) * scale if i + 1 < len(starts) else 0
        plan.append((s, t, _ramp(t * scale, up, down)))
    return plan


def check_tiling(tile, overlap) -> int:
    """Validate tile (latent pixels) and overlap (fraction); -> the stride between tile starts."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be a positive number of latent pixels, got {tile!r}")
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    return max(1, tile - int(round(tile * overlap)))


def tile_grid(h: int, w: int, tile: int = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP, scale: int = 8) -> tuple:
    """(rows, cols): the axis plans of a latent [h, w] for `tile`/`overlap`; every tile is min(tile, h) x
    min(tile, w) latent pixels, so one fixed-shape model serves them all."""
    stride = check_tiling(tile, overlap)
    return axis_plan(h, tile, stride, scale), axis_plan(w, tile, stride, scale)


def tile_inputs(z, rows, cols):
    """The tiles of z [1, C, h, w] in blend order (row by row), each [1, C, th, tw]."""
    for y0, th, _ in rows:
        for x0, tw, _ in cols:
            yield z[:, :, y0:y0 + th, x0:x0 + tw]


def blend(images, rows, cols, scale: int) -> np.ndarray:
    """Image tiles [1, 3, th*scale, tw*scale] (an iterable in tile_inputs order) -> the blended canvas [3, H, W] f32:
    each tile weighted by its separable cosine ramps, the sum divided by the summed weights."""
    h, w = rows[-1][0] + rows[-1][1], cols[-1][0] + cols[-1][1]
    out = np.zeros((3, h * scale, w * scale), np.float32)                  # out: [3, H, W] weighted sum
    wsum = np.zeros((1, h * scale, w * scale), np.float32)                 # wsum: [1, H, W]
    it = iter(images)
    for y0, th, wy in rows:
        for x0, tw, wx in cols:
            img = np.asarray(next(it))[0]                                   # img: [3, th*scale, tw*scale]
            wt = np.outer(wy, wx).astype(np.float32)[None]                  # wt: [1, th*scale, tw*scale]
            ys, xs = slice(y0 * scale, (y0 + th) * scale), slice(x0 * scale, (x0 + tw) * scale)
            out[:, ys, xs] += img * wt
            wsum[:, ys, xs] += wt
    return out / wsum


def decode_tiled(decode_fn, z, scale: int, tile: int = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP) -> np.ndarray:
    """z: [1, C, h, w] at latent resolution (numpy, or anything sliced the same way) -> [3, h*scale, w*scale] f32
    numpy (unclamped), one tile at a time.

    decode_fn maps a tile [1, C, th, tw] to an image tile [1, 3, th*scale, tw*scale] (array-like: the torch VAE passes
    its upsampling stages). Peak memory is one tile's activations plus the output canvas and weights."""
    _, _, h, w = z.shape
    rows, cols = tile_grid(h, w, tile, overlap, scale)
    log.debug("tiled decode: latent %dx%d, tile %d, overlap %s, %d tiles", h, w, tile, overlap, len(rows) * len(cols))
    return blend((decode_fn(t) for t in tile_inputs(z, rows, cols)), rows, cols, scale)
