"""Tiled VAE decoding: overlapping latent-resolution tiles, each upsampled alone, blended with cosine ramps."""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

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


def decode_tiled(decode_fn, z: torch.Tensor, scale: int, tile: int = DEFAULT_TILE,
                 overlap: float = DEFAULT_OVERLAP) -> torch.Tensor:
    """z: [1, C, h, w] at latent resolution -> [3, h*scale, w*scale] f32 (unclamped), one tile at a time.

    decode_fn maps a tile [1, C, th, tw] to an image tile [1, 3, th*scale, tw*scale] (the VAE passes its trunk
    features and the upsampling stages). Peak memory is one tile's activations plus the output canvas and weights."""
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive number of latent pixels, got {tile!r}")
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    stride = max(1, tile - int(round(tile * overlap)))
    _, _, h, w = z.shape
    rows, cols = axis_plan(h, tile, stride, scale), axis_plan(w, tile, stride, scale)
    out = torch.zeros(3, h * scale, w * scale, dtype=torch.float32)         # out: [3, H, W] weighted sum
    wsum = torch.zeros(1, h * scale, w * scale, dtype=torch.float32)        # wsum: [1, H, W]
    log.debug("tiled decode: latent %dx%d, tile %d, stride %d, %d tiles", h, w, tile, stride, len(rows) * len(cols))
    for y0, th, wy in rows:
        for x0, tw, wx in cols:
            img = decode_fn(z[:, :, y0:y0 + th, x0:x0 + tw])[0]              # img: [3, th*scale, tw*scale]
            wt = torch.from_numpy(np.outer(wy, wx).astype(np.float32))[None]  # wt: [1, th*scale, tw*scale]
            ys, xs = slice(y0 * scale, (y0 + th) * scale), slice(x0 * scale, (x0 + tw) * scale)
            out[:, ys, xs] += img * wt
            wsum[:, ys, xs] += wt
    return out / wsum
