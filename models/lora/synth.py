"""Synthetic Anima LoRAs with the exact key names real files use, deterministic per seed (tests, benches, demos).

    write_lora("tiny", 0, "style.safetensors", layout="kohya", rank=8, alpha=4.0, groups=("blocks",))

Layouts: `kohya` (sd-scripts: lora_unet_<module with _>.lora_down.weight [r, in] / .lora_up.weight [out, r] / .alpha,
text encoder lora_te_<module>), `comfy` (sd-scripts' convert_anima_lora_to_comfy output: diffusion_model.<module>
.lora_A.weight / .lora_B.weight / .alpha, text encoder text_encoder.qwen3.<module>), `bare` (.lora_A / .lora_B without
.weight) and `peft-default` (.lora_A.default.weight / .lora_B.default.weight). Groups: `blocks` (sd-scripts' default
targets: q/k/v/output_proj of self- and cross-attention, mlp.layer1/2 in every block), `host` (the embedders, every
AdaLN modulation layer and the final layer), `adapter` (the LLM adapter's block linears: sd-scripts'
train_llm_adapter), `te` (Qwen3's attention and MLP projections).
"""
from __future__ import annotations

import logging
import math
import os
import zlib
from typing import Optional

import numpy as np

from models.lora.targets import ADAPTER_PREFIX, TE_PREFIX, place_of
from models.safetensors_io import TensorEntry, write_safetensors

log = logging.getLogger(__name__)

GROUPS = ("blocks", "host", "adapter", "te")
LAYOUTS = {   # layout -> (down suffix, up suffix, DiT name form, TE name form)
    "kohya": (".lora_down.weight", ".lora_up.weight", "kohya", "kohya"),
    "comfy": (".lora_A.weight", ".lora_B.weight", "dotted", "dotted"),
    "bare": (".lora_A", ".lora_B", "dotted", "dotted"),
    "peft-default": (".lora_A.default.weight", ".lora_B.default.weight", "dotted", "dotted"),
}
REL_STRENGTH = 0.25     # std of up @ down relative to the std of the weight it changes (before alpha / rank)
TE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


def _rng(seed: int, key: str) -> np.random.Generator:
    """One generator per tensor, so the order tensors are written in never changes their values."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])


def lora_name(module: str, model: str, form: str) -> str:
    """The name a LoRA file gives a module: module 'blocks.0.self_attn.q_proj' (DiT) or 'model.layers.0...' (Qwen3)."""
    if model == "te":
        rel = module[len(TE_PREFIX):] if module.startswith(TE_PREFIX) else module
        return "lora_te_" + rel.replace(".", "_") if form == "kohya" else "text_encoder.qwen3." + rel
    return "lora_unet_" + module.replace(".", "_") if form == "kohya" else "diffusion_model." + module


def preset_shapes(preset: str) -> tuple:
    """({DiT + adapter key: shape}, {Qwen3 key: shape}) of a synthetic preset's files."""
    from models.dit.synth import dit_shapes
    from models.text.synth import te_shapes
    return dit_shapes(preset), te_shapes(preset)


def target_weights(dit_shapes: dict, te_shapes: dict, groups) -> list:
    """[(model 'dit'|'te', weight key, (out, in), weight std)] of the layers the groups name, in key order, for
    models with these key -> shape tables (a preset's, or real files' own)."""
    from models.dit.synth import _scale_for
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise ValueError(f"LoRA groups {list(groups)!r}: choose from {list(GROUPS)}")
    out = []
    for key, shape in (dit_shapes or {}).items():
        if len(shape) != 2 or not key.endswith(".weight") or key.endswith("embed.weight"):
            continue
        place = place_of(key)
        group = {"branch": "blocks", "host": "host", "adapter": "adapter"}[place]
        if group in groups and (place != "adapter" or key.startswith(ADAPTER_PREFIX + "blocks.")):
            out.append(("dit", key, tuple(shape), _scale_for(key, shape)[0]))
    if "te" in groups:
        for key, shape in (te_shapes or {}).items():
            if key[:-len(".weight")].endswith(TE_LINEARS):
                out.append(("te", key, tuple(shape), 1.0 / math.sqrt(shape[1])))
    return out


def lora_entries(preset, seed: int, layout: str = "kohya", rank: int = 8, alpha: Optional[float] = None,
                 groups=("blocks",), dtype: str = "BF16") -> list:
    """Lazy TensorEntry list of a synthetic LoRA; alpha None writes no alpha (scale 1). preset: a preset name, or
    (dit shapes, te shapes) of the models it is for."""
    if layout not in LAYOUTS:
        raise ValueError(f"LoRA layout {layout!r}: choose one of {list(LAYOUTS)}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    down_sfx, up_sfx, dit_form, te_form = LAYOUTS[layout]
    entries = []
    shapes = preset_shapes(preset) if isinstance(preset, str) else preset
    for model, key, (n_out, n_in), w_std in target_weights(shapes[0], shapes[1], groups):
        name = lora_name(key[:-len(".weight")], model, te_form if model == "te" else dit_form)
        up_std = REL_STRENGTH * w_std * math.sqrt(n_in) / math.sqrt(rank)     # std(up @ down) ≈ REL · std(W)

        def down(name=name, n_in=n_in):
            return _rng(seed, name + ".down").standard_normal((rank, n_in), dtype=np.float32) / np.float32(
                math.sqrt(n_in))                                                # [r, in]

        def up(name=name, n_out=n_out, s=up_std):
            return _rng(seed, name + ".up").standard_normal((n_out, rank), dtype=np.float32) * np.float32(s)  # [out, r]
        entries.append(TensorEntry(name + down_sfx, dtype, (rank, n_in), down))
        entries.append(TensorEntry(name + up_sfx, dtype, (n_out, rank), up))
        if alpha is not None:
            entries.append(TensorEntry(name + ".alpha", dtype, (), np.asarray(alpha, np.float32)))
    return entries


def write_lora(preset, seed: int, out, layout: str = "kohya", rank: int = 8, alpha: Optional[float] = None,
               groups=("blocks",), dtype: str = "BF16") -> int:
    """Write a synthetic LoRA to `out`; returns the number of modules. Metadata as sd-scripts writes it."""
    entries = lora_entries(preset, seed, layout, rank, alpha, groups, dtype)
    modules = sum(1 for e in entries if e.name.endswith(LAYOUTS[layout][0]))
    meta = {"ss_network_module": "networks.lora_anima", "ss_network_dim": str(rank),
            "ss_network_alpha": str(alpha if alpha is not None else rank),
            "anima_synthetic": f"lora:{preset if isinstance(preset, str) else 'shapes'}:{seed}:{layout}:"
                               f"{','.join(groups)}"}
    log.info("writing synthetic LoRA preset=%s seed=%d layout=%s rank=%d alpha=%s (%d modules) to %s", preset, seed,
             layout, rank, alpha, modules, os.fspath(out))
    write_safetensors(out, entries, metadata=meta)
    return modules
