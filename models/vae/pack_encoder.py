"""`PackEncoder`: a VAE encoder pack (models/vae/encoder_pack.py) run with any branch backend (onnx, rknn-sim, the
board's rknn), no torch: the image's tiles through the features model, blended on the host (models.vae.tiled), the
head once, then normalised to model space."""
from __future__ import annotations

import logging
import time

import numpy as np

from models.runtime.backends.base import BranchBackend
from models.runtime.lifecycle import run_branch
from models.vae.encode import EncodeResult, check_image
from models.vae.encoder_pack import EncodeError, VaeEncoderPack
from models.vae.latent import normalize
from models.vae.tiled import blend, image_tile_inputs, tile_grid

log = logging.getLogger(__name__)


class PackEncoder:
    """One encoder pack + one backend instance (BranchBackend: load/init/infer/release, one model at a time)."""

    def __init__(self, pack: VaeEncoderPack, backend: BranchBackend):
        self.pack, self.config, self.backend = pack, pack.config, backend

    def check(self, image) -> np.ndarray:
        """The image as f32 [3, H, W] of exactly the pack's size; ValueError naming both otherwise."""
        a = check_image(image, self.config.upscale)
        if tuple(a.shape) != self.pack.image_shape:
            raise ValueError(f"image: {a.shape[2]}x{a.shape[1]} pixels, but the VAE encoder pack {self.pack.dir} "
                             f"encodes {self.pack.width}x{self.pack.height}")
        return a

    def encode_vae(self, image) -> tuple:
        """image [3, H, W] in [-1, 1] -> (the posterior mean [z, h, w] f32 VAE space, timings dict)."""
        img = self.check(image)[None]                                          # [1, 3, H, W]
        s = self.config.upscale
        io = {name: (b["inputs"][0]["name"], b["outputs"][0]["name"]) for name, b in self.pack.models.items()}
        rows, cols = tile_grid(img.shape[2] // s, img.shape[3] // s, self.pack.tile, self.pack.overlap, 1)
        feeds = [{io["features"][0]: np.ascontiguousarray(t)} for t in image_tile_inputs(img, rows, cols, s)]
        outs, tf = run_branch(self.backend, self.pack.model_path("features"), feeds)
        t0 = time.perf_counter()
        feats = blend((np.asarray(o[io["features"][1]], np.float32) for o in outs), rows, cols, 1)[None]
        blend_s = time.perf_counter() - t0
        (out,), th = run_branch(self.backend, self.pack.model_path("head"), [{io["head"][0]: feats}])
        mean = np.asarray(out[io["head"][1]], np.float32)[0]
        bad = int(np.size(mean) - np.count_nonzero(np.isfinite(mean)))
        if bad:
            raise EncodeError(f"VAE encoder pack {self.pack.dir} on backend {self.backend.name}: {bad} non-finite "
                              "values in the latent (an FP16 overflow on the NPU?); see the pack's fp16 report")
        return mean, {"features": _phases(tf), "head": _phases(th), "tiles": len(feeds), "blend_s": blend_s}

    def encode(self, image) -> EncodeResult:
        """image [3, H, W] in [-1, 1] -> EncodeResult(latent [16, H/8, W/8] f32 in model space)."""
        t0 = time.perf_counter()
        mean, timings = self.encode_vae(image)
        latent = normalize(mean)
        dt = time.perf_counter() - t0
        log.info("encoded %s -> %s in %.2f s (VAE encoder pack, backend %s, %d tiles)", list(np.shape(image)),
                 list(latent.shape), dt, self.backend.name, timings["tiles"])
        return EncodeResult(latent=latent, seconds=dt, timings=timings)


def _phases(t) -> dict:
    return {"load_s": t.load_s, "init_s": t.init_s, "infer_s": t.npu_s, "release_s": t.release_s}
