"""The "small" synthetic preset is what ComfyUI's Anima support loads as it is.

ComfyUI (comfy/model_detection.py, Cosmos-Predict2 branch with an llm_adapter) reads only the DiT's width from its
weights (x_embedder.proj.1.weight) and, for a width other than 2048 or 5120, builds MiniTrainDIT's defaults: 10
blocks, 16 heads, mlp_ratio 4, crossattn_emb_channels 1024, adaln_lora_dim 256; its LLMAdapter is fixed (6 blocks,
width 1024, 16 heads, MLP 4096, T5 vocabulary 32128); its Anima text encoder is the fixed Qwen3-0.6B config
(comfy/text_encoders/llama.py Qwen3_06BConfig); its Wan 2.1 VAE reads only the base dim (decoder.head.0.gamma).
Keys that do not fit are left unloaded there, so every key and shape must be the real model's.
"""
from __future__ import annotations

import re

from models.dit.config import detect_adapter_config, detect_dit_config
from models.dit.synth import ADAPTER_PREFIX, dit_shapes
from models.text.synth import te_shapes
from models.vae.keys import full_shapes
from models.vae.synth import VAE_PRESETS


def _strip_blocks(keys, n):
    return {k for k in keys if not re.match(r"^blocks\.(\d+)\.", k) or int(k.split(".")[1]) < n}


def test_small_dit_is_what_comfyui_builds_for_its_width():
    shapes = dit_shapes("small")
    c = detect_dit_config({k: v for k, v in shapes.items() if not k.startswith(ADAPTER_PREFIX)})
    assert c.width not in (2048, 5120)
    assert (c.blocks, c.heads, c.ffn_width, c.context_dim, c.lora_dim, c.latent_channels) == \
        (10, 16, 4 * c.width, 1024, 256, 16)
    assert c.head_dim * c.heads == c.width
    full = dit_shapes("full")
    # the same keys as the official checkpoint's first 10 blocks, nothing else
    assert set(shapes) == _strip_blocks(full, 10)


def test_small_adapter_text_encoder_and_vae_are_full_size():
    small, full = dit_shapes("small"), dit_shapes("full")
    adapter = {k: v for k, v in small.items() if k.startswith(ADAPTER_PREFIX)}
    assert adapter == {k: v for k, v in full.items() if k.startswith(ADAPTER_PREFIX)}
    a = detect_adapter_config(small)
    assert (a.blocks, a.width, a.heads, a.mlp_width, a.vocab, a.source_dim) == (6, 1024, 16, 4096, 32128, 1024)
    assert te_shapes("small") == te_shapes("full")
    assert te_shapes("small")["model.layers.0.post_attention_layernorm.weight"] == (1024,)
    assert VAE_PRESETS["small"] == VAE_PRESETS["full"]
    assert full_shapes(VAE_PRESETS["small"])["decoder.head.0.gamma"][0] == 96
