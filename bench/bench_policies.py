"""Benchmark (not a test): the lifecycle policies side by side, in process, on this machine's CPU (ONNX Runtime).

    .venv/bin/python bench/bench_policies.py                       # tiny model, 256x256, 1 thread -> bench/out/policies.json
    .venv/bin/python bench/bench_policies.py --resolution 512x512 --threads 2 --policies on-demand,prefetch2

Per policy, a fresh DiTRunner on the same pack runs `--forwards` CFG forwards (both passes) on the same inputs; the
last forward is reported: wall, pure inference, lifecycle visible on the critical path vs hidden behind other work,
host ops and the part of them that ran beside an inference (interleave), calls whose model was already loaded, resident
contexts, and whether the outputs equal on-demand's bitwise (they must). MEASURED on this x86 host with the tiny
synthetic model: the ratio of lifecycle to inference is nothing like the board's (see docs/board.md for the
board-paced figures); what transfers is which phases each policy hides.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.runtime.dit_runner import DiTRunner  # noqa: E402
from models.packs.pack import load_pack  # noqa: E402
from models.board.policy import parse_policy  # noqa: E402
from tests.pipeline_harness import tiny_assets  # noqa: E402

OUT = ROOT / "bench" / "out" / "policies.json"
DEFAULT = ("on-demand,prefetch,prefetch2,dual_core,interleave,resident,prefetch+interleave,resident+prefetch2,"
           "prefetch+dual_core")


def run_policy(pack, policy, inputs, threads: int, forwards: int) -> tuple:
    x, cond, uncond = inputs
    runner = DiTRunner(pack, threads=threads, policy=policy)
    try:
        outs = []
        for i in range(forwards):
            t0 = time.perf_counter()
            outs = runner.forward_cfg(x, 0.9 - 0.2 * i, cond, uncond)
            wall = time.perf_counter() - t0
        t = runner.last_timing
        lc = runner.branches.lifecycle
        sums = {k: v.to_dict() for k, v in t.per_kind.items()}
        row = {"policy": policy.name, "wall_s": wall, "infer_s": sum(s["infer_s"] for s in sums.values()),
               "visible_s": sum(s["visible_s"] for s in sums.values()),
               "hidden_s": sum(s["hidden_s"] for s in sums.values()),
               "host_s": t.host_s, "host_hidden_s": t.host_hidden_s, "calls": len(t.branches),
               "cached": sum(s["cached"] for s in sums.values()), "resident": len(lc.resident_paths),
               "resident_mb": lc.resident_mb, "per_kind": sums}
        return np.stack(outs), row
    finally:
        runner.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", default="256x256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--forwards", type=int, default=2, help="forwards per policy; the last one is reported")
    ap.add_argument("--policies", default=DEFAULT)
    ap.add_argument("--resident-mb", type=float, default=16.0)
    ap.add_argument("--cache", default=str(ROOT / "bench" / "out" / "cache-policies"))
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    w, h = (int(v) for v in args.resolution.lower().split("x"))
    _, pack_dir = tiny_assets(Path(args.cache), (w, h))
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    rng = np.random.default_rng(0)
    inputs = (rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w)).astype(np.float32),
              (rng.standard_normal((g.text_tokens, c.context_dim)) * 0.5).astype(np.float32),
              np.zeros((g.text_tokens, c.context_dim), np.float32))
    rows, ref = [], None
    print(f"MEASURED on this host ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}), tiny model {w}x{h} ({g.tokens} tokens), {args.threads} thread(s); "
          f"last of {args.forwards} forwards (both CFG passes)")
    hdr = (f"{'policy':<28}{'wall s':>8}{'infer s':>9}{'visible s':>10}{'hidden s':>9}{'host s':>8}"
           f"{'host hid s':>11}{'cached':>8}{'resident':>9}  bitwise")
    print(hdr)
    for name in args.policies.split(","):
        policy = parse_policy(name, {"resident_mb": args.resident_mb})
        v, row = run_policy(pack, policy, inputs, args.threads, args.forwards)
        ref = v if ref is None else ref
        row["bitwise_equal_first"] = bool(np.array_equal(v, ref))
        rows.append(row)
        print(f"{row['policy']:<28}{row['wall_s']:>8.2f}{row['infer_s']:>9.2f}{row['visible_s']:>10.2f}"
              f"{row['hidden_s']:>9.2f}{row['host_s']:>8.3f}{row['host_hidden_s']:>11.3f}"
              f"{row['cached']:>5}/{row['calls']:<3}{row['resident']:>8}  {row['bitwise_equal_first']}")
    out = {"resolution": [w, h], "tokens": g.tokens, "threads": args.threads, "forwards": args.forwards,
           "first_policy": rows[0]["policy"], "load_avg": os.getloadavg(), "rows": rows, "measured": True}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"JSON -> {args.json}")
    return 0 if all(r["bitwise_equal_first"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
