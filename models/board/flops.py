"""What a branch computes and holds, for the board cost model (models/board/cost.py): its FLOPs by how they scale
(`branch_flops`, a LoRA-ready pack's low-rank terms included: `lora_flops`), a shard's (`shard_flops`,
models/dit/shards.py's cuts) and its weight bytes (`weight_bytes`). `s` is a models.board.cost.Shape (widths, heads,
tokens)."""
from __future__ import annotations

from models.dit.partition import KINDS, branch_spec


class FlopsError(ValueError):
    """A branch kind the partition does not have."""


def lora_flops(kind: str, s: "Shape") -> dict:
    """FLOPs of a LoRA-ready branch's low-rank terms (partition.LoraSpec): {"linear": image-token rows, "constant":
    the text context's rows}; zeros for a plain pack."""
    out = {"linear": 0, "quadratic": 0, "constant": 0}
    if not s.lora_rank:
        return out
    dims = {"D": s.width, "Dc": s.context_dim, "F": s.ffn_width}
    for ls in branch_spec(kind).lora:
        part, rows = ("constant", s.text_tokens) if ls.in_dim == "Dc" else ("linear", s.tokens)
        out[part] += 2 * rows * s.lora_rank * (dims[ls.in_dim] + dims[ls.out_dim])
    return out


def branch_flops(kind: str, s: "Shape") -> dict:
    """FLOPs of one inference of a branch, by how they scale: {"linear": ~L, "quadratic": ~L^2, "constant": ~S}
    (a LoRA-ready pack's low-rank terms included: `lora_flops`)."""
    flops = _plain_flops(kind, s)
    return {p: v + lora_flops(kind, s)[p] for p, v in flops.items()}


def _plain_flops(kind: str, s: "Shape") -> dict:
    L, S, D, H, F, Dc = s.tokens, s.text_tokens, s.width, s.heads, s.ffn_width, s.context_dim
    softmax = 5                                    # max, subtract, exp, sum, divide per score
    if kind == "self":
        return {"linear": 4 * 2 * L * D * D        # q, k, v, output projections
                + 2 * 2 * L * D                    # q/k RMSNorm (mean of squares by MatMul)
                + 6 * L * D,                       # RoPE on q and k
                "quadratic": 2 * 2 * L * L * D     # q.k^T and weights x v over all heads
                + softmax * H * L * L,
                "constant": 0}
    if kind == "cross":
        return {"linear": 2 * 2 * L * D * D        # q and output projections
                + 2 * L * D                        # q RMSNorm
                + 2 * 2 * L * S * D                # scores and weights x v against S text tokens
                + softmax * H * L * S,
                "quadratic": 0,
                "constant": 2 * 2 * S * Dc * D     # k and v projections of the text context
                + 2 * S * D}
    if kind == "ffn":
        return {"linear": 2 * 2 * L * D * F + 8 * L * F, "quadratic": 0, "constant": 0}    # two projections, GELU
    raise FlopsError(f"branch kind {kind!r}: choose one of {', '.join(KINDS)}")


def shard_flops(kind: str, s: "Shape", cut: str, size: int, total: int) -> dict:
    """FLOPs of one shard (`size` of `total` rows, heads or hidden units), by the same parts as branch_flops."""
    f = branch_flops(kind, s)
    if cut == "heads":                             # every part is per head / per hidden unit
        return {p: v * size / total for p, v in f.items()}
    L, D, q = s.tokens, s.width, size / total      # rows: what the shard's rows compute ...
    if kind == "self":                             # ... and the keys and values every row shard computes again
        kv = 2 * 2 * L * D * D + 2 * L * D + 3 * L * D            # k, v projections, k RMSNorm, RoPE on k
        return {"linear": kv + (f["linear"] - kv) * q, "quadratic": f["quadratic"] * q, "constant": 0}
    return {"linear": f["linear"] * q, "quadratic": f["quadratic"] * q, "constant": f["constant"]}


def weight_bytes(kind: str, s: "Shape", itemsize: int = 2) -> int:
    """Bytes of a branch's weights (FP16 on the board)."""
    D, F, Dc, hd = s.width, s.ffn_width, s.context_dim, s.head_dim
    n = {"self": 4 * D * D + 2 * hd, "cross": 2 * D * D + 2 * Dc * D + 2 * hd, "ffn": 2 * D * F}[kind]
    return n * itemsize


def int8_projection_flops(kind: str, s: "Shape") -> int:
    """FLOPs of a W8A8 pack's INT8 projections in one inference of a branch kind (s.int8: fc1, qkv, q, fc2), all
    of them in the branch's "linear" part."""
    L, D, F = s.tokens, s.width, s.ffn_width
    per = {"fc1": ("ffn", 2 * L * D * F), "fc2": ("ffn", 2 * L * F * D), "qkv": ("self", 3 * 2 * L * D * D),
           "q": ("cross", 2 * L * D * D)}
    return sum(f for name, (k, f) in per.items() if k == kind and name in s.int8)


def int8_shard_flops(kind: str, s: "Shape", cut: str, size: int, total: int) -> float:
    """FLOPs of a W8A8 pack's INT8 projections in one shard (`size` of `total`), as `shard_flops` splits the
    branch: a heads shard 1/N of each; a rows shard its rows' share, except self-attention's k and v projections,
    which every rows shard computes for all tokens (qkv INT8: those stay whole)."""
    f8 = int8_projection_flops(kind, s)
    q = size / total
    if cut == "rows" and kind == "self" and "qkv" in s.int8:
        kv = 2 * 2 * s.tokens * s.width * s.width
        return kv + (f8 - kv) * q
    return f8 * q


def int8_weight_elements(kind: str, s: "Shape") -> int:
    """Weight elements of a branch kind a W8A8 pack stores as INT8 (1 byte instead of FP16's 2)."""
    D, F = s.width, s.ffn_width
    per = {"fc1": ("ffn", D * F), "fc2": ("ffn", F * D), "qkv": ("self", 3 * D * D), "q": ("cross", D * D)}
    return sum(n for name, (k, n) in per.items() if k == kind and name in s.int8)
