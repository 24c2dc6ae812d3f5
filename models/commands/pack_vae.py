"""`anima-models pack-vae`: convert a VAE file into a VAE pack (trunk + tile ONNX graphs for one resolution).

    anima-models pack-vae qwen_image_vae.safetensors --out packs/vae-512 --resolution 512x512 [--tile 32 --overlap 0.5]
    anima-models compile packs/vae-512 --target rk3588          # then: decode --vae-pack packs/vae-512 --backend rknn
"""
from __future__ import annotations

import logging
import os

from models.commands import UserError
from models.dit.partition import parse_resolution
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("vae", help="VAE file (qwen_image_vae.safetensors; original or diffusers layout)")
    p.add_argument("--out", required=True, help="pack folder to write (built next to it, then renamed into place)")
    p.add_argument("--resolution", default="512x512", help="image WIDTHxHEIGHT in pixels, multiples of 8 "
                                                          "(default 512x512; one pack per resolution)")
    p.add_argument("--tile", type=int, default=DEFAULT_TILE, help=f"tile side in latent pixels (default {DEFAULT_TILE})")
    p.add_argument("--overlap", type=float, default=DEFAULT_OVERLAP,
                   help=f"tile overlap as a fraction of the tile (default {DEFAULT_OVERLAP})")
    p.add_argument("--calibration-seeds", type=int, default=2, help="seeded random latents the FP16 norm scales are "
                   "measured on (default 2)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads for the calibration")
    p.add_argument("--overwrite", action="store_true", help="replace a pack built from another file or for another resolution")


def run(args) -> int:
    from models.vae.checkpoint import VAEError
    from models.vae.pack import build_vae_pack, load_vae_pack

    width, height = parse_resolution(args.resolution)
    if args.tile < 1:
        raise UserError(f"--tile must be >= 1 latent pixel, got {args.tile}")
    if not 0.0 <= args.overlap < 1.0:
        raise UserError(f"--overlap must be in [0, 1), got {args.overlap}")
    if args.calibration_seeds < 1:
        raise UserError(f"--calibration-seeds must be >= 1, got {args.calibration_seeds}")
    if not os.path.isfile(args.vae):
        raise UserError(f"{args.vae}: no such file")
    try:
        out = build_vae_pack(args.vae, args.out, (width, height), args.tile, args.overlap, args.overwrite,
                             seeds=tuple(range(args.calibration_seeds)), threads=args.threads)
    except VAEError as e:
        raise UserError(str(e)) from None
    pack = load_vae_pack(out)
    m = pack.manifest
    t, f = m["tiling"], m["fp16"]
    print(f"VAE pack {out}: {width}x{height}, trunk {m['latent']['h']}x{m['latent']['w']} + {t['count']} tiles of "
          f"{t['tile_h']}x{t['tile_w']} latent pixels (overlap {t['overlap']}); "
          + ", ".join(f"{b['name']} {b['bytes'] / 1e6:.1f} MB {b['gflop']:.1f} GFLOP" for b in m["branches"])
          + f"; FP16 headroom trunk {f['models']['trunk']['headroom']}x, tile {f['models']['tile']['headroom']}x"
          + ("" if f["ok"] else " (LOW: see the warnings)") + f"; source sha256 {m['source']['sha256'][:16]}")
    return 0
