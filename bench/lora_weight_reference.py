"""ComfyUI's own LoRA weight math on this project's synthetic LoRAs: every layer ComfyUI patches and its ΔW, recorded
for the CI tests to check models.lora against. Two ways into ComfyUI, one record each:

    /tmp/comfy_venv/bin/python bench/lora_weight_reference.py loader --comfyui-src COMFYUI_CHECKOUT \\
        --record tests/data/lora/comfy_lora_layouts.npz            # tests/test_lora_layouts.py
    .venv/bin/python bench/lora_weight_reference.py adapters --comfyui-src COMFYUI_CHECKOUT \\
        --record tests/data/lora/comfy_lycoris_weights.npz          # tests/test_lora_lycoris.py

`loader`: ComfyUI's whole LoraLoader path, as `comfy.sd.load_lora_for_models` runs it, on a file of every layout
models.lora.synth writes (LAYOUT_CASES): `comfy.lora.model_lora_keys_unet` builds the key map from the model's own
state-dict keys (the tiny preset's DiT and LLM adapter under `diffusion_model.`, the keys an Anima model holds),
`comfy.lora_convert.convert_lora`, `comfy.lora.load_lora` (the adapters' `.load`, alpha, the keys it leaves, which it
logs as "lora key not loaded"). It needs ComfyUI's own environment (torch; `--cpu` is passed to its argument parser).

`adapters`: ComfyUI's weight adapters alone (comfy/weight_adapter: LoRAAdapter, LoKrAdapter, LoHaAdapter `.load` with
the alpha its loader reads), the names mapped here as its Anima key map gives them (lora_unet_*, diffusion_model.*),
on ADAPTER_CASES: the official-Turbo-LoRA form, a LoKr and a LoHa over the blocks and host layers. Of the rest of
ComfyUI only comfy.model_management's `cast_to_device` is needed, given here: no ComfyUI install, GPU code or model
files.

Either way each patch's `calculate_weight` runs on a zero weight (the patch alone). Per case the record holds the
patched keys (`meta`), ΔW's Frobenius norm and SAMPLES fixed elements per layer (`sample_index`); `loader` also the
keys not loaded.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.lora.synth import DEFAULT_GROUPS, LAYOUTS, preset_shapes, write_lora  # noqa: E402

SAMPLES = 16
# adapters: file -> (layout, seed, rank, alpha, groups, strength_model)
ADAPTER_CASES = {"turbo.safetensors": ("turbo", 21, 8, None, ("blocks", "host"), 1.0),
                 "lokr.safetensors": ("lokr", 22, 4, 2.0, ("blocks", "host"), 0.8),
                 "loha.safetensors": ("loha", 23, 4, 3.0, ("blocks", "host"), -0.7)}
# loader: layout -> (seed, rank, alpha, groups, strength); every layout of models.lora.synth, the turbo one in its
# own groups
LAYOUT_CASES = {layout: (40 + i, 4, None if layout == "turbo" else 2.0,
                         DEFAULT_GROUPS.get(layout, ("blocks", "host", "adapter")), 0.75)
                for i, layout in enumerate(LAYOUTS)}


def sample_index(shape: tuple, n: int = SAMPLES) -> np.ndarray:
    """The flat indices of ΔW the record keeps (the same for the recorder and the tests)."""
    return np.random.default_rng([7, *shape]).integers(0, int(np.prod(shape)), n)


# ------------------------------------------------------------------ adapters: comfy/weight_adapter alone

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


def adapter_deltas(wa, path: Path, strength: float, shapes: dict) -> tuple[dict, dict]:
    """({DiT weight key: ΔW}, {}) as ComfyUI's adapters compute it: its loader's alpha (`.item()`), each adapter's
    load and calculate_weight."""
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
    return out, {}


# ------------------------------------------------------------------ loader: comfy.lora's whole path

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


def loader_deltas(mods, path: Path, strength: float, shapes: dict) -> tuple[dict, dict]:
    """({DiT key: ΔW}, {"not_loaded": [keys ComfyUI did not load]}) of one file through ComfyUI's loader."""
    import torch
    from safetensors.torch import load_file
    lora_mod, convert_mod = mods
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
    return out, {"not_loaded": sorted(missing.keys)}


# ------------------------------------------------------------------ the record

def _cases(way: str) -> dict:
    """{record name: (file name, meta head, (layout, seed, rank, alpha, groups), strength)} of one way in."""
    if way == "adapters":
        return {name: (name, {"layout": layout}, (layout, seed, rank, alpha, groups), strength)
                for name, (layout, seed, rank, alpha, groups, strength) in ADAPTER_CASES.items()}
    return {layout: (f"{layout}.safetensors", {}, (layout, seed, rank, alpha, groups), strength)
            for layout, (seed, rank, alpha, groups, strength) in LAYOUT_CASES.items()}


def record(way: str, src: Path, out: Path) -> None:
    shapes = preset_shapes("tiny")[0]
    if way == "adapters":
        ctx, deltas_of = comfy_adapters(src), adapter_deltas
        meta = {"cases": {}, "comfy_adapters": [c.__name__ for c in ctx.adapters]}
    else:
        ctx, deltas_of, meta = comfy_loader(src), loader_deltas, {"cases": {}}
    rec = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (file, head, (layout, seed, rank, alpha, groups), strength) in _cases(way).items():
            path = Path(d) / file
            write_lora("tiny", seed, path, layout, rank, alpha, groups)
            deltas, extra = deltas_of(ctx, path, strength, shapes)
            keys = sorted(deltas)
            meta["cases"][name] = {**head, "seed": seed, "rank": rank, "alpha": alpha, "groups": list(groups),
                                   "strength": strength, "keys": keys, **extra}
            rec[f"{name}/norm"] = np.array([np.linalg.norm(deltas[k]) for k in keys], np.float64)
            rec[f"{name}/samples"] = np.stack([deltas[k].ravel()[sample_index(deltas[k].shape)] for k in keys])
            print(f"{name}: ComfyUI patched {len(keys)} layers, |ΔW| {rec[f'{name}/norm'].min():.4g}.."
                  f"{rec[f'{name}/norm'].max():.4g}, {len(extra.get('not_loaded', []))} keys not loaded")
    rec["meta"] = np.array(json.dumps(meta))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **rec)
    print(f"wrote {out}")


NEEDS = {"adapters": Path("comfy") / "weight_adapter" / "lokr.py", "loader": Path("comfy") / "lora.py"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("way", choices=sorted(NEEDS), help="ComfyUI's whole loader, or its weight adapters alone")
    ap.add_argument("--comfyui-src", type=Path, required=True, help="an unmodified ComfyUI source tree")
    ap.add_argument("--record", type=Path, required=True, help="the .npz to write")
    a = ap.parse_args(argv)
    if not (a.comfyui_src / NEEDS[a.way]).is_file():
        raise SystemExit(f"--comfyui-src {a.comfyui_src}: no {NEEDS[a.way]} there")
    record(a.way, a.comfyui_src, a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
