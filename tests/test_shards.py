"""Sharded branch graphs (models/dit/shards.py, models/packs/branch_graphs.py): every cut of every branch kind, run by ONNX
Runtime in FP32, gives the unsharded graph's output (rows: bitwise, every row computed as the whole graph computes
it; heads: the partials summed in FP32, cos >= 0.9999999); the plans, the shards' inputs and outputs, bad requests."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models.packs.branch_graphs import build_branch, serialize
from models.dit.config import PRESETS
from models.dit.partition import Geometry, resolve
from models.dit.rope import rope_tables
from models.dit.shards import CUTS, combine, plan, shard_feed, shard_io, shard_weights, split, weight_fraction

CFG = PRESETS["tiny"]["dit"]                 # D 256, 4 heads of 64, FFN 1024, context 128
GEOM = Geometry.from_resolution(128, 128)    # 64 image tokens, 512 text tokens


def _weights(kind, seed=0):
    rng = np.random.default_rng(seed)
    D, hd, F, Dc = CFG.width, CFG.head_dim, CFG.ffn_width, CFG.context_dim
    kv = Dc if kind == "cross" else D
    shapes = {"ffn": {"layer1.weight": (F, D), "layer2.weight": (D, F)}}.get(kind) or {
        "q_proj.weight": (D, D), "k_proj.weight": (D, kv), "v_proj.weight": (D, kv), "output_proj.weight": (D, D),
        "q_norm.weight": (hd,), "k_norm.weight": (hd,)}
    return {k: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) if len(s) == 2 else
            (1 + 0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _feed(kind, seed=1):
    rng = np.random.default_rng(seed)
    cos, sin = rope_tables(GEOM.h_tokens, GEOM.w_tokens, CFG.head_dim)
    out = {}
    for spec in resolve(kind, CFG, GEOM, "fp32")["inputs"]:
        name = spec["name"]
        out[name] = {"rope_cos": cos, "rope_sin": sin}.get(name)
        if out[name] is None:
            out[name] = rng.standard_normal(spec["shape"]).astype(np.float32)
    return out


def _run(model, feed):
    sess = ort.InferenceSession(serialize(model), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feed.items() if k in names})[0]


def _cos(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["self", "cross", "ffn"])
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_branch_computes_the_branch(kind, cut, n):
    w, feed = _weights(kind), _feed(kind)
    want = _run(build_branch(kind, w, CFG, GEOM, "fp32", 0), feed)                  # [L, D]
    specs = plan(kind, cut, n, CFG, GEOM)
    outs = []
    for s in specs:
        model = build_branch(kind, shard_weights(s, w), CFG, GEOM, "fp32", 0, shard=s)
        io = shard_io(s, CFG, GEOM, "fp32")
        sf = shard_feed(s, feed)
        assert [i.name for i in model.graph.input] == [i["name"] for i in io["inputs"]]
        for i in io["inputs"]:
            assert list(sf[i["name"]].shape) == i["shape"]
        y = _run(model, sf)
        assert list(y.shape) == io["outputs"][0]["shape"]
        outs.append(y)
    got = combine(specs, outs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert _cos(got, want) >= 0.9999999
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))
    if cut == "rows":
        np.testing.assert_array_equal(got, want)         # each row computed alone, the same way: bitwise


def test_plans_split_evenly_and_say_what_they_hold():
    assert split(64, 3) == [(0, 22), (22, 43), (43, 64)] and split(4, 3) == [(0, 2), (2, 3), (3, 4)]
    heads = plan("self", "heads", 3, CFG, GEOM)
    assert [(s.a, s.b) for s in heads] == [(0, 2), (2, 3), (3, 4)]
    assert [weight_fraction(s) for s in heads] == [0.5, 0.25, 0.25]
    assert [weight_fraction(s) for s in plan("ffn", "rows", 3, CFG, GEOM)] == [1.0, 1.0, 1.0]
    # a heads shard holds its heads' rows of q/k/v and columns of the output projection; an FFN one its units
    w = _weights("cross")
    s1 = shard_weights(heads[1], w)
    np.testing.assert_array_equal(s1["k_proj.weight"], w["k_proj.weight"][128:192])
    np.testing.assert_array_equal(s1["output_proj.weight"], w["output_proj.weight"][:, 128:192])
    f = shard_weights(plan("ffn", "heads", 2, CFG, GEOM)[1], _weights("ffn"))
    assert f["layer1.weight"].shape == (512, 256) and f["layer2.weight"].shape == (256, 512)
    # what a shard takes and returns: rows shards their rows (self-attention all of xn), heads shards everything
    rows = plan("cross", "rows", 3, CFG, GEOM)[2]
    io = shard_io(rows, CFG, GEOM, "fp16")
    assert io["inputs"][0] == {"name": "xn", "shape": [21, 256], "dtype": "f16"}
    assert io["outputs"][0]["shape"] == [21, 256]
    assert shard_io(plan("self", "rows", 3, CFG, GEOM)[0], CFG, GEOM, "fp16")["inputs"][0]["shape"] == [64, 256]
    full = [i["shape"] for i in resolve("self", CFG, GEOM, "fp16")["inputs"]]
    assert [i["shape"] for i in shard_io(heads[0], CFG, GEOM, "fp16")["inputs"]] == full


def test_bad_shard_requests_are_clear():
    with pytest.raises(ValueError, match=r"shards 4 must be an integer in \[1, 3\]"):
        plan("ffn", "rows", 4, CFG, GEOM)
    with pytest.raises(ValueError, match="cut 'cols'"):
        plan("ffn", "cols", 2, CFG, GEOM)
    tiny = Geometry.from_resolution(16, 8)                  # 1 x 1 tokens
    with pytest.raises(ValueError, match="need at least 2 token rows, it has 1"):
        plan("ffn", "rows", 2, CFG, tiny)
    with pytest.raises(ValueError, match="combine: 1 shard outputs for 2 shards"):
        combine(plan("ffn", "rows", 2, CFG, GEOM), [np.zeros((32, 256))])


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    """A branch of each kind as one graph and as 3 shards (ffn, cross by rows; self by heads), FP32 ONNX files."""
    d = tmp_path_factory.mktemp("shards")
    out = {}
    for kind, cut in (("self", "heads"), ("cross", "rows"), ("ffn", "rows")):
        w = _weights(kind)
        whole = d / f"b00_{kind}.onnx"
        whole.write_bytes(serialize(build_branch(kind, w, CFG, GEOM, "fp32", 0)))
        specs = plan(kind, cut, 3, CFG, GEOM)
        files = []
        for s in specs:
            f = d / f"b00_{kind}.s{s.index}.onnx"
            f.write_bytes(serialize(build_branch(kind, shard_weights(s, w), CFG, GEOM, "fp32", 0, shard=s)))
            files.append(str(f))
        out[str(whole)] = (files, specs)
    return out


@pytest.mark.parametrize("policy", ["on-demand", "shards", "dual_core+shards", "prefetch+shards", "interleave",
                                    "resident+prefetch2+shards"])
def test_the_lifecycle_runs_a_sharded_branch_under_every_policy(shard_files, policy):
    """The lifecycle opens a sharded branch's N contexts (2N with dual_core), feeds each shard its part of every
    pass and combines the outputs in FP32: bitwise the same under every policy, and the whole graph's result."""
    from models.runtime.lifecycle import Lifecycle, context_factory
    from models.board.policy import parse_policy
    lc = Lifecycle(context_factory("onnx", threads=1), parse_policy(policy, {"resident_mb": 1e6}),
                   shards_of=shard_files.get)
    paths = list(shard_files)
    feeds = {p: [_feed(k, seed) for seed in (1, 2)] for p, k in zip(paths, ("self", "cross", "ffn"))}
    try:
        for step in range(2):
            for i, p in enumerate(paths):
                outs, t = lc.run(p, feeds[p], ahead=paths[i + 1:i + 2])
                assert len(outs) == 2 and len(t.infer_s) == 2 and min(t.infer_s) > 0
                for o, f in zip(outs, feeds[p]):
                    want = _run(onnx.load(p), f)
                    assert o["y"].dtype == np.float32 and _cos(o["y"], want) >= 0.9999999
                    ref = combine(shard_files[p][1], [_run(onnx.load(sf), shard_feed(s, f))
                                                      for sf, s in zip(*shard_files[p])])
                    np.testing.assert_array_equal(o["y"], ref)
    finally:
        lc.close()


def test_pack_shard_entries_and_the_resolver(tmp_path):
    """A branch's shard graphs and manifest entries (models/packs/sharded.py), read back as specs, found by the
    resolver from the branch's own file name; a manifest whose shards do not cover the cut is refused."""
    import json
    from models.packs.sharded import ShardPackError, ShardResolver, choose_cuts, parse_cuts, part_files, part_specs, \
        shard_entries
    (tmp_path / "onnx").mkdir()
    w = _weights("ffn")
    block = shard_entries(tmp_path, "onnx/b00_ffn.onnx", "ffn", w, CFG, GEOM, "fp16", 0, 3, "heads")
    entry = {"block": 0, "kind": "ffn", "onnx": "onnx/b00_ffn.onnx", "shards": block}
    specs = part_specs(entry)
    assert [(s.a, s.b, s.total) for s in specs] == [(0, 342, 1024), (342, 683, 1024), (683, 1024, 1024)]
    assert [p for p, _ in part_files(entry)] == [f"onnx/b00_ffn.s{i}.onnx" for i in range(3)]
    assert all((tmp_path / p).is_file() for p, _ in part_files(entry))
    assert block["parts"][1]["outputs"][0] == {"name": "y", "shape": [64, 256], "dtype": "f16"}
    (tmp_path / "onnx" / "b00_ffn.onnx").write_bytes(b"")
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {"n": 3}, "branches": [entry]}))
    files, got = ShardResolver()(tmp_path / "onnx" / "b00_ffn.onnx")
    assert got == specs and files == [str((tmp_path / p).resolve()) for p, _ in part_files(entry)]
    assert ShardResolver()(tmp_path / "onnx" / "b01_ffn.onnx") is None
    bad = dict(entry, shards=dict(block, parts=block["parts"][::-1]))
    with pytest.raises(ShardPackError, match="do not cover its heads in order"):
        part_specs(bad)
    assert parse_cuts("self=heads,cross=rows,ffn=rows") == {"self": "heads", "cross": "rows", "ffn": "rows"}
    with pytest.raises(ShardPackError, match="--cuts 'ffn=cols'"):
        parse_cuts("ffn=cols")
    cuts, why = choose_cuts(CFG, GEOM, 3, {"ffn": "rows"})
    assert cuts["ffn"] == "rows" and set(cuts) == {"self", "cross", "ffn"} and "modelled" in why


@pytest.fixture(scope="module")
def dit2(tmp_path_factory):
    """The tiny DiT's first two blocks (seed 0): what sharding a pack does is the same in every block, and a pack of
    it is 6 branch graphs (and their shards) where the whole tiny DiT's is 84."""
    from models.dit.synth import write_dit
    path = tmp_path_factory.mktemp("two-block") / "two-block.safetensors"
    write_dit("tiny", 0, path, blocks=2)
    return path


def test_pack_shards_3_computes_what_the_unsharded_pack_does(dit2, tmp_path, capsys):
    """`anima-models pack --shards 3` (tiny, FP32): every branch's shard graphs beside its one graph, the cuts in the
    manifest; its forward (the shards on three contexts at once, and in turn) equals the unsharded pack's forward
    (cos >= 0.9999999; bitwise where every cut is rows); a manifest whose shards were tampered with is refused."""
    import json
    from pathlib import Path
    from models.commands.cli import main
    from models.runtime.dit_runner import DiTRunner
    from models.packs.pack import PackError, build_pack, load_pack
    from models.runtime.verify import random_inputs
    one = build_pack(dit2, tmp_path / "p1", (128, 128), "fp32")
    assert main(["pack", str(dit2), "--out", str(tmp_path / "p3"), "--resolution", "128x128", "--dtype", "fp32",
                 "--shards", "3", "--cuts", "self=heads,cross=rows,ffn=heads"]) == 0
    assert "shards 3 per branch: self by heads, cross by rows, ffn by heads" in capsys.readouterr().out
    rows = build_pack(dit2, tmp_path / "prows", (128, 128), "fp32", shards=3,
                      cuts={"self": "rows", "cross": "rows", "ffn": "rows"})
    sharded = load_pack(tmp_path / "p3")
    assert sharded.manifest["shards"]["cuts"] == {"self": "heads", "cross": "rows", "ffn": "heads"}
    assert all(len(b["shards"]["parts"]) == 3 for b in sharded.branches) and len(sharded.branches) == 6
    assert (sharded.dir / "onnx" / "b01_ffn.s2.onnx").is_file()
    assert sharded.identity != load_pack(one).identity
    x, ctx = random_inputs(load_pack(one), seed=4)
    want = DiTRunner(one, threads=1).forward(x, 0.6, ctx)
    from models.packs.sharded import ShardResolver
    files, specs = ShardResolver()(sharded.branch_path(0, "self"))    # what the lifecycle runs instead of the graph
    assert [Path(f).name for f in files] == [f"b00_self.s{i}.onnx" for i in range(3)] and specs[0].cut == "heads"
    for policy in ("shards", "on-demand", "prefetch+dual_core+shards"):
        r = DiTRunner(sharded, threads=1, policy=policy)
        try:
            v = r.forward(x, 0.6, ctx)
        finally:
            r.close()
        assert _cos(v, want) >= 0.9999999, policy
        assert np.abs(v - want).max() <= 1e-4 * np.abs(want).max(), policy
        assert not np.array_equal(v, want)             # the heads' partial sums: the shards ran, not the one graph
    r = DiTRunner(rows, threads=1, policy="shards")
    try:
        np.testing.assert_array_equal(r.forward(x, 0.6, ctx), want)
    finally:
        r.close()
    man = json.loads((sharded.dir / "manifest.json").read_text())
    man["branches"][5]["shards"]["parts"] = man["branches"][5]["shards"]["parts"][:2]
    (sharded.dir / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(PackError, match="b01_ffn: the shards of a ffn branch do not cover its heads in order"):
        load_pack(sharded.dir)
    man["branches"][5]["shards"]["parts"] = [dict(p, onnx="../../x.onnx") for p in
                                             json.loads((tmp_path / "prows" / "manifest.json").read_text())
                                             ["branches"][5]["shards"]["parts"]]
    man["branches"][5]["shards"]["cut"] = "rows"
    (sharded.dir / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(PackError, match="leaves the pack folder"):
        load_pack(sharded.dir)
    with pytest.raises(PackError, match=r"--shards 4: shards 4 must be an integer in \[1, 3\]"):
        build_pack(dit2, tmp_path / "p4", (128, 128), "fp32", shards=4)
    assert not (tmp_path / "p4").exists()


def test_a_pack_is_sharded_or_lora_ready_not_both(dit2, tmp_path, capsys):
    """Shard graphs take no LoRA factor inputs: `pack --shards N --lora-rank R` is refused naming both options, exit
    2, nothing written; the graph builder refuses a shard of a LoRA-ready geometry too. Either alone still builds."""
    from models.commands.cli import main
    from models.packs.pack import PackError, build_pack
    out = tmp_path / "both"
    assert main(["pack", str(dit2), "--out", str(out), "--resolution", "128x128", "--dtype", "fp32",
                 "--shards", "2", "--lora-rank", "4"]) == 2
    err = capsys.readouterr().err
    assert "--shards 2 with --lora-rank 4" in err and "not both" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(PackError, match="--shards 3 with --lora-rank 8: a pack is sharded or LoRA-ready, not both"):
        build_pack(dit2, out, (128, 128), "fp32", lora_rank=8, shards=3)
    assert not out.exists()
    spec = plan("ffn", "heads", 2, CFG, GEOM)[0]
    with pytest.raises(ValueError, match="not supported: build it sharded or LoRA-ready, not both"):
        build_branch("ffn", shard_weights(spec, _weights("ffn")), CFG, Geometry.from_resolution(128, 128, lora_rank=4),
                     "fp32", shard=spec)
    assert main(["pack", str(dit2), "--out", str(tmp_path / "lora"), "--resolution", "128x128", "--dtype",
                 "fp32", "--lora-rank", "4"]) == 0
    assert main(["pack", str(dit2), "--out", str(tmp_path / "s2"), "--resolution", "128x128", "--dtype", "fp32",
                 "--shards", "2"]) == 0


def test_one_backend_instance_of_one_context_runs_a_sharded_branch_in_turn(shard_files):
    """quant-check's simulator is one backend instance holding one context at a time (max_contexts 1): the lifecycle
    opens each shard on it in turn and combines their outputs (it refused any single instance before); a single
    instance of a backend that could hold several contexts is still refused, naming the factory to give."""
    from models.runtime.backends.onnx import OnnxBackend
    from models.runtime.lifecycle import Lifecycle, LifecycleError, single_context

    class OneContext(OnnxBackend):
        max_contexts = 1

    p = next(iter(shard_files))
    feed = [_feed("self", 3)]
    lc = Lifecycle(single_context(OneContext(threads=1)), shards_of=shard_files.get)
    try:
        outs, _ = lc.run(p, feed)
    finally:
        lc.close()
    ref = combine(shard_files[p][1], [_run(onnx.load(sf), shard_feed(s, feed[0])) for sf, s in zip(*shard_files[p])])
    np.testing.assert_array_equal(outs[0]["y"], ref)
    lc = Lifecycle(single_context(OnnxBackend(threads=1)), shards_of=shard_files.get)
    try:
        with pytest.raises(LifecycleError, match="context_factory"):
            lc.run(p, feed)
    finally:
        lc.close()
