"""3D rotary position tables (Cosmos split t/h/w) for image tokens of frame 0, FP32."""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

ROPE_THETA = 10000.0           # base for every axis before NTK scaling
SPATIAL_EXTRAPOLATION = 4.0    # NTK extrapolation ratio of the h and w axes (the t axis is unscaled)


def rope_axes(head_dim: int) -> tuple:
    """(dim_t, dim_h, dim_w): h and w get head_dim//6*2 each, t the rest (128 -> 44, 42, 42)."""
    if head_dim % 2 or head_dim < 12:
        raise ValueError(f"rope head_dim {head_dim} must be even and >= 12")
    dim_h = head_dim // 6 * 2
    return head_dim - 2 * dim_h, dim_h, dim_h


def axis_freqs(n: int, theta: float) -> np.ndarray:
    """theta^(-2k/n) for k = 0..n/2-1, float64 for accuracy before the final cast."""
    return theta ** (-np.arange(0, n, 2, dtype=np.float64)[: n // 2] / n)


def spatial_theta(dim: int) -> float:
    """NTK-scaled base of a spatial axis with `dim` rotary dims: 10000 * 4^(dim/(dim-2))."""
    return ROPE_THETA * SPATIAL_EXTRAPOLATION ** (dim / (dim - 2))


def rope_tables(h_tokens: int, w_tokens: int, head_dim: int) -> tuple:
    """(cos, sin), each [h_tokens*w_tokens, head_dim/2] float32; token order row-major, frame 0.

    Angle layout per token (i, j): [0 * t-freqs, i * h-freqs, j * w-freqs]. Angle k rotates the split-half pair
    (element k, element k + head_dim/2).
    """
    dim_t, dim_h, dim_w = rope_axes(head_dim)
    f_t = axis_freqs(dim_t, ROPE_THETA)                              # [dim_t/2]
    f_h = axis_freqs(dim_h, spatial_theta(dim_h))                    # [dim_h/2]
    f_w = axis_freqs(dim_w, spatial_theta(dim_w))                    # [dim_w/2]
    rows = np.repeat(np.arange(h_tokens, dtype=np.float64), w_tokens)  # [L] token row i
    cols = np.tile(np.arange(w_tokens, dtype=np.float64), h_tokens)    # [L] token col j
    ang = np.concatenate([np.zeros((rows.size, f_t.size)),             # frame 0: t angles are 0
                          rows[:, None] * f_h[None, :],
                          cols[:, None] * f_w[None, :]], axis=1)       # [L, head_dim/2] f64
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
