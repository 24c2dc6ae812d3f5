"""Pack forward vs the monolithic torch reference (FP32 and FP16), branch files vs ref_* oracles, CLI forward/verify."""
import json
import shutil

import numpy as np
import pytest

from models.commands import cli
from models.packs.branch_graphs import build_branch, serialize
from models.runtime.backends import BACKENDS, make_backend
from models.runtime.backends.onnx import OnnxBackend
from models.runtime.lifecycle import run_branch
from models.runtime.phase_times import PhaseTimes
from models.dit.checkpoint import DiTCheckpoint
from models.runtime.dit_runner import DiTRunner
from models.packs.pack import MANIFEST, build_pack, file_sha256, load_pack
from models.dit.partition import KINDS
from models.dit.reference import ref_cross_attn, ref_ffn, ref_self_attn, reference_forward
from models.dit.rope import rope_tables
from models.runtime.verify import metrics, random_inputs


def _cos(a, b):
    return metrics(a, b)["cos"]


@pytest.fixture(scope="module")
def ckpt(tiny_dit):
    return DiTCheckpoint.open(tiny_dit)


@pytest.fixture(scope="module")
def fp32_case(tiny_dit, ckpt, tmp_path_factory):
    """An FP32 pack for a non-square size with odd latent sides (200x136 -> latent 17x25, padded), its inputs and the
    reference's prediction and trace."""
    pack = build_pack(tiny_dit, tmp_path_factory.mktemp("fv") / "p32", (200, 136), "fp32")
    x, ctx = random_inputs(load_pack(pack), seed=3)
    assert x.shape == (16, 17, 25)
    v_ref, trace = reference_forward(ckpt, x, 0.8, ctx, trace=True)
    runner = DiTRunner(pack, threads=2)
    mine = []
    v = runner.forward_passes([x], 0.8, [ctx], trace=mine)[0]
    return dict(pack=pack, x=x, ctx=ctx, v_ref=v_ref, trace=trace, runner=runner, v=v, mine=mine)


def test_fp32_forward_matches_reference(fp32_case):
    v, v_ref = fp32_case["v"], fp32_case["v_ref"]
    assert v.shape == v_ref.shape == (16, 17, 25) and v.dtype == np.float32
    assert _cos(v, v_ref) >= 0.9999999
    assert np.abs(v - v_ref).max() <= 1e-4 * np.abs(v_ref).max()
    for b in (0, 13, 27):                                       # hidden state after each block tracks too
        assert _cos(fp32_case["mine"][b]["x_out"], fp32_case["trace"][b]["x_out"]) >= 0.9999999
    t = fp32_case["runner"].last_timing
    assert len(t.branches) == 84 and [k for _, k, _ in t.branches[:3]] == list(KINDS)
    assert all(p.init_s > 0 and p.infer_s > 0 for p in t.per_kind.values())
    assert t.total_s >= t.branch_s > 0 and t.host_s >= 0
    assert "release" in t.table()


def test_forward_cfg_runs_both_passes_per_branch(fp32_case):
    r, x = fp32_case["runner"], fp32_case["x"]
    ctx_u = np.zeros_like(fp32_case["ctx"])
    v_c, v_u = r.forward_cfg(x, 0.8, fp32_case["ctx"], ctx_u)
    assert len(r.last_timing.branches) == 84                    # each branch loaded once for both passes
    np.testing.assert_allclose(v_c, fp32_case["v"], rtol=0, atol=1e-6 * np.abs(v_c).max())
    assert _cos(v_u, v_c) < 0.9999                              # the unconditional pass really differs
    v_u1 = r.forward(x, 0.8, ctx_u)
    np.testing.assert_allclose(v_u, v_u1, rtol=0, atol=1e-6 * np.abs(v_u1).max())


def test_forward_rejects_bad_inputs(fp32_case):
    r, x, ctx = fp32_case["runner"], fp32_case["x"], fp32_case["ctx"]
    with pytest.raises(ValueError, match=r"x has shape \[16, 17, 24\]"):
        r.forward(x[:, :, :24], 0.5, ctx)
    with pytest.raises(ValueError, match="context has shape"):
        r.forward(x, 0.5, ctx[:77])
    with pytest.raises(ValueError, match="sigma"):
        r.forward(x, float("nan"), ctx)
    bad = x.copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        r.forward(bad, 0.5, ctx)


def test_branch_files_match_reference_branches(fp32_case, ckpt):
    """Each branch file, fed the reference's xn, against the torch per-branch oracles (isolated)."""
    pack = load_pack(fp32_case["pack"])
    g = pack.geometry
    cos, sin = rope_tables(g.h_tokens, g.w_tokens, ckpt.config.head_dim)
    be = OnnxBackend(threads=2)
    for b in (0, 27):
        for kind in KINDS:
            xn = fp32_case["trace"][b][kind]["xn"]
            w = ckpt.branch_weights(b, kind)
            feed = {"xn": xn, "rope_cos": cos, "rope_sin": sin, "context": fp32_case["ctx"]}
            want = {"self": lambda: ref_self_attn(w, xn, cos, sin), "cross": lambda: ref_cross_attn(w, xn, feed["context"]),
                    "ffn": lambda: ref_ffn(w, xn)}[kind]()
            names = [i["name"] for i in pack.branch(b, kind)["inputs"]]
            (out,), t = run_branch(be, pack.branch_path(b, kind), [{n: feed[n] for n in names}])
            y = out["y"]
            assert isinstance(t, PhaseTimes) and t.total_s > 0
            assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max(), (b, kind)


def test_fp16_pack_forward(tiny_dit, ckpt, tmp_path):
    pack = build_pack(tiny_dit, tmp_path / "p16", (256, 256), "fp16")
    x, ctx = random_inputs(load_pack(pack), seed=5)
    v_ref = reference_forward(ckpt, x, 0.35, ctx)
    v = DiTRunner(pack, threads=2).forward(x, 0.35, ctx)
    assert v.dtype == np.float32 and np.isfinite(v).all()
    assert _cos(v, v_ref) >= 0.99999


def test_fp16_graphs_at_512(ckpt, fp32_case, tmp_path):
    """The product resolution: 1024 image tokens; block 0's branches in FP16 against the torch oracles."""
    from models.dit.partition import Geometry
    g = Geometry.from_resolution(512, 512)
    assert g.tokens == 1024
    cos, sin = rope_tables(g.h_tokens, g.w_tokens, ckpt.config.head_dim)
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((g.tokens, ckpt.config.width), dtype=np.float32)
    ctx = fp32_case["ctx"]
    be = OnnxBackend(threads=2)
    for kind in KINDS:
        w = ckpt.branch_weights(0, kind)
        want = {"self": lambda: ref_self_attn(w, xn, cos, sin), "cross": lambda: ref_cross_attn(w, xn, ctx),
                "ffn": lambda: ref_ffn(w, xn)}[kind]()
        sess_path = tmp_path / f"b00_{kind}_512.onnx"
        sess_path.write_bytes(serialize(build_branch(kind, w, ckpt.config, g, "fp16", block=0)))
        feed = {"xn": xn, "rope_cos": cos, "rope_sin": sin, "context": ctx}
        names = {"self": ["xn", "rope_cos", "rope_sin"], "cross": ["xn", "context"], "ffn": ["xn"]}[kind]
        (out,), _ = run_branch(be, sess_path, [{n: feed[n].astype(np.float16) for n in names}])
        assert out["y"].dtype == np.float16 and np.isfinite(out["y"]).all()
        assert _cos(out["y"], want) >= 0.99999, kind


def test_backend_registry():
    assert set(BACKENDS) >= {"onnx", "rknn-sim"}
    assert isinstance(make_backend("onnx", threads=1), OnnxBackend)
    with pytest.raises(ValueError, match="backend 'nope'"):
        make_backend("nope")
    with pytest.raises(ValueError, match="threads"):
        OnnxBackend(threads=0)


def test_backend_errors_name_the_file_and_input(small_pack, tmp_path):
    from models.runtime.backends.base import BackendError
    be = OnnxBackend(threads=1)
    with pytest.raises(BackendError, match="missing.onnx: cannot read"):
        run_branch(be, tmp_path / "missing.onnx", [{}])
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(BackendError, match="junk.onnx: ONNX Runtime cannot initialise"):
        run_branch(be, tmp_path / "junk.onnx", [{}])
    pk = load_pack(small_pack)
    path, L, D = pk.branch_path(0, "ffn"), pk.geometry.tokens, pk.config.width
    xn = np.zeros((L, D), np.float32)
    with pytest.raises(BackendError, match="missing input 'xn'"):
        run_branch(be, path, [{"x": xn}])
    with pytest.raises(BackendError, match=r"input 'xn' has dtype float16, expected float32"):
        run_branch(be, path, [{"xn": xn.astype(np.float16)}])
    with pytest.raises(BackendError, match=rf"input 'xn' has shape \[{L - 1}, {D}\]"):
        run_branch(be, path, [{"xn": xn[:-1]}])
    (out,), _ = run_branch(be, path, [{"xn": xn}])          # the backend is usable again after failures
    assert out["y"].shape == (L, D)


# -- CLI ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pack(tiny_dit, tmp_path_factory):
    return build_pack(tiny_dit, tmp_path_factory.mktemp("cli") / "p", (64, 64), "fp32")


def test_cli_forward(small_pack, ckpt, tmp_path, capsys):
    x, ctx = random_inputs(load_pack(small_pack), seed=1)
    np.savez(tmp_path / "in.npz", x=x, sigma=np.float32(0.5), context=ctx)
    rc = cli.main(["forward", str(small_pack), "--inputs", str(tmp_path / "in.npz"), "--output",
                   str(tmp_path / "out.npz"), "--threads", "2"])
    assert rc == 0
    with np.load(tmp_path / "out.npz") as z:
        v = z["v"]
    v_ref = reference_forward(ckpt, x, 0.5, ctx)
    assert v.shape == (16, 8, 8) and _cos(v, v_ref) >= 0.9999999
    assert "infer s" in capsys.readouterr().out
    np.savez(tmp_path / "bad.npz", x=x, sigma=np.float32(0.5))
    rc = cli.main(["forward", str(small_pack), "--inputs", str(tmp_path / "bad.npz"), "--output",
                   str(tmp_path / "o2.npz")])
    assert rc == 2 and "missing array(s) ['context']" in capsys.readouterr().err
    rc = cli.main(["forward", str(tmp_path / "nopack"), "--inputs", str(tmp_path / "in.npz"), "--output",
                   str(tmp_path / "o2.npz")])
    assert rc == 2 and "no such pack" in capsys.readouterr().err
    assert not (tmp_path / "o2.npz").exists()


def test_cli_verify_passes_then_fails_on_a_damaged_branch(small_pack, ckpt, tmp_path, capsys):
    rep = tmp_path / "ok.json"
    assert cli.main(["verify", str(small_pack), "--json", str(rep), "--blocks", "0,5", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "hidden" in out
    d = json.loads(rep.read_text())
    assert d["ok"] and [(r["block"], r["what"]) for r in d["rows"]] == \
        [(0, "self"), (0, "cross"), (0, "ffn"), (0, "hidden"), (5, "self"), (5, "cross"), (5, "ffn"), (5, "hidden"),
         (None, "v")]
    assert all(r["nonfinite"] == 0 and r["cos"] > 0.9999999 for r in d["rows"])
    # damage block 5's FFN (perturbed weights, manifest hash fixed up so the file check passes)
    bad = tmp_path / "bad"
    shutil.copytree(small_pack, bad)
    pk = load_pack(bad)
    w = ckpt.branch_weights(5, "ffn")
    w2 = w["layer2.weight"]
    w["layer2.weight"] = w2 + np.random.default_rng(0).normal(0, 0.5 * w2.std(), w2.shape).astype(np.float32)
    rel = pk.branch(5, "ffn")["onnx"]
    (bad / rel).write_bytes(serialize(build_branch("ffn", w, pk.config, pk.geometry, "fp32", block=5)))
    m = json.loads((bad / MANIFEST).read_text())
    m["branches"][3 * 5 + 2]["sha256"] = file_sha256(bad / rel)
    (bad / MANIFEST).write_text(json.dumps(m))
    rep = tmp_path / "bad.json"
    assert cli.main(["verify", str(bad), "--checkpoint", str(ckpt.path), "--json", str(rep), "--blocks", "5"]) == 1
    d = json.loads(rep.read_text())
    failed = {(r["block"], r["what"]) for r in d["rows"] if not r["ok"]}
    assert (5, "ffn") in failed and (5, "hidden") in failed and (None, "v") in failed
    assert (5, "self") not in failed and (5, "cross") not in failed
    assert "FAIL" in capsys.readouterr().out


def test_cli_verify_errors(small_pack, tmp_path, capsys):
    from models.dit.synth import write_dit
    other = tmp_path / "other.safetensors"
    write_dit("tiny", 7, other)
    assert cli.main(["verify", str(small_pack), "--checkpoint", str(other)]) == 2
    assert "not the checkpoint this pack was built from" in capsys.readouterr().err
    assert cli.main(["verify", str(small_pack), "--blocks", "30"]) == 2
    assert "outside 0..27" in capsys.readouterr().err
    moved = tmp_path / "moved"
    shutil.copytree(small_pack, moved)
    m = json.loads((moved / MANIFEST).read_text())
    m["source"]["path"] = str(tmp_path / "gone.safetensors")
    (moved / MANIFEST).write_text(json.dumps(m))
    assert cli.main(["verify", str(moved)]) == 2
    assert "--checkpoint" in capsys.readouterr().err
