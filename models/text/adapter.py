"""The LLM adapter (`llm_adapter.*` in the DiT checkpoint) in torch: T5 ids + Qwen3 states -> text context rows."""
from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch
from torch import nn

from models.dit.config import DIT_PREFIXES, AdapterConfig, CheckpointError, detect_adapter_config, expected_adapter_shapes
from models.base.safetensors_io import SafeTensorsFile

log = logging.getLogger(__name__)

ADAPTER_PREFIX = "llm_adapter."
ROPE_THETA = 10000.0
RMS_EPS = 1e-6


class AdapterFileError(ValueError):
    """The DiT file has no usable LLM adapter; the message names the file and the key."""


def rope_cos_sin(n: int, head_dim: int, start: int = 0) -> tuple:
    """Rotate-half RoPE tables for positions start..start+n-1: (cos, sin), each [n, head_dim] f32."""
    half = head_dim // 2
    inv = ROPE_THETA ** (-torch.arange(half, dtype=torch.float32) * 2.0 / head_dim)   # inv: [hd/2]
    pos = torch.arange(start, start + n, dtype=torch.float32)                         # pos: [n]
    ang = pos[:, None] * inv[None, :]                                                 # ang: [n, hd/2]
    ang = torch.cat([ang, ang], dim=-1)                                               # ang: [n, hd]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [H, n, hd]; element k pairs with k + hd/2: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)                          # rot: [H, n, hd]
    return x * cos + rot * sin


class Attention(nn.Module):
    """Multi-head attention, no biases, q/k RMSNorm per head then RoPE, scale 1/sqrt(head_dim), no mask."""

    def __init__(self, width: int, source_dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.q_proj = nn.Linear(width, inner, bias=False)
        self.k_proj = nn.Linear(source_dim, inner, bias=False)
        self.v_proj = nn.Linear(source_dim, inner, bias=False)
        self.o_proj = nn.Linear(inner, width, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.k_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)

    def forward(self, x: torch.Tensor, src: torch.Tensor, rope_x: tuple, rope_src: tuple) -> torch.Tensor:
        n, m = x.shape[0], src.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)).transpose(0, 1)    # q: [H, n, hd]
        k = self.k_norm(self.k_proj(src).view(m, self.heads, self.head_dim)).transpose(0, 1)  # k: [H, m, hd]
        v = self.v_proj(src).view(m, self.heads, self.head_dim).transpose(0, 1)               # v: [H, m, hd]
        q = apply_rope(q, *rope_x)
        k = apply_rope(k, *rope_src)
        att = torch.softmax((q @ k.transpose(1, 2)) * (1.0 / math.sqrt(self.head_dim)), dim=-1)  # att: [H, n, m]
        y = (att @ v).transpose(0, 1).reshape(n, self.heads * self.head_dim)                   # y: [n, H*hd]
        return self.o_proj(y)                                                                  # [n, W]


class Block(nn.Module):
    """Pre-norm: x += SelfAttn(norm(x)); x += CrossAttn(norm(x), source); x += MLP(norm(x)) (exact GELU)."""

    def __init__(self, c: AdapterConfig):
        super().__init__()
        self.norm_self_attn = nn.RMSNorm(c.width, eps=RMS_EPS)
        self.self_attn = Attention(c.width, c.width, c.heads, c.head_dim)
        self.norm_cross_attn = nn.RMSNorm(c.width, eps=RMS_EPS)
        self.cross_attn = Attention(c.width, c.source_dim, c.heads, c.head_dim)
        self.norm_mlp = nn.RMSNorm(c.width, eps=RMS_EPS)
        self.mlp = nn.Sequential(nn.Linear(c.width, c.mlp_width), nn.GELU(approximate="none"),
                                 nn.Linear(c.mlp_width, c.width))

    def forward(self, x, src, rope_x, rope_src):
        h = self.norm_self_attn(x)
        x = x + self.self_attn(h, h, rope_x, rope_x)
        x = x + self.cross_attn(self.norm_cross_attn(x), src, rope_x, rope_src)
        return x + self.mlp(self.norm_mlp(x))


class LLMAdapter(nn.Module):
    """embed(T5 ids) -> blocks -> norm(out_proj(x)): [T, width] f32 (before per-token weights and padding)."""

    def __init__(self, c: AdapterConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.blocks))
        self.out_proj = nn.Linear(c.width, c.width)
        self.norm = nn.RMSNorm(c.width, eps=RMS_EPS)

    def forward(self, t5_ids: torch.Tensor, source: torch.Tensor, target_start: int = 0,
                source_start: int = 0) -> torch.Tensor:
        """t5_ids: [T] i64, source: [S, source_dim] f32 -> [T, width] f32.

        Positions count from 0 for the target and for the source separately; the `*_start` offsets exist only so
        tests can check that the result depends on relative positions alone.
        """
        c = self.config
        x = self.embed(t5_ids)                                              # x: [T, W]
        rope_x = rope_cos_sin(x.shape[0], c.head_dim, target_start)         # 2 x [T, hd]
        rope_src = rope_cos_sin(source.shape[0], c.head_dim, source_start)  # 2 x [S, hd]
        for blk in self.blocks:
            x = blk(x, source, rope_x, rope_src)
        return self.norm(self.out_proj(x))                                  # [T, W]


def find_adapter_prefix(path: str, st: SafeTensorsFile) -> str:
    """The full key prefix of the adapter tensors in a DiT file (e.g. 'net.llm_adapter.')."""
    for p in DIT_PREFIXES + ("",):
        if p + ADAPTER_PREFIX + "embed.weight" in st:
            return p + ADAPTER_PREFIX
    keys = st.keys()
    if any(k.startswith("model.layers.") or k.startswith("model.embed_tokens") for k in keys):
        what = "it looks like the Qwen3 text encoder, not the DiT"
    elif any(k.startswith(("decoder.", "conv2.", "post_quant_conv.")) for k in keys):
        what = "it looks like a VAE, not the DiT"
    elif any("x_embedder" in k for k in keys):
        what = "it is a DiT checkpoint without the LLM adapter"
    else:
        what = "no 'llm_adapter.embed.weight' tensor"
    raise AdapterFileError(f"{path}: no LLM adapter ({what})")


def adapter_tensors(dit_path: str) -> tuple:
    """Validate `llm_adapter.*` in a DiT checkpoint (prefix `net.` or `model.diffusion_model.`), config from shapes.

    -> (AdapterConfig, {key without `llm_adapter.`: shape}, get(key) -> f32 array). The torch module and the ONNX
    export both read the adapter through this."""
    path = os.fspath(dit_path)
    st = SafeTensorsFile(path)
    full = find_adapter_prefix(path, st)
    outer = full[: -len(ADAPTER_PREFIX)]
    shapes = {k[len(outer):]: st.shape(k) for k in st.keys() if k.startswith(full)}
    try:
        cfg = detect_adapter_config(shapes, ADAPTER_PREFIX)
    except CheckpointError as e:
        raise AdapterFileError(f"{path}: LLM adapter: {e}") from None
    if cfg.heads * cfg.head_dim != cfg.width:
        raise AdapterFileError(f"{path}: adapter width {cfg.width} is not a multiple of q_norm length {cfg.head_dim}")
    expected = expected_adapter_shapes(cfg, ADAPTER_PREFIX)
    for k, s in expected.items():
        if k not in shapes:
            raise AdapterFileError(f"{path}: missing tensor {outer + k!r}")
        if tuple(shapes[k]) != tuple(s):
            raise AdapterFileError(f"{path}: tensor {outer + k!r} has shape {list(shapes[k])}, expected {list(s)}")
        dt = st.dtype(outer + k)
        if dt not in ("BF16", "F16", "F32"):
            raise AdapterFileError(f"{path}: tensor {outer + k!r} has dtype {dt}; only bf16/f16/f32 are supported")
    shapes = {k[len(ADAPTER_PREFIX):]: tuple(s) for k, s in expected.items()}
    return cfg, shapes, (lambda key: st.get(full + key))


def load_adapter(dit_path: str) -> LLMAdapter:
    """The adapter of a DiT checkpoint as a torch module (FP32), config from shapes."""
    path = os.fspath(dit_path)
    cfg, shapes, get = adapter_tensors(path)
    with torch.device("meta"):
        model = LLMAdapter(cfg)
    state = {k: torch.from_numpy(get(k)) for k in shapes}                # f32 copies
    model.load_state_dict(state, strict=True, assign=True)
    log.info("loaded LLM adapter from %s: %d blocks, width %d, %d heads x %d, source %d, vocab %d", path,
             cfg.blocks, cfg.width, cfg.heads, cfg.head_dim, cfg.source_dim, cfg.vocab)
    return model.eval().float()


@torch.inference_mode()
def run_adapter(model: LLMAdapter, t5_ids: list, source: np.ndarray) -> np.ndarray:
    """t5_ids (len T, each < vocab), source [S, source_dim] f32 -> adapter rows [T, width] f32."""
    c = model.config
    if source.ndim != 2 or source.shape[1] != c.source_dim:
        raise ValueError(f"adapter source must be [S, {c.source_dim}], got {list(source.shape)}")
    bad = [i for i in t5_ids if not 0 <= int(i) < c.vocab]
    if bad:
        raise ValueError(f"T5 token id {bad[0]} outside the adapter vocabulary [0, {c.vocab})")
    ids = torch.tensor(list(t5_ids), dtype=torch.long)                     # ids: [T] i64
    out = model(ids, torch.from_numpy(np.ascontiguousarray(source, dtype=np.float32)))
    return out.numpy().astype(np.float32, copy=True)                       # [T, W] f32
