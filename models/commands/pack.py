"""`anima-models pack`: convert a DiT checkpoint into a model pack (FP32 host weights + per-branch ONNX graphs).

    anima-models pack anima-preview.safetensors --out packs/anima-512 --resolution 512x512 --dtype fp16
    anima-models pack anima-preview.safetensors --out packs/anima-512-lora32 --lora-rank 32    # LoRAs per job
    anima-models pack anima-preview.safetensors --out packs/anima-512-style --lora style.safetensors:0.8   # baked
    anima-models pack anima-preview.safetensors --out packs/anima-512-s3 --shards 3     # every NPU core on a branch
    anima-models pack anima-turbo.safetensors --out packs/turbo-1024 --resolution 1024x1024 --sampling turbo
"""
from __future__ import annotations

import logging

from models.dit.partition import MAX_LORA_RANK, PACK_DTYPES, TEXT_TOKENS, parse_resolution

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="DiT checkpoint (.safetensors; prefix net. or model.diffusion_model.)")
    p.add_argument("--out", required=True, help="pack folder to write (built next to it, then renamed into place)")
    p.add_argument("--resolution", default="512x512", help="image WIDTHxHEIGHT in pixels, multiples of 8 "
                                                          "(default 512x512)")
    p.add_argument("--dtype", default="fp16", choices=sorted(PACK_DTYPES), help="branch I/O and weight dtype")
    p.add_argument("--overwrite", action="store_true", help="replace a pack built from another checkpoint or for another resolution")
    p.add_argument("--context", type=int, default=TEXT_TOKENS,
                   help=f"context rows of cross-attention (default {TEXT_TOKENS}); more keeps every row of prompts "
                        f"longer than {TEXT_TOKENS} T5 tokens as ComfyUI does, with a mask input (docs/prompts.md)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help=f"a LoRA-ready pack: every attention and FFN projection takes rank-R low-rank inputs, so "
                        f"LoRAs up to a stacked rank R are chosen per job without rebuilding (0..{MAX_LORA_RANK}; "
                        "default 0, docs/lora.md)")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="bake a LoRA into the weights (repeatable; strength default 1.0): no run-time cost")
    p.add_argument("--shards", type=int, default=1, help="also split every branch into N shard graphs (1-3), run on "
                   "N contexts on N NPU cores at once by the `shards` policy (docs/board.md section 9); not with "
                   "--lora-rank")
    p.add_argument("--quant", choices=("w8a8",), default=None, help="an INT8 pack: the --int8 projections with INT8 "
                   "weights (per channel) and activations, the rest FP16; needs --calib (docs/quant.md)")
    p.add_argument("--calib", default=None, metavar="CALIB", help="with --quant: a calibration folder of this "
                   "checkpoint at this size (anima-models calibrate)")
    p.add_argument("--smooth", default="0.5", metavar="ALPHA|off", help="with --quant: SmoothQuant alpha folded into "
                   "the host modulation (default 0.5), or off")
    p.add_argument("--int8", default="fc1,qkv,q", help="with --quant: the INT8 projections, from fc1, qkv, q, fc2 "
                   "(default fc1,qkv,q: fc2's input has nothing on the host to fold smoothing into)")
    from models.packs.sampling import add_sampling_arguments
    add_sampling_arguments(p)
    p.add_argument("--cuts", default=None, metavar="KIND=CUT,...", help="with --shards: the cut of a branch kind, "
                   "rows or heads (e.g. self=heads,ffn=rows); the kinds not named are chosen by the board model")


def _quant(args):
    """(calibration folder, INT8 layers, alpha | None) of --quant, or None; ValueError naming the option."""
    from models.quant.smooth import parse_int8, parse_smooth
    if args.quant is None:
        if args.calib is not None:
            raise ValueError("--calib is for --quant w8a8")
        return None
    if args.calib is None:
        raise ValueError("--quant w8a8 needs --calib CALIB (a calibration folder: anima-models calibrate)")
    return args.calib, parse_int8(args.int8), parse_smooth(args.smooth)


def run(args) -> int:
    from models.lora import parse_lora_arg
    from models.packs.pack import build_pack, load_pack
    from models.packs.sampling import parse_sampling
    from models.packs.sharded import parse_cuts
    width, height = parse_resolution(args.resolution)
    sampling = parse_sampling(args.sampling, args.sampling_json)
    loras = [parse_lora_arg(a) for a in args.lora]
    out = build_pack(args.checkpoint, args.out, (width, height), args.dtype, overwrite=args.overwrite,
                     context=args.context, lora_rank=args.lora_rank, loras=loras, shards=args.shards,
                     cuts=parse_cuts(args.cuts), quant=_quant(args), sampling=sampling)
    pack = load_pack(out)
    g = pack.geometry
    print(f"pack {out}: {pack.config.blocks} blocks x {len(pack.branches) // pack.config.blocks} branches, "
          f"{pack.dtype}, {g.width}x{g.height} (latent {g.latent_h}x{g.latent_w}, {g.tokens} image tokens, "
          f"{g.text_tokens} text tokens), source sha256 {pack.source['sha256'][:16]}"
          + (f", LoRA rank {g.lora_rank}" if g.lora_rank else "")
          + "".join(f", baked LoRA {b['name']} x {b['strength']:g}" for b in pack.manifest.get("lora", {})
                    .get("baked", [])))
    from models.records.manifest import quant_info, sampling_info
    rec = sampling_info(pack.manifest)
    if rec is not None:
        print(f"sampling for jobs that set none: {rec['steps']} steps, cfg {rec['cfg']:g}, {rec['sampler']}, "
              f"{rec['scheduler']}")
    q = quant_info(pack.manifest)
    if q is not None:
        print(f"quant {q['scheme']}: INT8 {','.join(q['int8'])}, smoothing {q['smooth']}, "
              f"{q['dataset']['samples']} quantizer samples per branch; compile it with `anima-models compile`")
    sh = pack.manifest.get("shards")
    if sh:
        cuts = ", ".join(f"{k} by {v}" for k, v in sh["cuts"].items())
        print(f"shards {sh['n']} per branch: {cuts} ({sh['chosen']})")
    return 0
