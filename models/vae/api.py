"""`VAE`: open a VAE file, decode a model-space latent [16, h, w] to an RGB image, tiled or whole (torch).

Also the pieces every VAE backend shares, importable without torch: `DecodeResult`, `check_latent`, `to_unit`,
`to_uint8` (the VAE-pack backends in models.vae.pack_decoder run on boards that have no torch)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from models.vae.latent import denormalize
from models.vae.tiled import DEFAULT_OVERLAP, DEFAULT_TILE, decode_tiled

log = logging.getLogger(__name__)


@dataclass
class DecodeResult:
    image: np.ndarray           # [H, W, 3] uint8 RGB
    array: np.ndarray           # [3, H, W] f32 in [0, 1]
    seconds: float              # decode wall time
    timings: dict = field(default_factory=dict)   # per phase seconds (the pack backends: load/init/infer/release)


def to_unit(x) -> np.ndarray:
    """Decoder output [3, H, W] (≈[-1, 1]; numpy or a CPU torch tensor) -> clamp((x + 1) / 2, 0, 1) as f32 numpy."""
    a = np.asarray(x, dtype=np.float32)
    return np.clip((a + np.float32(1.0)) * np.float32(0.5), np.float32(0.0), np.float32(1.0))


_U8_SCALE = np.float32(255.0)


def to_uint8(unit: np.ndarray) -> np.ndarray:
    """[3, H, W] f32 in [0, 1] -> [H, W, 3] uint8 exactly as ComfyUI's SaveImage converts: clip(255 * x, 0, 255) in
    float32, then truncated (not rounded). The one float -> pixel conversion: every VAE backend goes through it."""
    scaled = np.asarray(unit, dtype=np.float32).transpose(1, 2, 0) * _U8_SCALE     # scaled: [H, W, 3] f32
    return np.ascontiguousarray(np.clip(scaled, 0.0, 255.0).astype(np.uint8))


def check_latent(latent, z_dim: int) -> np.ndarray:
    """A model-space latent [z_dim, h, w], finite float; raises ValueError naming what is wrong."""
    a = np.asarray(latent)
    if a.dtype.kind != "f":
        raise ValueError(f"latent: dtype {a.dtype} is not floating point")
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 3 or a.shape[0] != z_dim or a.shape[1] < 1 or a.shape[2] < 1:
        raise ValueError(f"latent: shape {list(a.shape)}, expected [{z_dim}, h, w]")
    if not np.isfinite(a).all():
        raise ValueError("latent: has NaN or infinite values")
    return a.astype(np.float32, copy=False)


class VAE:
    """The single-image decoder with its weights loaded; thread count applies to torch's intra-op pool."""

    def __init__(self, weights, threads: Optional[int] = None):
        from models.vae.decoder import VAEDecoder               # torch: imported only by the torch backend
        self.weights = weights                                   # models.vae.checkpoint.VAEWeights
        self.config = weights.config
        self.threads = threads
        self.decoder = VAEDecoder(weights)

    @classmethod
    def open(cls, path, threads: Optional[int] = None) -> "VAE":
        from models.vae.checkpoint import load_vae
        return cls(load_vae(path), threads)

    def _set_threads(self) -> None:
        import torch
        if self.threads is not None:
            if int(self.threads) < 1:
                raise ValueError(f"threads must be >= 1, got {self.threads}")
            torch.set_num_threads(int(self.threads))

    def decode_raw(self, latent, tile: Optional[int] = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP):
        """Model-space latent [16, h, w] -> decoder output [3, 8h, 8w] f32 torch tensor (unclamped); tile=None
        decodes whole."""
        import torch
        z = torch.from_numpy(denormalize(check_latent(latent, self.config.z_dim)))[None]   # z: [1, 16, h, w]
        self._set_threads()
        with torch.inference_mode():
            if tile is None:
                return self.decoder.forward(z)[0]
            feats = self.decoder.trunk(z)                          # feats: [1, 384, h, w], whole
            return torch.from_numpy(decode_tiled(self.decoder.upsampler, feats, self.config.upscale, tile, overlap))

    def decode(self, latent, tile: Optional[int] = DEFAULT_TILE, overlap: float = DEFAULT_OVERLAP) -> DecodeResult:
        """Model-space latent [16, h, w] -> DecodeResult(image [H, W, 3] u8, array [3, H, W] f32 in [0, 1])."""
        t0 = time.perf_counter()
        unit = to_unit(self.decode_raw(latent, tile, overlap))
        dt = time.perf_counter() - t0
        log.info("decoded %s -> %dx%d in %.2f s (%s)", list(np.shape(latent)), unit.shape[2], unit.shape[1], dt,
                 "whole" if tile is None else f"tile {tile}, overlap {overlap}")
        return DecodeResult(image=to_uint8(unit), array=unit, seconds=dt)
