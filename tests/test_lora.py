"""LoRA files, names and math (models/lora/): every layout, the name mapping from the models' own keys, merged
weights and stacked factors against an independent reading of the file (safetensors + torch), and every refusal."""
from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

from models.dit.config import PRESETS, expected_adapter_shapes, expected_dit_shapes
from models.lora import LoraError, LoraFile, LoraUse, TargetTable, parse_lora_arg, plan_loras, reduce_rank
from models.lora.synth import LAYOUTS, lora_name, write_lora
from models.lora.targets import place_of
from models.base.safetensors_io import TensorEntry, write_safetensors
from models.text.qwen3 import Qwen3Shape
from models.text.synth import TE_PRESETS

ALL_GROUPS = ("blocks", "host", "adapter", "te")


def tiny_table(te: bool = True, adapter: bool = True) -> TargetTable:
    p = PRESETS["tiny"]
    return TargetTable.from_configs(p["dit"], p["adapter"] if adapter else None,
                                    Qwen3Shape(**TE_PRESETS["tiny"]) if te else None)


def torch_pairs(path) -> dict:
    """An independent reading: safetensors' own torch loader -> {key: f32 array}."""
    from safetensors.torch import load_file
    return {k: v.float().numpy() for k, v in load_file(str(path)).items()}


@pytest.fixture(scope="module")
def kohya(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "kohya.safetensors"
    write_lora("tiny", 3, path, "kohya", rank=8, alpha=4.0, groups=ALL_GROUPS)
    return path


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_reads_back_onto_the_same_layers(tmp_path, layout):
    path = tmp_path / f"{layout}.safetensors"
    n = write_lora("tiny", 1, path, layout, rank=4, alpha=2.0, groups=ALL_GROUPS)
    f = LoraFile(path)
    assert f.layouts == ({"turbo": "comfy"}.get(layout, layout),) and len(f.pairs) == n and not f.stray
    plan = plan_loras([LoraUse(str(path))], tiny_table())
    counts = plan.report()[0]["layers"]
    # blocks: 28 x (4 self + 4 cross + 2 ffn); host: x_embedder, 2 t_embedder, 28 x 3 x 2 modulation, final 3;
    # adapter: 6 x (8 attention + 2 mlp); te: 2 layers x 7
    assert counts == {"branch": 280, "host": 1 + 2 + 168 + 3, "adapter": 60, "te": 14}
    assert all(abs(u.factor - 0.5) < 1e-12 for ups in plan.updates.values() for u in ups)   # alpha / rank


def test_underscore_names_map_back_to_the_checkpoints_modules(kohya):
    f = LoraFile(kohya)
    table = tiny_table()
    expect = {
        "lora_unet_blocks_3_adaln_modulation_self_attn_1": "blocks.3.adaln_modulation_self_attn.1.weight",
        "lora_unet_blocks_3_adaln_modulation_cross_attn_2": "blocks.3.adaln_modulation_cross_attn.2.weight",
        "lora_unet_blocks_27_cross_attn_output_proj": "blocks.27.cross_attn.output_proj.weight",
        "lora_unet_blocks_0_mlp_layer2": "blocks.0.mlp.layer2.weight",
        "lora_unet_t_embedder_1_linear_1": "t_embedder.1.linear_1.weight",
        "lora_unet_x_embedder_proj_1": "x_embedder.proj.1.weight",
        "lora_unet_final_layer_adaln_modulation_2": "final_layer.adaln_modulation.2.weight",
        "lora_unet_final_layer_linear": "final_layer.linear.weight",
        "lora_unet_llm_adapter_blocks_5_cross_attn_o_proj": "llm_adapter.blocks.5.cross_attn.o_proj.weight",
        "lora_unet_llm_adapter_blocks_0_mlp_0": "llm_adapter.blocks.0.mlp.0.weight",
        "lora_te_layers_1_mlp_gate_proj": "model.layers.1.mlp.gate_proj.weight",
        "lora_te_layers_0_self_attn_o_proj": "model.layers.0.self_attn.o_proj.weight",
    }
    for name, key in expect.items():
        assert name in f.pairs
        assert table.lookup(name).key == key
    assert table.lookup("diffusion_model.blocks.3.self_attn.q_proj").key == "blocks.3.self_attn.q_proj.weight"
    assert table.lookup("text_encoder.qwen3.layers.0.mlp.up_proj").key == "model.layers.0.mlp.up_proj.weight"
    assert table.lookup("lora_unet_blocks_3_self_attn_q_norm") is None          # 1-D: no LoRA target
    assert [place_of(k) for k in ("blocks.2.cross_attn.k_proj.weight", "blocks.2.adaln_modulation_mlp.1.weight",
                                  "llm_adapter.out_proj.weight", "blocks.2.self_attn.q_norm.weight")] == \
        ["branch", "host", "adapter", "branch"]


def test_ambiguous_underscore_names_are_refused():
    table = TargetTable({"a.b_c.weight": (4, 4), "a_b.c.weight": (4, 4)})
    with pytest.raises(LoraError, match="ambiguous"):
        table.lookup("lora_unet_a_b_c")
    assert table.lookup("diffusion_model.a.b_c").key == "a.b_c.weight"


def test_merged_weights_equal_an_independent_formula(kohya):
    raw = torch_pairs(kohya)
    plan = plan_loras([LoraUse(str(kohya), strength=0.7, clip_strength=-1.3)], tiny_table())
    rng = np.random.default_rng(0)
    for key, name, strength in (("blocks.4.self_attn.k_proj.weight", "lora_unet_blocks_4_self_attn_k_proj", 0.7),
                                ("blocks.9.adaln_modulation_mlp.2.weight", "lora_unet_blocks_9_adaln_modulation_mlp_2",
                                 0.7),
                                ("llm_adapter.blocks.2.self_attn.v_proj.weight",
                                 "lora_unet_llm_adapter_blocks_2_self_attn_v_proj", 0.7),
                                ("model.layers.1.self_attn.q_proj.weight", "lora_te_layers_1_self_attn_q_proj", -1.3)):
        up, down = raw[name + ".lora_up.weight"].astype(np.float64), raw[name + ".lora_down.weight"].astype(np.float64)
        alpha = float(raw[name + ".alpha"])
        w = rng.standard_normal(plan.targets[key].shape).astype(np.float32)
        want = w + strength * alpha / down.shape[0] * (up @ down)
        got = plan.merged(key, w)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), key
        assert np.allclose(plan.delta(key), want - w, atol=1e-6)


def test_no_alpha_means_scale_one(tmp_path):
    path = tmp_path / "noalpha.safetensors"
    write_lora("tiny", 2, path, "comfy", rank=6, alpha=None, groups=("blocks",))
    plan = plan_loras([LoraUse(str(path), 0.5)], tiny_table())
    assert {u.factor for ups in plan.updates.values() for u in ups} == {0.5}
    raw = torch_pairs(path)
    up = raw["diffusion_model.blocks.1.mlp.layer1.lora_B.weight"]
    down = raw["diffusion_model.blocks.1.mlp.layer1.lora_A.weight"]
    assert np.allclose(plan.delta("blocks.1.mlp.layer1.weight"), 0.5 * up @ down, atol=1e-6)


def test_stacked_factors_equal_the_sum_and_pad_with_zeros(tmp_path, kohya):
    other = tmp_path / "other.safetensors"
    write_lora("tiny", 4, other, "comfy", rank=4, alpha=8.0, groups=("blocks",))
    plan = plan_loras([LoraUse(str(kohya), 0.6), LoraUse(str(other), -0.4)], tiny_table())
    key = "blocks.7.cross_attn.v_proj.weight"
    assert plan.rank(key) == 12 and plan.max_rank() == 12
    B, A, err = plan.factors(key, 16)
    assert B.shape == (256, 16) and A.shape == (16, 128) and err == 0.0
    assert not B[:, 12:].any() and not A[12:].any()
    assert np.abs(B @ A - plan.delta(key)).max() < 1e-6
    B, A, _ = plan.factors("blocks.7.cross_attn.v_proj.weight", 12)
    assert np.abs(B @ A - plan.delta(key)).max() < 1e-6
    with pytest.raises(LoraError, match=r"stacked LoRA rank 12 exceeds the pack's LoRA rank 8 in 280 layers"):
        plan.check_rank(8)
    with pytest.raises(LoraError, match="takes no LoRA at run time"):
        plan.check_rank(0)
    assert len(plan.check_rank(8, "svd")) == 280


def test_svd_reduction_reports_its_own_error(kohya):
    plan = plan_loras([LoraUse(str(kohya))], tiny_table())
    key = "blocks.0.mlp.layer1.weight"
    d = plan.delta(key)
    B, A, err = plan.factors(key, 5, "svd")
    assert B.shape == (1024, 5) and A.shape == (5, 256)
    actual = float(np.linalg.norm(B @ A - d) / np.linalg.norm(d))
    assert 0.01 < err and abs(err - actual) < 1e-5
    s = np.linalg.svd(d.astype(np.float64), compute_uv=False)           # Eckart-Young: the optimum
    assert abs(err - np.sqrt((s[5:] ** 2).sum() / (s ** 2).sum())) < 1e-5
    B, A, err = plan.factors(key, 8, "svd")                             # rank fits: nothing dropped
    assert err == 0.0 and np.abs(B @ A - d).max() < 1e-6
    Bs, As, e2 = reduce_rank(np.hstack([B, B]), np.vstack([A, A]), 8)   # rank 16 holding rank 8: exact
    assert e2 < 1e-6 and np.abs(Bs @ As - 2 * d).max() < 1e-5


def test_parts_a_run_lacks_are_counted_not_refused(kohya):
    plan = plan_loras([LoraUse(str(kohya))], tiny_table(te=False, adapter=False))
    rep = plan.report()[0]
    assert rep["layers"] == {"branch": 280, "host": 174}
    assert rep["not_applied"] == {"adapter": 60, "te": 14}


def _write(path, tensors: dict, meta=None):
    write_safetensors(path, [TensorEntry(k, "F32", tuple(np.shape(v)), np.asarray(v, np.float32))
                             for k, v in tensors.items()], meta)
    return path


def test_refusals_name_the_file_and_the_problem(tmp_path, kohya):
    t = tiny_table()
    # truncated
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(kohya.read_bytes()[:-1000])
    with pytest.raises(LoraError, match="truncated"):
        LoraFile(cut)
    # not a safetensors file at all
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(LoraError, match="not a safetensors file or truncated"):
        LoraFile(junk)
    # wrong shapes for this model
    bad = _write(tmp_path / "shape.safetensors", {"lora_unet_blocks_0_self_attn_q_proj.lora_up.weight": np.ones((512, 4)),
                                                  "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight": np.ones((4, 512))})
    with pytest.raises(LoraError, match=r"makes \[512, 512\], but blocks.0.self_attn.q_proj.weight is \[256, 256\]"):
        plan_loras([LoraUse(str(bad))], t)
    # another model's LoRA
    sdxl = _write(tmp_path / "sdxl.safetensors", {
        "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": np.ones((8, 2)),
        "lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": np.ones((2, 8))})
    with pytest.raises(LoraError, match="names a layer of Anima.*Stable Diffusion"):
        plan_loras([LoraUse(str(sdxl))], t)
    # other adapter types, named
    for suffix, what in ((".hada_w1_a", "both a LoRA pair"), (".lokr_w1", "both a LoRA pair"),
                         (".dora_scale", "this is DoRA"), (".oft_blocks", "this is OFT")):
        p = _write(tmp_path / f"t{suffix}.safetensors", {
            "lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.ones((1024, 2)),
            "lora_unet_blocks_0_mlp_layer1.lora_down.weight": np.ones((2, 256)),
            "lora_unet_blocks_0_mlp_layer1" + suffix: np.ones((2, 2))})
        with pytest.raises(LoraError, match=what):
            LoraFile(p)
    # half a pair
    half = _write(tmp_path / "half.safetensors", {"lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.ones((1024, 2))})
    with pytest.raises(LoraError, match="half a LoRA pair"):
        LoraFile(half)
    # a bad alpha
    alpha = _write(tmp_path / "alpha.safetensors", {
        "lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.ones((1024, 2)),
        "lora_unet_blocks_0_mlp_layer1.lora_down.weight": np.ones((2, 256)),
        "lora_unet_blocks_0_mlp_layer1.alpha": np.ones(3)})
    with pytest.raises(LoraError, match="alpha must be one number"):
        LoraFile(alpha)
    # a bad strength
    with pytest.raises(LoraError, match=r"strength must be a number in \[-100, 100\]"):
        plan_loras([LoraUse(str(kohya), float("nan"))], t)
    with pytest.raises(LoraError, match="no such file"):
        plan_loras([LoraUse(str(tmp_path / "missing.safetensors"))], t)


def test_unknown_keys_are_refused_by_name_or_skipped_like_comfyui(tmp_path, caplog):
    p = _write(tmp_path / "extra.safetensors", {
        "lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.ones((1024, 2)),
        "lora_unet_blocks_0_mlp_layer1.lora_down.weight": np.ones((2, 256)),
        "lora_unet_blocks_0_mlp_layer9.lora_up.weight": np.ones((1024, 2)),
        "lora_unet_blocks_0_mlp_layer9.lora_down.weight": np.ones((2, 256)),
        "something_else": np.ones(1)})
    with pytest.raises(LoraError, match=r"2 keys match no layer of Anima: 'lora_unet_blocks_0_mlp_layer9', "
                                        r"'something_else'"):
        plan_loras([LoraUse(str(p))], tiny_table())
    with caplog.at_level(logging.WARNING):
        plan = plan_loras([LoraUse(str(p))], tiny_table(), strict=False)
    assert list(plan.targets) == ["blocks.0.mlp.layer1.weight"]
    assert "lora key not loaded: lora_unet_blocks_0_mlp_layer9" in caplog.text


def test_non_finite_weights_are_refused_when_read(tmp_path):
    p = _write(tmp_path / "nan.safetensors", {
        "lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.full((1024, 2), np.nan),
        "lora_unet_blocks_0_mlp_layer1.lora_down.weight": np.ones((2, 256))})
    plan = plan_loras([LoraUse(str(p))], tiny_table())
    with pytest.raises(LoraError, match="holds NaN or Inf"):
        plan.delta("blocks.0.mlp.layer1.weight")


def test_lora_arguments_parse():
    assert parse_lora_arg("a.safetensors") == LoraUse("a.safetensors", 1.0, None)
    assert parse_lora_arg("dir/a.safetensors:0.75") == LoraUse("dir/a.safetensors", 0.75, None)
    assert parse_lora_arg("a:b.safetensors:0.5:-1") == LoraUse("a:b.safetensors", 0.5, -1.0)
    with pytest.raises(LoraError, match="strength"):
        parse_lora_arg("a.safetensors:1000")
    with pytest.raises(ValueError, match="FILE"):
        parse_lora_arg(":1")


def test_synthetic_names_are_those_real_files_use():
    assert lora_name("blocks.0.self_attn.q_proj", "dit", "kohya") == "lora_unet_blocks_0_self_attn_q_proj"
    assert lora_name("model.layers.3.mlp.down_proj", "te", "kohya") == "lora_te_layers_3_mlp_down_proj"
    assert lora_name("blocks.0.self_attn.q_proj", "dit", "dotted") == "diffusion_model.blocks.0.self_attn.q_proj"
    assert lora_name("model.layers.3.mlp.down_proj", "te", "dotted") == "text_encoder.qwen3.layers.3.mlp.down_proj"
    # every DiT / adapter weight key of the full model has a kohya name that maps back to it
    p = PRESETS["full"]
    shapes = dict(expected_dit_shapes(p["dit"]))
    shapes.update(expected_adapter_shapes(p["adapter"], "llm_adapter."))
    table = TargetTable(shapes)
    for key, shape in shapes.items():
        if len(shape) == 2:
            assert table.lookup(lora_name(key[:-7], "dit", "kohya")).key == key


def test_synth_lora_command(tmp_path):
    from models.commands.cli import main
    out = tmp_path / "loras" / "s.safetensors"
    assert main(["synth", "lora", "--out", str(out), "--layout", "comfy", "--rank", "3", "--alpha", "none",
                 "--groups", "blocks,te", "--seed", "5"]) == 0
    f = LoraFile(out)
    assert f.layouts == ("comfy",) and {p.rank for p in f.pairs.values()} == {3}
    assert all(p.alpha is None for p in f.pairs.values())
    assert "text_encoder.qwen3.layers.1.self_attn.k_proj" in f.pairs
    assert main(["synth", "lora", "--out", str(out), "--layout", "diffusers"]) == 2


def test_merged_weights_equal_comfyuis_on_the_small_bundle(tmp_path):
    """tests/data/lora/comfy_small_weights.npz: ComfyUI's own LoRA math (load_lora_for_models + calculate_weight, FP32,
    an unmodified ComfyUI on the synthetic small bundle: 10-block DiT, full adapter and Qwen3) for two synthetic LoRAs
    made by models.lora.synth from the files' key lists: the layers it patched, ΔW's norm per layer and ΔW at 8
    sampled elements per layer. The same LoRAs are made again here and planned against the same key lists."""
    import json
    rec = np.load("tests/data/lora/comfy_small_weights.npz")
    shapes = json.loads(bytes(rec["shapes"]))
    meta = json.loads(bytes(rec["meta"]))
    table = TargetTable(shapes["dit"], shapes["te"])
    for case, m in meta.items():
        layout, seed, rank, alpha, groups = m["lora"]
        path = tmp_path / f"{case}.safetensors"
        write_lora((shapes["dit"], shapes["te"]), seed, path, layout, rank, alpha, tuple(groups))
        plan = plan_loras([LoraUse(str(path), m["strength_model"], m["strength_clip"])], table)
        ours = {}
        for key in m["keys"]:
            ours[key] = key[len("diffusion_model."):] if key.startswith("diffusion_model.") else \
                "model." + key.split(".transformer.model.", 1)[1]
        comfy_dit = {ours[k] for k in m["keys"] if k.startswith("diffusion_model.")}
        assert comfy_dit == {k for k, t in plan.targets.items() if t.model == "dit"} and \
            len(comfy_dit) == m["patched_model"]
        comfy_te = {ours[k] for k in m["keys"] if not k.startswith("diffusion_model.")}
        if m["patched_clip"]:
            assert comfy_te == set(plan.keys("te"))
        else:       # ComfyUI has no names for text_encoder.qwen3.* (sd-scripts' converter's form): it skipped them all
            assert len(m["not_loaded"]) == 2 * len(plan.keys("te")) > 0
            assert all("text_encoder.qwen3." in n for n in m["not_loaded"])
        for i, key in enumerate(m["keys"]):
            if ".layers." in key and not any(f".layers.{n}." in key for n in (0, 27)) or \
                    "llm_adapter.blocks." in key and not any(f"adapter.blocks.{n}." in key for n in (0, 5)):
                continue                    # Qwen3 and the adapter at full size: the first and last layers suffice
            d = plan.delta(ours[key]).astype(np.float64).ravel()
            norm = float(rec[f"{case}.norm"][i])
            assert abs(np.linalg.norm(d) - norm) <= 1e-5 * norm, key
            assert np.abs(d[rec[f"{case}.idx"][i]] - rec[f"{case}.val"][i]).max() <= 1e-5 * norm, key


def test_a1111_tags_come_out_of_the_prompt_as_a1111_takes_them():
    from models.lora.a1111 import LoraTag, lora_tag, split_lora_tags
    assert split_lora_tags("1girl, <lora:style:0.8>, smile") == ("1girl, , smile", [LoraTag("style", 0.8, 0.8)])
    text, tags = split_lora_tags("<lora:a:0.5:1.2> x <lyco:sub/b> <lora:c:te=0.3> <lora:d:unet=2:te=1>")
    assert text == "x" and tags == [LoraTag("a", 1.2, 0.5), LoraTag("sub/b", 1.0, 1.0), LoraTag("c", 0.3, 0.3),
                                       LoraTag("d", 2.0, 1.0)]
    assert split_lora_tags("no tags <here>") == ("no tags <here>", [])
    for bad, msg in (("<lora::1>", "no LoRA name"), ("<lora:a:x>", "not a number"), ("<lora:a:1:2:3>", "at most two"),
                     ("<lora:a:dyn=4>", "not a multiplier"), ("<lora:a:inf>", "finite")):
        with pytest.raises(LoraError, match=msg):
            split_lora_tags(bad)
    assert lora_tag("style.safetensors", 0.8, 0.8) == "<lora:style:0.8>"
    assert lora_tag("style.safetensors", 1.2, 0.5) == "<lora:style:0.5:1.2>"
    t = lora_tag("s.safetensors", 1.2, 0.5)
    assert split_lora_tags(t)[1] == [LoraTag("s", 1.2, 0.5)]            # written as it is read


def test_lora_names_resolve_under_the_models_folders_loras(tmp_path):
    from models.setup.models_dir import ModelsDirError, list_loras, lora_path
    (tmp_path / "loras" / "sub").mkdir(parents=True)
    for rel in ("style.safetensors", "sub/char.safetensors", "sub/style2.safetensors"):
        (tmp_path / "loras" / rel).write_bytes(b"x")
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    (tmp_path / "loras" / "link.safetensors").symlink_to(tmp_path / "secret.safetensors")
    assert list_loras(tmp_path) == ["style.safetensors", "sub/char.safetensors", "sub/style2.safetensors"]
    root = (tmp_path / "loras").resolve()
    assert lora_path(tmp_path, "style.safetensors") == root / "style.safetensors"
    assert lora_path(tmp_path, "sub/char.safetensors") == root / "sub" / "char.safetensors"
    assert lora_path(tmp_path, "char") == root / "sub" / "char.safetensors"          # A1111: by its stem
    for bad, msg in (("../secret.safetensors", "outside loras/"), (str(tmp_path / "secret.safetensors"), "outside"),
                     ("link.safetensors", "outside"), ("nope", r"no such file.*there are: style.safetensors"),
                     ("a\x00b", "relative path"), ("", "relative path")):
        with pytest.raises(ModelsDirError, match=msg):
            lora_path(tmp_path, bad)
    assert list_loras(tmp_path / "nothing") == []


def test_a1111_txt2img_takes_the_prompts_lora_tags_as_the_jobs_loras():
    from orchestrator.http.a1111 import to_spec
    from orchestrator.http.common import BadRequest
    spec = to_spec({"prompt": "1girl, <lora:ink:0.7>smile<lora:body:te=0:unet=-0.5>", "seed": 1})
    assert spec["prompt"] == "1girl, smile"
    assert spec["loras"] == [{"name": "ink", "strength": 0.7, "clip_strength": 0.7},
                             {"name": "body", "strength": -0.5, "clip_strength": 0.0}]
    assert "loras" not in to_spec({"prompt": "1girl"})
    with pytest.raises(BadRequest) as e:
        to_spec({"prompt": "1girl <lora:ink:strong>"})
    assert e.value.status == 422 and e.value.body["field"] == "prompt" and "'strong' is not a number" in str(e.value)
