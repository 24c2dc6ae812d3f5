"""`anima-models encode`: prompt (and negative prompt) -> text context CTX.npz with `cond`, `uncond` [512, Dc] f32.

    anima-models encode --models MODELS --prompt "1girl, (blue eyes:1.2)" --negative "lowres" --out ctx.npz
    anima-models encode --qwen TE.safetensors --dit DIT.safetensors --qwen-tokenizer DIR --t5-tokenizer DIR \\
        --prompt "..." --out ctx.npz --threads 4
    anima-models encode --backend onnx --pack packs/encoder --prompt "..." --out ctx.npz     # no torch needed
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from models.commands import UserError
from models.base.durable import atomic_write

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--models", metavar="DIR", help="ComfyUI-style models folder (diffusion_models/, text_encoders/, "
                                                   "tokenizers/qwen/, tokenizers/t5/)")
    p.add_argument("--prompt", required=True, help="prompt; (text:1.2), (text) and \\( \\) escapes are understood")
    p.add_argument("--negative", default="", help="negative prompt (default: empty)")
    p.add_argument("--out", required=True, metavar="CTX.npz", help="output .npz (cond, uncond, context = cond)")
    p.add_argument("--qwen", "--text-encoder", dest="qwen", metavar="FILE", help="Qwen3 text encoder safetensors")
    p.add_argument("--dit", metavar="FILE", help="DiT checkpoint holding the LLM adapter")
    p.add_argument("--qwen-tokenizer", metavar="DIR", help="folder with tokenizer.json or vocab.json + merges.txt")
    p.add_argument("--t5-tokenizer", metavar="PATH", help="tokenizer.json, spiece.model, or a folder holding one")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the runtime's choice)")
    p.add_argument("--backend", choices=("torch", "onnx"), default="torch",
                   help="torch: the model files (default); onnx: ONNX Runtime on an encoder pack (--pack)")
    p.add_argument("--pack", metavar="DIR", help="encoder pack (anima-models export-encoder) for --backend onnx")


def _resolve(args) -> tuple:
    """(text encoder, dit, qwen tokenizer dir, t5 tokenizer path) from --models and the per-file overrides."""
    from models.setup.models_dir import resolve_models
    t5_file = args.t5_tokenizer if args.t5_tokenizer and os.path.isfile(args.t5_tokenizer) else None
    overrides = {"dit": args.dit, "text_encoder": args.qwen, "qwen_tokenizer": args.qwen_tokenizer,
                 "t5_tokenizer": None if t5_file else args.t5_tokenizer}
    need = ("dit", "text_encoder", "qwen_tokenizer") + (() if t5_file else ("t5_tokenizer",))
    paths = resolve_models(args.models, overrides, need=need)
    return (str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
            t5_file or str(paths.t5_tokenizer))


def run(args) -> int:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    out = os.path.abspath(args.out)
    if not os.path.isdir(os.path.dirname(out)):
        raise UserError(f"--out {args.out}: folder {os.path.dirname(out)} does not exist")
    from models.text.prompt_weights import check_prompt
    check_prompt(args.prompt)                    # a bad weight syntax fails before minutes of model loading
    check_prompt(args.negative)
    from models.text.conditioning import TextEncoder
    if args.backend == "onnx":
        if not args.pack:
            raise UserError("--backend onnx needs --pack DIR (an encoder pack from `anima-models export-encoder`)")
        t0 = time.perf_counter()
        enc = TextEncoder.from_pack(args.pack, threads=args.threads)
    else:
        if args.pack:
            raise UserError("--pack is for --backend onnx")
        te, dit, qtok, t5tok = _resolve(args)
        t0 = time.perf_counter()
        enc = TextEncoder.from_files(te, dit, qtok, t5tok, threads=args.threads)
    t1 = time.perf_counter()
    try:
        cond, uncond = enc.encode_pair(args.prompt, args.negative)     # cond, uncond: [512, Dc] f32
    finally:
        enc.close()
    t2 = time.perf_counter()
    atomic_write(out, lambda f: np.savez(f, cond=cond, uncond=uncond, context=cond))
    print(f"wrote {out}: cond/uncond {list(cond.shape)} f32 ({args.backend}; load {t1 - t0:.1f} s, "
          f"encode {t2 - t1:.1f} s)")
    return 0
