"""Tiled VAE decoding and encoding: overlapping latent-resolution tiles, each upsampled (or an image tile downsampled)
alone, blended with cosine ramps.

numpy only: the torch decoder and encoder and the VAE-pack backends (ONNX Runtime, the NPU) share this one plan and
blend. Encoding plans in latent pixels too: a tile of t latent pixels reads the image's t*8 pixels at 8 * its start,
and its features [C, t, t] are blended at latent resolution (scale 1)."""
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
    """Tiles [1, C, th*scale, tw*scale] (an iterable in tile_inputs order) -> the blended canvas [C, H, W] f32:
    each tile weighted by its separable cosine ramps, the sum divided by the summed weights."""
    h, w = rows[-1][0] + rows[-1][1], cols[-1][0] + cols[-1][1]
    out = None                                                             # out: [C, H, W] weighted sum
    wsum = np.zeros((1, h * scale, w * scale), np.float32)                 # wsum: [1, H, W]
    it = iter(images)
    for y0, th, wy in rows:
        for x0, tw, wx in cols:
            img = np.asarray(next(it))[0]                                   # img: [C, th*scale, tw*scale]
            if out is None:                                                 # C: 3 for images, 384 for features
                out = np.zeros((img.shape[0], h * scale, w * scale), np.float32)
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


def image_tile_inputs(image, rows, cols, down: int):
    """The image tiles of image [1, 3, H, W] for latent-pixel plans (scale 1), in blend order, each
    [1, 3, th*down, tw*down]."""
    for y0, th, _ in rows:
        for x0, tw, _ in cols:
            yield image[:, :, y0 * down:(y0 + th) * down, x0 * down:(x0 + tw) * down]


def encode_tiled(encode_fn, image, down: int, tile: int = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP) -> np.ndarray:
    """image: [1, 3, H, W] (H, W multiples of `down`) -> the blended features [C, H/down, W/down] f32 numpy.

    encode_fn maps an image tile [1, 3, th*down, tw*down] to features [1, C, th, tw] (the encoder's downsampling
    stages); the tiles and their cosine ramps are planned at latent resolution, exactly the decoder's plan."""
    _, _, hh, ww = image.shape
    if hh % down or ww % down:
        raise ValueError(f"image {hh}x{ww} is not a multiple of {down} per side")
    rows, cols = tile_grid(hh // down, ww // down, tile, overlap, 1)
    log.debug("tiled encode: image %dx%d, tile %d, overlap %s, %d tiles", hh, ww, tile, overlap,
              len(rows) * len(cols))
    return blend((encode_fn(t) for t in image_tile_inputs(image, rows, cols, down)), rows, cols, 1)
