"""Host-side DiT operations in numpy FP32 (no torch): patchify, embeddings, AdaLN modulation, norms, final layer."""
from __future__ import annotations

import logging
import math
from typing import Mapping

import numpy as np

from models.dit.config import DiTConfig

log = logging.getLogger(__name__)

EPS = 1e-6                                      # LayerNorm and RMSNorm epsilon
SUBLAYERS = ("self_attn", "cross_attn", "mlp")  # order inside a block; index 0..2 of block_modulations' axis 1


def host_keys(cfg: DiTConfig) -> list:
    """Every tensor the host needs (everything except the branch weights), in checkpoint order."""
    keys = ["x_embedder.proj.1.weight", "t_embedder.1.linear_1.weight", "t_embedder.1.linear_2.weight",
            "t_embedding_norm.weight"]
    for i in range(cfg.blocks):
        for kind in SUBLAYERS:
            keys += [f"blocks.{i}.adaln_modulation_{kind}.1.weight", f"blocks.{i}.adaln_modulation_{kind}.2.weight"]
    keys += ["final_layer.adaln_modulation.1.weight", "final_layer.adaln_modulation.2.weight",
             "final_layer.linear.weight"]
    return keys


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def patchify(z: np.ndarray) -> tuple:
    """z [C, h, w] -> (tokens [L, (C+1)*4] f32, (hp, wp)); circular pad to even, zero mask channel, row-major."""
    z = np.asarray(z, dtype=np.float32)
    if z.ndim != 3:
        raise ValueError(f"latent must be [C, h, w], got shape {list(z.shape)}")
    c, h, w = z.shape
    z = np.pad(z, ((0, 0), (0, h % 2), (0, w % 2)), mode="wrap")             # [C, 2hp, 2wp] circular
    hp, wp = z.shape[1] // 2, z.shape[2] // 2
    z = np.concatenate([z, np.zeros((1, 2 * hp, 2 * wp), np.float32)], 0)  # [C+1, 2hp, 2wp] mask channel
    t = z.reshape(c + 1, hp, 2, wp, 2).transpose(1, 3, 0, 2, 4)           # [hp, wp, C+1, dy, dx]
    return np.ascontiguousarray(t.reshape(hp * wp, (c + 1) * 4)), (hp, wp)  # feature = ch*4 + dy*2 + dx


def unpatchify(out: np.ndarray, hp: int, wp: int, h: int, w: int, c: int) -> np.ndarray:
    """out [L, C*4] (feature = dy*2C + dx*C + ch) -> [C, h, w] f32, padding cropped."""
    out = np.asarray(out, dtype=np.float32)
    if out.shape != (hp * wp, c * 4):
        raise ValueError(f"final-layer output has shape {list(out.shape)}, expected {[hp * wp, c * 4]}")
    t = out.reshape(hp, wp, 2, 2, c).transpose(4, 0, 2, 1, 3)            # [C, hp, dy, wp, dx]
    return np.ascontiguousarray(t.reshape(c, 2 * hp, 2 * wp)[:, :h, :w])


def embed(tokens: np.ndarray, W: np.ndarray) -> np.ndarray:
    """x_embedder: tokens [L, F] @ W[D, F]^T -> [L, D] f32."""
    return np.asarray(tokens, np.float32) @ np.asarray(W, np.float32).T


def timestep_sinusoid(sigma: float, D: int) -> np.ndarray:
    """[cos(sigma*f_k), sin(sigma*f_k)], f_k = exp(-ln(10000) k / (D/2)) -> [D] f32 (fed sigma itself, 0..1)."""
    half = D // 2
    f = np.exp(-math.log(10000.0) * np.arange(half, dtype=np.float32) / np.float32(half))  # [D/2]
    a = np.float32(sigma) * f
    return np.concatenate([np.cos(a), np.sin(a)]).astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """RMSNorm over the last axis with eps 1e-6, times weight."""
    x = np.asarray(x, np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(EPS)) * weight


def t_embedding(weights: Mapping, sigma: float, cfg: DiTConfig) -> tuple:
    """-> (emb [D] = RMSNorm(sinusoid), adaln_lora [3D] = linear_2(SiLU(linear_1(sinusoid))))."""
    e = timestep_sinusoid(sigma, cfg.width)                                  # [D]
    h = weights["t_embedder.1.linear_1.weight"] @ e                          # [D]
    adaln_lora = weights["t_embedder.1.linear_2.weight"] @ _silu(h)          # [3D]
    emb = rms_norm(e, weights["t_embedding_norm.weight"])                    # [D]
    return emb.astype(np.float32), adaln_lora.astype(np.float32)


def block_modulations(weights: Mapping, emb: np.ndarray, adaln_lora: np.ndarray, cfg: DiTConfig) -> np.ndarray:
    """-> [blocks, 3 sub-layers (self/cross/ffn), 3 (shift/scale/gate), D] f32; computed once per sigma."""
    D = cfg.width
    s = _silu(np.asarray(emb, np.float32))                                   # [D]
    out = np.empty((cfg.blocks, 3, 3, D), np.float32)
    for i in range(cfg.blocks):
        for j, kind in enumerate(SUBLAYERS):
            p = f"blocks.{i}.adaln_modulation_{kind}."
            m = weights[p + "2.weight"] @ (weights[p + "1.weight"] @ s) + adaln_lora  # [3D]
            out[i, j] = m.reshape(3, D)
    return out


def layernorm_modulate(x: np.ndarray, shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """LayerNorm without affine (eps 1e-6) then x*(1+scale)+shift: x [L, D] -> xn [L, D] f32."""
    x = np.asarray(x, np.float32)
    mu = x.mean(axis=-1, keepdims=True)
    d = x - mu
    var = (d * d).mean(axis=-1, keepdims=True)
    return (d / np.sqrt(var + np.float32(EPS))) * (1.0 + scale) + shift


def gate_residual(x: np.ndarray, gate: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += gate * y in FP32 (x [L, D] f32 updated in place and returned; y [L, D] may be f16)."""
    x += gate * np.asarray(y, np.float32)
    return x


def final_layer(weights: Mapping, x: np.ndarray, emb: np.ndarray, adaln_lora: np.ndarray,
                cfg: DiTConfig) -> np.ndarray:
    """x [L, D] -> [L, C*4]: modulation with adaln_lora[:2D] (shift, scale), LayerNorm+modulate, linear."""
    D = cfg.width
    m = (weights["final_layer.adaln_modulation.2.weight"]
         @ (weights["final_layer.adaln_modulation.1.weight"] @ _silu(np.asarray(emb, np.float32)))
         + adaln_lora[: 2 * D])                                              # [2D]
    xn = layernorm_modulate(x, m[:D], m[D:])                                 # [L, D]
    return (xn @ weights["final_layer.linear.weight"].T).astype(np.float32)  # [L, C*4]


def fold_smoothing(mods: np.ndarray, s: np.ndarray) -> np.ndarray:
    """A W8A8 pack's SmoothQuant factors folded into the modulations: mods [blocks, 3, 3, D], s [blocks, 3, D]
    -> mods whose shift and scale give layernorm_modulate(x)/s, i.e. norm(x)·((1+scale)/s) + shift/s; the gate
    is untouched (the branch output is what it was). FP32, once per sigma."""
    out = np.array(mods, np.float32, copy=True)
    s = np.asarray(s, np.float32)
    out[:, :, 0] /= s
    out[:, :, 1] = (1.0 + out[:, :, 1]) / s - 1.0
    return out
