"""How the branch graphs lay out a projection's weight, in one place for the graph builder (models/packs/branch_graphs.py,
which bakes the weights) and for whoever feeds a LoRA-ready graph its low-rank inputs at run time (the scheduler,
`anima-models forward`): no onnx, no torch.

- q and k are projected by two matrices holding each head's first and second half of the rows (`head_halves`), so
  the rotary embedding needs no Slice; both carry 1/sqrt(head_dim) (`qk_scale`), which the norm gain undoes.
- a LoRA-ready Linear computes W·x + B·(A·x) with Aᵀ [in, R] and Bᵀ [R, out] as inputs (partition.LoraSpec): the
  same layout and scale as W, so `lora_inputs` applies to B exactly what the builder applied to W's rows.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from models.dit.config import DiTConfig
from models.dit.partition import NUMPY_DTYPES, Geometry, branch_spec, pack_io_dtype, symbols


def qk_scale(cfg: DiTConfig) -> float:
    """The factor folded into q and k projections: sum of (q/sqrt(hd))² is the mean of q² the RMSNorm needs."""
    return 1.0 / math.sqrt(cfg.head_dim)


def head_halves(W: np.ndarray, heads: int, hd: int) -> tuple:
    """Rows of a [H*hd, in] matrix split into each head's first and second half -> two [H*hd/2, in]."""
    w = np.asarray(W, np.float32).reshape(heads, 2, hd // 2, -1)            # [H, 2, hd/2, in]
    return w[:, 0].reshape(heads * hd // 2, -1), w[:, 1].reshape(heads * hd // 2, -1)


def lora_inputs(kind: str, factors: Mapping, cfg: DiTConfig, geom: Geometry, pack_dtype: str) -> dict:
    """{input name: array} of one LoRA-ready branch: factors {weight suffix: (B [out, R], A [R, in])} f32 (a Linear
    missing from `factors` gets zeros), laid out as the graph takes them, in the pack's io dtype."""
    spec = branch_spec(kind)
    np_dt = NUMPY_DTYPES[pack_io_dtype(pack_dtype)]
    sym = symbols(cfg, geom)
    R = geom.lora_rank
    if R <= 0:
        raise ValueError(f"a pack with LoRA rank {R} takes no LoRA inputs")
    unknown = set(factors) - {ls.weight for ls in spec.lora}
    if unknown:
        raise ValueError(f"{kind} branch: no LoRA input for {sorted(unknown)}")
    out = {}
    for ls in spec.lora:
        n_in, n_out = sym[ls.in_dim], sym[ls.out_dim]
        names = [i.name for i in ls.inputs(kind)]
        if ls.weight not in factors:
            out[names[0]] = np.zeros((n_in, R), np_dt)
            for n in names[1:]:
                out[n] = np.zeros((R, n_out // (len(names) - 1)), np_dt)
            continue
        B, A = (np.asarray(a, np.float32) for a in factors[ls.weight])
        if B.shape != (n_out, R) or A.shape != (R, n_in):
            raise ValueError(f"{kind} branch {ls.weight}: factors B {list(B.shape)}, A {list(A.shape)}; this pack "
                             f"takes B [{n_out}, {R}], A [{R}, {n_in}]")
        if ls.qk_scale:
            B = B * np.float32(qk_scale(cfg))
        out[names[0]] = np.ascontiguousarray(A.T.astype(np_dt))                        # Aᵀ [in, R]
        if ls.split:
            Ba, Bb = head_halves(B, cfg.heads, cfg.head_dim)                            # [out/2, R] each
            out[names[1]] = np.ascontiguousarray(Ba.T.astype(np_dt))                   # [R, out/2]
            out[names[2]] = np.ascontiguousarray(Bb.T.astype(np_dt))
        else:
            out[names[1]] = np.ascontiguousarray(B.T.astype(np_dt))                    # Bᵀ [R, out]
    return out
