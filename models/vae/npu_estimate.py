"""ESTIMATE — modelled, not measured — of a VAE pack's decode time on the RK3588 NPU, from the pack's FLOPs and the
NPU throughput the reference board's measured branch timings imply (docs/board-figures.md, the reference board
figures R2, R4, R5 and R6). Nothing here ran on a board: every line that prints these numbers says ESTIMATE and cites
the figures.

Compute: FLOPs ÷ the throughput of a reference branch kind (FLOPs of one pass of that branch at 512×512 ÷ its pure NPU
seconds per pass; the FFN is the main figure: it is the largest, most regular kernel, and the slowest per FLOP of the
three, so the estimate is not optimistic). Lifecycle (load + init + release of the pack's models once per decode):
the reference's sweep of 84 branch models cost 31.71 s (R6) for 3.99 GB of compiled models; that cost follows the
weight bytes (R4), so seconds per byte × the pack's .rknn bytes.
"""
from __future__ import annotations

# reference board figures (docs/board-figures.md): Anima at 512x512 (L 1024 image tokens, S 512 text tokens), D 2048,
# Dc 1024, F 8192, 28 blocks (R2); pure NPU seconds of one forward (one CFG pass over all 28 blocks) per kind (R5)
REF = {"L": 1024, "S": 512, "D": 2048, "Dc": 1024, "F": 8192, "blocks": 28}
REF_FORWARD_S = {"ffn": 21.99, "self": 12.99, "cross": 3.92}
REF_LIFECYCLE_S = {"load": 13.96, "init": 12.90, "release": 4.84}     # one sweep of the 84 models (R6)
REF_LIFECYCLE_BYTES = 3.99e9    # those 84 compiled models: 28 blocks x ~142.5 MB, inside R4's ~140-155 MB per block
MAIN_KIND = "ffn"


def branch_flops() -> dict:
    """FLOPs of one pass of each reference branch kind (2 per multiply-add; matmuls only)."""
    L, S, D, Dc, F = REF["L"], REF["S"], REF["D"], REF["Dc"], REF["F"]
    return {"ffn": 2 * L * D * F * 2,                                           # layer1 + layer2
            "self": 4 * 2 * L * D * D + 2 * 2 * L * L * D,                      # q k v o + q·kᵀ, p·v
            "cross": 2 * 2 * L * D * D + 2 * 2 * S * Dc * D + 2 * 2 * L * S * D}  # q o, k v, q·kᵀ, p·v


def throughputs() -> dict:
    """{kind: GFLOP/s} the reference timings imply (ESTIMATE inputs)."""
    fl = branch_flops()
    return {k: fl[k] / 1e9 / (REF_FORWARD_S[k] / REF["blocks"]) for k in REF_FORWARD_S}


def lifecycle_s_per_byte() -> float:
    return sum(REF_LIFECYCLE_S.values()) / REF_LIFECYCLE_BYTES


def estimate(manifest: dict) -> dict:
    """The ESTIMATE for one VAE pack manifest: compute (main figure and the range over the three reference kinds),
    lifecycle from the compiled bytes (or, uncompiled, from the FP16 weight bytes = ONNX FP32 bytes / 2), total."""
    models = manifest["branches"]
    gflop = sum(float(b["gflop"]) * int(b["calls"]) for b in models)
    tp = throughputs()
    compiled = all(isinstance(b.get("rknn"), dict) for b in models)
    nbytes = sum(b["rknn"]["bytes"] for b in models) if compiled else sum(b["bytes"] for b in models) / 2
    npu_s = {k: gflop / g for k, g in tp.items()}
    life = nbytes * lifecycle_s_per_byte()
    main = npu_s[MAIN_KIND]
    return {
        "estimate": True, "gflop": gflop, "calls": {b["name"]: b["calls"] for b in models},
        "throughput_gflops": tp, "npu_s": main, "npu_s_range": [min(npu_s.values()), max(npu_s.values())],
        "model_bytes": nbytes, "bytes_from": "rknn" if compiled else "fp16 weights (onnx / 2)",
        "lifecycle_s": life, "total_s": main + life,
        "arithmetic": (f"{gflop:.1f} GFLOP / {tp[MAIN_KIND]:.1f} GFLOP/s (reference FFN: "
                       f"{branch_flops()['ffn'] / 1e9:.2f} GFLOP per pass, {REF_FORWARD_S['ffn']} s / "
                       f"{REF['blocks']} passes) = {main:.1f} s; lifecycle {nbytes / 1e6:.1f} MB x "
                       f"{lifecycle_s_per_byte() * 1e9:.2f} s/GB (reference: {sum(REF_LIFECYCLE_S.values()):.2f} s "
                       f"per {REF_LIFECYCLE_BYTES / 1e9:.2f} GB sweep) = {life:.2f} s"),
    }


def describe(est: dict, label: str = "") -> str:
    lo, hi = est["npu_s_range"]
    return (f"ESTIMATE (modelled from reference board figures, not measured){' ' + label if label else ''}: "
            f"NPU decode ~{est['total_s']:.1f} s = compute {est['npu_s']:.1f} s (range {lo:.1f}-{hi:.1f} s over the "
            f"reference FFN/self/cross throughputs) + lifecycle {est['lifecycle_s']:.2f} s; {est['arithmetic']}")
