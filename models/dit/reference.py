"""The oracle: a monolithic FP32 torch DiT forward, written for clarity straight from the checkpoint.

Independent of host_ops/rope on purpose (patchify via unfold, RoPE via complex rotation), so that comparing the
split host+branch path against it tests something. Weights are read block by block: a full-size checkpoint never
needs all of its 4 GB in memory at once.
"""
from __future__ import annotations

import logging
import math
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from models.dit.checkpoint import DiTCheckpoint

log = logging.getLogger(__name__)

EPS = 1e-6


class ReferenceTrace(list):
    """Per-block records [{"self": {"xn", "y"}, "cross": {...}, "ffn": {...}, "x_out"}] plus `.start` and `.final`.

    start: {"x": embedded tokens [L, D], "emb": [D], "adaln_lora": [3D]}
    final: {"xn": [L, D], "out": final linear [L, C*4], "v": [C, h, w]}
    """

    def __init__(self):
        super().__init__()
        self.start: dict = {}
        self.final: dict = {}


def _t(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().copy()


def _load(ckpt: DiTCheckpoint, prefix: str) -> dict:
    """All tensors under `prefix`, prefix removed, as float32 torch tensors."""
    return {k[len(prefix):]: torch.from_numpy(ckpt.get(k)) for k in ckpt.keys() if k.startswith(prefix)}


# -- the three branches (torch) ---------------------------------------------------------------------------------------
def _heads(t: torch.Tensor, hd: int) -> torch.Tensor:
    return t.view(t.shape[0], -1, hd).transpose(0, 1)          # [L, D] -> [H, L, hd]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, L, hd], k/v [H, S, hd] -> [L, H*hd]; plain softmax attention, no mask."""
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])    # [H, L, S]
    o = torch.softmax(scores, dim=-1) @ v                      # [H, L, hd]
    return o.transpose(0, 1).reshape(q.shape[1], -1)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half rotary: pair (k, k+hd/2) is the complex number a+ib, multiplied by e^{i phi}. t [H, L, hd]."""
    half = t.shape[-1] // 2
    z = torch.complex(t[..., :half], t[..., half:])            # [H, L, hd/2] complex64
    z = z * torch.complex(cos, sin)                            # broadcast [L, hd/2]
    return torch.cat([z.real, z.imag], dim=-1)


def self_attn(w: Mapping, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    hd = w["q_norm.weight"].shape[0]
    q = _heads(xn @ w["q_proj.weight"].T, hd)
    k = _heads(xn @ w["k_proj.weight"].T, hd)
    v = _heads(xn @ w["v_proj.weight"].T, hd)
    q = F.rms_norm(q, (hd,), w["q_norm.weight"], eps=EPS)
    k = F.rms_norm(k, (hd,), w["k_norm.weight"], eps=EPS)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return _attend(q, k, v) @ w["output_proj.weight"].T        # [L, D]


def cross_attn(w: Mapping, xn: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    hd = w["q_norm.weight"].shape[0]
    q = F.rms_norm(_heads(xn @ w["q_proj.weight"].T, hd), (hd,), w["q_norm.weight"], eps=EPS)
    k = F.rms_norm(_heads(context @ w["k_proj.weight"].T, hd), (hd,), w["k_norm.weight"], eps=EPS)
    v = _heads(context @ w["v_proj.weight"].T, hd)
    return _attend(q, k, v) @ w["output_proj.weight"].T        # [L, D]


def ffn(w: Mapping, xn: torch.Tensor) -> torch.Tensor:
    return F.gelu(xn @ w["layer1.weight"].T, approximate="none") @ w["layer2.weight"].T


# -- numpy front doors for checking one branch graph in isolation ---------------------------------------------------
def ref_self_attn(w: Mapping, xn, cos, sin) -> np.ndarray:
    """w: branch weights without `blocks.i.self_attn.` (DiTCheckpoint.branch_weights(i, "self")); xn [L, D];
    cos/sin [L, hd/2] (models.dit.rope.rope_tables) -> y [L, D] f32."""
    with torch.no_grad():
        return _np(self_attn({k: _t(v) for k, v in w.items()}, _t(xn), _t(cos), _t(sin)))


def ref_cross_attn(w: Mapping, xn, context) -> np.ndarray:
    """xn [L, D], context [S, Dc] -> y [L, D] f32."""
    with torch.no_grad():
        return _np(cross_attn({k: _t(v) for k, v in w.items()}, _t(xn), _t(context)))


def ref_ffn(w: Mapping, xn) -> np.ndarray:
    """xn [L, D] -> y [L, D] f32."""
    with torch.no_grad():
        return _np(ffn({k: _t(v) for k, v in w.items()}, _t(xn)))


# -- the whole model ----------------------------------------------------------------------------------------------------
def rope_cos_sin(hp: int, wp: int, hd: int) -> tuple:
    """Cosmos 3D RoPE for frame 0 on an hp x wp grid: cos, sin [hp*wp, hd/2] (torch f32)."""
    n_h = hd // 6 * 2                                          # h and w dims; t gets the rest
    n_t = hd - 2 * n_h

    def inv_freq(n: int, theta: float) -> torch.Tensor:
        return 1.0 / theta ** (torch.arange(0, n, 2, dtype=torch.float32)[: n // 2] / n)

    theta_hw = 10000.0 * 4.0 ** (n_h / (n_h - 2))              # NTK extrapolation ratio 4
    ii, jj = torch.meshgrid(torch.arange(hp, dtype=torch.float32), torch.arange(wp, dtype=torch.float32),
                            indexing="ij")
    phi = torch.cat([torch.zeros(hp, wp, n_t // 2),
                     ii[..., None] * inv_freq(n_h, theta_hw),
                     jj[..., None] * inv_freq(n_h, theta_hw)], dim=-1).reshape(hp * wp, hd // 2)
    return torch.cos(phi), torch.sin(phi)


def _modulation(w1: torch.Tensor, w2: torch.Tensor, emb: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
    return w2 @ (w1 @ F.silu(emb)) + lora


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def reference_forward(ckpt: DiTCheckpoint, x, sigma: float, context, trace: bool = False):
    """x [C, h, w] f32 latent, sigma in 0..1, context [S, Dc] f32 -> v [C, h, w] f32 (and a ReferenceTrace)."""
    cfg = ckpt.config
    x = np.asarray(x, np.float32)
    context = np.asarray(context, np.float32)
    if x.ndim != 3 or x.shape[0] != cfg.latent_channels:
        raise ValueError(f"x must be [{cfg.latent_channels}, h, w], got {list(x.shape)}")
    if context.ndim != 2 or context.shape[1] != cfg.context_dim:
        raise ValueError(f"context must be [S, {cfg.context_dim}], got {list(context.shape)}")
    rec = ReferenceTrace()
    with torch.no_grad():
        h, w = x.shape[1:]
        # 1) patches -> tokens, 2) timestep embeddings
        hs, hp, wp = _embed_patches(ckpt, x)
        emb, lora = _embed_timestep(ckpt, sigma)
        rec.start = {"x": _np(hs), "emb": _np(emb), "adaln_lora": _np(lora)}
        cos, sin = rope_cos_sin(hp, wp, cfg.head_dim)
        ctx = _t(context)
        # 3) blocks
        for i in range(cfg.blocks):
            hs, entry = _block(_load(ckpt, f"blocks.{i}."), hs, emb, lora, cos, sin, ctx, trace)
            if trace:
                rec.append(entry)
        # 4) final layer and unpatchify
        xn, out, v = _final_layer(ckpt, hs, emb, lora, (h, w), (hp, wp))
        v = _np(v)
        if trace:
            rec.final = {"xn": _np(xn), "out": _np(out), "v": v}
            return v, rec
        return v


def _embed_patches(ckpt: DiTCheckpoint, x: np.ndarray) -> tuple:
    """Circular pad to even, mask channel, 2x2 patches (unfold: feature = ch*4 + dy*2 + dx), x_embedder
    -> (tokens [L, D], hp, wp)."""
    h, w = x.shape[1:]
    img = F.pad(_t(x)[None], (0, w % 2, 0, h % 2), mode="circular")           # [1, C, 2hp, 2wp]
    hp, wp = img.shape[2] // 2, img.shape[3] // 2
    img = torch.cat([img, torch.zeros(1, 1, 2 * hp, 2 * wp)], dim=1)            # [1, C+1, 2hp, 2wp]
    tokens = F.unfold(img, kernel_size=2, stride=2)[0].T                       # [L, (C+1)*4]
    return tokens @ torch.from_numpy(ckpt.get("x_embedder.proj.1.weight")).T, hp, wp   # [L, D]


def _embed_timestep(ckpt: DiTCheckpoint, sigma: float) -> tuple:
    """Sinusoid of sigma itself (cos first) -> (emb [D]: RMSNorm of the sinusoid, adaln_lora [3D]: an MLP of it)."""
    D = ckpt.config.width
    half = D // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    arg = torch.tensor(sigma, dtype=torch.float32) * freqs
    sinus = torch.cat([torch.cos(arg), torch.sin(arg)])                        # [D]
    te = _load(ckpt, "t_embedder.1.")
    lora = te["linear_2.weight"] @ F.silu(te["linear_1.weight"] @ sinus)       # [3D]
    emb = F.rms_norm(sinus, (D,), torch.from_numpy(ckpt.get("t_embedding_norm.weight")), eps=EPS)
    return emb, lora


def _block(bw: dict, hs, emb, lora, cos, sin, ctx, trace: bool) -> tuple:
    """One block: self-attention, cross-attention, FFN, each with its own AdaLN shift/scale/gate
    -> (hs [L, D], the block's trace entry or {})."""
    entry = {}
    for name, module in (("self", "self_attn"), ("cross", "cross_attn"), ("ffn", "mlp")):
        m = _modulation(bw[f"adaln_modulation_{module}.1.weight"], bw[f"adaln_modulation_{module}.2.weight"],
                        emb, lora)
        shift, scale, gate = m.chunk(3)
        xn = _modulate(hs, shift, scale)
        sub = {k[len(module) + 1:]: v for k, v in bw.items() if k.startswith(module + ".")}
        if name == "self":
            y = self_attn(sub, xn, cos, sin)
        elif name == "cross":
            y = cross_attn(sub, xn, ctx)
        else:
            y = ffn(sub, xn)
        hs = hs + gate * y
        if trace:
            entry[name] = {"xn": _np(xn), "y": _np(y)}
    if trace:
        entry["x_out"] = _np(hs)
    return hs, entry


def _final_layer(ckpt: DiTCheckpoint, hs, emb, lora, size: tuple, grid: tuple) -> tuple:
    """Final layer (shift, scale from adaln_lora[:2D]) and unpatchify (feature = dy*2C + dx*C + ch; fold wants
    ch*4 + dy*2 + dx), then crop the padding -> (xn [L, D], out [L, C*4], v [C, h, w])."""
    C, D = ckpt.config.latent_channels, ckpt.config.width
    (h, w), (hp, wp) = size, grid
    fl = _load(ckpt, "final_layer.")
    shift, scale = _modulation(fl["adaln_modulation.1.weight"], fl["adaln_modulation.2.weight"], emb,
                               lora[: 2 * D]).chunk(2)
    xn = _modulate(hs, shift, scale)
    out = xn @ fl["linear.weight"].T                                          # [L, C*4]
    cols = out.view(-1, 2, 2, C).permute(3, 1, 2, 0).reshape(C * 4, -1)        # [C*4, L]
    v = F.fold(cols[None], output_size=(2 * hp, 2 * wp), kernel_size=2, stride=2)[0, :, :h, :w]
    return xn, out, v
