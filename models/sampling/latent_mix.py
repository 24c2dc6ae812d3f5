"""ComfyUI's LatentComposite and LatentBlend (nodes.py) on Anima's latents, in numpy.

What ComfyUI computes (read from nodes.py; written here from that reading):
- LatentComposite(samples_to, samples_from, x, y, feather): x, y and feather are pixels, floored to latent cells of
  8 (`// 8`); a copy of samples_to gets samples_from pasted with its top-left corner at (y, x) on the latent's axes 2
  and 3, samples_from cut where samples_to ends. With feather f > 0 the pasted part is weighted by a mask whose first
  f cells along an axis ramp 1/f, 2/f ... 1 on each side that does not touch samples_to's edge (the ramps multiply
  where they cross): out = from x mask + to x (1 - mask).
- LatentBlend(samples1, samples2, blend_factor) with blend_mode "normal": samples1 x factor + samples2 x (1 - factor).

Anima's latent in ComfyUI is the Wan 2.1 VAE's video shape [B, 16, 1, H/8, W/8] (latent_formats.Wan21 has
latent_dimensions 3 and sd.py's VAE.encode adds the frame axis), so LatentComposite's axes 2 and 3 are the frame axis
and the rows: x moves the pasted latent down by x // 8 rows (and feathers its top rows), and any y >= 8 selects no
frame, so nothing is pasted. The functions below index the same axes of the same shape (`comfy_shape`), so a graph
gives ComfyUI's picture. LatentBlend of two different shapes fails in ComfyUI on this 5-D latent (its resize
permutes four axes): refused here.
"""
from __future__ import annotations

import numpy as np

from models.sampling.latent_ops import LATENT_SCALE

F32 = np.float32
MAX_OFFSET = 16384              # ComfyUI's MAX_RESOLUTION: x, y and feather's bound (pixels)


class LatentMixError(ValueError):
    """Latents ComfyUI's node could not combine (shapes that do not broadcast)."""


def comfy_shape(latent: np.ndarray) -> np.ndarray:
    """One image's latent as this project keeps it, [C, H/8, W/8], as ComfyUI holds Anima's: [1, C, 1, H/8, W/8]."""
    return np.asarray(latent, dtype=F32)[None, :, None]


def composite(to: np.ndarray, frm: np.ndarray, x: int, y: int, feather: int = 0) -> np.ndarray:
    """LatentComposite of latents of 4 or more axes (ComfyUI's layout: batch, channels, then the two axes it indexes)
    -> a new array of `to`'s shape. `frm`'s batch broadcasts onto `to`'s (one image onto a batch), not the other way."""
    to, frm = np.asarray(to, dtype=F32), np.asarray(frm, dtype=F32)
    x, y, feather = x // LATENT_SCALE, y // LATENT_SCALE, feather // LATENT_SCALE
    out = to.copy()
    src = frm[:, :, :to.shape[2] - y, :to.shape[3] - x]
    try:
        if feather == 0:                            # the target box is frm's own size, cut where `to` ends
            out[:, :, y:y + frm.shape[2], x:x + frm.shape[3]] = src
            return out
        mask = _feather_mask(src.shape, to.shape, x, y, feather)
        box = (slice(None), slice(None), slice(y, y + src.shape[2]), slice(x, x + src.shape[3]))
        out[box] = src * mask + out[box] * (F32(1.0) - mask)
    except ValueError as e:                         # numpy's broadcast error, as torch's in ComfyUI
        raise LatentMixError(f"samples_from {list(frm.shape)} does not fit samples_to {list(to.shape)}: {e}") from None
    return out


def _feather_mask(shape: tuple, to_shape: tuple, x: int, y: int, feather: int) -> np.ndarray:
    """The pasted part's weights: ones, each of its first `feather` cells from a side ramped by (t + 1) / feather
    when that side is inside `to` (Python slices as ComfyUI's: a far-side slice past the start wraps as theirs)."""
    mask = np.ones(shape, F32)
    rows, cols = shape[2], shape[3]
    for t in range(feather):
        ramp = F32((1.0 / feather) * (t + 1))
        if y != 0:
            mask[:, :, t:t + 1] *= ramp
        if y + rows < to_shape[2]:
            mask[:, :, rows - 1 - t:rows - t] *= ramp
        if x != 0:
            mask[:, :, :, t:t + 1] *= ramp
        if x + cols < to_shape[3]:
            mask[:, :, :, cols - 1 - t:cols - t] *= ramp
    return mask


def blend(samples1: np.ndarray, samples2: np.ndarray, factor: float) -> np.ndarray:
    """LatentBlend, blend_mode normal: samples1 x factor + samples2 x (1 - factor), in float32."""
    a, b = np.asarray(samples1, dtype=F32), np.asarray(samples2, dtype=F32)
    if a.shape != b.shape:
        raise LatentMixError(f"samples2 {list(b.shape)} is not samples1's shape {list(a.shape)} (ComfyUI's LatentBlend "
                             "cannot resize a 5-D latent)")
    return a * F32(factor) + b * F32(1.0 - factor)


def mix_image(kind: str, onto: np.ndarray, other: np.ndarray, *, x: int = 0, y: int = 0, feather: int = 0,
              factor: float = 0.5) -> np.ndarray:
    """One image's latents [C, H/8, W/8] combined as a graph's node does on ComfyUI's shape of them: `kind`
    "composite" (`other` pasted onto `onto`) or "blend" (`onto` x factor + `other` x (1 - factor)) -> [C, H/8, W/8]."""
    a, b = comfy_shape(onto), comfy_shape(other)
    out = composite(a, b, x, y, feather) if kind == "composite" else blend(a, b, factor)
    return np.ascontiguousarray(out[0, :, 0])
