"""What a LoRA costs, measured here and modelled for the board: one block's three branches at full size (Anima 2B
shapes, block 0 of the synthetic full checkpoint), 512x512, on ONNX Runtime: a plain graph, LoRA-ready graphs at
each --ranks R (a synthetic full-size LoRA of rank R as their inputs), and a plain graph with that LoRA baked in.

    .venv/bin/python bench/lora_cost.py [--ranks 16,32,64] [--dtype fp16] [--threads 2] [--repeat 3]
        [--json bench/out/lora_cost.json]

Not a test. Per graph: file bytes, load / init / infer (both CFG passes) / release (the on-demand lifecycle as the
executor runs it; median of --repeat round-robin rounds after a warm-up; this machine is shared, the load average
is printed); the bytes of the low-rank inputs each inference carries; the host's work per branch call (laying out a
LoRA's factors: made once per job and kept, models/lora/apply.py) and per job (merging the host layers). A forward is
projected as 28 x the block (every block has the same shapes). The board's figures are MODELLED by models/board
(cost.toml's reference figures; the low-rank FLOPs at each branch's own rate), never measured.
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

log = logging.getLogger("lora_cost")
KINDS = ("self", "cross", "ffn")
MODULES = {"self": "self_attn", "cross": "cross_attn", "ffn": "mlp"}


def block0(seed: int) -> dict:
    """{kind: {weight suffix: f32}} of block 0 and the host weights, as `anima-models synth` makes them (bf16)."""
    from models.dit.host_ops import host_keys
    from models.dit.config import PRESETS
    from models.base.safetensors_io import bf16_to_f32
    from models.dit.synth import dit_entries
    host = set(host_keys(PRESETS["full"]["dit"]))
    out = {k: {} for k in KINDS}
    out["host"] = {}
    for e in dit_entries("full", seed):
        key = e.name[len("net."):]
        for kind in KINDS:
            p = f"blocks.0.{MODULES[kind]}."
            if key.startswith(p):
                out[kind][key[len(p):]] = bf16_to_f32(e.data())
        if key in host:
            out["host"][key] = bf16_to_f32(e.data())
    return out


def feeds(kind: str, cfg, geom, dtype: str, lora: dict, rng) -> list:
    """Both CFG passes' inputs of one branch (xn per pass, the rest shared), LoRA inputs from `lora`."""
    from models.dit.partition import NUMPY_DTYPES, branch_inputs, branch_spec, pack_io_dtype
    from models.dit.rope import rope_tables
    io = NUMPY_DTYPES[pack_io_dtype(dtype)]
    cos, sin = rope_tables(geom.h_tokens, geom.w_tokens, cfg.head_dim)
    shared = {"rope_cos": cos.astype(io), "rope_sin": sin.astype(io),
              "context": rng.standard_normal((geom.text_tokens, cfg.context_dim)).astype(io), **lora}
    names = [i.name for i in branch_inputs(branch_spec(kind), geom)]
    return [{n: (rng.standard_normal((geom.tokens, cfg.width)).astype(io) if n == "xn" else shared[n])
             for n in names} for _ in range(2)]


def lifecycle(backend, path, passes) -> dict:
    from models.runtime.lifecycle import run_branch
    _, t = run_branch(backend, path, passes)
    return {"load_s": t.load_s, "init_s": t.init_s, "infer_s": t.npu_s, "release_s": t.release_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="16,32,64", help="comma-separated LoRA ranks (the LoRA-ready graphs' R)")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    ap.add_argument("--resolution", default="512x512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/out/lora_cost.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from models.runtime.backends import make_backend
    from models.board.cost import BoardModel, Shape
    from models.packs.branch_graphs import build_branch, serialize
    from models.dit.config import PRESETS, expected_dit_shapes
    from models.lora import LoraUse, TargetTable, plan_loras
    from models.lora.apply import DitLora
    from models.lora.synth import write_lora
    from models.dit.partition import Geometry, parse_resolution
    cfg = PRESETS["full"]["dit"]
    resolution = parse_resolution(a.resolution)
    ranks = [int(r) for r in a.ranks.split(",")]
    t0 = time.perf_counter()
    w = block0(a.seed)
    log.info("block 0 and host weights made in %.1f s", time.perf_counter() - t0)
    table = TargetTable(expected_dit_shapes(cfg))
    backend = make_backend("onnx", threads=a.threads)
    rng = np.random.default_rng(1)
    load0 = os.getloadavg()[0]
    cases, host_rows = [], []
    with tempfile.TemporaryDirectory(prefix="anima-lora-cost-") as d:
        d = Path(d)

        def graph(kind, geom, weights, name, lora_feed):
            data = serialize(build_branch(kind, weights, cfg, geom, a.dtype, block=0))
            path = d / f"{name}_{kind}.onnx"
            path.write_bytes(data)
            lora_bytes = sum(v.nbytes for v in lora_feed.values())
            cases.append({"case": name, "kind": kind, "rank": geom.lora_rank, "bytes": len(data), "path": path,
                          "lora_input_bytes": lora_bytes, "passes": feeds(kind, cfg, geom, a.dtype, lora_feed, rng),
                          "runs": []})

        plain = Geometry.from_resolution(*resolution)
        for kind in KINDS:
            graph(kind, plain, w[kind], "plain", {})
        for R in ranks:
            lora = d / f"lora{R}.safetensors"
            write_lora("full", a.seed + R, lora, "kohya", rank=R, alpha=R / 2, groups=("blocks", "host"))
            plan = plan_loras([LoraUse(str(lora), 1.0)], table)
            geom = Geometry.from_resolution(*resolution, lora_rank=R)
            applied = DitLora(plan, cfg, geom, a.dtype, cache_mb=0)
            t = time.perf_counter()
            merged_host = applied.host_weights(w["host"])
            host_merge_s = time.perf_counter() - t
            prep = {}
            for kind in KINDS:
                t = time.perf_counter()
                lora_feed = applied.branch_inputs(0, kind)
                prep[kind] = time.perf_counter() - t
                graph(kind, geom, w[kind], f"rank{R}", lora_feed)
                if R == ranks[-1]:                    # the same LoRA baked into a plain graph
                    p = f"blocks.0.{MODULES[kind]}."
                    baked = {k: plan.merged(p + k, v) if p + k in plan.targets else v for k, v in w[kind].items()}
                    graph(kind, plain, baked, f"baked{R}", {})
            host_rows.append({"rank": R, "host_merge_s": host_merge_s,
                              "host_layers": len([k for k in plan.keys("host") if k in merged_host]),
                              "factor_layout_s": prep, "lora_file_bytes": lora.stat().st_size})
            del merged_host, plan, applied
        for case in cases:                                # warm-up (first session, page cache), not counted
            lifecycle(backend, case["path"], case["passes"])
        for r in range(a.repeat):                         # round-robin: load changes hit every case alike
            for case in cases:
                case["runs"].append(lifecycle(backend, case["path"], case["passes"]))
            log.info("round %d of %d done", r + 1, a.repeat)
    load1 = os.getloadavg()[0]
    rows = []
    for case in cases:
        med = {k: statistics.median(x[k] for x in case["runs"]) for k in case["runs"][0]}
        # the fastest round: the one least disturbed by the machine's other work (the median carries its noise)
        best = {"min_" + k: min(x[k] for x in case["runs"]) for k in ("infer_s",)}
        rows.append({k: v for k, v in case.items() if k not in ("path", "passes", "runs")} | med | best)
    by = {(r["case"], r["kind"]): r for r in rows}
    names = ["plain"] + [f"rank{R}" for R in ranks] + [f"baked{ranks[-1]}"]
    print(f"\none block's branches, full size, {a.resolution}, {a.dtype}, ONNX Runtime {a.threads} threads, median of "
          f"{a.repeat} round-robin rounds after a warm-up (measured on this machine, load average {load0:.1f} -> "
          f"{load1:.1f})")
    from models.board.cost import branch_flops
    print(f"{'case':<8} {'kind':<6} {'file MB':>8} {'load s':>7} {'init s':>7} {'infer s (2 passes)':>19} "
          f"{'fastest':>8} {'release s':>9} {'LoRA in KB/inference':>21} {'FLOPs x plain':>14}")
    for n in names:
        for kind in KINDS:
            r = by[(n, kind)]
            sh = Shape(cfg.width, cfg.heads, cfg.head_dim, cfg.ffn_width, cfg.context_dim, 28, 1024, 512, r["rank"])
            fl = sum(branch_flops(kind, sh).values()) / sum(branch_flops(kind, Shape(
                cfg.width, cfg.heads, cfg.head_dim, cfg.ffn_width, cfg.context_dim, 28, 1024)).values())
            r["flops_x_plain"] = fl
            print(f"{n:<8} {kind:<6} {r['bytes'] / 1e6:>8.2f} {r['load_s']:>7.3f} {r['init_s']:>7.3f} "
                  f"{r['infer_s']:>19.3f} {r['min_infer_s']:>8.3f} {r['release_s']:>9.3f} "
                  f"{r['lora_input_bytes'] / 1024:>21.1f} {fl:>14.4f}")
    print(f"\nper forward (both CFG passes, 28 x the block), measured here:")
    print(f"{'case':<8} {'infer s':>9} {'x plain':>8} {'fastest s':>10} {'x plain':>8} {'lifecycle s':>12} "
          f"{'total s':>9} {'LoRA input MB':>14}")
    summary = []
    base = None
    for n in names:
        inf = 28 * sum(by[(n, k)]["infer_s"] for k in KINDS)
        fast = 28 * sum(by[(n, k)]["min_infer_s"] for k in KINDS)
        life = 28 * sum(by[(n, k)][p] for k in KINDS for p in ("load_s", "init_s", "release_s"))
        mb = 28 * 2 * sum(by[(n, k)]["lora_input_bytes"] for k in KINDS) / 2**20
        base = base or (inf, fast)
        summary.append({"case": n, "infer_s": inf, "fastest_infer_s": fast, "lifecycle_s": life,
                        "lora_input_mb_per_forward": mb})
        print(f"{n:<8} {inf:>9.2f} {inf / base[0]:>8.3f} {fast:>10.2f} {fast / base[1]:>8.3f} {life:>12.2f} "
              f"{inf + life:>9.2f} {mb:>14.1f}")
    print("\nhost work (this machine): laying out one branch's factors (once per job, kept) and merging the host layers "
          "(once per job)")
    for h in host_rows:
        print(f"rank {h['rank']:>3}: factors self {h['factor_layout_s']['self'] * 1e3:.1f} ms, cross "
              f"{h['factor_layout_s']['cross'] * 1e3:.1f} ms, ffn {h['factor_layout_s']['ffn'] * 1e3:.1f} ms per "
              f"branch (x28 per job); {h['host_layers']} host layers merged in {h['host_merge_s']:.2f} s; LoRA file "
              f"{h['lora_file_bytes'] / 1e6:.0f} MB")
    plain_board = BoardModel(Shape(cfg.width, cfg.heads, cfg.head_dim, cfg.ffn_width, cfg.context_dim, 28, 1024))
    print(f"\nthe board per computed step, MODELLED (models/board, {plain_board.source}; the low-rank FLOPs at each "
          "branch's own rate; input bytes not priced by the model yet):")
    board = []
    for R in [0] + ranks:
        m = BoardModel(Shape(cfg.width, cfg.heads, cfg.head_dim, cfg.ffn_width, cfg.context_dim, 28, 1024, 512, R))
        parts = m.step_parts()
        board.append({"rank": R, **parts, "step_s": sum(parts.values())})
        print(f"rank {R:>3}: NPU {parts['npu_s']:.2f} s, lifecycle {parts['lifecycle_s']:.2f} s, step "
              f"{sum(parts.values()):.2f} s ({sum(parts.values()) / plain_board.on_demand_step_s():.3f} x plain), "
              f"modelled")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"resolution": a.resolution, "dtype": a.dtype, "threads": a.threads,
                               "repeat": a.repeat, "loadavg": [load0, load1], "rows": rows, "per_forward": summary,
                               "host": host_rows, "board_modelled": board}, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
