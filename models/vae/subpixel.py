"""Nearest x2 upsample + 3x3 conv as one 2x2 conv per output phase (numpy): the torch decoder and the ONNX graphs
both take their upsample weights from here."""
from __future__ import annotations

import numpy as np

PHASES = ((0, 0), (0, 1), (1, 0), (1, 1))      # (row phase a, column phase c); phase k = 2a + c


def subpixel_weights(w: np.ndarray, bias: np.ndarray) -> tuple:
    """3x3 conv weights [Co, C, 3, 3] + bias [Co] after nearest x2 -> ([4 Co, C, 2, 2], [4 Co]) f32, phase k = 2a + c.

    Output row 2i+a reads upsampled rows 2i+a-1 .. 2i+a+1, i.e. small rows {i-1: k0, i: k1+k2} for a = 0 and
    {i: k0+k1, i+1: k2} for a = 1; the same along columns. With padding 1 one 2x2 conv's output row i+a holds
    phase a of row i (the torch decoder); with pads (top 1-a, bottom a) a phase's own conv is aligned (the ONNX
    graphs). 16 instead of 36 multiply-adds per output pixel and channel."""
    w = np.asarray(w, np.float32)

    def taps(k: np.ndarray, phase: int, axis: int) -> np.ndarray:
        k0, k1, k2 = (np.take(k, i, axis=axis) for i in range(3))           # the 3 taps along `axis`
        return np.stack((k0, k1 + k2) if phase == 0 else (k0 + k1, k2), axis=axis)
    phases = [taps(taps(w, a, 2), c, 3) for a, c in PHASES]                # 4 x [Co, C, 2, 2]
    return np.ascontiguousarray(np.concatenate(phases, axis=0)), np.tile(np.asarray(bias, np.float32), 4)
