"""Encoding an image to a model-space latent: the input check every encoder backend shares (no torch), and
`TorchEncoder` (the VAE file's encoder half in torch, tiled or whole).

    enc = TorchEncoder.open("qwen_image_vae.safetensors", threads=2)
    res = enc.encode(image)              # image [3, H, W] f32 in [-1, 1] -> EncodeResult(latent [16, H/8, W/8])
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from models.vae.latent import normalize
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE, encode_tiled

log = logging.getLogger(__name__)

RANGE_SLACK = 1e-3              # an image in [-1, 1] may carry float rounding from (x / 255) * 2 - 1


@dataclass
class EncodeResult:
    latent: np.ndarray          # [z, H/8, W/8] f32, model space
    seconds: float              # encode wall time
    timings: dict = field(default_factory=dict)   # per phase seconds (the pack backends: load/init/infer/release)


def check_image(image, down: int = 8) -> np.ndarray:
    """An RGB image [3, H, W] (or [1, 3, H, W]) of finite floats in [-1, 1], H and W multiples of `down`;
    -> f32 [3, H, W]; raises ValueError naming what is wrong."""
    a = np.asarray(image)
    if a.dtype.kind != "f":
        raise ValueError(f"image: dtype {a.dtype} is not floating point (expected f32 in [-1, 1])")
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 3 or a.shape[0] != 3 or a.shape[1] < 1 or a.shape[2] < 1:
        raise ValueError(f"image: shape {list(a.shape)}, expected [3, H, W]")
    if a.shape[1] % down or a.shape[2] % down:
        raise ValueError(f"image: {a.shape[2]}x{a.shape[1]} pixels, width and height must be multiples of {down}")
    if not np.isfinite(a).all():
        raise ValueError("image: has NaN or infinite values")
    lo, hi = float(a.min()), float(a.max())
    if lo < -1.0 - RANGE_SLACK or hi > 1.0 + RANGE_SLACK:
        raise ValueError(f"image: values in [{lo:.4g}, {hi:.4g}], expected [-1, 1] (2 * pixel / 255 - 1)")
    return a.astype(np.float32, copy=False)


class TorchEncoder:
    """The single-image encoder with its weights loaded; thread count applies to torch's intra-op pool."""

    def __init__(self, weights, threads: Optional[int] = None):
        from models.vae.encoder import VAEEncoder               # torch: imported only by the torch backend
        self.weights = weights                                   # models.vae.checkpoint.VAEWeights (encoder half)
        self.config = weights.config
        self.threads = threads
        self.encoder = VAEEncoder(weights)

    @classmethod
    def open(cls, path, threads: Optional[int] = None) -> "TorchEncoder":
        from models.vae.checkpoint import load_vae_encoder
        return cls(load_vae_encoder(path), threads)

    def encode_vae(self, image, tile: Optional[int] = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP):
        """image [3, H, W] in [-1, 1] -> the posterior mean [z, H/8, W/8] f32 numpy in VAE space; tile=None encodes
        whole."""
        import torch
        x = torch.from_numpy(np.ascontiguousarray(check_image(image, self.config.upscale)))[None]   # [1, 3, H, W]
        if self.threads is not None:
            if int(self.threads) < 1:
                raise ValueError(f"threads must be >= 1, got {self.threads}")
            torch.set_num_threads(int(self.threads))
        with torch.inference_mode():
            if tile is None:
                feats = self.encoder.features(x)                 # feats: [1, 384, h, w]
            else:
                feats = torch.from_numpy(encode_tiled(self.encoder.features, x, self.config.upscale, tile,
                                                      overlap))[None]
            return self.encoder.head(feats)[0].numpy()

    def encode(self, image, tile: Optional[int] = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP) -> EncodeResult:
        """image [3, H, W] in [-1, 1] -> EncodeResult(latent [16, H/8, W/8] f32 in model space)."""
        t0 = time.perf_counter()
        latent = normalize(self.encode_vae(image, tile, overlap))
        dt = time.perf_counter() - t0
        log.info("encoded %s -> %s in %.2f s (%s)", list(np.shape(image)), list(latent.shape), dt,
                 "whole" if tile is None else f"tile {tile}, overlap {overlap}")
        return EncodeResult(latent=latent, seconds=dt)
