"""Synthetic DiT + LLM-adapter checkpoints with the official key names (bf16), deterministic per seed, streamed."""
from __future__ import annotations

import logging
import math
import os
import re
import zlib
from typing import Callable

import numpy as np

from models.dit.config import PRESETS, DIT_PREFIXES, expected_adapter_shapes, expected_dit_shapes
from models.base.safetensors_io import TensorEntry, f32_to_bf16, write_safetensors

log = logging.getLogger(__name__)

ADAPTER_PREFIX = "llm_adapter."


def _rng(seed: int, key: str) -> np.random.Generator:
    """A generator owned by one tensor, so lazy generation order never changes the values."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])


CONVERT_CHUNK = 1 << 22                  # elements per f32 -> bf16 conversion step (bounds temporaries to ~16 MB)


def _normal(shape, std: float, mean: float = 0.0) -> Callable:
    """A generator of N(mean, std^2) as bf16 bit patterns (uint16), converted in chunks to bound peak memory."""
    def gen(rng: np.random.Generator) -> np.ndarray:
        a = rng.standard_normal(shape, dtype=np.float32).reshape(-1)    # [numel] f32
        out = np.empty(a.size, np.uint16)                               # [numel] bf16 bits
        for i in range(0, a.size, CONVERT_CHUNK):
            c = a[i:i + CONVERT_CHUNK]
            c *= np.float32(std)
            if mean:
                c += np.float32(mean)
            out[i:i + CONVERT_CHUNK] = f32_to_bf16(c)
        return out.reshape(shape)
    return gen


def _scale_for(key: str, shape: tuple) -> tuple:
    """(std, mean) of the normal a weight is drawn from; chosen so activations stay O(1) through every block.

    Linears: std 1/sqrt(fan_in) (unit gain). Norm weights: 1 + 0.1 N. AdaLN second layers and the t_embedder's
    second layer are damped so shift/scale/gate and adaln_lora stay around 0.1-0.5. Biases small.
    """
    fan_in = shape[-1]
    if len(shape) == 1:
        if key.endswith(".bias"):
            return 0.02, 0.0
        return 0.1, 1.0                                           # norm weights near 1
    if key.endswith("embed.weight"):
        return 1.0, 0.0                                           # adapter token embedding: unit rows
    if ".adaln_modulation" in key and key.endswith(".2.weight"):
        return 0.15 / math.sqrt(fan_in), 0.0                      # per-sub-layer modulation ~0.1
    if key == "t_embedder.1.linear_2.weight":
        return 0.5 / math.sqrt(fan_in), 0.0                       # adaln_lora ~0.2
    return 1.0 / math.sqrt(fan_in), 0.0


def dit_shapes(preset: str) -> dict:
    """{stripped key: shape} for the DiT then the adapter, in writing order."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    shapes = dict(expected_dit_shapes(p["dit"]))
    shapes.update(expected_adapter_shapes(p["adapter"], ADAPTER_PREFIX))
    return shapes


def _bent(gen: Callable, key: str, seed: int, width: int) -> Callable:
    """A generator whose tensor goes through the outlier preset (models/dit/outliers.py) before its bf16 rounding."""
    from models.dit.outliers import bend
    from models.base.safetensors_io import bf16_to_f32

    def g(rng: np.random.Generator) -> np.ndarray:
        a = gen(rng)
        return f32_to_bf16(np.ascontiguousarray(bend(key, bf16_to_f32(a), seed, width), np.float32)).reshape(a.shape)
    return g


def keep_blocks(shapes: dict, blocks: int) -> dict:
    """The shapes of a checkpoint cut to its first `blocks` DiT blocks (a short model for tests and benches)."""
    if blocks < 1:
        raise ValueError(f"blocks {blocks} must be >= 1")
    return {k: v for k, v in shapes.items() if not re.match(r"^blocks\.(\d+)\.", k) or int(k.split(".")[1]) < blocks}


def dit_entries(preset, seed: int, prefix: str = "net.", outliers: bool = False) -> list:
    """Lazy TensorEntry list (bf16) for a synthetic checkpoint; each entry's data is a callable returning the
    tensor as bf16 bit patterns (uint16; widen with models.base.safetensors_io.bf16_to_f32). preset: a preset name, or
    {stripped key: shape} of the checkpoint to make (each tensor depends only on the seed, its key and its shape,
    so a recorded key list makes the same file again). outliers: the outlier preset (models/dit/outliers.py), a
    stand-in for a real checkpoint's activation statistics."""
    if prefix not in DIT_PREFIXES:
        raise ValueError(f"unknown key prefix {prefix!r}; choose one of {list(DIT_PREFIXES)}")
    entries = []
    shapes = dit_shapes(preset) if isinstance(preset, str) else {k: tuple(v) for k, v in preset.items()}
    for key, shape in shapes.items():
        std, mean = _scale_for(key, shape)
        gen = _normal(shape, std, mean)
        if outliers:
            gen = _bent(gen, key, seed, shapes["x_embedder.proj.1.weight"][0])
        entries.append(TensorEntry(prefix + key, "BF16", tuple(shape),
                                   (lambda g=gen, k=key: g(_rng(seed, k)))))
    return entries


def param_count(preset: str) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for s in dit_shapes(preset).values())


def write_dit(preset: str, seed: int, out, prefix: str = "net.", outliers: bool = False,
              blocks: int = 0) -> None:
    """Write the synthetic checkpoint to `out` one tensor at a time (peak memory ~ the largest tensor); outliers:
    the outlier preset; blocks > 0: only the first that many DiT blocks."""
    shapes = dit_shapes(preset) if not blocks else keep_blocks(dit_shapes(preset), blocks)
    entries = dit_entries(shapes, seed, prefix, outliers)
    log.info("writing synthetic DiT preset=%s seed=%d%s (%d tensors) to %s", preset, seed,
             " with outlier channels" if outliers else "", len(entries), os.fspath(out))
    tag = f"{preset}:{seed}" + (":outliers" if outliers else "") + (f":blocks{blocks}" if blocks else "")
    write_safetensors(out, entries, metadata={"format": "pt", "anima_synthetic": tag})
