"""ComfyUI's own LoRA loader on a file of every layout this project reads: which Anima DiT layers it patches and with
what ΔW, recorded for tests/test_lora_layouts.py to check models.lora against.

    /tmp/comfy_venv/bin/python bench/lora_layout_reference.py --comfyui-src COMFYUI_CHECKOUT \\
        --record tests/data/lora/comfy_lora_layouts.npz

Unlike bench/lora_adapter_reference.py (the weight adapters alone, names mapped here), this runs ComfyUI's whole
LoraLoader path as `comfy.sd.load_lora_for_models` does: `comfy.lora.model_lora_keys_unet` builds the key map from the
model's own state-dict keys (here the tiny preset's DiT and LLM adapter under `diffusion_model.`, the keys an Anima
model holds), `comfy.lora_convert.convert_lora`, `comfy.lora.load_lora` (the adapters' `.load`, alpha, the keys it
leaves, which it logs as "lora key not loaded"), then each patch's `calculate_weight` on a zero weight. It needs
ComfyUI's own environment (torch; `--cpu` is passed to its argument parser). LAYOUT_CASES are
models.lora.synth files; per layout the record holds the patched keys, the keys not loaded, and ΔW's Frobenius norm
and SAMPLES fixed elements per layer (bench/lora_adapter_reference.sample_index).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_adapter_reference import sample_index  # noqa: E402
from models.lora.synth import DEFAULT_GROUPS, LAYOUTS, preset_shapes, write_lora  # noqa: E402

# layout -> (seed, rank, alpha, groups, strength); every layout of models.lora.synth, the turbo one in its own groups
LAYOUT_CASES = {layout: (40 + i, 4, None if layout == "turbo" else 2.0,
                         DEFAULT_GROUPS.get(layout, ("blocks", "host", "adapter")), 0.75)
                for i, layout in enumerate(LAYOUTS)}


def comfy_loader(src: Path):
    """ComfyUI's comfy.lora and comfy.lora_convert imported from `src`, its argument parser told --cpu."""
    sys.path.insert(0, str(src))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.lora
    import comfy.lora_convert
    import torch
    torch.set_grad_enabled(False)
    return comfy.lora, comfy.lora_convert


class _Missing(logging.Handler):
    def __init__(self):
        super().__init__()
        self.keys: list = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("lora key not loaded: "):
            self.keys.append(text[len("lora key not loaded: "):])


def comfy_patches(lora_mod, convert_mod, path: Path, strength: float, shapes: dict) -> tuple:
    """({DiT key: ΔW}, [keys ComfyUI did not load]) of one file through ComfyUI's loader."""
    import torch
    from safetensors.torch import load_file
    model = types.SimpleNamespace(state_dict=lambda: {"diffusion_model." + k: None for k in shapes},
                                  model_config=types.SimpleNamespace(unet_config={}))
    key_map = lora_mod.model_lora_keys_unet(model, {})
    missing = _Missing()
    logging.getLogger().addHandler(missing)
    try:
        patches = lora_mod.load_lora(convert_mod.convert_lora(load_file(str(path))), key_map)
    finally:
        logging.getLogger().removeHandler(missing)
    out = {}
    for key, adapter in patches.items():
        k = key[len("diffusion_model."):]
        w = torch.zeros(tuple(shapes[k]), dtype=torch.float32)
        out[k] = adapter.calculate_weight(w, key, strength, 1.0, None, lambda a: a).numpy().copy()
    return out, sorted(missing.keys)


def record(src: Path, out: Path) -> None:
    lora_mod, convert_mod = comfy_loader(src)
    shapes = preset_shapes("tiny")[0]
    rec, meta = {}, {"cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for layout, (seed, rank, alpha, groups, strength) in LAYOUT_CASES.items():
            path = Path(d) / f"{layout}.safetensors"
            write_lora("tiny", seed, path, layout, rank, alpha, groups)
            deltas, missing = comfy_patches(lora_mod, convert_mod, path, strength, shapes)
            keys = sorted(deltas)
            meta["cases"][layout] = {"seed": seed, "rank": rank, "alpha": alpha, "groups": list(groups),
                                     "strength": strength, "keys": keys, "not_loaded": missing}
            rec[f"{layout}/norm"] = np.array([np.linalg.norm(deltas[k]) for k in keys], np.float64)
            rec[f"{layout}/samples"] = np.stack([deltas[k].ravel()[sample_index(deltas[k].shape)] for k in keys])
            print(f"{layout}: ComfyUI patched {len(keys)} layers, {len(missing)} keys not loaded")
    rec["meta"] = np.array(json.dumps(meta))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **rec)
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui-src", type=Path, required=True, help="an unmodified ComfyUI source tree")
    ap.add_argument("--record", type=Path, required=True, help="the .npz to write")
    a = ap.parse_args(argv)
    if not (a.comfyui_src / "comfy" / "lora.py").is_file():
        raise SystemExit(f"--comfyui-src {a.comfyui_src}: no comfy/lora.py there")
    record(a.comfyui_src, a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
