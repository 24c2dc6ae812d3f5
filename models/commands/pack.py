"""`anima-models pack`: convert a DiT checkpoint into a model pack (FP32 host weights + per-branch ONNX graphs).

    anima-models pack anima-preview.safetensors --out packs/anima-512 --resolution 512x512 --dtype fp16
"""
from __future__ import annotations

import logging

from models.partition import PACK_DTYPES, TEXT_TOKENS, parse_resolution

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="DiT checkpoint (.safetensors; prefix net. or model.diffusion_model.)")
    p.add_argument("--out", required=True, help="pack folder to write (built next to it, then renamed into place)")
    p.add_argument("--resolution", default="512x512", help="image WIDTHxHEIGHT in pixels, multiples of 8 "
                                                          "(default 512x512)")
    p.add_argument("--dtype", default="fp16", choices=sorted(PACK_DTYPES), help="branch I/O and weight dtype")
    p.add_argument("--overwrite", action="store_true", help="replace a pack built from another checkpoint")
    p.add_argument("--context", type=int, default=TEXT_TOKENS,
                   help=f"context rows of cross-attention (default {TEXT_TOKENS}); more keeps every row of prompts "
                        f"longer than {TEXT_TOKENS} T5 tokens as ComfyUI does, with a mask input (docs/prompts.md)")


def run(args) -> int:
    from models.pack import build_pack, load_pack
    width, height = parse_resolution(args.resolution)
    out = build_pack(args.checkpoint, args.out, (width, height), args.dtype, overwrite=args.overwrite,
                     context=args.context)
    pack = load_pack(out)
    g = pack.geometry
    print(f"pack {out}: {pack.config.blocks} blocks x {len(pack.branches) // pack.config.blocks} branches, "
          f"{pack.dtype}, {g.width}x{g.height} (latent {g.latent_h}x{g.latent_w}, {g.tokens} image tokens, "
          f"{g.text_tokens} text tokens), source sha256 {pack.source['sha256'][:16]}")
    return 0
