"""The outlier preset of the synthetic DiT: a stand-in for a real checkpoint's activation statistics.

Trained DiTs carry a few "massive" channels in the modulated inputs of their projections (fc1, self-attention QKV,
cross-attention Q), tens of times the median magnitude, in the same channels for every token and every step; the
weights' input columns of those channels are small to match. Random weights have none of that, so per-tensor INT8
would look fine on them and prove nothing. This module bends a synthetic checkpoint's tensors to carry such channels:

- one hidden unit of every AdaLN modulation (row 0 of `adaln_modulation_*.1.weight`) reads only the lowest-frequency
  cosine of the timestep embedding, which is ~1 for every sigma in [0, 1]: a constant, whatever the step;
- the shift rows of the chosen channels take a large weight on that unit, so shift_j is large at every step and
  norm(x)_j·(1+scale_j)+shift_j is large for every token;
- the projections reading those channels get their input columns divided by the same factor, so the picture's
  arithmetic stays O(1) (what makes the channels a quantization problem and not a numerical one).

Synthetic weights: the figures it gives are about the arithmetic of INT8, not about any real checkpoint.
"""
from __future__ import annotations

import re
import zlib

import numpy as np

OUTLIER_RATIOS = (35.0, 55.0, 90.0)        # target |xn_j| max / median channel |xn| max of the chosen channels
MEDIAN_ABS_MAX = 2.6                       # a normal channel's abs max over ~64-4096 tokens of LayerNorm output
CONST_UNIT = 0                             # the modulation hidden unit that carries the constant
_MOD1 = re.compile(r"^blocks\.(\d+)\.adaln_modulation_(self_attn|cross_attn|mlp)\.1\.weight$")
_MOD2 = re.compile(r"^blocks\.(\d+)\.adaln_modulation_(self_attn|cross_attn|mlp)\.2\.weight$")
# projections whose input is a modulated activation, by sub-layer (the columns that get divided)
_READERS = re.compile(r"^blocks\.(\d+)\.(self_attn\.[qkv]_proj|cross_attn\.q_proj|mlp\.layer1)\.weight$")


def outlier_channels(seed: int, width: int) -> dict:
    """{channel: ratio}: len(OUTLIER_RATIOS) distinct channels of [0, width), deterministic per seed."""
    rng = np.random.default_rng([int(seed), zlib.crc32(b"outlier-channels")])
    chans = rng.choice(width, size=len(OUTLIER_RATIOS), replace=False)
    return {int(c): r for c, r in zip(chans, OUTLIER_RATIOS)}


def _const_gain(width: int) -> float:
    """silu(emb_k) of the lowest-frequency cosine: emb = RMSNorm(sinusoid) with rms 1/sqrt(2), norm weight ~1."""
    e = np.sqrt(2.0)
    return float(e / (1.0 + np.exp(-e)))


def bend(key: str, arr: np.ndarray, seed: int, width: int) -> np.ndarray:
    """One tensor (f32, as drawn) bent for the outlier preset; tensors the preset does not touch come back as they
    are. Deterministic in (key, seed, width), so tensors may be made in any order."""
    chans = outlier_channels(seed, width)
    if _MOD1.match(key):
        out = arr.copy()
        out[CONST_UNIT] = 0.0
        out[CONST_UNIT, width // 2 - 1] = 1.0               # the cos of the smallest frequency: ~1 at every sigma
        return out
    if _MOD2.match(key):
        out = arr.copy()
        out[:, CONST_UNIT] = 0.0                             # the constant unit feeds only the chosen shifts
        rng = np.random.default_rng([int(seed), zlib.crc32(key.encode())])
        for j, ratio in chans.items():
            sign = 1.0 if rng.random() < 0.5 else -1.0
            out[j, CONST_UNIT] = sign * ratio * MEDIAN_ABS_MAX / _const_gain(width)   # shift_j
        return out
    if _READERS.match(key):
        out = arr.copy()
        for j, ratio in chans.items():
            out[:, j] /= ratio * MEDIAN_ABS_MAX
        return out
    return arr
