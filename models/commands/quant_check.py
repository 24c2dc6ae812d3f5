"""`anima-models quant-check PACK --checkpoint CK --calib CALIB`: is this INT8 pack good enough to trust?

    anima-models quant-check packs/anima-512-w8a8 --checkpoint anima.safetensors --calib calib/anima-512 \\
        [--steps 20] [--seed 0] [--json report.json]

Every branch in the rknn-toolkit2 simulator against the FP32 reference on held-out calibration inputs (a cosine
table), then a whole job's final latent against a FP16 pack's. The last line is
`quant-check branches=N worst_cos=X mean_cos=Y final_cos=Z`; docs/quant.md says how to read it.
"""
from __future__ import annotations

import json

from models.base.durable import atomic_write


def add_arguments(p) -> None:
    p.add_argument("pack", help="a W8A8 pack (anima-models pack --quant w8a8)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint the pack was built from (the FP32 reference)")
    p.add_argument("--calib", required=True, help="its calibration folder (held-out inputs are compared on)")
    p.add_argument("--steps", type=int, default=20, help="steps of the whole-job check (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the whole-job check")
    p.add_argument("--cfg", type=float, default=4.0, help="CFG scale of the whole-job check (default 4)")
    p.add_argument("--jobs", type=int, default=2, help="branches built in the simulator at once (default 2)")
    p.add_argument("--toolkit-venv", default=None, help="rknn-toolkit2 environment (as for compile)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


def run(args) -> int:
    from models.runtime.quant_check import describe, quant_check
    if args.steps < 1 or args.jobs < 1 or args.seed < 0:
        raise ValueError("--steps and --jobs must be >= 1, --seed >= 0")
    from models.rknn.client import ToolkitError
    try:
        rep = quant_check(args.pack, args.checkpoint, args.calib, steps=args.steps, seed=args.seed,
                          cfg_scale=args.cfg, venv=args.toolkit_venv, jobs=args.jobs)
    except ToolkitError as e:                # no toolkit environment, or a build it refused: exit 2, no traceback
        raise ValueError(f"--toolkit-venv: {e.args[0]}") from None
    if args.json:
        atomic_write(args.json, json.dumps(rep, indent=1) + "\n")
    print(describe(rep))
    return 0
