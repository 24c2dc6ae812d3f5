"""The real rknn-toolkit2 (2.5.0, .venv-rknn): compile the tiny pack, resume, and check branches in its simulator.

Costs (2 shared cores, measured): the session fixture `rknn_pack` compiles blocks 0 and 27 of the tiny 128x128 pack
(6 of 84 branches, one worker; ~40 s); the resume test rebuilds one branch (~20 s); the simulator builds block 27's three
branches again (~40 s with the toolkit and torch imports) and runs a 2-block cut of the same checkpoint (blocks 0-1)
through the simulator, every branch of the whole forward (6 builds, ~25 s). The full 84-branch compile and 28-block
simulator run are bench/rknn_full.py's job.
"""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

MIN_COS = 0.9999


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_compile_tiny_pack(rknn_pack):
    from models.packs.pack import load_pack
    pack_dir, rep = rknn_pack
    assert (rep["built"], rep["skipped"], rep["failed"]) == (6, 0, 0), rep
    assert rep["toolkit"] == "2.5.0" and rep["compiler"].startswith("2.5.0")
    pack = load_pack(pack_dir, check=True)           # every .rknn's sha256 matches the manifest
    assert pack.manifest["rknn"]["toolkit"] == "2.5.0" and pack.manifest["rknn"]["branches"] == 6
    entries = [b for b in pack.branches if "rknn" in b]
    assert [(b["block"], b["kind"]) for b in entries] == [(0, "self"), (0, "cross"), (0, "ffn"),
                                                          (27, "self"), (27, "cross"), (27, "ffn")]
    for b in entries:
        e = b["rknn"]
        f = pack_dir / e["file"]
        assert f.stat().st_size == e["bytes"] > 10_000
        assert e["onnx_sha256"] == b["sha256"] and e["target"] == "rk3588"
        assert e["build_s"] > 0 and e["peak_rss_mb"] > 100          # the toolkit alone takes a few hundred MB
        assert isinstance(e["cpu_ops"], list) and e["npu_layers"] > 0
        log = (pack_dir / e["log"]).read_text()
        assert "REGTASK" not in log and "Network Layer Information Table" in log
        print(f"{f.name}: {e['bytes']} B, build {e['build_s']} s, RSS {e['peak_rss_mb']} MB, CPU ops {e['cpu_ops']}")
    # the FFN branch must run entirely on the NPU (GELU fused, no Erf on the CPU)
    assert [b["rknn"]["cpu_ops"] for b in entries if b["kind"] == "ffn"] == [[], []]


def test_compile_resumes_and_rebuilds_only_stale(rknn_pack, rknn_venv, tmp_path):
    from models.commands.cli import main
    src, _ = rknn_pack
    pack = tmp_path / "pack"
    shutil.copytree(src, pack)
    # a damaged output is rebuilt, the other five are up to date
    victim = pack / "rknn" / "b27_cross.rknn"
    victim.write_bytes(b"damaged")
    out = tmp_path / "report.json"
    rc = main(["compile", str(pack), "--blocks", "0,27", "--toolkit-venv", str(rknn_venv), "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0 and (rep["built"], rep["skipped"], rep["failed"]) == (1, 5, 0)
    assert [b["name"] for b in rep["branches"] if b["status"] == "built"] == ["b27_cross"]
    assert victim.stat().st_size > 10_000
    # bad requests are clear errors (exit 2), not tracebacks
    assert main(["compile", str(pack), "--target", "rk1234"]) == 2
    assert main(["compile", str(pack), "--blocks", "28"]) == 2


@pytest.fixture(scope="module")
def sim_inputs(rknn_pack):
    from models.packs.pack import load_pack
    from models.dit.rope import rope_tables
    pack = load_pack(rknn_pack[0], check=False)
    g, c = pack.geometry, pack.config
    rng = np.random.default_rng(5)
    cos, sin = rope_tables(g.h_tokens, g.w_tokens, c.head_dim)          # [L, hd/2] f32
    ctx = np.zeros((g.text_tokens, c.context_dim), np.float32)          # [S, Dc]
    ctx[:40] = rng.standard_normal((40, c.context_dim), dtype=np.float32)
    xn = rng.standard_normal((g.tokens, c.width), dtype=np.float32)     # [L, D] LayerNorm-like
    return pack, {"xn": xn, "context": ctx, "rope_cos": cos, "rope_sin": sin}


def test_simulator_matches_onnx_runtime_and_fp32(sim_inputs, tiny_dit, rknn_venv):
    from models.runtime.backends import make_backend
    from models.runtime.lifecycle import run_branch
    from models.dit.checkpoint import DiTCheckpoint
    from models.dit.reference import ref_cross_attn, ref_ffn, ref_self_attn
    pack, avail = sim_inputs
    ck = DiTCheckpoint.open(tiny_dit)
    sim, ort = make_backend("rknn-sim", venv=rknn_venv), make_backend("onnx", threads=1)
    for b in [b for b in pack.branches if b["block"] == 27]:      # blocks 0-1 run in the cumulative test below
        feed = {i["name"]: avail[i["name"]].astype(np.float16) for i in b["inputs"]}
        (ys,), t = run_branch(sim, pack.dir / b["onnx"], [feed])
        (yo,), _ = run_branch(ort, pack.dir / b["onnx"], [feed])
        f32 = {k: v.astype(np.float32) for k, v in feed.items()}
        w = ck.branch_weights(b["block"], b["kind"])
        ref = {"self": lambda: ref_self_attn(w, f32["xn"], f32["rope_cos"], f32["rope_sin"]),
               "cross": lambda: ref_cross_attn(w, f32["xn"], f32["context"]),
               "ffn": lambda: ref_ffn(w, f32["xn"])}[b["kind"]]()
        y = ys["y"]
        assert y.dtype == np.float16 and y.shape == yo["y"].shape
        assert np.isfinite(y.astype(np.float32)).all()
        c_ort, c_ref = _cos(y, yo["y"]), _cos(y, ref)
        print(f"b{b['block']:02d}_{b['kind']}: cos vs ORT {c_ort:.7f}, vs FP32 {c_ref:.7f}, "
              f"build {sim.last['build_s']:.2f} s, infer {sim.last['infer_s']:.3f} s")
        assert c_ort >= MIN_COS and c_ref >= MIN_COS
        assert t.init_s > 0 and t.npu_s > 0 and len(t.infer_s) == 1
        if b["kind"] == "ffn":        # the comparison can fail: another block's weights score far below the mark
            assert _cos(y, ref_ffn(ck.branch_weights(0, "ffn"), f32["xn"])) < 0.5


def test_simulator_rejects_compiled_files_and_bad_inputs(rknn_pack, rknn_venv):
    from models.runtime.backends import make_backend
    from models.runtime.backends.base import BackendError
    pack_dir, _ = rknn_pack
    sim = make_backend("rknn-sim", venv=rknn_venv)
    with pytest.raises(BackendError, match="cannot run a compiled .rknn"):
        sim.load(pack_dir / "rknn" / "b00_ffn.rknn")
    sim.load(pack_dir / "onnx" / "b00_ffn.onnx")
    sim.init()
    try:
        with pytest.raises(BackendError, match="input 'xn' has shape"):
            sim.infer({"xn": np.zeros((3, 3), np.float16)})
    finally:
        sim.release()


def test_one_simulator_worker_holds_every_graph_of_a_check(rknn_venv, tmp_path):
    """quant-check's ResidentSim keeps each graph in a slot of one of `jobs` toolkit workers (a toolkit import each,
    not one per graph): with jobs 1 one process holds a one-block pack's three branches, and each answers, called in
    turn and again, bitwise what the simulator gives for that graph built alone (the rknn-sim backend)."""
    from models.dit.synth import write_dit
    from models.packs.pack import build_pack, load_pack
    from models.runtime.backends import make_backend
    from models.runtime.lifecycle import run_branch
    from models.runtime.quant_check import ResidentSim
    dit = tmp_path / "one-block.safetensors"
    write_dit("tiny", 0, dit, blocks=1)
    pack = load_pack(build_pack(dit, tmp_path / "p", (64, 64), "fp16"))
    rng = np.random.default_rng(11)
    feeds = {b["kind"]: {i["name"]: rng.standard_normal(i["shape"]).astype(np.float16) for i in b["inputs"]}
             for b in pack.branches}
    alone = make_backend("rknn-sim", venv=rknn_venv)
    want = {b["kind"]: run_branch(alone, pack.dir / b["onnx"], [feeds[b["kind"]]])[0][0]["y"] for b in pack.branches}
    sim = ResidentSim(pack, venv=rknn_venv, jobs=1)
    try:
        assert len(sim.pool) == 1 and len(sim.workers) == 3 and {id(w) for w in sim.workers.values()} == \
            {id(sim.pool[0])}
        for _ in range(2):
            for b in pack.branches:
                (got,), _ = run_branch(sim, pack.dir / b["onnx"], [feeds[b["kind"]]])
                np.testing.assert_array_equal(got["y"], want[b["kind"]])
    finally:
        sim.close()
    assert not sim.pool


def test_verify_cumulative_through_simulator(tmp_path, tiny_dit, rknn_venv, monkeypatch):
    """anima-models verify --backend rknn-sim on a 2-block cut of the tiny checkpoint: every branch of the whole
    forward runs in the simulator; per-branch, per-block hidden state and final v against the FP32 reference."""
    from models.commands.cli import main
    from models.packs.pack import build_pack
    from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors
    src = SafeTensorsFile(tiny_dit)
    dit_block = re.compile(r"^(?:net\.|model\.diffusion_model\.)?blocks\.(\d+)\.")     # not llm_adapter.blocks
    keep = [k for k in src.keys() if not (dit_block.match(k) and int(dit_block.match(k).group(1)) >= 2)]
    cut = tmp_path / "tiny-2blocks.safetensors"
    write_safetensors(cut, [TensorEntry(k, src.dtype(k), tuple(src.shape(k)), src.raw(k)) for k in keep])
    pack = build_pack(cut, tmp_path / "pack", (128, 128), "fp16")
    monkeypatch.setenv("ANIMA_RKNN_VENV", str(rknn_venv))
    out = tmp_path / "verify.json"
    rc = main(["verify", str(pack), "--backend", "rknn-sim", "--json", str(out)])
    rep = json.loads(out.read_text())
    rows = {(r["block"], r["what"]): r for r in rep["rows"]}
    assert rep["backend"] == "rknn-sim" and len(rows) == 2 * 4 + 1
    for key, r in rows.items():
        print(key, f"cos {r['cos']:.7f} max AE {r['max_ae']:.3e} NaN/Inf {r['nonfinite']}")
        assert r["nonfinite"] == 0
    assert all(r["cos"] >= MIN_COS for k, r in rows.items() if k[1] in ("self", "cross", "ffn"))
    assert rows[(None, "v")]["cos"] >= MIN_COS and rows[(1, "hidden")]["cos"] >= MIN_COS
    assert rc == 0 and rep["ok"]


def test_a_sharded_pack_compiles_its_shards_and_runs_them_on_the_board_backend(rknn_venv, tmp_path):
    """`compile` builds a sharded pack's shard graphs too (bNN_kind.sI.rknn, each part's own `rknn` entry, hashed by
    load_pack); the `rknn` backend (stand-in) resolves a shard's ONNX name to its .rknn, and the lifecycle's `shards`
    policy on it computes the whole branch (cos >= 0.9999999 against the one graph, FP16 pack). Block 0 of a one-block
    checkpoint: only block 0 is compiled, so the 27 blocks more of the tiny DiT were 324 graphs built for nothing."""
    from models.runtime.backends.rknn import RknnLiteBackend, compiled_path
    from models.runtime.lifecycle import Lifecycle, context_factory, run_branch
    from models.runtime.backends import make_backend
    from models.packs.pack import build_pack, load_pack
    from models.packs.sharded import ShardResolver
    from models.board.policy import parse_policy
    from models.rknn.compile import compile_pack
    from models.dit.synth import write_dit
    dit = tmp_path / "one-block.safetensors"
    write_dit("tiny", 0, dit, blocks=1)
    pack_dir = build_pack(dit, tmp_path / "p", (128, 128), "fp16", shards=3,
                          cuts={"self": "heads", "cross": "rows", "ffn": "heads"})
    rep = compile_pack(pack_dir, target="rk3588", jobs=2, venv=rknn_venv, blocks=[0], per_worker=0)
    assert (rep["built"], rep["failed"]) == (12, 0), rep
    assert [b["name"] for b in rep["branches"][:4]] == ["b00_self", "b00_self.s0", "b00_self.s1", "b00_self.s2"]
    pack = load_pack(pack_dir, check=True)               # every shard's .rknn hashed against its entry
    parts = pack.branch(0, "ffn")["shards"]["parts"]
    assert [p["rknn"]["file"] for p in parts] == [f"rknn/b00_ffn.s{i}.rknn" for i in range(3)]
    assert all(p["rknn"]["onnx_sha256"] == p["sha256"] and p["rknn"]["cpu_ops"] == [] for p in parts)
    assert compiled_path(pack.dir / parts[1]["onnx"]) == pack.dir / "rknn" / "b00_ffn.s1.rknn"
    rng = np.random.default_rng(7)
    lc = Lifecycle(context_factory(RknnLiteBackend, lite="standin"), parse_policy("shards"), shards_of=ShardResolver())
    try:
        for kind in ("self", "cross", "ffn"):
            path = pack.branch_path(0, kind)
            feeds = [{i["name"]: rng.standard_normal(i["shape"]).astype(np.float16)
                      for i in pack.branch(0, kind)["inputs"]} for _ in range(2)]
            outs, _ = lc.run(path, feeds)
            want, _ = run_branch(make_backend("onnx", threads=1), path, feeds)
            for got, ref in zip(outs, want):
                assert got["y"].dtype == np.float32 and _cos(got["y"], ref["y"]) >= 0.9999999, kind
    finally:
        lc.close()
