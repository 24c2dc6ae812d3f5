"""A LoRA-ready pack through the real rknn-toolkit2 (2.5.0, .venv-rknn): block 0 of a 2-block cut of the tiny
checkpoint at 128x128, FP16, rank 8, compiled for the RK3588 (every op on the NPU) and run in the toolkit's simulator
with a synthetic LoRA's factors as inputs, against ONNX Runtime and the FP32 oracle on the merged weights.
Costs (2 shared cores): compile 3 branches ~20 s, simulator ~15 s."""
from __future__ import annotations

import re

import numpy as np
import pytest

MIN_COS = 0.9999


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def lora_ready_rknn(tmp_path_factory, tiny_dit, rknn_venv):
    from models.packs.pack import build_pack
    from models.rknn.compile import compile_pack
    from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors
    d = tmp_path_factory.mktemp("lora_rknn")
    src = SafeTensorsFile(tiny_dit)
    dit_block = re.compile(r"^(?:net\.|model\.diffusion_model\.)?blocks\.(\d+)\.")     # not llm_adapter.blocks
    keep = [k for k in src.keys() if not (dit_block.match(k) and int(dit_block.match(k).group(1)) >= 2)]
    cut = d / "tiny-2blocks.safetensors"
    write_safetensors(cut, [TensorEntry(k, src.dtype(k), tuple(src.shape(k)), src.raw(k)) for k in keep])
    pack = build_pack(cut, d / "pack", (128, 128), "fp16", lora_rank=8)
    report = compile_pack(pack, target="rk3588", jobs=2, venv=rknn_venv, blocks=[0], per_worker=0)
    return cut, pack, report


def test_lora_ready_branches_compile_to_the_npu_and_compute_the_merged_weights(lora_ready_rknn, rknn_venv, tmp_path):
    from models.runtime.backends import make_backend
    from models.dit.checkpoint import DiTCheckpoint
    from models.runtime.lifecycle import run_branch
    from models.lora import LoraUse, TargetTable, plan_loras
    from models.lora.apply import DitLora
    from models.lora.synth import write_lora
    from models.packs.pack import load_pack
    from models.dit.reference import ref_cross_attn, ref_ffn, ref_self_attn
    from models.dit.rope import rope_tables
    cut, pack_dir, rep = lora_ready_rknn
    assert (rep["built"], rep["failed"]) == (3, 0), rep
    pack = load_pack(pack_dir)
    entries = [b for b in pack.branches if "rknn" in b]
    assert [b["rknn"]["cpu_ops"] for b in entries] == [[], [], []]          # the low-rank MatMuls run on the NPU
    ck = DiTCheckpoint.open(cut)
    shapes = {k: ck.shape(k) for k in ck.keys()}
    lora = tmp_path / "l.safetensors"
    write_lora((shapes, None), 3, lora, "kohya", rank=8, alpha=4.0, groups=("blocks",))
    plan = plan_loras([LoraUse(str(lora), 1.0)], TargetTable(shapes))
    g, c = pack.geometry, pack.config
    applied = DitLora(plan, c, g, "fp16")
    rng = np.random.default_rng(5)
    cos, sin = rope_tables(g.h_tokens, g.w_tokens, c.head_dim)               # [L, hd/2] f32
    ctx = np.zeros((g.text_tokens, c.context_dim), np.float32)               # [S, Dc]
    ctx[:40] = rng.standard_normal((40, c.context_dim), dtype=np.float32)
    avail = {"xn": rng.standard_normal((g.tokens, c.width), dtype=np.float32), "context": ctx,
             "rope_cos": cos, "rope_sin": sin}
    sim, ort = make_backend("rknn-sim", venv=rknn_venv), make_backend("onnx", threads=1)
    board = make_backend("rknn", lite="standin")      # the board's backend on the .rknn files (labelled stand-in)
    for b in entries:
        feed = {k: v.astype(np.float16) for k, v in avail.items()}
        feed.update(applied.branch_inputs(0, b["kind"]))                     # f16 factors
        feed = {i["name"]: feed[i["name"]] for i in b["inputs"]}
        (ys,), _ = run_branch(sim, pack.dir / b["onnx"], [feed])
        (yo,), _ = run_branch(ort, pack.dir / b["onnx"], [feed])
        (yb,), _ = run_branch(board, pack.dir / b["onnx"], [feed])           # every input, in the manifest's order
        assert np.array_equal(yb["y"], yo["y"])
        f32 = {k: v.astype(np.float32) for k, v in feed.items()}
        prefix = f"blocks.0.{ {'self': 'self_attn', 'cross': 'cross_attn', 'ffn': 'mlp'}[b['kind']] }."
        base = ck.branch_weights(0, b["kind"])
        merged = {k: plan.merged(prefix + k, w) if prefix + k in plan.targets else w for k, w in base.items()}
        ref = {"self": lambda w: ref_self_attn(w, f32["xn"], f32["rope_cos"], f32["rope_sin"]),
               "cross": lambda w: ref_cross_attn(w, f32["xn"], f32["context"]),
               "ffn": lambda w: ref_ffn(w, f32["xn"])}[b["kind"]]
        y = ys["y"]
        c_ort, c_ref, c_base = _cos(y, yo["y"]), _cos(y, ref(merged)), _cos(ref(base), ref(merged))
        print(f"b00_{b['kind']} LoRA rank 8: simulator vs ORT {c_ort:.7f}, vs FP32 merged {c_ref:.7f} "
              f"(plain weights vs merged {c_base:.4f})")
        assert y.dtype == np.float16 and c_ort >= MIN_COS and c_ref >= MIN_COS
        assert c_base < 0.99                                   # the LoRA's effect is far larger than the error
