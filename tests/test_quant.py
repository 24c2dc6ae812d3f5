"""INT8 (W8A8) packs: the outlier preset, calibration, smoothing folded into the host modulation, quant-check."""
from __future__ import annotations

import numpy as np
import pytest


def _cos(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _fake_w8a8(x, w):
    """x [L, in] @ w[out, in]ᵀ with x per-tensor asymmetric INT8 and w per-output-channel symmetric INT8, written here
    from the definitions (not the project's code): what the toolkit's w8a8 does to one MatMul."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    step = (hi - lo) / 255.0
    zp = np.round(-128 - lo / step)
    xq = (np.clip(np.round(x / step + zp), -128, 127) - zp) * step
    ws = np.abs(w).max(axis=1, keepdims=True) / 127.0
    wq = np.clip(np.round(w / ws), -127, 127) * ws
    return xq @ wq.T


@pytest.fixture(scope="module")
def outlier_ckpt(tmp_path_factory):
    from models.dit.synth import write_dit
    path = tmp_path_factory.mktemp("outliers") / "outliers.safetensors"
    write_dit("tiny", 0, path, outliers=True, blocks=1)
    return path


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    from models.dit.synth import write_dit
    path = tmp_path_factory.mktemp("plain") / "plain.safetensors"
    write_dit("tiny", 0, path, blocks=2)
    return path


def _trace(ckpt, tmp, sigma):
    from models.packs.pack import build_pack
    from models.runtime.dit_runner import DiTRunner
    pack = build_pack(ckpt, tmp / "p32", (128, 128), "fp32", overwrite=True)
    r = DiTRunner(pack, "onnx")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 16, 16)).astype(np.float32)
    ctx = rng.standard_normal((512, r.cfg.context_dim)).astype(np.float32)
    tr = []
    r.forward_passes([x], sigma, [ctx], trace=tr)
    return r, tr


def test_outlier_preset_has_stable_massive_channels_that_break_per_tensor_int8(outlier_ckpt, plain_ckpt, tmp_path):
    from models.dit.checkpoint import DiTCheckpoint
    from models.dit.outliers import outlier_channels
    tops = []
    for sigma in (0.95, 0.1):
        _, tr = _trace(outlier_ckpt, tmp_path, sigma)
        for rec in tr:
            for kind in ("self", "cross", "ffn"):
                am = np.abs(rec[kind]["xn"]).max(axis=0)            # per channel over tokens
                ratio = am / np.median(am)
                top = set(np.flatnonzero(ratio > 20).tolist())
                assert 30 <= ratio.max() <= 100, (kind, ratio.max())
                tops.append(top)
    # the same few channels at every sigma, block and branch: what a calibration can rely on
    assert all(t == tops[0] for t in tops) and len(tops[0]) == 3
    assert tops[0] == set(outlier_channels(0, 256))
    ck = DiTCheckpoint.open(outlier_ckpt)
    w1 = ck.get("blocks.0.mlp.layer1.weight")
    xn = tr[0]["ffn"]["xn"]
    ref = xn.astype(np.float64) @ w1.T.astype(np.float64)
    cos_outliers = _cos(_fake_w8a8(xn, w1), ref)
    _, trp = _trace(plain_ckpt, tmp_path, 0.1)
    w1p = DiTCheckpoint.open(plain_ckpt).get("blocks.0.mlp.layer1.weight")
    xp = trp[0]["ffn"]["xn"]
    cos_plain = _cos(_fake_w8a8(xp, w1p), xp.astype(np.float64) @ w1p.T.astype(np.float64))
    assert cos_plain > 0.999 and cos_outliers < 0.99, (cos_plain, cos_outliers)


def test_synth_outliers_cli(tmp_path):
    from models.commands.cli import main
    from models.dit.checkpoint import DiTCheckpoint
    out = tmp_path / "o.safetensors"
    assert main(["synth", "dit", "--outliers", "--blocks", "1", "--out", str(out)]) == 0
    assert DiTCheckpoint.open(out).config.blocks == 1
    assert main(["synth", "dit", "--blocks", "-1", "--out", str(out)]) == 2


@pytest.fixture(scope="module")
def calib(outlier_ckpt, tiny_bundle, tmp_path_factory):
    """An FP32 128x128 pack of the 1-block outlier DiT and its calibration (2 prompts x 1 seed x 4 steps)."""
    from models.commands.cli import main
    from models.packs.pack import build_pack
    tmp = tmp_path_factory.mktemp("calib")
    pack = build_pack(outlier_ckpt, tmp / "p32", (128, 128), "fp32")
    prompts = tmp / "prompts.txt"
    prompts.write_text("1girl, blue hair\n# not a prompt\n\nlandscape, mountains at dawn\n")
    rc = main(["calibrate", str(pack), "--models", str(tiny_bundle), "--dit", str(outlier_ckpt), "--prompts",
               str(prompts), "--out", str(tmp / "calib"), "--seeds", "3", "--steps", "4", "--samples", "5",
               "--holdout", "2"])
    assert rc == 0
    return pack, tmp / "calib"


def test_calibrate_keeps_maxima_of_every_sigma_and_holds_samples_out(calib):
    from models.quant.calib import read_calib
    from models.sampling.sampler import make_sigmas
    _, folder = calib
    c = read_calib(folder)
    assert c.info["records"] == 2 * 1 * 4 * 2                      # prompts x seeds x steps x passes
    want = [float(s) for s in make_sigmas("sgm_uniform", 4)[:-1]]  # every sampled sigma, the final 0 aside
    np.testing.assert_allclose(c.info["sigmas"], sorted(want, reverse=True), rtol=1e-6)
    assert len(c.info["samples"]) == 5 and len(c.info["heldout"]) == 2
    assert {m["pass"] for m in c.info["samples"] + c.info["heldout"]} == {0, 1}
    for name in ("b00_self", "b00_cross", "b00_ffn"):
        am = c.absmax(name)
        kept = np.stack([np.abs(x).max(axis=0) for x, _ in c.inputs(name)])
        # the maxima are over every non-held-out record: never below a kept sample (f16 rounding aside)
        assert (kept.max(axis=0) <= am * (1 + 1e-3) + 1e-3).all()
        assert np.sort(am / np.median(am))[-3] > 20                # the preset's 3 channels are in the statistics
    x, ctx = c.inputs("b00_cross", held_out=True)[0]
    assert x.shape == (64, 256) and ctx.shape == (512, 128)


class _CountingRunner:
    """Stands in for DiTRunner in `collect`: counts the passes it is asked for and traces one block whose inputs say
    which context fed them (its first row), so the statistics show which passes were recorded."""

    def __init__(self):
        from types import SimpleNamespace
        self.geom = SimpleNamespace(width=32, height=32)
        self.cfg = SimpleNamespace(latent_channels=4)
        self.contexts: list = []

    def forward_passes(self, xs, sigma, contexts, trace=None):
        self.contexts.append(float(contexts[0][0, 0]))
        xn = np.full((4, 8), contexts[0][0, 0], np.float32)
        trace.append({kind: {"xn": xn} for kind in ("self", "cross", "ffn")})
        return [np.zeros_like(xs[0])]


def test_collect_at_cfg_1_traces_the_conditional_pass_alone():
    """ComfyUI runs no unconditional pass at cfg 1: calibration must not run one either, nor let its inputs into the
    statistics (the uncond context here is 7.0, the cond 1.0: 7 in a maximum means an uncond pass was recorded)."""
    from models.quant.calib import Collector, collect
    from models.sampling.denoise import make_sampler
    cond, uncond = np.full((2, 3), 1.0, np.float32), np.full((2, 3), 7.0, np.float32)
    for cfg, want in ((1.0, [1.0] * 3), (4.0, [1.0, 7.0] * 3)):
        runner, col = _CountingRunner(), Collector(samples=4, holdout=1)
        collect(runner, [(cond, uncond if cfg != 1.0 else None, 0, (0, 1))], make_sampler(3, cfg, spectrum=None), col)
        assert runner.contexts == want, cfg                       # 3 Euler steps, one call each
        assert col.records == len(want)
        metas = [m for m, _ in col.keep.slots + col.held.slots]
        assert {m["pass"] for m in metas} == ({0} if cfg == 1.0 else {0, 1})
        assert float(col.absmax["b00_cross"].max()) == max(want[i] for i in range(len(want)) if i % 3 != 2)


def test_calibrate_at_cfg_1_records_one_pass_and_no_negative(outlier_ckpt, tiny_bundle, calib, tmp_path, caplog):
    """`anima-models calibrate --cfg 1`: prompts x seeds x steps records (one pass each), one context per prompt
    (the negative prompt is not encoded, and the command says so)."""
    from models.commands.cli import main
    from models.quant.calib import read_calib
    pack, _ = calib
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1girl, blue hair\nlandscape, mountains at dawn\n")
    with caplog.at_level("WARNING"):
        assert main(["calibrate", str(pack), "--models", str(tiny_bundle), "--dit", str(outlier_ckpt), "--prompts",
                     str(prompts), "--out", str(tmp_path / "c1"), "--seeds", "3", "--steps", "4", "--cfg", "1",
                     "--negative", "blurry", "--samples", "5", "--holdout", "2"]) == 0
    assert any("--negative" in r.getMessage() and "not encoded" in r.getMessage() for r in caplog.records)
    c = read_calib(tmp_path / "c1")
    assert c.info["records"] == 2 * 1 * 4 * 1 and c.info["passes"] == 1 and c.info["contexts"] == 2
    assert {m["pass"] for m in c.info["samples"] + c.info["heldout"]} == {0}
    assert {m["context"] for m in c.info["samples"] + c.info["heldout"]} <= {0, 1}


def test_calibrate_bad_input_is_a_clear_error(calib, tmp_path, capsys):
    from models.commands.cli import main
    pack, _ = calib
    empty = tmp_path / "p.txt"
    empty.write_text("# nothing\n")
    assert main(["calibrate", str(pack), "--models", str(tmp_path), "--prompts", str(empty), "--out",
                 str(tmp_path / "c")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert main(["calibrate", str(pack), "--models", str(tmp_path), "--prompts", str(empty), "--out",
                 str(tmp_path / "c"), "--seeds", "x"]) == 2
    assert "--seeds" in capsys.readouterr().err


def _forward(pack, x, ctx, sigma=0.6):
    from models.runtime.dit_runner import DiTRunner
    r = DiTRunner(pack, "onnx")
    try:
        return r.forward(x, sigma, ctx)
    finally:
        r.close()


def test_smoothing_folded_into_the_host_modulation_leaves_the_model_unchanged(outlier_ckpt, calib, tmp_path):
    """FP32 graphs, no quantization: X/s on the host times W·s in the graph is X·W, so the W8A8 pack's float path
    matches the plain FP32 pack's; without the host's 1/s it would be far off."""
    from models.dit.checkpoint import DiTCheckpoint
    from models.packs.pack import build_pack, load_pack
    from models.quant.smooth import SMOOTH_KEY
    plain, folder = calib
    q = build_pack(outlier_ckpt, tmp_path / "q32", (128, 128), "fp32", quant=(folder, ("fc1", "qkv", "q"), 0.5))
    pk = load_pack(q)
    s = pk.host_weights()[SMOOTH_KEY]
    assert s.shape == (1, 3, 256) and s.max() > 20 * np.median(s)         # the outlier channels get divided most
    # the graph's fc1 weight is the checkpoint's with its input columns times s (read back from the ONNX file)
    import onnx
    from onnx import numpy_helper
    g = onnx.load(str(pk.branch_path(0, "ffn")))
    w = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    fc1 = next(v for k, v in w.items() if k.startswith("h_w"))             # [D, F] (in, out)
    want = DiTCheckpoint.open(outlier_ckpt).get("blocks.0.mlp.layer1.weight").T * s[0, 2][:, None]
    np.testing.assert_allclose(fc1, want, rtol=1e-6)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 16, 16)).astype(np.float32)
    ctx = rng.standard_normal((512, 128)).astype(np.float32)
    ref, got = _forward(plain, x, ctx), _forward(q, x, ctx)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()
    assert pk.manifest["quant"]["int8"] == ["fc1", "qkv", "q"]
    assert [len(b["int8"]) for b in pk.branches] == [5, 1, 1]         # q/k halves, v; cross q; fc1


def test_pack_quant_refuses_bad_combinations(outlier_ckpt, plain_ckpt, calib, tmp_path, capsys):
    from models.commands.cli import main
    _, folder = calib
    base = ["pack", str(outlier_ckpt), "--out", str(tmp_path / "p"), "--resolution", "128x128"]
    for extra, word in ((["--quant", "w8a8"], "--calib"), (["--quant", "w8a8", "--calib", str(folder), "--lora-rank",
                                                             "8"], "--lora-rank"),
                        (["--quant", "w8a8", "--calib", str(folder), "--smooth", "2"], "--smooth"),
                        (["--quant", "w8a8", "--calib", str(folder), "--int8", "fc3"], "--int8"),
                        (["--calib", str(folder)], "--calib")):
        assert main(base + extra) == 2, extra
        assert word in capsys.readouterr().err
    other = ["pack", str(plain_ckpt), "--out", str(tmp_path / "p"), "--resolution", "128x128", "--quant", "w8a8",
             "--calib", str(folder)]
    assert main(other) == 2 and "checkpoint" in capsys.readouterr().err
    assert main(base[:4] + ["--resolution", "256x256", "--quant", "w8a8", "--calib", str(folder)]) == 2
    assert "128x128" in capsys.readouterr().err


@pytest.fixture(scope="module")
def int8_pack(outlier_ckpt, calib, tmp_path_factory, rknn_venv):
    """The W8A8 (smoothed, FP16 I/O) pack of the 1-block outlier DiT, compiled by the real rknn-toolkit2 in one
    worker (a worker is a toolkit import, seconds of CPU; the sharded pack below compiles with two)."""
    from models.packs.pack import build_pack
    from models.rknn.compile import compile_pack
    _, folder = calib
    pack = build_pack(outlier_ckpt, tmp_path_factory.mktemp("int8") / "w8a8", (128, 128), "fp16",
                      quant=(folder, ("fc1", "qkv", "q"), 0.5))
    report = compile_pack(pack, jobs=1, venv=rknn_venv, per_worker=0)
    return pack, report


def test_compile_builds_the_int8_layers_and_resumes(int8_pack, rknn_venv):
    from models.packs.pack import load_pack
    from models.rknn.compile import compile_pack
    pack, report = int8_pack
    assert (report["built"], report["failed"]) == (3, 0), report
    p = load_pack(pack)
    for b in p.branches:
        assert b["rknn"]["quant"] and b["rknn"]["int8_tensors"] >= len(b["int8"])
    again = compile_pack(pack, jobs=1, venv=rknn_venv, per_worker=0)
    assert (again["built"], again["skipped"]) == (0, 3)
    from orchestrator.engine.packs import read_pack
    assert read_pack(pack).int8 == ("fc1", "qkv", "q")            # what the daemon refuses LoRAs by


def test_quant_check_smoothing_keeps_the_picture_plain_int8_does_not(int8_pack, outlier_ckpt, calib, tmp_path,
                                                                  rknn_venv, capsys):
    """The simulator's INT8 branches against the FP32 reference: with smoothing every branch stays >= 0.998; the
    same INT8 layers without it fall plainly lower on the outlier channels (measured, not modelled)."""
    from models.commands.cli import main
    from models.packs.pack import build_pack, load_pack
    from models.runtime.quant_check import ResidentSim, branch_table
    from models.quant.calib import read_calib
    from models.dit.checkpoint import DiTCheckpoint
    pack, _ = int8_pack
    _, folder = calib
    out = tmp_path / "qc.json"
    assert main(["quant-check", str(pack), "--checkpoint", str(outlier_ckpt), "--calib", str(folder), "--steps", "3",
                 "--toolkit-venv", str(rknn_venv), "--json", str(out), "--jobs", "1"]) == 0      # one worker, 3 slots
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert last.startswith("quant-check ") and fields["branches"] == "3"
    assert float(fields["worst_cos"]) >= 0.998 and float(fields["final_cos"]) >= 0.99, last
    assert main(["quant-check", str(calib[0]), "--checkpoint", str(outlier_ckpt), "--calib", str(folder)]) == 2
    assert "not a W8A8 pack" in capsys.readouterr().err                # a float pack: a clear error, no simulator
    off = build_pack(outlier_ckpt, tmp_path / "off", (128, 128), "fp16", quant=(folder, ("fc1",), None))
    sim = ResidentSim(load_pack(off), venv=rknn_venv, kinds=("ffn",))
    try:
        rows = branch_table(load_pack(off), sim, DiTCheckpoint.open(outlier_ckpt), read_calib(folder))
    finally:
        sim.close()
    assert [r["branch"] for r in rows] == ["b00_ffn"]
    ffn = rows[0]
    assert ffn["cos"] < 0.99, rows                                   # per-tensor INT8 of the massive channels


def test_board_model_prices_int8_projections_at_the_reference_speedup():
    """The modelled NPU time of an INT8 pack's FFN: fc1's FLOP share of the branch at 1/1.90 of its FP16 time
    (R13), the rest as FP16; its weights at 1 byte for the lifecycle. Computed here from the FLOP definitions."""
    import dataclasses
    from models.board.cost import BoardModel, Shape
    fp16 = BoardModel(Shape.at_resolution(512, 512))
    L, D, F = fp16.shape.tokens, fp16.shape.width, fp16.shape.ffn_width
    one = BoardModel(dataclasses.replace(fp16.shape, int8=("fc1",)))
    share = 2 * L * D * F / (2 * 2 * L * D * F + 8 * L * F)                 # fc1 of the FFN's FLOPs
    want = fp16.kinds["ffn"].npu_s * (1 - share * (1 - 1 / 1.90))
    assert one.kinds["ffn"].npu_s == pytest.approx(want, rel=1e-9)
    assert one.kinds["self"].npu_s == pytest.approx(fp16.kinds["self"].npu_s, rel=1e-12)   # not INT8 there
    assert one.kinds["ffn"].lifecycle_s == pytest.approx(fp16.kinds["ffn"].lifecycle_s * 0.75, rel=1e-9)
    both = BoardModel(dataclasses.replace(fp16.shape, int8=("fc1", "fc2")))
    # both projections INT8, as the reference measured: its FFN core at ~1/1.90 (GELU aside)
    assert both.kinds["ffn"].npu_s / fp16.kinds["ffn"].npu_s == pytest.approx(1 / 1.90, rel=0.01)


CUTS2 = {"self": "heads", "cross": "rows", "ffn": "rows"}       # both cuts, a partial-sum kind and a rows kind


@pytest.fixture(scope="module")
def sharded_fp32(outlier_ckpt, calib, tmp_path_factory):
    """A 2-shard W8A8 pack of the outlier DiT with FP32 graphs (no quantization: the float path of the same pack)."""
    from models.packs.pack import build_pack
    _, folder = calib
    return build_pack(outlier_ckpt, tmp_path_factory.mktemp("s32") / "w8a8-s2", (128, 128), "fp32", shards=2,
                      cuts=CUTS2, quant=(folder, ("fc1", "qkv", "q"), 0.5))


def test_sharded_int8_pack_records_int8_per_shard_and_folds_the_smoothing(sharded_fp32, calib, outlier_ckpt):
    """Every shard graph lists its own INT8 MatMuls (as the branch does); the shard's weights are the smoothed
    checkpoint's cut (read back from its ONNX, computed here from the checkpoint and s); the float path of the
    sharded W8A8 pack gives the plain FP32 pack's output (smoothing folded into the host, shards combined)."""
    import onnx
    from onnx import numpy_helper
    from models.dit.checkpoint import DiTCheckpoint
    from models.packs.pack import load_pack
    from models.quant.smooth import SMOOTH_KEY
    plain, _ = calib
    pk = load_pack(sharded_fp32)
    assert pk.manifest["shards"]["n"] == 2 and pk.manifest["shards"]["cuts"] == CUTS2
    for b, want in zip(pk.branches, (5, 1, 1)):                           # q/k halves + v; cross q; fc1
        parts = b["shards"]["parts"]
        assert [len(p["int8"]) for p in parts] == [want, want], b["kind"]
        for p in parts:                                                  # the names are the shard graph's MatMuls
            g = onnx.load(str(pk.dir / p["onnx"]), load_external_data=False).graph
            assert set(p["int8"]) <= {n.output[0] for n in g.node if n.op_type == "MatMul"}
    s = pk.host_weights()[SMOOTH_KEY]
    g = onnx.load(str(pk.dir / pk.branch(0, "self")["shards"]["parts"][1]["onnx"]))
    w = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    v = next(a for k, a in w.items() if k.startswith("v_w"))                # [D, D/2]: heads 2..3 of v_proj
    ck = DiTCheckpoint.open(outlier_ckpt).get("blocks.0.self_attn.v_proj.weight")         # [D, D] (out, in)
    half = ck.shape[0] // 2
    np.testing.assert_allclose(v, ck[half:].T * s[0, 0][:, None], rtol=1e-6)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 16, 16)).astype(np.float32)
    ctx = rng.standard_normal((512, 128)).astype(np.float32)
    ref, got = _forward(plain, x, ctx), _forward(pk, x, ctx)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()


def test_a_shards_quantizer_dataset_is_its_part_of_the_branchs(sharded_fp32, tmp_path):
    """The quantizer inputs of a rows shard are its rows of the branch's stored X/s (sliced here by hand from the
    dataset file); a heads shard takes the whole input; the one dataset serves every shard, and each shard's build
    has its own fingerprint."""
    from models.packs.pack import load_pack
    from models.rknn.quant import quant_fingerprint, quant_request
    from models.base.safetensors_io import SafeTensorsFile
    pk = load_pack(sharded_fp32)
    ds = SafeTensorsFile(pk.dir / pk.manifest["quant"]["dataset"]["file"])
    ffn, selfb = pk.branch(0, "ffn"), pk.branch(0, "self")
    prints = set()
    for b in (ffn, selfb):
        for p in b["shards"]["parts"]:
            req = quant_request(pk.dir, pk.manifest, b, tmp_path / p["onnx"].replace("/", "_"), part=p)
            assert req["int8"] == p["int8"] and len(req["dataset"]) == pk.manifest["quant"]["dataset"]["samples"]
            for k, paths in enumerate(req["dataset"]):
                xn = np.load(paths[[i["name"] for i in p["inputs"]].index("xn")])
                full = ds.get(f"b00_{b['kind']}.{k}.xn")
                a, e = p["range"] if b["kind"] == "ffn" else (0, full.shape[0])
                np.testing.assert_array_equal(xn, full[a:e].astype(xn.dtype))
            prints.add(quant_fingerprint(pk.manifest, b, p))
    assert len(prints) == 4
    assert quant_fingerprint(pk.manifest, ffn) not in prints                  # the one graph's is its own


def test_board_model_prices_int8_shards_from_cost_rows():
    """A 3-shard W8A8 pack (ffn by rows, self by heads, cross by rows) against a hand computation from the cost
    file's rows: each shard's NPU time is its FP16 shard time less its INT8 projections' FP16 time x (1 - 1/1.90)
    (R13), the projections' FP16 time their FLOPs at the shard kind's FP16 seconds per FLOP; every rows shard of
    self-attention would still compute all keys and values, so its INT8 saving has them whole."""
    import dataclasses
    from models.board.cost import BoardModel, Shape, load_cost
    cost = load_cost()
    sp = float(cost["quant"]["int8_speedup"])
    assert sp == pytest.approx(44.76 / 23.57, rel=1e-3)                     # R13: the FFN core, FP16 vs W8A8
    base = Shape.at_resolution(512, 512).sharded(3, {"self": "rows", "cross": "rows", "ffn": "heads"})
    fp16 = BoardModel(base)
    int8 = BoardModel(dataclasses.replace(base, int8=("fc1", "qkv", "q")))
    L, D, F = base.tokens, base.width, base.ffn_width
    fwd = cost["npu"]["forward_s"]
    to_step = cost["npu"]["step_npu_s"] / (2 * sum(fwd.values()))
    ref = Shape.reference(cost)
    ref_flops = {"self": 4 * 2 * ref.tokens * ref.width ** 2 + 2 * 2 * ref.tokens * ref.width
                 + 6 * ref.tokens * ref.width + 2 * 2 * ref.tokens ** 2 * ref.width + 5 * ref.heads * ref.tokens ** 2,
                 "ffn": 2 * 2 * ref.tokens * ref.width * ref.ffn_width + 8 * ref.tokens * ref.ffn_width}
    per_flop = {k: fwd[k] / ref.blocks * to_step / ref_flops[k] for k in ("self", "ffn")}
    for i, (a, b) in enumerate(_split(F, 3)):
        f8 = 2 * L * D * (b - a)                                              # fc1's rows of its hidden units
        want = fp16.parts["ffn"][i].npu_s - f8 * per_flop["ffn"] * (1 - 1 / sp)
        assert int8.parts["ffn"][i].npu_s == pytest.approx(want, rel=1e-9)
    for i, (a, b) in enumerate(_split(L, 3)):
        f8 = 2 * 2 * L * D * D + 2 * (b - a) * D * D                            # k, v whole; q of its rows
        want = fp16.parts["self"][i].npu_s - f8 * per_flop["self"] * (1 - 1 / sp)
        assert int8.parts["self"][i].npu_s == pytest.approx(want, rel=1e-9)
    # lifecycle by weight bytes: a heads shard of the FFN holds a third of it, fc1 at 1 byte (fc2 FP16): 3/4 of FP16
    assert int8.parts["ffn"][0].lifecycle_s == pytest.approx(fp16.parts["ffn"][0].lifecycle_s * 0.75, rel=1e-9)
    assert int8.parts["ffn"][0].io_s == pytest.approx(fp16.parts["ffn"][0].io_s, rel=1e-12)     # I/O as FP16
    assert int8.parts["cross"][0].npu_s < fp16.parts["cross"][0].npu_s


def _split(total, n):
    base, extra = divmod(total, n)
    out, a = [], 0
    for i in range(n):
        out.append((a, a + base + (i < extra)))
        a = out[-1][1]
    return out


def test_auto_weighs_int8_shards_and_picks_them_when_faster():
    """choose_pack over a W8A8 pack considers 1..3 shards: at 512x512 on the 8 GB board the sharded INT8 pack is
    faster than the unsharded one (modelled) and auto picks it; its denoise is below the FP16 sharded pack's."""
    import dataclasses
    from models.board import auto
    from models.board.cost import BoardModel, Shape
    from models.packs.memory_fit import for_auto
    from models.quant.smooth import DEFAULT_INT8
    fp16 = BoardModel(Shape.at_resolution(512, 512))
    int8 = BoardModel(dataclasses.replace(fp16.shape, int8=DEFAULT_INT8))
    budget, memory = int8.context_budget_mib(8), for_auto((512, 512))
    n, cuts, best = auto.choose_pack(int8, budget, memory=memory)
    one = auto.choose(int8, budget, memory=memory)[0]
    assert n == 3 and best.denoise_s < one.denoise_s * (1 - auto.TIE), (n, best.denoise_s, one.denoise_s)
    n16, _, best16 = auto.choose_pack(fp16, budget, memory=memory)
    assert n16 == 3 and best.denoise_s < best16.denoise_s
    assert auto.sharded_model(int8, n, cuts).shape.int8 == DEFAULT_INT8      # the pack it prices is INT8


def test_sharded_int8_pack_compiles_and_passes_quant_check_in_the_simulator(outlier_ckpt, calib, tmp_path,
                                                                           rknn_venv, capsys):
    """A 2-shard W8A8 pack through the real rknn-toolkit2: `compile` builds every shard with hybrid quantization
    (its INT8 MatMuls kept INT8) and resumes; `quant-check` runs the job on the shards and compares each branch's
    combined shards (and each shard) with the FP32 reference: smoothed, they hold (measured in the simulator)."""
    from models.commands.cli import main
    from models.packs.pack import build_pack, load_pack
    from models.rknn.compile import compile_pack
    _, folder = calib
    pack = build_pack(outlier_ckpt, tmp_path / "w8a8-s2", (128, 128), "fp16", shards=2, cuts=CUTS2,
                      quant=(folder, ("fc1", "qkv", "q"), 0.5))
    report = compile_pack(pack, jobs=2, venv=rknn_venv, per_worker=0)
    assert (report["built"], report["failed"]) == (9, 0), report                  # 3 branches + 6 shards
    for b in load_pack(pack).branches:
        for p in b["shards"]["parts"]:
            assert p["rknn"]["quant"] and p["rknn"]["int8_tensors"] >= len(p["int8"]), p
    again = compile_pack(pack, jobs=1, venv=rknn_venv, per_worker=0)
    assert (again["built"], again["skipped"]) == (0, 9)
    assert main(["quant-check", str(pack), "--checkpoint", str(outlier_ckpt), "--calib", str(folder), "--steps", "3",
                 "--toolkit-venv", str(rknn_venv)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    fields = dict(kv.split("=") for kv in out[-1].split()[1:])
    assert out[-1].startswith("quant-check ") and fields["branches"] == "3"
    assert float(fields["worst_cos"]) >= 0.998 and float(fields["final_cos"]) >= 0.99, out[-1]
    shard_rows = [ln.split() for ln in out if ln.startswith("  b00_")]
    assert len(shard_rows) == 6 and min(float(r[1]) for r in shard_rows) >= 0.998, out


def test_a_relative_toolkit_venv_works_and_a_missing_one_is_a_clear_error(sharded_fp32, calib, outlier_ckpt,
                                                                            rknn_venv, tmp_path, monkeypatch,
                                                                            capsys):
    """The toolkit worker starts in its own scratch folder: a relative --toolkit-venv must still name the venv
    (it was looked up from the scratch folder: FileNotFoundError); quant-check without a toolkit environment
    exits 2 naming --toolkit-venv."""
    from models.commands.cli import main
    from models.rknn.client import ToolkitWorker
    monkeypatch.chdir(rknn_venv.parent)
    with ToolkitWorker(rknn_venv.name) as w:                                  # e.g. ".venv-rknn"
        assert w.toolkit_version
    monkeypatch.chdir(tmp_path)
    _, folder = calib
    assert main(["quant-check", str(sharded_fp32), "--checkpoint", str(outlier_ckpt), "--calib", str(folder),
                 "--toolkit-venv", str(tmp_path / "no-venv")]) == 2
    assert "--toolkit-venv" in capsys.readouterr().err


def test_the_analytic_bench_prices_a_sharded_int8_pack(capsys, tmp_path):
    """bench/overhead.py --analytic --quant w8a8 --policy auto: auto's line names a --shards 3 pack, every line is
    labelled modelled, the job is faster than the FP16 pack's and than the INT8 pack unsharded (--shards 1); a run
    (not --analytic) with --quant is refused: it would run the FP16 tiny pack."""
    import re
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import overhead
    jobs = {}
    for name, extra in (("fp16", []), ("int8", ["--quant", "w8a8"]), ("int8-1", ["--quant", "w8a8", "--shards", "1"])):
        assert overhead.main(["--analytic", "--policy", "auto", "--board-ram", "8"] + extra) == 0
        out = capsys.readouterr().out.splitlines()
        auto_line = next(line for line in out if line.startswith("auto:"))
        assert "modelled" in auto_line and all("modelled" in line for line in out if "W8A8" in line)
        if name == "int8":
            assert "pack --shards 3" in auto_line and "W8A8" in out[0]
        jobs[name] = float(re.fullmatch(r"policy=auto board_ram=8 overhead_ratio=[\d.]+ job_s=([\d.]+)", out[-1])[1])
    assert jobs["int8"] < jobs["fp16"] and jobs["int8"] < jobs["int8-1"], jobs
    import json
    out = tmp_path / "a.json"
    assert overhead.main(["--analytic", "--policy", "auto", "--quant", "w8a8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["label"] == "modelled" and doc["quant"] == "w8a8"
    assert doc["lines"][-1].endswith("job_s=%.1f" % jobs["int8"])
    capsys.readouterr()
    assert overhead.main(["--backend", "board-sim", "--quant", "w8a8"]) == 2
    assert "--analytic" in capsys.readouterr().err


def test_board_sim_models_a_sharded_int8_pack_as_built(sharded_fp32):
    """What board-sim and `auto` read off a pack (Shape.of_pack): its shards, cuts and INT8 layers together, so its
    shards are priced with their INT8 projections (each shard's NPU time below the same FP16 pack's)."""
    import dataclasses
    from models.board.cost import BoardModel, Shape
    shape = Shape.of_pack(sharded_fp32, "full")
    assert (shape.shards, dict(shape.cuts), shape.int8) == (2, CUTS2, ("fc1", "qkv", "q"))
    int8, fp16 = BoardModel(shape), BoardModel(dataclasses.replace(shape, int8=()))
    for kind in ("self", "cross", "ffn"):
        assert len(int8.parts[kind]) == 2
        assert all(a.npu_s < b.npu_s for a, b in zip(int8.parts[kind], fp16.parts[kind])), kind
