"""LyCORIS LoKr / LoHa and the Turbo-LoRA form (models/lora/lycoris.py, file.py, plan.py): ΔW against ComfyUI's own
weight adapters (tests/data/lora/comfy_lycoris_weights.npz, bench/lora_weight_reference.py adapters) and against a plain
second computation written here; the exact low-rank form; baked and run-time packs against the torch reference on
the checkpoint with the LoRA merged; every refusal."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.lora_weight_reference import ADAPTER_CASES as CASES, sample_index
from models.dit.checkpoint import DiTCheckpoint
from models.dit.config import PRESETS, expected_dit_shapes
from models.dit.reference import reference_forward
from models.lora import LoraError, LoraFile, LoraUse, TargetTable, plan_loras
from models.lora.merged_file import write_merged
from models.lora.synth import write_lora
from models.packs.pack import build_pack, load_pack
from models.runtime.dit_runner import DiTRunner
from models.runtime.verify import metrics, random_inputs
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors

REC = np.load(Path(__file__).parent / "data" / "lora" / "comfy_lycoris_weights.npz")
META = json.loads(str(REC["meta"]))
RES = (64, 64)
Q = "lora_unet_blocks_0_self_attn_q_proj"          # tiny: [256, 256]
FC1 = "lora_unet_blocks_0_mlp_layer1"              # tiny: [1024, 256]


def table() -> TargetTable:
    return TargetTable.from_configs(PRESETS["tiny"]["dit"])


def _write(path, tensors: dict):
    write_safetensors(path, [TensorEntry(k, "F32", np.shape(v), np.asarray(v, np.float32)) for k, v in
                             tensors.items()])
    return path


def _merged_delta(path, strength=1.0, key="blocks.0.self_attn.q_proj.weight"):
    plan = plan_loras([LoraUse(str(path), strength)], table())
    base = np.zeros(plan.targets[key].shape, np.float32)
    return plan.merged(key, base), plan


@pytest.mark.parametrize("name", list(CASES))
def test_merged_weights_equal_comfyuis_weight_adapters(tmp_path, name):
    case = META["cases"][name]
    assert (case["layout"], case["seed"], case["rank"], case["alpha"], tuple(case["groups"]), case["strength"]) == \
        CASES[name]
    path = tmp_path / name
    write_lora("tiny", case["seed"], path, case["layout"], case["rank"], case["alpha"], tuple(case["groups"]))
    plan = plan_loras([LoraUse(str(path), case["strength"])], table())
    assert sorted(plan.targets) == case["keys"]                   # the layers ComfyUI patched, no more, no fewer
    for i, key in enumerate(case["keys"]):
        d = plan.delta(key)
        norm = REC[f"{name}/norm"][i]
        assert abs(np.linalg.norm(d) / norm - 1) < 1e-5, key
        np.testing.assert_allclose(d.ravel()[sample_index(d.shape)], REC[f"{name}/samples"][i],
                                   atol=1e-6 * norm / np.sqrt(d.size), rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("w1_split,w2_split,alpha", [(False, True, 2.0), (True, False, 3.0), (True, True, 5.0),
                                                     (False, False, 7.0), (False, True, None)])
def test_lokr_against_a_plain_kronecker_product(tmp_path, w1_split, w2_split, alpha):
    rng = np.random.default_rng(1)
    t = {}
    w1 = rng.standard_normal((16, 8)).astype(np.float32)                      # out 256 = 16·16, in 256 = 8·32
    if w1_split:
        t[Q + ".lokr_w1_a"], t[Q + ".lokr_w1_b"] = rng.standard_normal((16, 3)), rng.standard_normal((3, 8))
        w1 = np.float32(t[Q + ".lokr_w1_a"]) @ np.float32(t[Q + ".lokr_w1_b"])
    else:
        t[Q + ".lokr_w1"] = w1
    w2 = rng.standard_normal((16, 32)).astype(np.float32)
    if w2_split:
        t[Q + ".lokr_w2_a"], t[Q + ".lokr_w2_b"] = rng.standard_normal((16, 5)), rng.standard_normal((5, 32))
        w2 = np.float32(t[Q + ".lokr_w2_a"]) @ np.float32(t[Q + ".lokr_w2_b"])
    else:
        t[Q + ".lokr_w2"] = w2
    if alpha is not None:
        t[Q + ".alpha"] = alpha
    # ComfyUI's rule: alpha over the rank of w2's split, else w1's; no split (or no alpha): no scale
    dim = 5 if w2_split else 3 if w1_split else None
    scale = alpha / dim if alpha is not None and dim else 1.0
    want = np.zeros((256, 256))
    for i in range(16):                                                       # kron written out block by block
        for j in range(8):
            want[i * 16:(i + 1) * 16, j * 32:(j + 1) * 32] = w1[i, j] * w2
    got, plan = _merged_delta(_write(tmp_path / "k.safetensors", t), 0.6)
    np.testing.assert_allclose(got, 0.6 * scale * want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    pair = plan.updates["blocks.0.self_attn.q_proj.weight"][0].pair
    assert pair.kind == "lokr" and pair.runtime_rank == (3 if w1_split else 8) * (5 if w2_split else 16)


def test_loha_against_a_plain_hadamard_product(tmp_path):
    import torch
    rng = np.random.default_rng(2)
    t = {FC1 + ".hada_w1_a": rng.standard_normal((1024, 4)), FC1 + ".hada_w1_b": rng.standard_normal((4, 256)),
         FC1 + ".hada_w2_a": rng.standard_normal((1024, 6)), FC1 + ".hada_w2_b": rng.standard_normal((6, 256)),
         FC1 + ".alpha": 2.0}
    tt = {k: torch.tensor(np.float32(v)) for k, v in t.items()}
    want = (tt[FC1 + ".hada_w1_a"] @ tt[FC1 + ".hada_w1_b"]) * (tt[FC1 + ".hada_w2_a"] @ tt[FC1 + ".hada_w2_b"])
    got, plan = _merged_delta(_write(tmp_path / "h.safetensors", t), -1.2, "blocks.0.mlp.layer1.weight")
    np.testing.assert_allclose(got, -1.2 * (2.0 / 4) * want.numpy(), rtol=2e-5, atol=1e-5)  # alpha / rank(w1)
    key = "blocks.0.mlp.layer1.weight"
    B, A, err = plan.factors(key, 24)                                         # the exact form: rank 4·6
    assert err == 0.0 and plan.rank(key) == 24
    np.testing.assert_allclose(B @ A, plan.delta(key), atol=1e-4)
    with pytest.raises(LoraError, match="LoHa takes rank r1·r2 at run time.*anima-models pack CKPT --out PACK "
                                        "--lora FILE:STRENGTH.*anima-models bundle --lora"):
        plan.check_rank(16)


@pytest.mark.parametrize("layout", ["lokr", "loha"])
def test_the_low_rank_form_is_exact(tmp_path, layout):
    path = tmp_path / f"{layout}.safetensors"
    write_lora("tiny", 4, path, layout, rank=4, alpha=2.0, groups=("blocks", "host"))
    plan = plan_loras([LoraUse(str(path), 0.9)], table())
    assert plan.max_rank("branch") == 16 and plan.report()[0]["layouts"] == [layout]
    for key in plan.keys("branch")[:12] + plan.keys("host")[:12]:
        d = plan.delta(key)
        B, A, err = plan.factors(key, 16)
        assert err == 0.0
        np.testing.assert_allclose(B @ A, d, atol=1e-6 * np.abs(d).max() + 1e-9)


def test_lycoris_refusals(tmp_path):
    cases = {
        "tucker": ({Q + ".lokr_w1": np.ones((16, 8)), Q + ".lokr_w2_a": np.ones((16, 2)),
                    Q + ".lokr_w2_b": np.ones((2, 32)), Q + ".lokr_t2": np.ones((2, 2, 1, 1))}, "Tucker LoKr"),
        "mixed": ({Q + ".lokr_w1": np.ones((16, 8)), Q + ".hada_w1_a": np.ones((256, 2))}, "mixes LoKr"),
        "pair": ({Q + ".lokr_w1": np.ones((16, 8)), Q + ".lokr_w2": np.ones((16, 32)),
                  Q + ".lora_up.weight": np.ones((256, 2)), Q + ".lora_down.weight": np.ones((2, 256))},
                 "both a LoRA pair"),
        "half_w2": ({Q + ".lokr_w1": np.ones((16, 8)), Q + ".lokr_w2_a": np.ones((16, 2))},
                    "has lokr_w2_a but needs lokr_w2, or lokr_w2_a and lokr_w2_b"),
        "loha_half": ({Q + ".hada_w1_a": np.ones((256, 2)), Q + ".hada_w1_b": np.ones((2, 256))},
                      "not hada_w2_a, hada_w2_b"),
        "loha_chain": ({Q + ".hada_w1_a": np.ones((256, 2)), Q + ".hada_w1_b": np.ones((2, 256)),
                        Q + ".hada_w2_a": np.ones((128, 2)), Q + ".hada_w2_b": np.ones((2, 256))}, "do not chain"),
        "dora": ({Q + ".lokr_w1": np.ones((16, 8)), Q + ".lokr_w2": np.ones((16, 32)),
                  Q + ".dora_scale": np.ones((256, 1))}, "this is DoRA"),
    }
    for name, (tensors, msg) in cases.items():
        with pytest.raises(LoraError, match=msg):
            LoraFile(_write(tmp_path / f"{name}.safetensors", tensors))
    shape = _write(tmp_path / "shape.safetensors", {Q + ".lokr_w1": np.ones((8, 8)), Q + ".lokr_w2": np.ones((16, 32))})
    with pytest.raises(LoraError, match=r"makes \[128, 256\], but blocks.0.self_attn.q_proj.weight is \[256, 256\]"):
        plan_loras([LoraUse(str(shape))], table())


@pytest.fixture(scope="module")
def lyco(tmp_path_factory):
    d = tmp_path_factory.mktemp("lyco")
    files = {}
    for layout, seed, rank, alpha in (("turbo", 31, 8, None), ("lokr", 32, 4, 2.0), ("loha", 33, 4, 3.0)):
        files[layout] = d / f"{layout}.safetensors"
        write_lora("tiny", seed, files[layout], layout, rank, alpha, ("blocks", "host"))
    return d, files


@pytest.mark.parametrize("layout,strength", [("turbo", 1.0), ("lokr", 0.8), ("loha", -0.7)])
def test_baked_and_run_time_packs_equal_the_merged_checkpoint(tiny_dit, lyco, tmp_path, layout, strength):
    d, files = lyco
    use = LoraUse(str(files[layout]), strength)
    ckpt = DiTCheckpoint.open(tiny_dit)
    plan = plan_loras([use], TargetTable(expected_dit_shapes(ckpt.config)))
    merged = tmp_path / "merged.safetensors"
    write_merged(tiny_dit, plan, merged)
    baked = build_pack(tiny_dit, tmp_path / "baked", RES, "fp32", loras=[use])
    x, ctx = random_inputs(load_pack(baked), seed=5)
    inputs = (x, 0.7, ctx)
    v_ref = reference_forward(DiTCheckpoint.open(merged), *inputs)
    v_plain = reference_forward(ckpt, *inputs)
    assert metrics(DiTRunner(baked, threads=2).forward(*inputs), v_ref)["cos"] >= 0.99999
    assert metrics(v_plain, v_ref)["cos"] < 0.9999                            # the LoRA changes it by far more
    ready = DiTRunner(build_pack(tiny_dit, tmp_path / "ready", RES, "fp32", lora_rank=16), threads=2)
    ready.set_lora(plan)                                                      # turbo rank 8, LoKr / LoHa 4·4
    assert metrics(ready.forward(*inputs), v_ref)["cos"] >= 0.99999


def test_text_encoder_and_adapter_layers_merge_a_lokr_and_a_loha(tmp_path):
    """The encoder's layers (Qwen3 under strength_clip, the LLM adapter under strength_model) take the same ΔW."""
    from models.dit.config import expected_adapter_shapes
    from models.text.qwen3 import Qwen3Shape, expected_shapes
    from models.text.synth import TE_PRESETS
    te = "lora_te_layers_0_mlp_down_proj"                                      # [64, 192]
    ad = "lora_unet_llm_adapter_blocks_0_mlp_0"                               # [512, 128]
    rng = np.random.default_rng(3)
    t = {te + ".lokr_w1": rng.standard_normal((4, 8)), te + ".lokr_w2": rng.standard_normal((16, 24)),
         te + ".alpha": 9.0,                                                  # both full: alpha does not scale
         ad + ".hada_w1_a": rng.standard_normal((512, 2)), ad + ".hada_w1_b": rng.standard_normal((2, 128)),
         ad + ".hada_w2_a": rng.standard_normal((512, 3)), ad + ".hada_w2_b": rng.standard_normal((3, 128))}
    t = {k: np.float32(v) for k, v in t.items()}
    path = _write(tmp_path / "enc.safetensors", t)
    tab = TargetTable(expected_adapter_shapes(PRESETS["tiny"]["adapter"], "llm_adapter."),
                      expected_shapes(Qwen3Shape(**TE_PRESETS["tiny"])))
    plan = plan_loras([LoraUse(str(path), 0.5, 1.5)], tab)
    want_te = np.einsum("ij,kl->ikjl", t[te + ".lokr_w1"], t[te + ".lokr_w2"]).reshape(64, 192)
    np.testing.assert_allclose(plan.delta("model.layers.0.mlp.down_proj.weight"), 1.5 * want_te, rtol=1e-5,
                               atol=1e-5)
    want_ad = (t[ad + ".hada_w1_a"] @ t[ad + ".hada_w1_b"]) * (t[ad + ".hada_w2_a"] @ t[ad + ".hada_w2_b"])
    np.testing.assert_allclose(plan.delta("llm_adapter.blocks.0.mlp.0.weight"), 0.5 * want_ad, rtol=1e-5, atol=1e-5)
    assert plan.report()[0]["layers"] == {"adapter": 1, "te": 1}


def test_synth_command_writes_each_layout(tmp_path, capsys):
    from models.commands import cli
    for layout, keys in (("turbo", ("diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight",
                                    "diffusion_model.blocks.0.adaln_modulation_mlp.2.lora_B.weight",
                                    "diffusion_model.llm_adapter.blocks.5.mlp.2.lora_B.weight")),
                         ("lokr", ("lora_unet_blocks_0_self_attn_q_proj.lokr_w1",
                                   "lora_unet_blocks_0_self_attn_q_proj.lokr_w2_b")),
                         ("loha", ("lora_unet_blocks_0_mlp_layer1.hada_w2_a", "lora_unet_blocks_0_mlp_layer1.alpha"))):
        out = tmp_path / f"{layout}.safetensors"
        assert cli.main(["synth", "lora", "--preset", "tiny", "--out", str(out), "--layout", layout,
                         "--rank", "4"]) == 0
        assert set(keys) <= set(SafeTensorsFile(out).keys()), layout
    # the published Turbo layout: 28 blocks x (10 linears + 6 modulation) + the adapter's 60 (test_lora_layouts.py)
    assert len(LoraFile(tmp_path / "turbo.safetensors").pairs) == 280 + 168 + 60
    assert len(LoraFile(tmp_path / "lokr.safetensors").pairs) == 280                # blocks only by default
