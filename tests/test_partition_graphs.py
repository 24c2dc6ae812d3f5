"""Partition table and branch ONNX graphs vs an independent numpy evaluation of the DiT math (docs/model-facts.md)."""
import math

import numpy as np
import onnxruntime as ort
import pytest

from models.packs.branch_graphs import build_branch, serialize
from models.dit.config import PRESETS
from models.dit.partition import (BRANCHES, KINDS, Geometry, branch_file, branch_index, branch_order, parse_blocks,
                              parse_branch_file, parse_resolution, resolve)
from models.dit.rope import rope_tables

CFG = PRESETS["tiny"]["dit"]
GEOM = Geometry.from_resolution(128, 128)   # 16x16 latent -> 8x8 = 64 tokens


# --- independent numpy math (straight from docs/model-facts.md, written without looking at the graph builder) ----
def _rms(x, g):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _rope(x, cos, sin):                      # x [H, L, hd]; pair k with k + hd/2
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def _attn(q, k, v):                          # [H, L, hd], [H, T, hd], [H, T, hd]
    s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def np_branch(kind, w, xn, cos=None, sin=None, ctx=None):
    xn = xn.astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in w.items()}
    H, hd = CFG.heads, CFG.head_dim
    heads = lambda t: t.reshape(t.shape[0], H, hd).transpose(1, 0, 2)  # noqa: E731
    if kind == "ffn":
        h = xn @ w["layer1.weight"].T
        erf = np.vectorize(math.erf)
        return (0.5 * h * (1 + erf(h / math.sqrt(2)))) @ w["layer2.weight"].T
    src = xn if kind == "self" else ctx.astype(np.float64)
    q = _rms(heads(xn @ w["q_proj.weight"].T), w["q_norm.weight"])
    k = _rms(heads(src @ w["k_proj.weight"].T), w["k_norm.weight"])
    v = heads(src @ w["v_proj.weight"].T)
    if kind == "self":
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = _attn(q, k, v).transpose(1, 0, 2).reshape(xn.shape[0], -1)
    return o @ w["output_proj.weight"].T


def _rand_weights(kind, rng, scale=1.0):
    D, hd, F, Dc = CFG.width, CFG.head_dim, CFG.ffn_width, CFG.context_dim
    kv = Dc if kind == "cross" else D
    shapes = {"q_proj.weight": (D, D), "k_proj.weight": (D, kv), "v_proj.weight": (D, kv),
              "output_proj.weight": (D, D), "layer1.weight": (F, D), "layer2.weight": (D, F)}
    w = {}
    for k in next(b for b in BRANCHES if b.kind == kind).weights:
        if k.endswith("norm.weight"):
            w[k] = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
        else:
            w[k] = (scale * rng.standard_normal(shapes[k]) / math.sqrt(shapes[k][1])).astype(np.float32)
    return w


def _inputs(kind, rng, dt=np.float32, geom=GEOM):
    L, S = geom.tokens, geom.text_tokens
    cos, sin = rope_tables(geom.h_tokens, geom.w_tokens, CFG.head_dim)
    feed = {"xn": rng.standard_normal((L, CFG.width)).astype(dt)}
    if kind == "self":
        feed.update(rope_cos=cos.astype(dt), rope_sin=sin.astype(dt))
    if kind == "cross":
        ctx = rng.standard_normal((S, CFG.context_dim)).astype(np.float32)
        ctx[300:] = 0                                     # zero-padded rows take part in the softmax
        feed["context"] = ctx.astype(dt)
    return feed


def _run(model, feed):
    sess = ort.InferenceSession(serialize(model), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _expected(kind, w, feed):
    f = {k: v.astype(np.float64) for k, v in feed.items()}
    return np_branch(kind, w, f["xn"], f.get("rope_cos"), f.get("rope_sin"), f.get("context"))


def _cos(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# --- partition ---------------------------------------------------------------------------------------------------
def test_partition_order_and_shapes():
    assert KINDS == ("self", "cross", "ffn")
    order = list(branch_order(CFG))
    assert len(order) == 3 * CFG.blocks
    assert [(i, s.kind) for i, s in order[:4]] == [(0, "self"), (0, "cross"), (0, "ffn"), (1, "self")]
    assert [branch_index(i, s.kind) for i, s in order] == list(range(len(order)))
    with pytest.raises(ValueError, match="branch kind 'attn'"):
        branch_index(0, "attn")
    g = Geometry.from_resolution(512, 512)
    assert (g.latent_h, g.latent_w, g.tokens, g.text_tokens) == (64, 64, 1024, 512)
    full = PRESETS["full"]["dit"]
    r = resolve("self", full, g, "fp16")
    assert r["inputs"] == [{"name": "xn", "shape": [1024, 2048], "dtype": "f16"},
                           {"name": "rope_cos", "shape": [1024, 64], "dtype": "f16"},
                           {"name": "rope_sin", "shape": [1024, 64], "dtype": "f16"}]
    assert resolve("cross", full, g, "fp32")["inputs"][1] == {"name": "context", "shape": [512, 1024], "dtype": "f32"}
    assert resolve("ffn", full, g, "fp32")["outputs"] == [{"name": "y", "shape": [1024, 2048], "dtype": "f32"}]
    g2 = Geometry.from_resolution(768, 520)             # odd latent height 65 -> padded to 66 -> 33 token rows
    assert (g2.latent_h, g2.h_tokens, g2.w_tokens) == (65, 33, 48)
    assert branch_file(3, "cross") == "b03_cross.onnx" and branch_file(39, "ffn") == "b39_ffn.onnx"
    assert parse_branch_file("b03_cross.onnx") == (3, "cross") and parse_branch_file("b39_ffn.rknn") == (39, "ffn")
    for bad in ("x03_cross.onnx", "b3x_self.onnx", "b03_attn.onnx", "host.safetensors"):
        with pytest.raises(ValueError, match="not a branch file name"):
            parse_branch_file(bad)
    assert BRANCHES[0].weight_keys(5)[0] == "blocks.5.self_attn.q_proj.weight"
    assert BRANCHES[2].weight_keys(0) == ["blocks.0.mlp.layer1.weight", "blocks.0.mlp.layer2.weight"]


def test_partition_parsing_errors():
    assert parse_resolution("512x768") == (512, 768)
    for bad in ("512", "512x500", "0x512", "axb"):
        with pytest.raises(ValueError, match="resolution"):
            parse_resolution(bad)
    assert parse_blocks("0,3,5-7", 28) == [0, 3, 5, 6, 7]
    assert parse_blocks("all", 4) == [0, 1, 2, 3]
    for bad in ("28", "3-1", "x"):
        with pytest.raises(ValueError, match="blocks"):
            parse_blocks(bad, 28)
    with pytest.raises(ValueError, match="kind"):
        resolve("mlp", CFG, GEOM, "fp16")
    with pytest.raises(ValueError, match="dtype"):
        resolve("ffn", CFG, GEOM, "bf16")


# --- graphs ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_graph_matches_numpy_math(kind):
    rng = np.random.default_rng(1)
    w = _rand_weights(kind, rng)
    feed = _inputs(kind, rng)
    got = _run(build_branch(kind, w, CFG, GEOM, "fp32", block=0), feed)
    want = _expected(kind, w, feed)
    assert got.shape == (GEOM.tokens, CFG.width) and got.dtype == np.float32
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 2e-6, rel
    assert _cos(got, want) > 1 - 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_graph_close_and_finite(kind):
    rng = np.random.default_rng(2)
    w = _rand_weights(kind, rng, scale=3.0)            # larger activations than the synthetic checkpoints
    feed = _inputs(kind, rng, np.float16)
    got = _run(build_branch(kind, w, CFG, GEOM, "fp16"), feed)
    want = _expected(kind, w, feed)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    assert _cos(got, want) > 0.99999


def test_graph_op_set_is_npu_friendly():
    rng = np.random.default_rng(3)
    banned = {"Gather", "Slice", "Split", "Concat", "Neg", "LayerNormalization", "RMSNormalization",
              "ReduceMean", "Sqrt", "Div"}
    for kind in KINDS:
        m = build_branch(kind, _rand_weights(kind, rng), CFG, GEOM, "fp16")
        ops = {n.op_type for n in m.graph.node}
        # the FFN's exact GELU is Div(h, Sqrt(2)) -> Erf -> Add -> Mul -> Mul: the one form the RKNN compiler fuses
        allowed = {"Sqrt", "Div"} if kind == "ffn" else set()
        assert not ops & (banned - allowed), (kind, ops & banned)
        if kind == "ffn":
            seq = [n.op_type for n in m.graph.node if n.op_type in ("Sqrt", "Div", "Erf", "Add", "Mul")]
            assert seq == ["Sqrt", "Div", "Erf", "Add", "Mul", "Mul"], seq
        assert m.opset_import[0].version == 19
        assert all(i.data_type == 10 for i in m.graph.initializer if i.name.split("_")[0] != "shape")
        # every value has a fixed, fully known shape after inference
        import onnx
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            dims = vi.type.tensor_type.shape.dim
            assert dims and all(d.HasField("dim_value") for d in dims), vi.name
    assert "Pow" in {n.op_type for n in build_branch("self", _rand_weights("self", rng), CFG, GEOM).graph.node}
    assert "Erf" in {n.op_type for n in build_branch("ffn", _rand_weights("ffn", rng), CFG, GEOM).graph.node}


def test_bad_weights_named():
    rng = np.random.default_rng(4)
    w = _rand_weights("cross", rng)
    w["k_proj.weight"] = w["k_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="k_proj.weight"):
        build_branch("cross", w, CFG, GEOM)
    w = _rand_weights("ffn", rng)
    del w["layer2.weight"]
    with pytest.raises(ValueError, match="layer2.weight"):
        build_branch("ffn", w, CFG, GEOM)
