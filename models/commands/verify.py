"""`anima-models verify`: compare a pack's branches (isolated) and whole forward (cumulative) with the FP32 reference.

    anima-models verify packs/anima-512 [--checkpoint anima-preview.safetensors] [--json report.json]
                        [--backend onnx|rknn-sim|rknn|board-sim] [--blocks 0,5-7] [--seed 0]

Exit 0 when every row meets the marks of models.runtime.verify.THRESHOLDS for the pack's dtype, 1 when one does not.
"""
from __future__ import annotations

import json
import logging

from models.runtime.backends import backend_names
from models.base.durable import atomic_write
from models.runtime.verify import DEFAULT_SIGMA

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("pack", help="pack folder (anima-models pack)")
    p.add_argument("--checkpoint", default=None, help="DiT checkpoint (default: the one recorded in the manifest)")
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.add_argument("--backend", default="onnx", choices=backend_names(), help="branch backend (default onnx)")
    p.add_argument("--threads", type=int, default=None, help="backend threads (default: all cores)")
    p.add_argument("--blocks", default="all", help="blocks to report, e.g. 0,5-7 (default all; the forward always "
                                                   "runs every block)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random latent and context")
    p.add_argument("--sigma", type=float, default=DEFAULT_SIGMA, help=f"timestep (default {DEFAULT_SIGMA})")


def run(args) -> int:
    from models.runtime.verify import verify_pack
    report = verify_pack(args.pack, checkpoint=args.checkpoint, backend=args.backend, threads=args.threads,
                         blocks=args.blocks, seed=args.seed, sigma=args.sigma)
    print(report.table())
    if args.json:
        d = report.to_dict()
        if report.timing is not None:
            d["timing"] = report.timing.to_dict()
        atomic_write(args.json, json.dumps(d, indent=1))
    return 0 if report.ok else 1
