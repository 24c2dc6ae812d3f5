"""`anima-models forward`: one DiT forward through a pack, in process (host ops + every branch in block order).

    anima-models forward packs/anima-512 --inputs in.npz --output out.npz [--backend onnx] [--threads 4]
    anima-models forward packs/anima-512-lora32 --inputs in.npz --output out.npz --lora style.safetensors:0.8

IN.npz: x [16, h, w] f32, sigma (scalar), context [512, context_dim] f32. OUT.npz: v [16, h, w] f32.
--lora (repeatable) applies LoRAs at run time: host layers merged in FP32, branch layers through a LoRA-ready pack's
low-rank inputs (docs/lora.md); the LLM adapter's and text encoder's layers do not take part in a DiT forward.
"""
from __future__ import annotations

import logging

import numpy as np

from models.runtime.backends import backend_names
from models.base.durable import atomic_write

log = logging.getLogger(__name__)
INPUT_KEYS = ("x", "sigma", "context")


def add_arguments(p) -> None:
    p.add_argument("pack", help="pack folder (anima-models pack)")
    p.add_argument("--inputs", required=True, help="npz with x [16,h,w], sigma, context [512,Dc]")
    p.add_argument("--output", required=True, help="npz to write with v [16,h,w]")
    p.add_argument("--backend", default="onnx", choices=backend_names(), help="branch backend (default onnx)")
    p.add_argument("--threads", type=int, default=None, help="backend threads (default: all cores)")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="apply a LoRA at run time (repeatable; strength default 1.0)")
    p.add_argument("--lora-overflow", choices=("refuse", "svd"), default="refuse",
                   help="stacked LoRA rank over the pack's: refuse (default) or reduce by SVD, reporting the error")


def read_inputs(path: str) -> dict:
    """The three arrays of an inputs npz, with a clear error naming a missing or malformed one."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in INPUT_KEYS if k not in z.files]
            if missing:
                raise ValueError(f"{path}: missing array(s) {missing}; it has {sorted(z.files)}")
            arrs = {k: z[k] for k in INPUT_KEYS}
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such inputs file") from None
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(path):
            raise
        raise ValueError(f"{path}: not a readable .npz ({e})") from None
    if arrs["sigma"].size != 1:
        raise ValueError(f"{path}: sigma must be a scalar, got shape {list(arrs['sigma'].shape)}")
    for k in ("x", "context"):
        if not np.issubdtype(arrs[k].dtype, np.floating):
            raise ValueError(f"{path}: {k} must be floating point, got {arrs[k].dtype}")
    return arrs


def run(args) -> int:
    from models.runtime.dit_runner import DiTRunner
    arrs = read_inputs(args.inputs)
    runner = DiTRunner(args.pack, backend=args.backend, threads=args.threads)
    if args.lora:
        from models.lora import TargetTable, parse_lora_arg, plan_loras
        from models.dit.config import expected_dit_shapes
        plan = plan_loras([parse_lora_arg(a) for a in args.lora], TargetTable(expected_dit_shapes(runner.cfg)))
        applied = runner.set_lora(plan, args.lora_overflow)
        for rep in plan.report():
            print(f"LoRA {rep['name']} x {rep['strength']:g}: {rep['layers']}"
                  + (f" (not part of a DiT forward: {rep['not_applied']})" if rep["not_applied"] else ""))
    v = runner.forward(arrs["x"], float(arrs["sigma"].reshape(())), arrs["context"])
    if args.lora and applied.svd_errors:
        print(f"LoRA rank reduced by SVD in {len(applied.svd_errors)} layers, relative error up to "
              f"{max(applied.svd_errors.values()):.2%}")
    atomic_write(args.output, lambda f: np.savez(f, v=v.astype(np.float32)))
    print(runner.last_timing.table())
    print(f"v {list(v.shape)} -> {args.output}")
    return 0
