"""Synthetic Qwen-Image VAE files with the real key names (encoder half and time_conv included), bf16, per seed.

Presets: "full" = base dim 96, z 16 (the real `qwen_image_vae.safetensors` shapes, ~254 MB bf16);
"tiny" = base dim 8, z 16, same structure (dims 8/16/32/32, 3 residual blocks per decoder stage), ~0.5 MB;
"small" = the full shapes (the preset ComfyUI loads: its Wan 2.1 VAE reads only the base dim from the weights).
Both layouts hold the same values for the same seed (each tensor's generator is keyed by its original-layout name).
"""
from __future__ import annotations

import logging
import math
import os
import zlib

import numpy as np

from models.base.safetensors_io import TensorEntry, write_safetensors
from models.vae.keys import DEFAULT_DIM_MULT, DEFAULT_NUM_RES_BLOCKS, VAEConfig, full_shapes, to_diffusers

log = logging.getLogger(__name__)

VAE_PRESETS = {
    "full": VAEConfig(z_dim=16, base_dim=96, dim_mult=DEFAULT_DIM_MULT, num_res_blocks=DEFAULT_NUM_RES_BLOCKS),
    "tiny": VAEConfig(z_dim=16, base_dim=8, dim_mult=DEFAULT_DIM_MULT, num_res_blocks=DEFAULT_NUM_RES_BLOCKS),
    "small": VAEConfig(z_dim=16, base_dim=96, dim_mult=DEFAULT_DIM_MULT, num_res_blocks=DEFAULT_NUM_RES_BLOCKS),
}
LAYOUTS = ("original", "diffusers")


def _gain(key: str) -> float:
    """Output scale of a weight (std = gain / sqrt(2D fan-in)), chosen so activations stay O(1) and the image
    lands mostly inside [-1, 1]: residual branches' second conv damped, the latent's first conv scaled for
    de-normalised inputs of std ~2-3."""
    if key.endswith("residual.6.weight"):
        return 0.5
    if key == "decoder.conv1.weight":
        return 0.5
    if key.endswith("head.2.weight"):
        return 0.6
    return 1.0


def _tensor(key: str, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])
    if key.endswith(".gamma"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if key.endswith(".bias"):
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[1] * (shape[-2] * shape[-1] if len(shape) >= 4 else 1)   # one temporal tap meets the input
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= np.float32(_gain(key) / math.sqrt(fan_in))
    return a


def vae_entries(preset: str, seed: int, layout: str = "original") -> list:
    """Lazy bf16 TensorEntry list for a whole VAE (encoder + decoder) in the given key layout, sorted by name."""
    if preset not in VAE_PRESETS:
        raise ValueError(f"unknown VAE preset {preset!r}; choose one of {sorted(VAE_PRESETS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown VAE key layout {layout!r}; choose one of {list(LAYOUTS)}")
    cfg = VAE_PRESETS[preset]
    entries = []
    for key, shape in full_shapes(cfg).items():
        name = key if layout == "original" else to_diffusers(key, cfg.per_stage)
        entries.append(TensorEntry(name, "BF16", tuple(shape), (lambda k=key, s=shape: _tensor(k, s, seed))))
    entries.sort(key=lambda e: e.name)
    return entries


def write_vae(preset: str, seed: int, out, layout: str = "original") -> None:
    """Write a synthetic VAE file to `out` (streamed, tmp + rename)."""
    entries = vae_entries(preset, seed, layout)
    write_safetensors(os.fspath(out), entries, metadata={"format": "pt"})
    n = sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries)
    log.info("wrote synthetic VAE %s (%s layout, seed %d): %d tensors, %d parameters", out, layout, seed,
             len(entries), n)
