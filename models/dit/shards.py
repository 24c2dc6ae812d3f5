"""Sharded branches: one branch cut into N graphs that N NPU contexts compute at once, by one of two cuts.

    rows    token rows: shard i computes the output rows [a_i, b_i) of the branch; exact, no partial sums, but every
            shard holds all the branch's weights (N x the lifecycle and the context memory). The FFN and
            cross-attention take only their rows of xn; self-attention needs every token for its keys and values,
            so each shard takes all of xn and computes the queries (and the output) of its rows only.
    heads   weight columns / head groups: attention heads [h_i, h_i+1) with their rows of the q/k/v projections and
            their columns of the output projection; the FFN's hidden units [f_i, f_i+1) (rows of layer1, columns of
            layer2). Each shard holds 1/N of the weights and takes the whole input; it returns a partial y [L, D],
            and y = the partials summed in FP32 on the host (in shard order, so every policy gives the same bits).

The pieces a sharded branch needs, per shard: its plan (ShardSpec), its weights (`shard_weights`), its inputs and
outputs (`shard_io`: what the pack manifest records and the board model prices), its part of a pass's inputs
(`shard_feed`), and the branch's output from the shards' (`combine`). The graphs are models/packs/branch_graphs.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from models.dit.config import DiTConfig
from models.dit.partition import Geometry, branch_inputs, branch_spec, resolve_io

CUTS = ("rows", "heads")
MAX_SHARDS = 3                  # the RK3588 NPU's cores: more shards than cores only queue


@dataclass(frozen=True)
class ShardSpec:
    """One shard of one branch kind: rows [a, b) of the output (rows cut), or heads / hidden units [a, b)
    (heads cut: attention heads for self/cross, FFN hidden units for ffn)."""
    kind: str
    cut: str
    index: int
    n: int
    a: int
    b: int
    total: int                  # what the cut divides: L rows, heads, or FFN hidden units

    @property
    def size(self) -> int:
        return self.b - self.a

    def to_dict(self) -> dict:
        return {"index": self.index, "cut": self.cut, "range": [self.a, self.b], "of": self.total}


def split(total: int, n: int) -> list:
    """[(a, b)] n ranges covering 0..total, as even as possible (the first ones one longer)."""
    base, extra = divmod(int(total), int(n))
    out, a = [], 0
    for i in range(n):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def cut_extent(kind: str, cut: str, cfg: DiTConfig, geom: Geometry) -> int:
    """What a cut divides: token rows L, or attention heads, or FFN hidden units."""
    if cut == "rows":
        return geom.tokens
    return cfg.ffn_width if kind == "ffn" else cfg.heads


def check_shards(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= int(n) <= MAX_SHARDS:
        raise ValueError(f"shards {n!r} must be an integer in [1, {MAX_SHARDS}] (the NPU's cores)")
    return int(n)


def plan(kind: str, cut: str, n: int, cfg: DiTConfig, geom: Geometry) -> list:
    """The n shards of a branch kind under a cut -> [ShardSpec]."""
    branch_spec(kind)
    n = check_shards(n)
    if cut not in CUTS:
        raise ValueError(f"cut {cut!r}: choose one of {', '.join(CUTS)}")
    total = cut_extent(kind, cut, cfg, geom)
    if n > total:
        what = "token rows" if cut == "rows" else "hidden units" if kind == "ffn" else "attention heads"
        raise ValueError(f"{kind} branch: {n} shards by {cut} need at least {n} {what}, it has {total}")
    return [ShardSpec(kind, cut, i, n, a, b, total) for i, (a, b) in enumerate(split(total, n))]


def shard_weights(spec: ShardSpec, w: Mapping) -> dict:
    """The shard's weights (checkpoint suffix names, as branch_graphs takes them): all of them for a rows cut; for a
    heads cut, the rows of the q/k/v projections and the columns of the output projection of its heads (head h:
    rows h*hd..(h+1)*hd, hd = the norm's length), or the FFN's hidden units (rows of layer1, columns of layer2)."""
    if spec.cut == "rows":
        return dict(w)
    a, b = spec.a, spec.b
    if spec.kind == "ffn":
        return {"layer1.weight": np.asarray(w["layer1.weight"])[a:b],
                "layer2.weight": np.asarray(w["layer2.weight"])[:, a:b]}
    hd = int(np.shape(w["q_norm.weight"])[0])
    r = slice(a * hd, b * hd)
    out = {k: np.asarray(w[k])[r] for k in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    out["output_proj.weight"] = np.asarray(w["output_proj.weight"])[:, r]
    out["q_norm.weight"], out["k_norm.weight"] = w["q_norm.weight"], w["k_norm.weight"]
    return out


def weight_fraction(spec: ShardSpec) -> float:
    """The share of the branch's weights a shard holds (rows: all of them; the q/k norms' few values aside)."""
    return 1.0 if spec.cut == "rows" else spec.size / spec.total


def shard_io(spec: ShardSpec, cfg: DiTConfig, geom: Geometry, pack_dtype: str) -> dict:
    """{"inputs": [...], "outputs": [...]} of one shard graph (names, resolved shapes, dtypes), as the manifest and
    the board model read them: a rows shard's output has its rows, and so does the FFN's and cross-attention's
    xn; everything else as the branch's (models.dit.partition)."""
    bs = branch_spec(spec.kind)
    ins = resolve_io(branch_inputs(bs, geom), cfg, geom, pack_dtype)
    outs = resolve_io(bs.outputs, cfg, geom, pack_dtype)
    if spec.cut == "rows":
        outs = [dict(o, shape=[spec.size] + o["shape"][1:]) for o in outs]
        if spec.kind != "self":
            ins = [dict(i, shape=[spec.size] + i["shape"][1:]) if i["name"] == "xn" else i for i in ins]
    return {"inputs": ins, "outputs": outs}


def shard_feed(spec: ShardSpec, feed: Mapping) -> dict:
    """A pass's inputs for one shard: its rows of xn (FFN and cross-attention rows cuts), else the same arrays."""
    if spec.cut == "rows" and spec.kind != "self":
        return {k: (v[spec.a:spec.b] if k == "xn" else v) for k, v in feed.items()}
    return dict(feed)


def combine(specs: list, outs: list, name: str = "y") -> np.ndarray:
    """The branch's output from its shards' (in shard order) -> FP32: rows concatenated, partials summed in FP32."""
    if not specs or len(specs) != len(outs):
        raise ValueError(f"combine: {len(outs)} shard outputs for {len(specs)} shards")
    parts = [np.asarray(o[name] if isinstance(o, Mapping) else o, np.float32) for o in outs]
    if specs[0].cut == "rows":
        return np.concatenate(parts, axis=0)
    y = parts[0].copy()
    for p in parts[1:]:
        y += p
    return y


def describe(kind: str, cut: str, n: int) -> str:
    if n == 1:
        return f"{kind}: one graph"
    return f"{kind}: {n} shards by {'token rows' if cut == 'rows' else 'hidden units' if kind == 'ffn' else 'heads'}"
