"""`anima-models decode`: model-space latent [16, h, w] (.npy) -> PNG through the Qwen-Image VAE decoder.

    anima-models decode --vae qwen_image_vae.safetensors --latent lat.npy --out img.png [--save-array img.npy]
                        [--tile 32 --overlap 0.5 | --no-tile] [--threads 2]
"""
from __future__ import annotations

import logging
import os

import numpy as np

from models.cli import UserError

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--vae", required=True, help="VAE file (qwen_image_vae.safetensors; original or diffusers layout)")
    p.add_argument("--latent", required=True, help="model-space latent [16, h, w] float32 .npy")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--save-array", help="also save the float image [3, H, W] in [0, 1] as .npy")
    p.add_argument("--tile", type=int, default=32, help="tile side in latent pixels (default 32)")
    p.add_argument("--overlap", type=float, default=0.5, help="tile overlap as a fraction of the tile (default 0.5)")
    p.add_argument("--no-tile", action="store_true", help="decode the whole latent at once")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")


def _load_latent(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise UserError(f"--latent {path}: no such file")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"--latent {path}: not a readable .npy array ({e})") from None


def run(args) -> int:
    from models.vae import VAE, VAEError, decode_to_png

    if args.tile < 1:
        raise UserError(f"--tile must be >= 1 latent pixel, got {args.tile}")
    if not 0.0 <= args.overlap < 1.0:
        raise UserError(f"--overlap must be in [0, 1), got {args.overlap}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if not os.path.isfile(args.vae):
        raise UserError(f"--vae {args.vae}: no such file")
    latent = _load_latent(args.latent)
    try:
        vae = VAE.open(args.vae, threads=args.threads)
    except VAEError as e:
        raise UserError(f"--vae: {e}") from None
    try:
        latent = np.asarray(latent)
        meta = {"vae": os.path.basename(args.vae), "latent": os.path.basename(args.latent),
                "tile": "none" if args.no_tile else f"{args.tile}/{args.overlap}"}
        res = decode_to_png(vae, latent, args.out, meta, tile=None if args.no_tile else args.tile,
                            overlap=args.overlap)
    except ValueError as e:
        raise UserError(f"--latent {args.latent}: {e}") from None
    if args.save_array:
        np.save(args.save_array, res.array)
    print(f"decoded {list(latent.shape)} -> {args.out} ({res.image.shape[1]}x{res.image.shape[0]}) "
          f"in {res.seconds:.2f} s")
    return 0
