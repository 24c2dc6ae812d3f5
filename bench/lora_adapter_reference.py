"""ComfyUI's own LoRA weight math on this project's synthetic LoRAs: every patched layer's ΔW as ComfyUI's weight
adapters compute it (comfy/weight_adapter: LoRAAdapter, LoKrAdapter, LoHaAdapter `.load` then `.calculate_weight`),
recorded for tests/test_lora_lycoris.py to check models.lora's merged weights against.

    .venv/bin/python bench/lora_adapter_reference.py --comfyui-src COMFYUI_CHECKOUT \\
        --record tests/data/lora/comfy_lycoris_weights.npz

COMFYUI_CHECKOUT: an unmodified ComfyUI source tree (its comfy/weight_adapter/ is imported as it is; the one module it
needs from the rest of ComfyUI, comfy.model_management, is given here as its `cast_to_device` alone, so no ComfyUI
install, GPU code or model files are needed). The LoRAs are models.lora.synth's, made again from CASES by the test:
the official-Turbo-LoRA form (ComfyUI's diffusion_model.* lora_A/lora_B over blocks and host layers), a LoKr and a
LoHa, on the tiny preset's DiT. Per layer the record holds ΔW's Frobenius norm and ΔW at SAMPLES fixed elements.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.lora.synth import preset_shapes, write_lora  # noqa: E402

# file -> (layout, seed, rank, alpha, groups, strength_model)
CASES = {"turbo.safetensors": ("turbo", 21, 8, None, ("blocks", "host"), 1.0),
         "lokr.safetensors": ("lokr", 22, 4, 2.0, ("blocks", "host"), 0.8),
         "loha.safetensors": ("loha", 23, 4, 3.0, ("blocks", "host"), -0.7)}
SAMPLES = 16


def sample_index(shape: tuple, n: int = SAMPLES) -> np.ndarray:
    """The flat indices of ΔW the record keeps (the same for the recorder and the test)."""
    return np.random.default_rng([7, *shape]).integers(0, int(np.prod(shape)), n)


def comfy_adapters(src: Path):
    """ComfyUI's comfy.weight_adapter package imported from `src`, with comfy.model_management's cast_to_device."""
    import torch
    sys.path.insert(0, str(src))
    mm = types.ModuleType("comfy.model_management")

    def cast_to_device(tensor, device, dtype, copy=False):
        return tensor.to(device=device, dtype=dtype, copy=copy)
    mm.cast_to_device = cast_to_device
    pe = types.ModuleType("comfy.patcher_extension")
    pe.PatcherInjection = type("PatcherInjection", (), {"__init__": lambda self, *a, **k: None})
    comfy = importlib.import_module("comfy")
    sys.modules["comfy.model_management"], comfy.model_management = mm, mm
    sys.modules["comfy.patcher_extension"], comfy.patcher_extension = pe, pe
    torch.set_grad_enabled(False)
    return importlib.import_module("comfy.weight_adapter")


def comfy_deltas(wa, path: Path, strength: float, shapes: dict) -> dict:
    """{DiT weight key: ΔW} as ComfyUI computes it: its loader's alpha (`.item()`), each adapter's load and
    calculate_weight on a zero weight (the patch alone), names as its Anima key map gives them (lora_unet_*,
    diffusion_model.*)."""
    import torch
    from safetensors.torch import load_file
    lora = load_file(str(path))
    names = {}
    for key in shapes:
        if key.endswith(".weight") and len(shapes[key]) == 2:
            module = key[:-len(".weight")]
            names["lora_unet_" + module.replace(".", "_")] = key
            names["diffusion_model." + module] = key
    out = {}
    for x, key in names.items():
        alpha = lora[x + ".alpha"].item() if x + ".alpha" in lora else None
        for cls in wa.adapters:
            adapter = cls.load(x, lora, alpha, None, set())
            if adapter is not None:
                w = torch.zeros(tuple(shapes[key]), dtype=torch.float32)
                w = adapter.calculate_weight(w, key, strength, 1.0, None, lambda a: a)
                out[key] = w.numpy().copy()
    return out


def record(src: Path, out: Path) -> None:
    wa = comfy_adapters(src)
    shapes = preset_shapes("tiny")[0]
    rec, meta = {}, {"cases": {}, "comfy_adapters": [c.__name__ for c in wa.adapters]}
    with tempfile.TemporaryDirectory() as d:
        for name, (layout, seed, rank, alpha, groups, strength) in CASES.items():
            path = Path(d) / name
            write_lora("tiny", seed, path, layout, rank, alpha, groups)
            deltas = comfy_deltas(wa, path, strength, shapes)
            keys = sorted(deltas)
            meta["cases"][name] = {"layout": layout, "seed": seed, "rank": rank, "alpha": alpha,
                                   "groups": list(groups), "strength": strength, "keys": keys}
            rec[f"{name}/norm"] = np.array([np.linalg.norm(deltas[k]) for k in keys], np.float64)
            rec[f"{name}/samples"] = np.stack([deltas[k].ravel()[sample_index(deltas[k].shape)] for k in keys])
            print(f"{name}: ComfyUI patched {len(keys)} layers, |ΔW| {rec[f'{name}/norm'].min():.4g}.."
                  f"{rec[f'{name}/norm'].max():.4g}")
    rec["meta"] = np.array(json.dumps(meta))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **rec)
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui-src", type=Path, required=True, help="an unmodified ComfyUI source tree")
    ap.add_argument("--record", type=Path, required=True, help="the .npz to write")
    a = ap.parse_args(argv)
    if not (a.comfyui_src / "comfy" / "weight_adapter" / "lokr.py").is_file():
        raise SystemExit(f"--comfyui-src {a.comfyui_src}: no comfy/weight_adapter/lokr.py there")
    record(a.comfyui_src, a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
