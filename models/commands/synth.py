"""`anima-models synth {dit,te,vae,tokenizers,bundle}`: write synthetic checkpoints, tokenizers or a models folder.

    anima-models synth dit --preset tiny --seed 0 --out tiny-dit.safetensors [--prefix model.diffusion_model.]
    anima-models synth bundle --preset tiny --seed 0 --out models/
"""
from __future__ import annotations

import importlib
import logging
import os
import time

from models.cli import UserError
from models.config import DIT_PREFIXES, PRESETS

log = logging.getLogger(__name__)

WHAT = ("dit", "te", "vae", "tokenizers", "bundle")


def add_arguments(p) -> None:
    p.add_argument("what", choices=WHAT, help="which part to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="tiny (any machine) or full (official shapes)")
    p.add_argument("--seed", type=int, default=0, help="weights are a deterministic function of the seed")
    p.add_argument("--out", required=True, help="output file (dit, te, vae) or folder (tokenizers, bundle)")
    p.add_argument("--prefix", choices=DIT_PREFIXES, default="net.", help="DiT key prefix (dit only)")
    p.add_argument("--layout", choices=("original", "diffusers"), default="original", help="VAE key layout (vae only)")


def _call(module: str, func: str, *a):
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise UserError(f"{module} is not available in this installation ({e})") from None
        raise
    return getattr(mod, func)(*a)


def run(args) -> int:
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    out = os.path.abspath(args.out)
    parent = out if args.what in ("tokenizers", "bundle") else os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    t0 = time.monotonic()
    if args.what == "dit":
        from models.synth_dit import write_dit
        write_dit(args.preset, args.seed, out, args.prefix)
    elif args.what == "te":
        _call("models.text.synth", "write_te", args.preset, args.seed, out)
    elif args.what == "vae":
        _call("models.vae.synth", "write_vae", args.preset, args.seed, out, args.layout)
    elif args.what == "tokenizers":
        _call("models.text.synth", "write_tokenizers", args.preset, out)
    else:
        _call("models.models_dir", "write_bundle", args.preset, args.seed, out)
    print(f"wrote synthetic {args.what} ({args.preset}, seed {args.seed}) to {out} in {time.monotonic() - t0:.1f} s")
    return 0
