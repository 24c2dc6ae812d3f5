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

import numpy as np

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
    compiled = all(isinstance(b.get("rknn"), dict) for b in models)
    nbytes = sum(b["rknn"]["bytes"] for b in models) if compiled else sum(b["bytes"] for b in models) / 2
    return _estimate(gflop, nbytes, "rknn" if compiled else "fp16 weights (onnx / 2)",
                     {b["name"]: b["calls"] for b in models})


def encode_estimate(cfg, width: int, height: int, tile: int | None = None, overlap: float | None = None) -> dict:
    """The ESTIMATE of encoding one width x height image on the NPU (img2img's VAE_ENCODE) as an encoder pack at the
    default tiling (or `tile`, `overlap`) runs it (build_vae_encoder_pack: a features tile graph per tile, the head once), by the same
    arithmetic as a decode; lifecycle from the encoder's FP16 weight bytes (the 2D kernels the single-image encoder
    runs). What a built encoder pack's manifest says is `estimate(manifest)`; nothing here was timed."""
    from models.vae.flops import features_flops, head_flops
    from models.vae.keys import encoder_shapes
    from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE, tile_grid
    h, w, s = height // cfg.upscale, width // cfg.upscale, cfg.upscale
    rows, cols = tile_grid(h, w, tile or DEFAULT_TILE, DEFAULT_OVERLAP if overlap is None else overlap, 1)
    tiles = len(rows) * len(cols)
    gflop = (features_flops(cfg, s * cols[0][1], s * rows[0][1]) * tiles + head_flops(cfg, h, w)) / 1e9
    params = 0
    for shape in encoder_shapes(cfg, temporal_down=None).values():
        kernel = shape[:2] + shape[3:] if len(shape) == 5 else shape      # a 3D kernel runs as its last 2D slice
        params += int(np.prod(kernel))
    return _estimate(gflop, 2 * params, "fp16 weights (analytic)", {"features": tiles, "head": 1})


def _estimate(gflop: float, nbytes: float, bytes_from: str, calls: dict) -> dict:
    tp = throughputs()
    npu_s = {k: gflop / g for k, g in tp.items()}
    life = nbytes * lifecycle_s_per_byte()
    main = npu_s[MAIN_KIND]
    return {
        "estimate": True, "gflop": gflop, "calls": calls,
        "throughput_gflops": tp, "npu_s": main, "npu_s_range": [min(npu_s.values()), max(npu_s.values())],
        "model_bytes": nbytes, "bytes_from": bytes_from,
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
