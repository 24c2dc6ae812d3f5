"""Qwen3 text encoder through `transformers` `Qwen3Model`, loaded from `model.*` safetensors, config from shapes, FP32."""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from models.base.safetensors_io import SafeTensorsFile

log = logging.getLogger(__name__)

PREFIX = "model."
ROPE_THETA = 1e6
RMS_EPS = 1e-6
MAX_POSITIONS = 40960            # Qwen3-0.6B-Base's max_position_embeddings (only bounds the RoPE cache)
_LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


class TextEncoderFileError(ValueError):
    """The file is not a Qwen3 text encoder we can load; the message names the file and the key."""


@dataclass(frozen=True)
class Qwen3Shape:
    vocab: int           # 151936
    hidden: int          # 1024
    layers: int          # 28
    heads: int           # 16
    kv_heads: int        # 8
    head_dim: int        # 128
    intermediate: int    # 3072


def _what_is_it(keys: list) -> str:
    """A short description of a file that is not a Qwen3 text encoder."""
    stripped = [re.sub(r"^(model\.diffusion_model\.|net\.)", "", k) for k in keys]
    if any(k.startswith(("x_embedder.", "llm_adapter.", "blocks.")) for k in stripped):
        return "it looks like an Anima DiT checkpoint (diffusion model), not the Qwen3 text encoder"
    if any(k.startswith(("decoder.", "conv2.", "encoder.", "post_quant_conv.")) for k in keys):
        return "it looks like a VAE, not the Qwen3 text encoder"
    return "it has no 'model.embed_tokens.weight' / 'model.layers.N.*' tensors"


def detect_shape(path: str, st: SafeTensorsFile) -> Qwen3Shape:
    """Derive the Qwen3 configuration from tensor shapes; check every tensor the model needs."""
    keys = st.keys()
    if PREFIX + "embed_tokens.weight" not in st:
        raise TextEncoderFileError(f"{path}: not a Qwen3 text encoder: {_what_is_it(keys)}")
    for k in keys:
        dt = st.dtype(k)
        if dt not in ("BF16", "F16", "F32"):
            raise TextEncoderFileError(f"{path}: tensor {k!r} has dtype {dt}; only bf16/f16/f32 text encoders "
                                       "are supported (quantized variants are not)")
    layers = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if not layers:
        raise TextEncoderFileError(f"{path}: no 'model.layers.N.*' tensors")
    n = max(layers) + 1
    vocab, hidden = st.shape(PREFIX + "embed_tokens.weight")
    l0 = PREFIX + "layers.0."
    for k in ("self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight"):
        if l0 + k not in st:
            raise TextEncoderFileError(f"{path}: missing tensor {l0 + k!r}")
    head_dim = st.shape(l0 + "self_attn.q_norm.weight")[0]
    q_rows = st.shape(l0 + "self_attn.q_proj.weight")[0]
    kv_rows = st.shape(l0 + "self_attn.k_proj.weight")[0]
    if head_dim <= 0 or q_rows % head_dim or kv_rows % head_dim or (q_rows // head_dim) % max(1, kv_rows // head_dim):
        raise TextEncoderFileError(f"{path}: q_proj rows {q_rows} / k_proj rows {kv_rows} do not fit head dim "
                                   f"{head_dim} (from q_norm)")
    shape = Qwen3Shape(vocab=vocab, hidden=hidden, layers=n, heads=q_rows // head_dim, kv_heads=kv_rows // head_dim,
                       head_dim=head_dim, intermediate=st.shape(l0 + "mlp.gate_proj.weight")[0])
    expected = expected_shapes(shape)
    for k, s in expected.items():
        if k not in st:
            raise TextEncoderFileError(f"{path}: missing tensor {k!r}")
        if tuple(st.shape(k)) != s:
            raise TextEncoderFileError(f"{path}: tensor {k!r} has shape {list(st.shape(k))}, expected {list(s)}")
    return shape


def expected_shapes(c: Qwen3Shape) -> dict:
    """Every tensor of a Qwen3 text encoder file (keys with the `model.` prefix) and its shape."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    per_layer = {"input_layernorm.weight": (c.hidden,), "post_attention_layernorm.weight": (c.hidden,),
                 "self_attn.q_proj.weight": (q, c.hidden), "self_attn.k_proj.weight": (kv, c.hidden),
                 "self_attn.v_proj.weight": (kv, c.hidden), "self_attn.o_proj.weight": (c.hidden, q),
                 "self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,),
                 "mlp.gate_proj.weight": (c.intermediate, c.hidden), "mlp.up_proj.weight": (c.intermediate, c.hidden),
                 "mlp.down_proj.weight": (c.hidden, c.intermediate)}
    assert set(per_layer) == set(_LAYER_KEYS)
    s = {PREFIX + "embed_tokens.weight": (c.vocab, c.hidden), PREFIX + "norm.weight": (c.hidden,)}
    for i in range(c.layers):
        for k, v in per_layer.items():
            s[f"{PREFIX}layers.{i}.{k}"] = v
    return s


def hf_config(c: Qwen3Shape):
    """The `transformers` Qwen3Config for a detected shape (RoPE θ 1e6, RMSNorm eps 1e-6, no attention bias)."""
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate,
                       num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                       head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=MAX_POSITIONS,
                       rms_norm_eps=RMS_EPS, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       attention_bias=False, tie_word_embeddings=True, use_cache=False, dtype="float32")


class Qwen3TextEncoder:
    """Qwen3Model in FP32: token ids -> final hidden states after the last RMSNorm, [S, hidden]."""

    def __init__(self, path: str, attn_implementation: str = "sdpa"):
        from transformers import Qwen3Model
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        t0 = time.perf_counter()
        self.path = os.fspath(path)
        st = SafeTensorsFile(self.path)
        self.shape = detect_shape(self.path, st)
        self.config = hf_config(self.shape)
        self.config._attn_implementation = attn_implementation
        # Build on the meta device (no allocation, no random init), then adopt one FP32 copy of each stored tensor.
        with torch.device("meta"):
            model = Qwen3Model(self.config)
        state = {}
        for k in expected_shapes(self.shape):
            state[k[len(PREFIX):]] = torch.from_numpy(st.get(k))       # bf16 -> f32, one fresh copy per tensor
        missing, unexpected = model.load_state_dict(state, strict=True, assign=True)
        del state
        model.rotary_emb = Qwen3RotaryEmbedding(self.config)             # non-persistent buffers: build on CPU
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.device.type == "meta":
                raise RuntimeError(f"Qwen3 tensor {name} was not loaded from {self.path}")
        self.model = model.eval().float()
        del st
        self.load_s = time.perf_counter() - t0
        log.info("loaded Qwen3 text encoder %s: hidden %d, %d layers, %d/%d heads x %d, vocab %d (%.2f s)",
                 self.path, self.shape.hidden, self.shape.layers, self.shape.heads, self.shape.kv_heads,
                 self.shape.head_dim, self.shape.vocab, self.load_s)

    @torch.inference_mode()
    def hidden_states(self, ids: list) -> np.ndarray:
        """ids (non-empty, < vocab) -> last_hidden_state [S, hidden] f32 (causal attention, positions 0..S-1)."""
        if len(ids) == 0:
            raise ValueError("Qwen3 input ids must not be empty (the empty prompt uses the single pad token)")
        bad = [i for i in ids if not 0 <= int(i) < self.shape.vocab]
        if bad:
            raise ValueError(f"Qwen3 token id {bad[0]} outside the vocabulary [0, {self.shape.vocab})")
        x = torch.tensor([list(ids)], dtype=torch.long)                   # x: [1, S] i64
        out = self.model(input_ids=x, use_cache=False).last_hidden_state  # out: [1, S, hidden] f32
        return out[0].numpy().astype(np.float32, copy=True)               # [S, hidden] f32

    def close(self) -> None:
        self.model = None
