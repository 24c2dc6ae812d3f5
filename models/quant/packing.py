"""What `anima-models pack --quant w8a8` adds to a pack: the smoothing table (host weights), the smoothed branch
weights, the names of the INT8 MatMuls per branch, and the quantizer's dataset (PACK/quant/dataset.safetensors)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from models.quant.calib import Calibration, CalibError, read_calib
from models.quant.smooth import SMOOTH_KEY, DEFAULT_INT8, apply_smoothing, smooth_factors, smoothed_weights  # noqa: F401


DATASET_FILE = "quant/dataset.safetensors"
SCHEME = "w8a8"
KINDS = ("self", "cross", "ffn")


@dataclass
class QuantPlan:
    calib: Calibration
    int8: tuple = DEFAULT_INT8
    alpha: Optional[float] = 0.5          # None: no smoothing (s = 1)
    smooth: Optional[np.ndarray] = None   # [blocks, 3, D] once computed


def open_plan(calib_dir, int8: tuple, alpha: Optional[float], sha: str, geom) -> QuantPlan:
    """The calibration checked against the checkpoint (`sha`) and the pack's geometry; CalibError naming --calib."""
    calib = read_calib(calib_dir)
    if calib.info["source_sha256"] != sha:
        raise CalibError(f"--calib {calib_dir}: made for checkpoint sha256 {calib.info['source_sha256'][:12]}…, "
                         f"this checkpoint is {sha[:12]}…; calibrate a pack of this checkpoint")
    g = calib.info["geometry"]
    if (g.get("width"), g.get("height"), g.get("text_tokens")) != (geom.width, geom.height, geom.text_tokens):
        raise CalibError(f"--calib {calib_dir}: made at {g.get('width')}x{g.get('height')} ({g.get('text_tokens')} "
                         f"context rows), this pack is {geom.width}x{geom.height} ({geom.text_tokens}); calibrate "
                         "at this size")
    return QuantPlan(calib, int8, alpha)


def smooth_table(plan: QuantPlan, ckpt, cfg) -> np.ndarray:
    """s [blocks, 3, D]: SmoothQuant factors per branch (1 where the branch has no smoothed INT8 layer)."""
    s = np.ones((cfg.blocks, len(KINDS), cfg.width), np.float32)
    if plan.alpha is None:
        return s
    for b in range(cfg.blocks):
        for j, kind in enumerate(KINDS):
            ws = smoothed_weights(kind, plan.int8)
            if ws:
                w = ckpt.branch_weights(b, kind)
                s[b, j] = smooth_factors(plan.calib.absmax(f"b{b:02d}_{kind}"), [w[k] for k in ws], plan.alpha)
    return s


def branch_weights(plan: QuantPlan, block: int, kind: str, weights: dict) -> dict:
    return apply_smoothing(weights, kind, plan.smooth[block, KINDS.index(kind)], plan.int8)


def write_dataset(tmp, plan: QuantPlan, cfg, geom) -> dict:
    """The quantizer's inputs per branch as the graphs take them (xn / s, the context, the RoPE tables); -> its
    manifest entry {file, sha256, samples}."""
    from models.dit.rope import rope_tables
    from models.records.manifest import file_sha256
    from models.base.safetensors_io import save_arrays
    arrays = {}
    cos, sin = rope_tables(geom.h_tokens, geom.w_tokens, cfg.head_dim)
    arrays["shared.rope_cos"], arrays["shared.rope_sin"] = cos, sin
    n = 0
    for b in range(cfg.blocks):
        for j, kind in enumerate(KINDS):
            name = f"b{b:02d}_{kind}"
            for k, (x, ctx) in enumerate(plan.calib.inputs(name)):
                arrays[f"{name}.{k}.xn"] = (x / plan.smooth[b, j][None, :]).astype(np.float32)
                if ctx is not None:
                    arrays[f"{name}.{k}.context"] = ctx.astype(np.float32)
                n = max(n, k + 1)
    (tmp / DATASET_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_arrays(tmp / DATASET_FILE, arrays, metadata={"kind": "anima-quant-dataset"})
    return {"file": DATASET_FILE, "sha256": file_sha256(tmp / DATASET_FILE), "samples": n}


def quant_section(plan: QuantPlan, dataset: dict) -> dict:
    """The manifest's "quant" table (models.records.manifest.quant_info reads it)."""
    return {"scheme": SCHEME, "int8": list(plan.int8), "smooth": "off" if plan.alpha is None else plan.alpha,
            "weights": "int8 per output channel (symmetric)", "activations": "int8 per tensor (asymmetric)",
            "calib": {"sha256": plan.calib.info["tensors_sha256"], "records": plan.calib.info["records"]},
            "dataset": dataset}


def check_combination(lora_rank: int, loras) -> None:
    """An INT8 pack takes no LoRA-ready inputs and no baked LoRAs (their deltas would need re-calibration);
    ValueError naming both options. Shards are fine: each shard graph carries its branch's INT8 layers."""
    if lora_rank:
        raise ValueError(f"--quant w8a8 with --lora-rank {lora_rank}: an INT8 pack takes no LoRA inputs (its INT8 "
                         "projections have no FP16 low-rank path); build a FP16 LoRA-ready pack for LoRAs")
    if loras:
        raise ValueError("--quant w8a8 with --lora: bake the LoRA into the checkpoint and calibrate that, or use a "
                         "FP16 pack")
