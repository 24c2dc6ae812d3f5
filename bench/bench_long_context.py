"""What a long-context pack costs: one full-size cross-attention branch (Anima 2B shapes, block 0 of the synthetic
full checkpoint's weights) at 512 context rows (the default pack, no mask) vs longer contexts (mask input), measured
with ONNX Runtime on this machine: graph file size, load / init / infer (both CFG passes) / release.

    .venv/bin/python bench/bench_long_context.py [--contexts 512,1024] [--dtype fp16] [--threads 2] [--repeat 3]
        [--resolution 512x512] [--json bench/out/long_context.json]

Not a test. Only the cross branch depends on the context length (self-attention, FFN and the host weights are the
same files), so the pack grows by 28 x the cross-branch difference printed here. Weights: the full preset's cross
attention of block 0, made the way `anima-models synth` makes them (bf16, seeded); timings: the median of --repeat
runs of the on-demand lifecycle (load, init, infer cond + uncond, release), as the executor runs it, the contexts taking
turns after one warm-up run each (this machine is shared: the load average is printed).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("bench_long_context")


def cross_weights(seed: int = 0) -> tuple:
    from models.dit.config import PRESETS
    from models.base.safetensors_io import bf16_to_f32
    from models.dit.synth import dit_entries
    want = "net.blocks.0.cross_attn."
    w = {e.name[len(want):]: bf16_to_f32(e.data()) for e in dit_entries("full", seed) if e.name.startswith(want)}
    return w, PRESETS["full"]["dit"]


def prepare(w, cfg, resolution, context: int, dtype: str, folder: Path) -> dict:
    """Build and write the cross graph for `context` rows; its two CFG passes' feeds."""
    from models.packs.branch_graphs import build_branch, serialize
    from models.dit.partition import NUMPY_DTYPES, Geometry, context_mask, pack_io_dtype, resolve
    geom = Geometry.from_resolution(*resolution, text_tokens=context)
    t0 = time.perf_counter()
    data = serialize(build_branch("cross", w, cfg, geom, dtype, block=0))
    build_s = time.perf_counter() - t0
    path = folder / f"cross_{context}.onnx"
    path.write_bytes(data)
    io = NUMPY_DTYPES[pack_io_dtype(dtype)]
    rng = np.random.default_rng(1)
    passes = []
    for rows in (min(context, 600), 512):               # cond: a long prompt where it fits; uncond: a short one
        feed = {"xn": rng.standard_normal((geom.tokens, cfg.width)).astype(io),
                "context": rng.standard_normal((context, cfg.context_dim)).astype(io)}
        if geom.long_context:
            feed["context_mask"] = context_mask(rows, context, io)
        passes.append(feed)
    assert [i["name"] for i in resolve("cross", cfg, geom, dtype)["inputs"]] == list(passes[0])
    return {"context": context, "mask_input": geom.long_context, "bytes": len(data), "build_s": round(build_s, 3),
            "path": path, "passes": passes, "runs": []}


def lifecycle(backend, case: dict) -> dict:
    from models.runtime.lifecycle import run_branch
    _, t = run_branch(backend, case["path"], case["passes"])
    return {"load_s": t.load_s, "init_s": t.init_s, "infer_s": t.npu_s, "release_s": t.release_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,1024", help="comma-separated context row counts (first = baseline)")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    ap.add_argument("--resolution", default="512x512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="bench/out/long_context.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from models.dit.partition import parse_resolution
    resolution = parse_resolution(a.resolution)
    contexts = [int(c) for c in a.contexts.split(",")]
    w, cfg = cross_weights()
    from models.runtime.backends import make_backend
    backend = make_backend("onnx", threads=a.threads)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="anima-longctx-") as d:
        cases = [prepare(w, cfg, resolution, c, a.dtype, Path(d)) for c in contexts]
        for case in cases:                               # warm-up (first session, page cache), not counted
            lifecycle(backend, case)
        for r in range(a.repeat):                        # round-robin: load changes hit every context alike
            for case in cases:
                case["runs"].append(lifecycle(backend, case))
                log.info("round %d, context %d: infer %.3f s", r + 1, case["context"], case["runs"][-1]["infer_s"])
    rows = []
    for case in cases:
        med = {k: round(statistics.median(x[k] for x in case["runs"]), 4) for k in case["runs"][0]}
        rows.append({k: v for k, v in case.items() if k not in ("path", "passes")} | med)
    load1 = os.getloadavg()[0]
    base = rows[0]
    print(f"\ncross-attention branch, full size, {a.resolution}, {a.dtype}, ONNX Runtime {a.threads} threads, "
          f"median of {a.repeat} round-robin rounds after a warm-up (measured on this machine, load average "
          f"{load0:.1f} -> {load1:.1f})")
    print(f"{'context':>8} {'mask':>5} {'file bytes':>11} {'+bytes':>7} {'load s':>7} {'init s':>7} "
          f"{'infer s (2 passes)':>18} {'release s':>9} {'infer x':>8}")
    for r in rows:
        print(f"{r['context']:>8} {str(r['mask_input']):>5} {r['bytes']:>11} {r['bytes'] - base['bytes']:>7} "
              f"{r['load_s']:>7.3f} {r['init_s']:>7.3f} {r['infer_s']:>18.3f} {r['release_s']:>9.3f} "
              f"{r['infer_s'] / base['infer_s']:>8.2f}")
    print("pack size: only the 28 cross graphs change, by 28 x the +bytes above; weights are the same")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"resolution": a.resolution, "dtype": a.dtype, "threads": a.threads,
                               "repeat": a.repeat, "loadavg": [load0, load1], "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
