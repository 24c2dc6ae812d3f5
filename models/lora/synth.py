"""Synthetic Anima LoRAs with the exact key names real files use, deterministic per seed (tests, benches, demos).

    write_lora("tiny", 0, "style.safetensors", layout="kohya", rank=8, alpha=4.0, groups=("blocks",))

Layouts: `kohya` (sd-scripts: lora_unet_<module with _>.lora_down.weight [r, in] / .lora_up.weight [out, r] / .alpha,
text encoder lora_te_<module>), `comfy` (sd-scripts' convert_anima_lora_to_comfy output: diffusion_model.<module>
.lora_A.weight / .lora_B.weight / .alpha, text encoder text_encoder.qwen3.<module>), `bare` (.lora_A / .lora_B without
.weight), `peft-default` (.lora_A.default.weight / .lora_B.default.weight), `diffusers-proc` (NAME_lora.down.weight /
NAME_lora.up.weight), `diffusers-lora` (.lora.down.weight / .lora.up.weight), `transformers`
(.lora_linear_layer.down.weight / .up.weight), `turbo` (the official Anima Turbo LoRA v0.2's layout as public code
describes it: the ComfyUI form with no alpha over every block's linears and AdaLN modulation and the LLM adapter's
blocks, those with zero lora_B; docs/lora.md), `lokr` (LyCORIS LoKr in kohya names: .lokr_w1 [a, b] full,
.lokr_w2_a [c, r] / .lokr_w2_b [r, d], .alpha; a·c = out, b·d = in) and `loha` (LyCORIS LoHa: .hada_w1_a [out, r],
.hada_w1_b [r, in], .hada_w2_a, .hada_w2_b, .alpha). Groups: `blocks` (sd-scripts' default
targets: q/k/v/output_proj of self- and cross-attention, mlp.layer1/2 in every block), `host` (the embedders, every
AdaLN modulation layer and the final layer), `adapter` (the LLM adapter's block linears: sd-scripts'
train_llm_adapter), `te` (Qwen3's attention and MLP projections), `modulation` (the blocks' AdaLN modulation layers
alone: the part of `host` the Turbo LoRA changes).
"""
from __future__ import annotations

import logging
import math
import os
import zlib
from typing import Optional

import numpy as np

from models.lora.targets import ADAPTER_PREFIX, TE_PREFIX, place_of
from models.base.safetensors_io import TensorEntry, write_safetensors

log = logging.getLogger(__name__)

GROUPS = ("blocks", "host", "modulation", "adapter", "te")
LAYOUTS = {   # layout -> (down suffix, up suffix, DiT name form, TE name form)
    "kohya": (".lora_down.weight", ".lora_up.weight", "kohya", "kohya"),
    "comfy": (".lora_A.weight", ".lora_B.weight", "dotted", "dotted"),
    "bare": (".lora_A", ".lora_B", "dotted", "dotted"),
    "peft-default": (".lora_A.default.weight", ".lora_B.default.weight", "dotted", "dotted"),
    "diffusers-proc": ("_lora.down.weight", "_lora.up.weight", "dotted", "dotted"),
    "diffusers-lora": (".lora.down.weight", ".lora.up.weight", "dotted", "dotted"),
    "transformers": (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight", "dotted", "dotted"),
    "turbo": (".lora_A.weight", ".lora_B.weight", "dotted", "dotted"),
    "lokr": (".lokr_w1", ".lokr_w2_b", "kohya", "kohya"),        # (a key every module has, for counting)
    "loha": (".hada_w1_a", ".hada_w1_b", "kohya", "kohya"),
}
# what a layout targets when no groups are given: the official Turbo LoRA v0.2's 508 modules (docs/lora.md)
DEFAULT_GROUPS = {"turbo": ("blocks", "modulation", "adapter")}
LOKR_FACTOR = 4         # w1's side: the divisor of out / in nearest 4 (LyCORIS' `factor`), w2 the rest
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
        modulation = "modulation" in groups and place == "host" and key.startswith("blocks.")
        if (group in groups or modulation) and (place != "adapter" or key.startswith(ADAPTER_PREFIX + "blocks.")):
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
    make = {"lokr": _lokr, "loha": _loha}.get(layout, _pair)
    entries = []
    shapes = preset_shapes(preset) if isinstance(preset, str) else preset
    for model, key, (n_out, n_in), w_std in target_weights(shapes[0], shapes[1], groups):
        name = lora_name(key[:-len(".weight")], model, te_form if model == "te" else dit_form)
        pair = make(seed, name, n_out, n_in, rank, REL_STRENGTH * w_std, dtype, (down_sfx, up_sfx))
        if layout == "turbo" and key.startswith(ADAPTER_PREFIX):   # the published file's adapter lora_B are zeros
            pair = [TensorEntry(e.name, e.dtype, e.shape, np.zeros(e.shape, np.float32)) if e.name.endswith(up_sfx)
                    else e for e in pair]
        entries += pair
        if alpha is not None:
            entries.append(TensorEntry(name + ".alpha", dtype, (), np.asarray(alpha, np.float32)))
    return entries


def _normal(seed: int, key: str, shape: tuple, std: float):
    """A lazy N(0, std²) f32 array, its values a function of (seed, key) alone."""
    return lambda: _rng(seed, key).standard_normal(shape, dtype=np.float32) * np.float32(std)


def _pair(seed, name, n_out, n_in, rank, rel, dtype, sfx) -> list:
    """down [r, in], up [out, r] with std(up @ down) ≈ rel (the weight's std times REL_STRENGTH)."""
    def down():            # divided, not multiplied by 1/√in: the same bits as the files tests/data/lora records
        return _rng(seed, name + ".down").standard_normal((rank, n_in), dtype=np.float32) / np.float32(
            math.sqrt(n_in))                                                    # [r, in]
    return [TensorEntry(name + sfx[0], dtype, (rank, n_in), down),
            TensorEntry(name + sfx[1], dtype, (n_out, rank), _normal(seed, name + ".up", (n_out, rank),
                                                                     rel * math.sqrt(n_in) / math.sqrt(rank)))]


def lokr_split(n: int, factor: int = LOKR_FACTOR) -> tuple:
    """(m, n // m): m the divisor of n nearest `factor` with m <= n // m (1 for a prime n)."""
    best = 1
    for m in range(1, int(math.isqrt(n)) + 1):
        if n % m == 0 and abs(m - factor) < abs(best - factor):
            best = m
    return best, n // best


def _lokr(seed, name, n_out, n_in, rank, rel, dtype, sfx) -> list:
    """w1 [a, b] full, w2 = w2_a [c, r] @ w2_b [r, d]: std(kron(w1, w2)) ≈ rel."""
    (a, c), (b, d) = lokr_split(n_out), lokr_split(n_in)
    r = min(rank, c, d)
    return [TensorEntry(name + ".lokr_w1", dtype, (a, b), _normal(seed, name + ".w1", (a, b), 1.0)),
            TensorEntry(name + ".lokr_w2_a", dtype, (c, r), _normal(seed, name + ".w2a", (c, r), rel)),
            TensorEntry(name + ".lokr_w2_b", dtype, (r, d), _normal(seed, name + ".w2b", (r, d), 1 / math.sqrt(r)))]


def _loha(seed, name, n_out, n_in, rank, rel, dtype, sfx) -> list:
    """(w1_a @ w1_b) of std 1 times (w2_a @ w2_b) of std rel."""
    sd = 1 / math.sqrt(rank)
    return [TensorEntry(name + ".hada_w1_a", dtype, (n_out, rank), _normal(seed, name + ".w1a", (n_out, rank), 1.0)),
            TensorEntry(name + ".hada_w1_b", dtype, (rank, n_in), _normal(seed, name + ".w1b", (rank, n_in), sd)),
            TensorEntry(name + ".hada_w2_a", dtype, (n_out, rank), _normal(seed, name + ".w2a", (n_out, rank), rel)),
            TensorEntry(name + ".hada_w2_b", dtype, (rank, n_in), _normal(seed, name + ".w2b", (rank, n_in), sd))]


def write_lora(preset, seed: int, out, layout: str = "kohya", rank: int = 8, alpha: Optional[float] = None,
               groups=("blocks",), dtype: str = "BF16") -> int:
    """Write a synthetic LoRA to `out`; returns the number of modules. Metadata as sd-scripts writes it."""
    entries = lora_entries(preset, seed, layout, rank, alpha, groups, dtype)
    modules = sum(1 for e in entries if e.name.endswith(LAYOUTS[layout][0]))
    meta = {"ss_network_module": "lycoris.kohya" if layout in ("lokr", "loha") else "networks.lora_anima",
            "ss_network_dim": str(rank), "ss_network_alpha": str(alpha if alpha is not None else rank)}
    if layout == "turbo":
        meta = {"format": "pt"}                     # what the published Turbo LoRA carries (a PEFT save)
    meta["anima_synthetic"] = (f"lora:{preset if isinstance(preset, str) else 'shapes'}:{seed}:{layout}:"
                               f"{','.join(groups)}")
    log.info("writing synthetic LoRA preset=%s seed=%d layout=%s rank=%d alpha=%s (%d modules) to %s", preset, seed,
             layout, rank, alpha, modules, os.fspath(out))
    write_safetensors(out, entries, metadata=meta)
    return modules
