"""`anima-models forward`: one DiT forward through a pack, in process (host ops + every branch in block order).

    anima-models forward packs/anima-512 --inputs in.npz --output out.npz [--backend onnx] [--threads 4]

IN.npz: x [16, h, w] f32, sigma (scalar), context [512, context_dim] f32. OUT.npz: v [16, h, w] f32.
"""
from __future__ import annotations

import logging

import numpy as np

from models.backends import backend_names
from models.durable import atomic_write

log = logging.getLogger(__name__)
INPUT_KEYS = ("x", "sigma", "context")


def add_arguments(p) -> None:
    p.add_argument("pack", help="pack folder (anima-models pack)")
    p.add_argument("--inputs", required=True, help="npz with x [16,h,w], sigma, context [512,Dc]")
    p.add_argument("--output", required=True, help="npz to write with v [16,h,w]")
    p.add_argument("--backend", default="onnx", choices=backend_names(), help="branch backend (default onnx)")
    p.add_argument("--threads", type=int, default=None, help="backend threads (default: all cores)")


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
    from models.dit_runner import DiTRunner
    arrs = read_inputs(args.inputs)
    runner = DiTRunner(args.pack, backend=args.backend, threads=args.threads)
    v = runner.forward(arrs["x"], float(arrs["sigma"].reshape(())), arrs["context"])
    atomic_write(args.output, lambda f: np.savez(f, v=v.astype(np.float32)))
    print(runner.last_timing.table())
    print(f"v {list(v.shape)} -> {args.output}")
    return 0
