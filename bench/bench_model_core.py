"""Model-core benchmark on the full-size (official shapes) synthetic DiT: pack build time and peak RSS, one in-process
forward at 512x512 with a per-branch-kind phase table, and the verify table against the FP32 reference.

    .venv/bin/python bench/bench_model_core.py                                  # fp16 pack, 512x512
    .venv/bin/python bench/bench_model_core.py --dtype fp32 --threads 2 --verify-blocks 0,27 --json bench/out/mc.json
    .venv/bin/python bench/bench_model_core.py --skip-verify                    # build + forward only

Not a test. The 4.2 GB checkpoint is synthesized once into --cache (default ~/.cache/anima-npu). The pack build runs in
a child process so its peak RSS (ru_maxrss) is the build's alone.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("bench_model_core")
ROOT = Path(__file__).resolve().parent.parent
RSS_LIMIT_GB = 3.0           # what the issue allows the full-size build


def ensure_checkpoint(cache: Path, seed: int) -> tuple:
    from models.dit.synth import write_dit
    ckpt = cache / f"anima-full-synth-{seed}.safetensors"
    if ckpt.exists():
        return ckpt, None
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_dit("full", seed, ckpt, prefix="net.")
    return ckpt, time.perf_counter() - t0


def build_in_child(ckpt: Path, pack: Path, resolution: str, dtype: str) -> dict:
    """`anima-models pack` in a fresh interpreter; wall time and the child's peak RSS."""
    cmd = [sys.executable, "-m", "models.commands.cli", "pack", str(ckpt), "--out", str(pack), "--resolution", resolution,
           "--dtype", dtype, "--overwrite"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pack build failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kb <= before:
        log.warning("ru_maxrss of children did not grow (%d kB); an earlier child was bigger", before)
    size = sum(f.stat().st_size for f in pack.rglob("*") if f.is_file())
    return {"wall_s": wall, "peak_rss_gb": peak_kb / 1024 ** 2, "pack_bytes": size,
            "rss_within_limit": peak_kb / 1024 ** 2 <= RSS_LIMIT_GB, "stdout": proc.stdout.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/anima-npu"), help="where the checkpoint lives")
    ap.add_argument("--resolution", default="512x512")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-blocks", default="0,13,27", help="blocks whose branches verify scores in isolation")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "model_core.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from models.runtime.dit_runner import DiTRunner
    from models.packs.pack import load_pack
    from models.runtime.verify import random_inputs, verify_pack

    result = {"resolution": args.resolution, "dtype": args.dtype, "threads": args.threads, "cpus": os.cpu_count(),
              "load_avg_start": os.getloadavg()}
    cache = Path(args.cache)
    ckpt, synth_s = ensure_checkpoint(cache, args.seed)
    result["checkpoint"] = {"path": str(ckpt), "bytes": ckpt.stat().st_size, "synth_s": synth_s}
    # 1) pack build (child process)
    pack_dir = cache / f"pack-full-{args.seed}-{args.resolution}-{args.dtype}"
    log.info("building %s ...", pack_dir)
    result["build"] = build_in_child(ckpt, pack_dir, args.resolution, args.dtype)
    b = result["build"]
    print(f"\npack build: {b['wall_s']:.1f} s, peak RSS {b['peak_rss_gb']:.2f} GB (limit {RSS_LIMIT_GB} GB), "
          f"pack {b['pack_bytes'] / 1e9:.2f} GB")
    # 2) one forward in process
    pack = load_pack(pack_dir)
    x, ctx = random_inputs(pack, args.seed)
    runner = DiTRunner(pack, threads=args.threads)
    v = runner.forward(x, 0.6, ctx)
    t = runner.last_timing
    print(f"\nforward {pack.geometry.width}x{pack.geometry.height} ({pack.geometry.tokens} tokens), {args.dtype}, "
          f"{len(t.branches)} branches, threads={args.threads or 'all'}:")
    print(t.table())
    result["forward"] = {**t.to_dict(), "v_finite": bool(np.isfinite(v).all()), "v_abs_max": float(np.abs(v).max())}
    del runner
    # 3) verify against the FP32 reference (reference forward + pack forward with isolated passes)
    if not args.skip_verify:
        t0 = time.perf_counter()
        rep = verify_pack(pack, checkpoint=str(ckpt), threads=args.threads, blocks=args.verify_blocks, seed=args.seed)
        print(f"\nverify ({time.perf_counter() - t0:.1f} s):")
        print(rep.table())
        result["verify"] = {**rep.to_dict(), "wall_s": time.perf_counter() - t0}
    result["load_avg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nJSON -> {out}")
    return 0 if (args.skip_verify or result["verify"]["ok"]) and b["rss_within_limit"] else 1


if __name__ == "__main__":
    sys.exit(main())
