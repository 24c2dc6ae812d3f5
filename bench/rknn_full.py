"""Full-size RKNN benchmark (not CI): compile the synthetic full preset's pack at a size and check it in the simulator.

    .venv/bin/python bench/rknn_full.py [--out bench/out/rknn_full] [--resolution 512x512] [--blocks all|0,13,27]
                                        [--jobs 1] [--sim per-branch|cumulative|none] [--json FILE]

Last line: `rknn_full resolution=WxH branches=N built=N failed=N worst_cos=X` (worst_cos: the lowest per-branch
cosine of the simulator against ONNX Runtime; - without a per-branch check).

1) writes the synthetic `full` checkpoint (28 blocks, D 2048; bf16, ~4.2 GB) and its FP16 pack at the size when absent;
2) compiles the selected blocks with rknn-toolkit2 (one process per branch): total time, per-branch build time, size
   and peak RSS; the size sum is extrapolated to 84 branches and set against the reference work's ~3.99 GB;
3) simulator check: `per-branch` builds each selected branch in the simulator and compares it with ONNX Runtime and
   the FP32 torch branch on LayerNorm-like inputs; `cumulative` runs `verify_pack(backend="rknn-sim")`: every block
   through the simulator, final prediction vs the FP32 reference (target cos >= 0.99999; heavy: ~8 GB for the
   reference and ~84 simulator builds).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from models.dit.partition import KINDS  # noqa: E402

log = logging.getLogger("bench.rknn_full")
REFERENCE_TOTAL_GB = 3.99             # the reference work's 84 compiled branches at 512x512
TARGET_FINAL_COS = 0.99999


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def ensure_pack(out: Path, size: tuple = (512, 512)) -> Path:
    from models.packs.pack import build_pack
    from models.dit.synth import write_dit
    ckpt = out / "full-dit.safetensors"
    pack = out / ("pack512" if size == (512, 512) else f"pack{size[0]}x{size[1]}")
    if not ckpt.exists():
        t = time.perf_counter()
        write_dit("full", 0, ckpt)
        log.info("synthetic full checkpoint: %.1f GB in %.0f s", ckpt.stat().st_size / 1e9, time.perf_counter() - t)
    if not (pack / "manifest.json").exists():
        t = time.perf_counter()
        build_pack(ckpt, pack, size, "fp16")
        log.info("pack: built in %.0f s", time.perf_counter() - t)
    return pack


def per_branch_sim(pack_dir: Path, blocks: list, seed: int = 0) -> list:
    """Each selected branch: simulator vs ONNX Runtime vs the FP32 torch branch, on LayerNorm-like inputs."""
    from models.runtime.backends import make_backend
    from models.runtime.lifecycle import run_branch
    from models.dit.checkpoint import DiTCheckpoint
    from models.packs.pack import load_pack
    from models.dit.reference import ref_cross_attn, ref_ffn, ref_self_attn
    from models.dit.rope import rope_tables
    pack = load_pack(pack_dir, check=False)
    ck = DiTCheckpoint.open(pack.source["path"])
    g, c = pack.geometry, pack.config
    cos, sin = rope_tables(g.h_tokens, g.w_tokens, c.head_dim)                 # [L, hd/2] f32
    rng = np.random.default_rng(seed)
    sim, ort = make_backend("rknn-sim"), make_backend("onnx")
    rows = []
    for b in [b for b in pack.branches if b["block"] in set(blocks)]:
        xn = rng.standard_normal((g.tokens, c.width), dtype=np.float32)      # [L, D] ~ LayerNorm output
        ctx = np.zeros((g.text_tokens, c.context_dim), np.float32)            # [S, Dc], 120 prompt rows
        ctx[:120] = rng.standard_normal((120, c.context_dim), dtype=np.float32)
        avail = {"xn": xn, "context": ctx, "rope_cos": cos, "rope_sin": sin}
        feed = {i["name"]: avail[i["name"]].astype(np.float16) for i in b["inputs"]}
        t = time.perf_counter()
        (ys,), times = run_branch(sim, pack.dir / b["onnx"], [feed])
        sim_s = time.perf_counter() - t
        (yo,), _ = run_branch(ort, pack.dir / b["onnx"], [feed])
        w = ck.branch_weights(b["block"], b["kind"])
        f32 = {k: v.astype(np.float32) for k, v in feed.items()}
        ref = {"self": lambda: ref_self_attn(w, f32["xn"], f32["rope_cos"], f32["rope_sin"]),
               "cross": lambda: ref_cross_attn(w, f32["xn"], f32["context"]),
               "ffn": lambda: ref_ffn(w, f32["xn"])}[b["kind"]]()
        y = ys["y"].astype(np.float32)
        row = {"branch": f"b{b['block']:02d}_{b['kind']}", "cos_vs_onnx": cosine(y, yo["y"]),
               "cos_vs_fp32": cosine(y, ref), "onnx_cos_vs_fp32": cosine(yo["y"], ref),
               "max_ae_vs_fp32": float(np.abs(y - ref).max()), "nonfinite": int((~np.isfinite(y)).sum()),
               "sim_build_s": sim.last.get("build_s"), "sim_infer_s": sim.last.get("infer_s"),
               "sim_wall_s": round(sim_s, 2)}
        log.info("%s", row)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "rknn_full"))
    ap.add_argument("--blocks", default="0", help="blocks to compile (default 0; 'all' = 84 branches)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--sim", default="per-branch", choices=("per-branch", "cumulative", "none"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--resolution", default="512x512", help="the pack's picture size WxH (default 512x512)")
    args = ap.parse_args(argv)
    try:
        size = tuple(int(v) for v in args.resolution.lower().split("x"))
        from models.dit.partition import Geometry
        Geometry.from_resolution(*size)
    except (ValueError, TypeError) as e:
        print(f"bench/rknn_full.py: --resolution {args.resolution}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.dit.partition import parse_blocks
    from models.rknn.compile import compile_pack, describe
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pack = ensure_pack(out, size)
    blocks = parse_blocks(args.blocks, 28)
    result = {"blocks": blocks, "resolution": f"{size[0]}x{size[1]}"}
    # 1) compile
    rep = compile_pack(pack, jobs=args.jobs, blocks=blocks, per_worker=1)
    print(describe(rep))
    sizes = {b["name"]: b["bytes"] for b in rep["branches"]}
    by_kind = {k: [s for n, s in sizes.items() if n.endswith(k)] for k in KINDS}
    est = 28 * sum(np.mean(v) for v in by_kind.values() if v) if all(by_kind.values()) else None
    result["compile"] = rep
    result["size_sum_bytes"] = sum(sizes.values())
    result["size_est_84_gb"] = None if est is None else est / 1e9
    result["reference_total_gb"] = REFERENCE_TOTAL_GB
    built = [b for b in rep["branches"] if b["status"] == "built"]
    if built:
        result["build_s_mean_by_kind"] = {k: float(np.mean([b["build_s"] for b in built if b["kind"] == k]))
                                          for k in KINDS if any(b["kind"] == k for b in built)}
        result["peak_rss_mb_max"] = max(b["peak_rss_mb"] for b in built)
    # 2) simulator
    if args.sim == "per-branch":
        result["sim"] = per_branch_sim(pack, blocks)
    elif args.sim == "cumulative":
        from models.runtime.verify import verify_pack
        t = time.perf_counter()
        vr = verify_pack(pack, backend="rknn-sim", blocks=args.blocks)
        print(vr.table())
        result["sim_cumulative"] = {**vr.to_dict(), "wall_s": time.perf_counter() - t}
        final = [r for r in vr.rows if r["what"] == "v"][0]
        result["final_cos"] = final["cos"]
        result["final_cos_target_met"] = final["cos"] >= TARGET_FINAL_COS
    text = json.dumps(result, indent=1, default=float)
    Path(args.json or out / f"result-{result['resolution']}.json").write_text(text + "\n")
    print(text)
    failed = [b for b in rep["branches"] if b["status"] == "failed"]
    built = [b for b in rep["branches"] if b["status"] in ("built", "skipped")]      # skipped: compiled by a run before
    cos = [r["cos_vs_onnx"] for r in result.get("sim", [])]
    worst = f"{min(cos):.6f}" if cos else "-"
    print(f"rknn_full resolution={result['resolution']} branches={len(rep['branches'])} built={len(built)} "
          f"failed={len(failed)} worst_cos={worst}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
