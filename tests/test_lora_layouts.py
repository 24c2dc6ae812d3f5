"""Every LoRA layout ComfyUI's loader accepts for the Anima DiT is read by models/lora with the same layers and ΔW:
files of each layout (models.lora.synth, exact key names) against what ComfyUI's whole loader made of the same files
(comfy.lora.model_lora_keys_unet, lora_convert, load_lora, calculate_weight: tests/data/lora/comfy_lora_layouts.npz,
bench/lora_weight_reference.py loader); the key of each layout as docs/lora.md's table names it; the official Turbo
LoRA's published layout; what ComfyUI does not map for Anima (lycoris_*) refused, named."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.lora_weight_reference import LAYOUT_CASES, sample_index
from models.dit.config import PRESETS
from models.lora import LoraError, LoraFile, LoraUse, TargetTable, plan_loras
from models.lora.synth import LAYOUTS, write_lora
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors

REC = np.load(Path(__file__).parent / "data" / "lora" / "comfy_lora_layouts.npz")
META = json.loads(str(REC["meta"]))["cases"]
# layout -> one key of a file in it, as docs/lora.md's table lists them
EXAMPLE_KEYS = {
    "kohya": "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight",
    "comfy": "diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight",
    "bare": "diffusion_model.blocks.0.self_attn.q_proj.lora_A",
    "peft-default": "diffusion_model.blocks.0.self_attn.q_proj.lora_A.default.weight",
    "diffusers-proc": "diffusion_model.blocks.0.self_attn.q_proj_lora.down.weight",
    "diffusers-lora": "diffusion_model.blocks.0.self_attn.q_proj.lora.down.weight",
    "transformers": "diffusion_model.blocks.0.self_attn.q_proj.lora_linear_layer.down.weight",
    "turbo": "diffusion_model.blocks.0.adaln_modulation_self_attn.1.lora_A.weight",
    "lokr": "lora_unet_blocks_0_self_attn_q_proj.lokr_w1",
    "loha": "lora_unet_blocks_0_self_attn_q_proj.hada_w1_a",
}


def table() -> TargetTable:
    return TargetTable.from_configs(PRESETS["tiny"]["dit"], PRESETS["tiny"]["adapter"])


def test_the_record_covers_every_layout_the_synthesiser_writes():
    from models.commands.synth import LORA_LAYOUTS
    assert set(META) == set(LAYOUTS) == set(LAYOUT_CASES) == set(EXAMPLE_KEYS) == set(LORA_LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUT_CASES))
def test_each_layout_patches_the_layers_comfyui_patches_with_its_delta(tmp_path, layout):
    seed, rank, alpha, groups, strength = LAYOUT_CASES[layout]
    case = META[layout]
    assert (case["seed"], case["rank"], case["alpha"], tuple(case["groups"]), case["strength"]) == \
        (seed, rank, alpha, tuple(groups), strength)
    path = tmp_path / f"{layout}.safetensors"
    write_lora("tiny", seed, path, layout, rank, alpha, groups)
    assert EXAMPLE_KEYS[layout] in SafeTensorsFile(path).keys()
    f = LoraFile(path)
    assert f.layouts == ({"turbo": "comfy"}.get(layout, layout),) and not f.stray
    assert case["not_loaded"] == []                                # ComfyUI loaded every key too
    plan = plan_loras([LoraUse(str(path), strength)], table())
    assert sorted(plan.targets) == case["keys"]                    # the layers ComfyUI patched, no more, no fewer
    for i, key in enumerate(case["keys"]):
        d = plan.delta(key)
        norm = REC[f"{layout}/norm"][i]
        if norm == 0:                                              # the Turbo file's zero adapter lora_B
            assert not d.any(), key
            continue
        assert abs(np.linalg.norm(d) / norm - 1) < 1e-5, key
        np.testing.assert_allclose(d.ravel()[sample_index(d.shape)], REC[f"{layout}/samples"][i],
                                   atol=1e-6 * norm / np.sqrt(d.size), rtol=1e-5, err_msg=key)


def test_the_turbo_stand_in_has_the_published_layout(tmp_path):
    """anima-turbo-lora-v0.2 as public code that loads it describes it: 508 pairs under diffusion_model. with PEFT's
    lora_A/lora_B.weight, no alpha, metadata {"format": "pt"}: 448 in the 28 blocks (q/k/v/output_proj of both
    attentions, mlp.layer1/2, adaln_modulation_{self_attn,cross_attn,mlp}.1/.2) and 60 in the LLM adapter's 6 blocks
    (q/k/v/o_proj of both attentions, mlp.0/2), whose lora_B are zeros."""
    from models.commands.cli import main
    out = tmp_path / "turbo.safetensors"
    assert main(["synth", "lora", "--preset", "tiny", "--layout", "turbo", "--out", str(out)]) == 0
    st = SafeTensorsFile(out)
    keys = st.keys()
    assert st.metadata["format"] == "pt" and not [k for k in keys if k.endswith(".alpha")]
    assert all(k.startswith("diffusion_model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    f = LoraFile(out)
    adapter = [n for n in f.pairs if n.startswith("diffusion_model.llm_adapter.")]
    assert len(f.pairs) == 508 and len(adapter) == 60
    per_block = sorted(n.split(".", 3)[3] for n in f.pairs if n.startswith("diffusion_model.blocks.0."))
    assert per_block == sorted([f"{a}.{p}" for a in ("self_attn", "cross_attn")
                                for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
                               + ["mlp.layer1", "mlp.layer2"]
                               + [f"adaln_modulation_{m}.{i}" for m in ("self_attn", "cross_attn", "mlp")
                                  for i in (1, 2)])
    assert not any(st.get(n + ".lora_B.weight").any() for n in adapter)
    assert all(f.pairs[n].alpha is None for n in f.pairs)


def test_names_comfyui_does_not_map_for_anima_are_refused_named(tmp_path):
    """ComfyUI maps lycoris_* (SimpleTuner) only for UNet, SD3, Flux and a few DiTs, not Anima: it loads nothing of
    such a file ("lora key not loaded"); this project refuses it, naming a key, rather than run without it."""
    path = tmp_path / "lyco.safetensors"
    name = "lycoris_blocks_0_self_attn_q_proj"
    write_safetensors(path, [TensorEntry(name + ".lora_down.weight", "F32", (2, 256), np.ones((2, 256), np.float32)),
                             TensorEntry(name + ".lora_up.weight", "F32", (256, 2), np.ones((256, 2), np.float32))])
    with pytest.raises(LoraError, match=name):
        plan_loras([LoraUse(str(path))], table())
