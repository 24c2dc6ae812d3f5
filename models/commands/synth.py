"""`anima-models synth {dit,te,vae,tokenizers,bundle,lora}`: write synthetic checkpoints, tokenizers, a models folder
or a LoRA.

    anima-models synth dit --preset tiny --seed 0 --out tiny-dit.safetensors [--prefix model.diffusion_model.]
    anima-models synth dit --preset tiny --outliers --blocks 2 --out outliers.safetensors   # INT8 stand-in
    anima-models synth bundle --preset tiny --seed 0 --out models/
    anima-models synth lora --preset tiny --seed 1 --out models/loras/style.safetensors --layout kohya --rank 8 \
        --alpha 4 --groups blocks,host,adapter,te
    anima-models synth lora --preset tiny --seed 2 --out models/loras/lokr.safetensors --layout lokr --rank 4
"""
from __future__ import annotations

import logging
import os
import time

from models.base.lazy import import_target
from models.commands import UserError
from models.dit.config import DIT_PREFIXES, PRESETS

log = logging.getLogger(__name__)

WHAT = ("dit", "te", "vae", "tokenizers", "bundle", "lora")
VAE_LAYOUTS = ("original", "diffusers")
LORA_LAYOUTS = ("kohya", "comfy", "bare", "peft-default", "diffusers-proc", "diffusers-lora", "transformers", "turbo",
                "lokr", "loha")                              # models.lora.synth.LAYOUTS (tests/test_lora_layouts.py)


def add_arguments(p) -> None:
    p.add_argument("what", choices=WHAT, help="which part to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="tiny (any machine), small (the smallest ComfyUI loads: a 10-block DiT, full-size text encoder and VAE) or full (official shapes)")
    p.add_argument("--seed", type=int, default=0, help="weights are a deterministic function of the seed")
    p.add_argument("--out", required=True, help="output file (dit, te, vae) or folder (tokenizers, bundle)")
    p.add_argument("--prefix", choices=DIT_PREFIXES, default="net.", help="DiT key prefix (dit only)")
    p.add_argument("--layout", choices=VAE_LAYOUTS + LORA_LAYOUTS, default=None,
                   help="key layout: vae original (default) | diffusers; lora kohya (default) | comfy | bare | "
                        "peft-default | diffusers-proc | diffusers-lora | transformers | turbo (the official Turbo "
                        "LoRA's layout: docs/lora.md) | lokr | loha (LyCORIS)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (lora only)")
    p.add_argument("--alpha", default=None, help="LoRA alpha (lora only; default rank / 2, 'none' for no alpha)")
    p.add_argument("--groups", default=None, help="LoRA targets, comma-separated: blocks (sd-scripts' default), "
                   "host, modulation, adapter, te (lora only; default blocks, turbo blocks,modulation,adapter)")
    p.add_argument("--outliers", action="store_true", help="dit only: a few modulated channels 35-90x the median "
                   "magnitude at every token and step, a stand-in for a real checkpoint's statistics (docs/quant.md)")
    p.add_argument("--blocks", type=int, default=0, help="dit only: keep the first N blocks (default all)")
    p.add_argument("--dtype", choices=("BF16", "F16", "F32"), default="BF16", help="LoRA weight dtype (lora only)")


def _call(target: str, *a):
    module = target.partition(":")[0]
    try:
        fn = import_target(target)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise UserError(f"{module} is not available in this installation ({e})") from None
        raise
    return fn(*a)


def _layout(args) -> str:
    allowed = LORA_LAYOUTS if args.what == "lora" else VAE_LAYOUTS
    if args.layout is None:
        return allowed[0]
    if args.layout not in allowed:
        raise UserError(f"--layout {args.layout}: synth {args.what} takes one of {', '.join(allowed)}")
    return args.layout


def _lora(args, out: str) -> None:
    from models.lora.synth import DEFAULT_GROUPS, write_lora
    if args.rank < 1:
        raise UserError(f"--rank must be >= 1, got {args.rank}")
    layout = _layout(args)
    if args.alpha is None:
        alpha = None if layout == "turbo" else args.rank / 2      # the published Turbo LoRA has no alpha
    elif str(args.alpha).lower() == "none":
        alpha = None
    else:
        try:
            alpha = float(args.alpha)
        except ValueError:
            raise UserError(f"--alpha {args.alpha!r}: a number or 'none'") from None
    if args.groups is None:
        groups = DEFAULT_GROUPS.get(layout, ("blocks",))
    else:
        groups = tuple(g.strip() for g in args.groups.split(",") if g.strip())
    write_lora(args.preset, args.seed, out, layout, args.rank, alpha, groups, args.dtype)


def run(args) -> int:
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    out = os.path.abspath(args.out)
    parent = out if args.what in ("tokenizers", "bundle") else os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    t0 = time.monotonic()
    if args.what == "dit":
        from models.dit.synth import write_dit
        if args.blocks < 0:
            raise UserError(f"--blocks must be >= 0, got {args.blocks}")
        write_dit(args.preset, args.seed, out, args.prefix, outliers=args.outliers, blocks=args.blocks)
    elif args.what == "te":
        _call("models.text.synth:write_te", args.preset, args.seed, out)
    elif args.what == "vae":
        _call("models.vae.synth:write_vae", args.preset, args.seed, out, _layout(args))
    elif args.what == "tokenizers":
        _call("models.text.synth:write_tokenizers", args.preset, out)
    elif args.what == "lora":
        _lora(args, out)
    else:
        _call("models.setup.models_dir:write_bundle", args.preset, args.seed, out)
    print(f"wrote synthetic {args.what} ({args.preset}, seed {args.seed}) to {out} in {time.monotonic() - t0:.1f} s")
    return 0
