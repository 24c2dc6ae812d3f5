"""LyCORIS LoKr and LoHa modules: their keys, their header checks, and ΔW computed as ComfyUI's weight adapters
compute it (comfy/weight_adapter/lokr.py, loha.py: `calculate_weight`), plus an exact low-rank form of the same ΔW
for a LoRA-ready pack's branch inputs.

    LoKr  ΔW = scale · kron(w1, w2)              w1 = lokr_w1 [a, b]  or lokr_w1_a [a, r1] @ lokr_w1_b [r1, b]
                                                 w2 = lokr_w2 [c, d]  or lokr_w2_a [c, r2] @ lokr_w2_b [r2, d]
                                                 ΔW [a·c, b·d] = the layer's [out, in]
          scale = alpha / dim, dim = r2 when w2 is split, else r1 when w1 is split; 1 when both are full or no alpha
    LoHa  ΔW = scale · (w1_a @ w1_b) ∘ (w2_a @ w2_b) hada_w1_a [out, r1], hada_w1_b [r1, in], hada_w2_a [out, r2],
                                                 hada_w2_b [r2, in]; scale = alpha / r1, or 1 without alpha

Exact low-rank forms (no approximation): kron(U1·V1, U2·V2) = kron(U1, U2) · kron(V1, V2), of rank k1·k2 (a full
w1 [a, b] is I·w1 or w1·I, whichever is narrower); (A1·B1) ∘ (A2·B2) = (A1 ⊙ A2) · (B1 ⊙ B2) with the row-wise and
column-wise Khatri-Rao products, of rank r1·r2. Tucker forms (lokr_t2, hada_t1/t2) belong to convolutions, which
Anima has none of: refused.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

# key suffix (after "NAME.") -> kind
LOKR_PARTS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
KIND_OF_PART = {**{p: "lokr" for p in LOKR_PARTS}, **{p: "loha" for p in LOHA_PARTS}}
KIND_NAMES = {"lokr": "LoKr", "loha": "LoHa"}
TUCKER = ("lokr_t2", "hada_t1", "hada_t2")


class Shapes:
    """What a module's header says: ΔW's (out, in), ComfyUI's scale divisor `dim` (None: scale 1), and the rank
    of the exact low-rank form."""

    def __init__(self, out_features: int, in_features: int, dim: Optional[int], runtime_rank: int):
        self.out_features, self.in_features, self.dim, self.runtime_rank = out_features, in_features, dim, \
            runtime_rank


def _factor(parts: dict, shape: Callable, full: str, a: str, b: str, what: str, fail: Callable) -> tuple:
    """(rows, cols, split rank or None, rank of its low-rank form) of one LoKr factor, full or split."""
    if full in parts:
        if a in parts or b in parts:
            fail(f"has both {full} and {a}/{b}")
        s = shape(parts[full])
        if len(s) != 2:
            fail(f"{full} is {list(s)}: must be 2-D ({what} of a Linear layer)")
        return int(s[0]), int(s[1]), None, min(int(s[0]), int(s[1]))
    if a not in parts or b not in parts:
        fail(f"has {' and '.join(k for k in (a, b) if k in parts) or 'neither'} but needs {full}, or {a} and {b}")
    sa, sb = shape(parts[a]), shape(parts[b])
    if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0] or sa[1] == 0:
        fail(f"{a} {list(sa)} and {b} {list(sb)} do not chain ([rows, rank] @ [rank, cols])")
    return int(sa[0]), int(sb[1]), int(sb[0]), int(sb[0])


def check_shapes(kind: str, parts: dict, shape: Callable, fail: Callable) -> Shapes:
    """The module's Shapes from its header; `fail(text)` raises naming the file and module."""
    for t in TUCKER:
        if t in parts:
            fail(f"has {t}: a Tucker {KIND_NAMES[kind]} (convolution layers only; Anima has no convolution a "
                 "LoRA may target)")
    if kind == "lokr":
        a, b, r1, k1 = _factor(parts, shape, "lokr_w1", "lokr_w1_a", "lokr_w1_b", "w1", fail)
        c, d, r2, k2 = _factor(parts, shape, "lokr_w2", "lokr_w2_a", "lokr_w2_b", "w2", fail)
        return Shapes(a * c, b * d, r2 if r2 is not None else r1, k1 * k2)
    missing = [p for p in LOHA_PARTS[:4] if p not in parts]
    if missing:
        fail(f"has {', '.join(sorted(parts))} but not {', '.join(missing)} (a LoHa module has all four)")
    s = {p: shape(parts[p]) for p in LOHA_PARTS[:4]}
    if any(len(v) != 2 for v in s.values()):
        fail(f"LoHa weights must be 2-D, got {', '.join(f'{p} {list(v)}' for p, v in s.items())}")
    m1 = (s["hada_w1_a"][0], s["hada_w1_b"][1])
    m2 = (s["hada_w2_a"][0], s["hada_w2_b"][1])
    r1, r2 = s["hada_w1_a"][1], s["hada_w2_a"][1]
    if r1 != s["hada_w1_b"][0] or r2 != s["hada_w2_b"][0] or m1 != m2 or 0 in (r1, r2):
        fail(f"LoHa weights do not chain to one [out, in]: {', '.join(f'{p} {list(v)}' for p, v in s.items())}")
    return Shapes(int(m1[0]), int(m1[1]), int(r1), int(r1) * int(r2))


def _w(arrays: dict, full: str, a: str, b: str) -> np.ndarray:
    return arrays[full] if full in arrays else arrays[a] @ arrays[b]


def product(kind: str, arrays: dict) -> np.ndarray:
    """ΔW before scale and strength, [out, in] f32, as ComfyUI's calculate_weight forms it."""
    if kind == "lokr":
        return np.kron(_w(arrays, "lokr_w1", "lokr_w1_a", "lokr_w1_b"),
                       _w(arrays, "lokr_w2", "lokr_w2_a", "lokr_w2_b")).astype(np.float32, copy=False)
    return (arrays["hada_w1_a"] @ arrays["hada_w1_b"]) * (arrays["hada_w2_a"] @ arrays["hada_w2_b"])


def _split(arrays: dict, full: str, a: str, b: str) -> tuple:
    """A LoKr factor as (U [rows, k], V [k, cols]) with U @ V equal to it."""
    if full in arrays:
        w = arrays[full]
        if w.shape[0] <= w.shape[1]:
            return np.eye(w.shape[0], dtype=np.float32), w
        return w, np.eye(w.shape[1], dtype=np.float32)
    return arrays[a], arrays[b]


def low_rank(kind: str, arrays: dict) -> tuple:
    """(up [out, k], down [k, in]) f32 with up @ down = product(kind, arrays) exactly (k = Shapes.runtime_rank)."""
    if kind == "lokr":
        u1, v1 = _split(arrays, "lokr_w1", "lokr_w1_a", "lokr_w1_b")                # [a, k1], [k1, b]
        u2, v2 = _split(arrays, "lokr_w2", "lokr_w2_a", "lokr_w2_b")                # [c, k2], [k2, d]
        return np.kron(u1, u2).astype(np.float32), np.kron(v1, v2).astype(np.float32)   # [ac, k1k2], [k1k2, bd]
    a1, b1, a2, b2 = (arrays[p] for p in LOHA_PARTS[:4])                            # [out, r1] [r1, in] [out, r2] ...
    up = (a1[:, :, None] * a2[:, None, :]).reshape(a1.shape[0], -1)                 # [out, r1·r2]
    down = (b1[:, None, :] * b2[None, :, :]).reshape(-1, b1.shape[1])               # [r1·r2, in]
    return up, down
