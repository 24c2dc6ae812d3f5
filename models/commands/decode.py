"""`anima-models decode`: model-space latent [16, h, w] (.npy) -> PNG through the Qwen-Image VAE decoder.

    anima-models decode --vae qwen_image_vae.safetensors --latent lat.npy --out img.png [--save-array img.npy]
                        [--tile 32 --overlap 0.5 | --no-tile] [--threads 2]            # torch, any resolution
    anima-models decode --vae-pack packs/vae-512 --backend onnx|rknn-sim|rknn --latent lat.npy --out img.png
                        [--save-array img.npy] [--threads 2] [--core-mask 0_1_2]        # the pack's resolution
"""
from __future__ import annotations

import logging
import os

import numpy as np

from models.runtime.backends import vae_pack_backends
from models.commands import UserError
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE

log = logging.getLogger(__name__)

PACK_BACKENDS = vae_pack_backends()              # onnx, rknn-sim, rknn (models/runtime/backends/__init__.py)
BACKENDS = ("torch",) + PACK_BACKENDS            # torch: the VAE file itself, not a pack


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--vae", help="VAE file (qwen_image_vae.safetensors; original or diffusers layout): torch")
    src.add_argument("--vae-pack", help="VAE pack folder (anima-models pack-vae; compiled for --backend rknn)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="torch (with --vae, the default there) | onnx (ONNX Runtime, the default with --vae-pack) | "
                        "rknn-sim (rknn-toolkit2's simulator) | rknn (the RK3588 NPU through rknn-toolkit-lite2)")
    p.add_argument("--latent", required=True, help="model-space latent [16, h, w] float32 .npy")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--save-array", help="also save the float image [3, H, W] in [0, 1] as .npy")
    p.add_argument("--tile", type=int, default=None, help=f"--vae: tile side in latent pixels (default {DEFAULT_TILE}; "
                   "a pack's tiling is fixed when it is built)")
    p.add_argument("--overlap", type=float, default=None, help=f"--vae: tile overlap as a fraction of the tile "
                   f"(default {DEFAULT_OVERLAP})")
    p.add_argument("--no-tile", action="store_true", help="--vae: decode the whole latent at once")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op / ONNX Runtime threads (default: all)")
    p.add_argument("--core-mask", default="auto", help="rknn: NPU cores (auto | 0 | 1 | 2 | 0_1 | 0_1_2 | all)")
    p.add_argument("--toolkit-venv", default=None, help="rknn-sim: the rknn-toolkit2 environment (default .venv-rknn "
                   "or $ANIMA_RKNN_VENV)")


def _load_latent(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise UserError(f"--latent {path}: no such file")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"--latent {path}: not a readable .npy array ({e})") from None


def _open_torch(args):
    from models.vae import VAE, VAEError
    if args.backend not in (None, "torch"):
        raise UserError(f"--backend {args.backend} runs a VAE pack: give --vae-pack DIR (anima-models pack-vae)")
    tile = DEFAULT_TILE if args.tile is None else args.tile
    overlap = DEFAULT_OVERLAP if args.overlap is None else args.overlap
    if tile < 1:
        raise UserError(f"--tile must be >= 1 latent pixel, got {tile}")
    if not 0.0 <= overlap < 1.0:
        raise UserError(f"--overlap must be in [0, 1), got {overlap}")
    if not os.path.isfile(args.vae):
        raise UserError(f"--vae {args.vae}: no such file")
    try:
        vae = VAE.open(args.vae, threads=args.threads)
    except VAEError as e:
        raise UserError(f"--vae: {e}") from None
    tile = None if args.no_tile else tile
    meta = {"vae": os.path.basename(args.vae), "tile": "none" if tile is None else f"{tile}/{overlap}"}
    return (lambda latent: vae.decode(latent, tile=tile, overlap=overlap)), meta, "torch"


def open_pack_decoder(pack_dir, backend: str, threads=None, core_mask="auto", toolkit_venv=None):
    """A PackDecoder for `pack_dir` on `backend` (onnx | rknn-sim | rknn); VaePackError / ValueError if unusable."""
    from models.runtime.backends import backend_class, backend_kwargs
    from models.vae.pack import load_vae_pack
    from models.vae.pack_decoder import PackDecoder
    if backend not in PACK_BACKENDS:
        raise ValueError(f"backend {backend!r}: a VAE pack runs on {', '.join(PACK_BACKENDS)}")
    cls = backend_class(backend)
    pack = load_vae_pack(pack_dir)
    if cls.needs_compiled_pack and not pack.compiled():
        raise ValueError(f"VAE pack {pack_dir} is not compiled for the NPU (anima-models compile {pack_dir} "
                         "--target rk3588)")
    # each option goes to the backends whose constructor names it (threads: onnx; venv: rknn-sim; core_mask: rknn)
    options = {"venv": toolkit_venv, "core_mask": core_mask}
    return PackDecoder(pack, cls(**backend_kwargs(cls, threads, options)))


def _open_pack(args):
    from models.packs.pack import PackError
    if args.tile is not None or args.overlap is not None or args.no_tile:
        raise UserError("--tile/--overlap/--no-tile: a VAE pack's tiling is fixed when it is built (anima-models "
                        "pack-vae --tile --overlap)")
    backend = args.backend or "onnx"
    if backend == "torch":
        raise UserError("--backend torch decodes a VAE file: give --vae FILE")
    try:
        dec = open_pack_decoder(args.vae_pack, backend, args.threads, args.core_mask, args.toolkit_venv)
    except PackError as e:
        raise UserError(f"--vae-pack: {e}") from None
    p = dec.pack
    meta = {"vae": p.manifest["source"]["name"], "vae_pack": os.path.basename(os.path.abspath(args.vae_pack)),
            "backend": backend, "tile": f"{p.tile}/{p.overlap}"}
    return dec.decode, meta, backend


def run(args) -> int:
    from models.vae import write_png

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    from models.runtime.backends.base import BackendError
    from models.vae.pack_decoder import DecodeError
    latent = np.asarray(_load_latent(args.latent))
    try:
        decode, meta, backend = _open_pack(args) if args.vae_pack else _open_torch(args)
    except BackendError as e:                    # e.g. rknn without rknn-toolkit-lite2: a clear line, no traceback
        raise UserError(f"--backend {args.backend}: {e}") from None
    try:
        res = decode(latent)
    except ValueError as e:
        raise UserError(f"--latent {args.latent}: {e}") from None
    except (BackendError, DecodeError) as e:
        log.error("decode failed: %s", e)
        print(f"anima-models decode: failed: {e}")
        return 1
    write_png(args.out, res.image, {**meta, "latent": os.path.basename(args.latent)})
    if args.save_array:
        np.save(args.save_array, res.array)
    print(f"decoded {list(latent.shape)} -> {args.out} ({res.image.shape[1]}x{res.image.shape[0]}) "
          f"in {res.seconds:.2f} s ({backend})")
    return 0
