"""ONNX (opset 19) graph per DiT branch (self / cross / ffn), fixed shapes, FP16 or FP32, written for NPU compilers.

Op choices (what RK3588's compiler maps well, see docs/architecture.md "Branch graphs"):
- every projection is a MatMul against a constant [in, out] initializer;
- the rotary halves come from the weight layout, not from slicing: q and k are projected by two matrices holding the
  first and the second half of every head's rows, so no Slice/Split/Gather/Concat appears; the attention scores are
  qa·kaᵀ + qb·kbᵀ, so the rotated halves are never concatenated either;
- per-head RMSNorm is a mean of squares by MatMul with a constant ones column, then Pow(-0.5): no norm op, no transposes;
  the 1/sqrt(head_dim) of the mean is folded into the projection weights and undone in the norm gain, and the attention
  scale 1/sqrt(head_dim) is applied to q before q·kᵀ (in the gain), which keeps FP16 scores small;
- exact GELU as 0.5·x·(1 + erf(x/√2));
- a LoRA-ready graph (geometry.lora_rank R > 0) adds (x·Aᵀ)·Bᵀ to each projection partition.LoraSpec names, with
  Aᵀ [in, R] and Bᵀ [R, out] as inputs laid out like the weight (models/dit/branch_layout.py): two MatMuls and an Add
  per projection, zeros computing exactly what a plain graph computes.
"""
from __future__ import annotations

import logging
import math
from typing import Mapping

import numpy as np
import onnx
from onnx import helper

from models.dit.branch_layout import head_halves, qk_scale
from models.dit.config import DiTConfig
from models.dit.partition import Geometry, branch_spec, pack_io_dtype, resolve
from models.dit.shards import ShardSpec, shard_io
from models.graphs.builder import ONNX_DTYPES, OPSET, GraphBuilder, serialize  # noqa: F401  (pack's and tests' import)

log = logging.getLogger(__name__)

EPS = 1e-6                      # q/k RMSNorm epsilon


def _lora_names(kind: str, weight: str, lora: bool) -> tuple:
    """The input names of one projection's LoRA factors in a LoRA-ready graph (empty for a plain one)."""
    return tuple(i.name for i in branch_spec(kind).lora_spec(weight).inputs(kind)) if lora else ()


def _proj(g: GraphBuilder, kind: str, x: str, w: Mapping, weight: str, stem: str, lora: bool,
          scale: float = 1.0) -> str:
    """x @ (scale·W)ᵀ, plus the low-rank term in a LoRA-ready graph (its factors carry the same scale)."""
    y = g.matmul(x, np.asarray(w[weight], np.float32) * scale, stem)
    names = _lora_names(kind, weight, lora)
    return g.low_rank(y, x, names[0], names[1], stem) if names else y


def _check_weights(kind: str, w: Mapping, cfg: DiTConfig, heads: int, ffn: int) -> None:
    """The weights of a branch with `heads` attention heads / `ffn` hidden units (a heads shard has fewer)."""
    D, hd, Dc = cfg.width, cfg.head_dim, cfg.context_dim
    kv_in = Dc if kind == "cross" else D
    inner = heads * hd
    want = {
        "self": {"q_proj.weight": (inner, D), "k_proj.weight": (inner, D), "v_proj.weight": (inner, D),
                 "output_proj.weight": (D, inner), "q_norm.weight": (hd,), "k_norm.weight": (hd,)},
        "cross": {"q_proj.weight": (inner, D), "k_proj.weight": (inner, kv_in), "v_proj.weight": (inner, kv_in),
                  "output_proj.weight": (D, inner), "q_norm.weight": (hd,), "k_norm.weight": (hd,)},
        "ffn": {"layer1.weight": (ffn, D), "layer2.weight": (D, ffn)},
    }[kind]
    for k in branch_spec(kind).weights:
        if k not in w:
            raise ValueError(f"{kind} branch: missing weight {k!r}")
        if tuple(np.shape(w[k])) != want[k]:
            raise ValueError(f"{kind} branch: weight {k!r} has shape {list(np.shape(w[k]))}, expected {list(want[k])}")


def _rms_rstd(g: GraphBuilder, sq: str, n: int) -> str:
    """(sum of squares over the last axis, via MatMul with ones[n, 1]) + eps, ^-0.5 -> [..., 1]."""
    ms = g.op("MatMul", [sq, g.const("ones", np.ones((n, 1)))], "mean_sq")  # [1, T, H, 1]
    return g.op("Pow", [g.op("Add", [ms, g.const("eps", EPS)]), g.const("m_half", -0.5)], "rstd")


def _rows(g: GraphBuilder, x: str, a: int, b: int, stem: str) -> str:
    """Rows [a, b) of a 2-D input (a rows shard's queries): one Slice on axis 0 with constant bounds."""
    return g.op("Slice", [x, g.shape([a]), g.shape([b]), g.shape([0])], stem)


def _self_attn(g: GraphBuilder, w: Mapping, cfg: DiTConfig, L: int, H: int, lora: bool, rows=None) -> str:
    """rows (a, b): only those query rows (a rows shard: keys and values still come from every token)."""
    hd = cfg.head_dim
    h2 = hd // 2
    inv = qk_scale(cfg)                       # folded into q/k projections: sum of (q/√hd)² = mean of q²
    Lq = L if rows is None else rows[1] - rows[0]
    src = {"q": "xn" if rows is None else _rows(g, "xn", rows[0], rows[1], "xq"), "k": "xn"}       # [Lq | L, D]
    tables = {"k": ("rope_cos", "rope_sin")}
    tables["q"] = tables["k"] if rows is None else tuple(_rows(g, t, rows[0], rows[1], t + "_q") for t in tables["k"])
    rope = {}                                                                # one [1, T, 1, hd/2] pair per table
    for p in ("k", "q"):
        T = Lq if p == "q" else L
        if tables[p] not in rope:
            rope[tables[p]] = tuple(g.op("Reshape", [t, g.shape([1, T, 1, h2])], stem)
                                    for t, stem in zip(tables[p], ("cos", "sin")))
    rot = {}
    for p, gain in (("q", 1.0), ("k", math.sqrt(hd))):                      # q keeps the 1/√hd attention scale
        T = Lq if p == "q" else L
        cos, sin = rope[tables[p]]
        Wa, Wb = head_halves(w[f"{p}_proj.weight"], H, hd)
        ya, yb = g.matmul(src[p], Wa * inv, p + "a"), g.matmul(src[p], Wb * inv, p + "b")          # [T, H*hd/2] each
        names = _lora_names("self", f"{p}_proj.weight", lora)
        if names:                                 # the halves share x·Aᵀ; Bᵀ comes split as the rows are
            t = g.op("MatMul", [src[p], names[0]], p + "_la")                                        # [T, R]
            ya = g.op("Add", [ya, g.op("MatMul", [t, names[1]], p + "a_lb")], p + "a_lora")
            yb = g.op("Add", [yb, g.op("MatMul", [t, names[2]], p + "b_lb")], p + "b_lora")
        a = g.op("Reshape", [ya, g.shape([1, T, H, h2])], p + "a4")                                   # [1, T, H, hd/2]
        b = g.op("Reshape", [yb, g.shape([1, T, H, h2])], p + "b4")                                   # [1, T, H, hd/2]
        sq = g.op("Add", [g.op("Mul", [a, a]), g.op("Mul", [b, b])], p + "_sq")                     # [1, L, H, hd/2]
        r = _rms_rstd(g, sq, h2)                                                                     # [1, L, H, 1]
        nw = np.asarray(w[f"{p}_norm.weight"], np.float32) * gain                                    # [hd]
        an = g.op("Mul", [g.op("Mul", [a, r]), g.const(p + "_ga", nw[:h2])], p + "an")
        bn = g.op("Mul", [g.op("Mul", [b, r]), g.const(p + "_gb", nw[h2:])], p + "bn")
        # rotary, split-half pairs (k, k + hd/2): (a, b) -> (a cos - b sin, b cos + a sin)
        ra = g.op("Sub", [g.op("Mul", [an, cos]), g.op("Mul", [bn, sin])], p + "ra")
        rb = g.op("Add", [g.op("Mul", [bn, cos]), g.op("Mul", [an, sin])], p + "rb")
        rot[p] = (ra, rb)
    qa = g.op("Transpose", [rot["q"][0]], "qaT", perm=[0, 2, 1, 3])         # [1, H, L, hd/2]
    qb = g.op("Transpose", [rot["q"][1]], "qbT", perm=[0, 2, 1, 3])
    ka = g.op("Transpose", [rot["k"][0]], "kaT", perm=[0, 2, 3, 1])         # [1, H, hd/2, L]
    kb = g.op("Transpose", [rot["k"][1]], "kbT", perm=[0, 2, 3, 1])
    s = g.op("Add", [g.op("MatMul", [qa, ka]), g.op("MatMul", [qb, kb])], "scores")  # [1, H, Lq, L]
    v = _proj(g, "self", "xn", w, "v_proj.weight", "v", lora)                          # [L, H*hd]
    return _attend(g, "self", s, v, Lq, L, H, hd, w, lora)


def _cross_attn(g: GraphBuilder, w: Mapping, cfg: DiTConfig, L: int, S: int, masked: bool, H: int,
                lora: bool) -> str:
    hd = cfg.head_dim
    inv = qk_scale(cfg)
    normed = {}
    for p, src, T, gain in (("q", "xn", L, 1.0), ("k", "context", S, math.sqrt(hd))):
        x = g.op("Reshape", [_proj(g, "cross", src, w, f"{p}_proj.weight", p, lora, inv),
                             g.shape([1, T, H, hd])], p + "4")                                   # [1, T, H, hd]
        r = _rms_rstd(g, g.op("Mul", [x, x], p + "_sq"), hd)                                      # [1, T, H, 1]
        nw = np.asarray(w[f"{p}_norm.weight"], np.float32) * gain
        normed[p] = g.op("Mul", [g.op("Mul", [x, r]), g.const(p + "_g", nw)], p + "n")          # [1, T, H, hd]
    q = g.op("Transpose", [normed["q"]], "qT", perm=[0, 2, 1, 3])             # [1, H, L, hd]
    k = g.op("Transpose", [normed["k"]], "kT", perm=[0, 2, 3, 1])             # [1, H, hd, S]
    s = g.op("MatMul", [q, k], "scores")                                      # [1, H, L, S]
    if masked:                                                                # + context_mask [S], broadcast
        s = g.op("Add", [s, "context_mask"], "scores_masked")
    v = _proj(g, "cross", "context", w, "v_proj.weight", "v", lora)           # [S, H*hd]
    return _attend(g, "cross", s, v, L, S, H, hd, w, lora)


def _attend(g: GraphBuilder, kind: str, scores: str, v2d: str, L: int, T: int, H: int, hd: int, w: Mapping,
            lora: bool) -> str:
    """softmax(scores) · v, heads merged, output_proj -> y [L, D] (a heads shard: its partial of y)."""
    p = g.op("Softmax", [scores], "probs", axis=-1)                           # [1, H, L, T]
    v = g.op("Transpose", [g.op("Reshape", [v2d, g.shape([1, T, H, hd])], "v4")], "vT", perm=[0, 2, 1, 3])  # [1,H,T,hd]
    o = g.op("Transpose", [g.op("MatMul", [p, v], "attn")], "oT", perm=[0, 2, 1, 3])   # [1, L, H, hd]
    o = g.op("Reshape", [o, g.shape([L, H * hd])], "o2")                               # [L, H*hd]
    return _proj(g, kind, o, w, "output_proj.weight", "out", lora)                     # [L, D]


def _ffn(g: GraphBuilder, w: Mapping, lora: bool) -> str:
    h = _proj(g, "ffn", "xn", w, "layer1.weight", "h", lora)                           # [L, F]
    # exact GELU written as rknn-toolkit2 2.5.0 fuses it into one NPU op (ConvExGelu): Div(h, Sqrt(2)) -> Erf ->
    # Add 1 -> Mul h -> Mul 0.5. Any other arrangement (e.g. Mul by 1/sqrt2) leaves Erf on the CPU; Sqrt of the
    # exact constant 2 keeps sqrt2 exact in FP32 (an FP16 literal 1.414 does not fuse).
    sqrt2 = g.op("Sqrt", [g.const("two", 2.0)])
    e = g.op("Erf", [g.op("Div", [h, sqrt2])])                                           # [L, F]
    act = g.op("Mul", [g.op("Mul", [h, g.op("Add", [e, g.const("one", 1.0)])]), g.const("half", 0.5)], "gelu")
    return _proj(g, "ffn", act, w, "layer2.weight", "out", lora)                       # [L, D]


def build_branch(kind: str, weights: Mapping, cfg: DiTConfig, geom: Geometry, dtype: str = "fp16",
                 block: int = None, shard: ShardSpec = None) -> onnx.ModelProto:
    """One branch graph with its weights (suffix names as in partition.BRANCHES) as initializers; with `shard`, that
    shard's graph (its weights: models.dit.shards.shard_weights).

    I/O names, shapes and dtypes come from the partition table (models.dit.partition.resolve; a shard's from
    models.dit.shards.shard_io); a geometry with lora_rank R > 0 gives a LoRA-ready graph (low-rank inputs per
    projection, partition.LoraSpec). A shard of a LoRA-ready branch is refused: shard_io has no low-rank inputs.
    """
    lora = geom.lora_rank > 0
    if lora and shard is not None:
        raise ValueError(f"{kind} branch: a shard of a LoRA-ready graph (lora_rank {geom.lora_rank}) is not "
                         "supported: build it sharded or LoRA-ready, not both")
    heads = shard.size if shard is not None and shard.cut == "heads" and kind != "ffn" else cfg.heads
    ffn = shard.size if shard is not None and shard.cut == "heads" and kind == "ffn" else cfg.ffn_width
    _check_weights(kind, weights, cfg, heads, ffn)
    dt = pack_io_dtype(dtype)
    io = resolve(kind, cfg, geom, dtype) if shard is None else shard_io(shard, cfg, geom, dtype)
    g = GraphBuilder(dt)
    L, S = geom.tokens, geom.text_tokens
    rows = (shard.a, shard.b) if shard is not None and shard.cut == "rows" else None
    if kind == "self":
        y = _self_attn(g, weights, cfg, L, heads, lora, rows)
    elif kind == "cross":                  # a rows shard's xn has only its rows: the graph is the branch at Lq rows
        y = _cross_attn(g, weights, cfg, L if rows is None else rows[1] - rows[0], S,
                        any(i["name"] == "context_mask" for i in io["inputs"]), heads, lora)
    else:
        y = _ffn(g, weights, lora)
    out_name = io["outputs"][0]["name"]
    g.nodes.append(helper.make_node("Identity", [y], [out_name], name="output"))
    vi = lambda d: helper.make_tensor_value_info(d["name"], ONNX_DTYPES[d["dtype"]], d["shape"])  # noqa: E731
    name = f"b{block:02d}_{kind}" if block is not None else kind
    name += f".s{shard.index}" if shard is not None else ""
    graph = helper.make_graph(g.nodes, name, [vi(d) for d in io["inputs"]], [vi(d) for d in io["outputs"]],
                              g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="anima-npu",
                              doc_string=f"Anima DiT {kind} branch" + (f", block {block}" if block is not None else ""))
    model.ir_version = min(model.ir_version, 9)      # readable by older runtimes (rknn-toolkit2's onnx)
    props = {"kind": kind, "block": str(block), "dtype": dt}
    if lora:
        props["lora_rank"] = str(geom.lora_rank)
    if shard is not None:
        props.update(shard=str(shard.index), shards=str(shard.n), cut=shard.cut, range=f"{shard.a}:{shard.b}")
    helper.set_model_props(model, props)
    return model
