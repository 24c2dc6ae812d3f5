"""Decoding through a VAE pack with any branch backend (`onnx`, `rknn-sim`, the board's `rknn`): no torch.

    dec = PackDecoder(load_vae_pack("packs/vae-512"), make_backend("onnx", threads=2))
    result = dec.decode(latent)          # DecodeResult(image [H, W, 3] u8, array [3, H, W] f32, seconds, timings)

Per decode: 1) the latent is checked against the pack's resolution and de-normalised on the host (FP32); 2) the trunk
model runs once on the whole latent (load, init, infer, release); 3) the tile model is loaded once and runs every tile
of the pack's plan, then is released; 4) the tiles are blended (models.vae.tiled.blend, FP32 on the host) and go
through the one to_unit / to_uint8 of models.vae.api. A non-finite output is an error, never a black image.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from models.runtime.backends.base import BranchBackend
from models.runtime.lifecycle import run_branch
from models.vae.api import DecodeResult, check_latent, to_uint8, to_unit
from models.vae.latent import denormalize
from models.vae.pack import VaePack
from models.vae.tiled import blend, tile_grid, tile_inputs

log = logging.getLogger(__name__)


class DecodeError(RuntimeError):
    """A backend produced an unusable image (NaN/Inf: e.g. an FP16 overflow on the NPU)."""


class PackDecoder:
    """One VAE pack + one backend instance (BranchBackend: load/init/infer/release, one model at a time)."""

    def __init__(self, pack: VaePack, backend: BranchBackend):
        self.pack = pack
        self.config = pack.config
        self.backend = backend

    def check(self, latent) -> np.ndarray:
        """The latent as f32 [z, h, w] of exactly the pack's resolution; ValueError naming both otherwise."""
        a = check_latent(latent, self.config.z_dim)
        if tuple(a.shape) != self.pack.latent_shape:
            z, h, w = self.pack.latent_shape
            raise ValueError(f"latent: shape {list(a.shape)}, but the VAE pack {self.pack.dir} decodes "
                             f"{self.pack.width}x{self.pack.height} (latent [{z}, {h}, {w}]); build a pack for this "
                             f"resolution (anima-models pack-vae --resolution {a.shape[2] * 8}x{a.shape[1] * 8})")
        return a

    def decode_raw(self, latent) -> tuple:
        """Model-space latent [16, h, w] -> (decoder output [3, 8h, 8w] f32 unclamped, timings dict)."""
        z = denormalize(self.check(latent))[None]                              # z: [1, 16, h, w] VAE space
        _, _, h, w = z.shape
        scale = self.config.upscale
        io = {name: (b["inputs"][0]["name"], b["outputs"][0]["name"]) for name, b in self.pack.models.items()}
        # 1) the trunk, whole: feats [1, 384, h, w]
        (out,), tt = run_branch(self.backend, self.pack.model_path("trunk"), [{io["trunk"][0]: z}])
        feats = np.asarray(out[io["trunk"][1]], np.float32)
        # 2) every tile on one loaded tile model: each [1, 384, th, tw] -> [1, 3, 8 th, 8 tw]
        rows, cols = tile_grid(h, w, self.pack.tile, self.pack.overlap, scale)
        feeds = [{io["tile"][0]: np.ascontiguousarray(t)} for t in tile_inputs(feats, rows, cols)]
        outs, tl = run_branch(self.backend, self.pack.model_path("tile"), feeds)
        # 3) blend on the host (FP32)
        t0 = time.perf_counter()
        img = blend((np.asarray(o[io["tile"][1]], np.float32) for o in outs), rows, cols, scale)   # [3, 8h, 8w]
        bad = int(np.size(img) - np.count_nonzero(np.isfinite(img)))
        if bad:
            raise DecodeError(f"VAE pack {self.pack.dir} on backend {self.backend.name}: {bad} non-finite values in "
                              "the decoded image (an FP16 overflow on the NPU?); see the pack's fp16 report")
        timings = {"trunk": _phases(tt), "tile": _phases(tl), "tiles": len(feeds),
                   "blend_s": time.perf_counter() - t0}
        return img, timings

    def decode(self, latent) -> DecodeResult:
        """Model-space latent [16, h, w] -> DecodeResult(image u8 [H, W, 3], array f32 [3, H, W] in [0, 1])."""
        t0 = time.perf_counter()
        raw, timings = self.decode_raw(latent)
        unit = to_unit(raw)
        dt = time.perf_counter() - t0
        log.info("decoded %s -> %dx%d in %.2f s (VAE pack, backend %s, %d tiles)", list(np.shape(latent)),
                 unit.shape[2], unit.shape[1], dt, self.backend.name, timings["tiles"])
        return DecodeResult(image=to_uint8(unit), array=unit, seconds=dt, timings=timings)


def _phases(t) -> dict:
    """One model's lifecycle seconds (models.runtime.lifecycle.PhaseTimes) as the flat figures DECODED reports."""
    return {"load_s": t.load_s, "init_s": t.init_s, "infer_s": t.npu_s, "release_s": t.release_s}
