"""Sharded branch graphs through the rknn-toolkit2 compiler and its simulator (.venv-rknn): every kind x cut at N
shards, built and run like `anima-models verify --backend rknn-sim` runs a branch, combined as the executor
combines them (FP32), against the one-graph branch in the same simulator and against FP32 ONNX Runtime.

    .venv/bin/python bench/shards_sim.py [--shards 3] [--dtype fp16] [--config tiny] [--resolution 128x128]

Prints one row per kind x cut: cos and max |diff| of the combined shards against the one graph (both simulated) and
against the FP32 reference, and the operators the compiler placed on the CPU (none expected); exits 1 when a row is
below the marks of the pack's dtype (models/runtime/verify.py). Measured here (x86): numbers of the simulator, not a board.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.packs.branch_graphs import build_branch, serialize  # noqa: E402
from models.dit.config import PRESETS  # noqa: E402
from models.dit.partition import KINDS, Geometry, parse_resolution, resolve  # noqa: E402
from models.dit.rope import rope_tables  # noqa: E402
from models.dit.shards import CUTS, combine, plan, shard_feed, shard_weights  # noqa: E402

MARKS = {"fp16": 0.9999, "fp32": 0.9999999}     # cos of the combined shards against the one graph


def weights(cfg, kind, rng) -> dict:
    D, hd, F, Dc = cfg.width, cfg.head_dim, cfg.ffn_width, cfg.context_dim
    kv = Dc if kind == "cross" else D
    shapes = {"layer1.weight": (F, D), "layer2.weight": (D, F)} if kind == "ffn" else {
        "q_proj.weight": (D, D), "k_proj.weight": (D, kv), "v_proj.weight": (D, kv), "output_proj.weight": (D, D),
        "q_norm.weight": (hd,), "k_norm.weight": (hd,)}
    return {k: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) if len(s) == 2
            else (1 + 0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def feed(cfg, geom, kind, dtype, rng) -> dict:
    cos, sin = rope_tables(geom.h_tokens, geom.w_tokens, cfg.head_dim)
    np_dt = np.float16 if dtype == "fp16" else np.float32
    out = {}
    for spec in resolve(kind, cfg, geom, dtype)["inputs"]:
        a = {"rope_cos": cos, "rope_sin": sin}.get(spec["name"])
        out[spec["name"]] = (a if a is not None else rng.standard_normal(spec["shape"])).astype(np_dt)
    return out


def cos_sim(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def run_graph(backend, model, f, tmp: Path, name: str) -> tuple:
    """(the simulator's y, the operators its build log placed on the CPU)."""
    from models.rknn.buildlog import parse_build_log
    path = tmp / f"{name}.onnx"
    path.write_bytes(serialize(model))
    backend.load(path)
    backend.init()
    try:
        y = backend.infer(f)["y"]
    finally:
        backend.release()
    built = backend.log_dir / f"{name}.build.log"
    return y, parse_build_log(built.read_text(errors="replace")).cpu_op_names() if built.is_file() else ["(no log)"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--dtype", default="fp16", choices=sorted(MARKS))
    ap.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--resolution", default="128x128")
    ap.add_argument("--venv", default=str(ROOT / ".venv-rknn"))
    args = ap.parse_args(argv)
    import onnxruntime as ort
    from models.runtime.backends.rknn_sim import RknnSimBackend
    cfg = PRESETS[args.config]["dit"]
    geom = Geometry.from_resolution(*parse_resolution(args.resolution))
    rng = np.random.default_rng(0)
    ok, t0 = True, time.perf_counter()
    print(f"{'kind':<6}{'cut':<7}{'cos vs one graph':>17}{'max|d|':>10}{'cos vs FP32':>12}{'CPU ops':>9}"
          f"  [rknn-toolkit2 simulator, {args.dtype}, {args.shards} shards, {args.config} {args.resolution}; "
          "measured here]")
    with tempfile.TemporaryDirectory(prefix="shards-sim-") as d:
        tmp = Path(d)
        sim = RknnSimBackend(venv=args.venv, log_dir=tmp / "logs")
        for kind in KINDS:
            w, f = weights(cfg, kind, rng), feed(cfg, geom, kind, args.dtype, rng)
            whole, cpu = run_graph(sim, build_branch(kind, w, cfg, geom, args.dtype, 0), f, tmp, f"{kind}")
            f32 = {k: v.astype(np.float32) for k, v in f.items()}
            sess = ort.InferenceSession(serialize(build_branch(kind, w, cfg, geom, "fp32", 0)),
                                        providers=["CPUExecutionProvider"])
            names = {i.name for i in sess.get_inputs()}
            ref = sess.run(None, {k: v for k, v in f32.items() if k in names})[0]
            for cut in CUTS:
                specs = plan(kind, cut, args.shards, cfg, geom)
                outs, ops = [], list(cpu)
                for s in specs:
                    y, o = run_graph(sim, build_branch(kind, shard_weights(s, w), cfg, geom, args.dtype, 0, shard=s),
                                     shard_feed(s, f), tmp, f"{kind}.{cut}.s{s.index}")
                    outs.append(y)
                    ops += o
                got = combine(specs, outs)
                c1, c2 = cos_sim(got, whole), cos_sim(got, ref)
                diff = float(np.abs(got - whole.astype(np.float32)).max())
                good = c1 >= MARKS[args.dtype] and c2 >= MARKS[args.dtype] and not ops
                ok &= good
                print(f"{kind:<6}{cut:<7}{c1:>17.9f}{diff:>10.2e}{c2:>12.9f}{len(ops):>9}"
                      f"{'' if good else '  BELOW THE MARK'}")
    print(f"shards-sim {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
