"""The Qwen-Image (Wan 2.1) VAE decoder for one image, every causal 3D conv as a 2D conv, in torch (CPU).

Backend chosen by measurement (docs/vae.md has the numbers): torch's oneDNN conv2d in channels_last layout was as fast
as or faster than ONNX Runtime's on every conv shape of this decoder on this machine's 2 cores (e.g. 96->96 at
256x256: torch channels_last 35 GFLOP/s, ONNX Runtime 22, torch NCHW 16), and convs are ~97% of the FLOPs; so the
decoder is plain torch, channels_last, inference mode, no graph export.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F

from models.vae.checkpoint import VAEWeights
from models.vae.keys import decoder_plan
from models.vae.latent import LATENT_MEAN, LATENT_STD, denormalize  # noqa: F401  (re-exported)
from models.vae.subpixel import subpixel_weights

log = logging.getLogger(__name__)

NORM_EPS = 1e-12                 # F.normalize's floor on the channel norm


class VAEDecoder:
    """VAE-space latent [1, z, h, w] -> image [1, 3, 8h, 8w] (≈[-1, 1], unclamped); weights held as torch tensors."""

    def __init__(self, weights: VAEWeights, channels_last: bool = True):
        self.config = weights.config
        self.plan = decoder_plan(self.config)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.fmt = fmt
        self.w = {}
        tensors = dict(weights.tensors)
        for i, (kind, _, _) in enumerate(self.plan):
            if kind == "up":
                p = f"decoder.upsamples.{i}."
                wk, bias = subpixel_weights(tensors.pop(p + "resample.1.weight"), tensors.pop(p + "resample.1.bias"))
                tensors[p + "phases.weight"], tensors[p + "phases.bias"] = wk, bias
        for k, a in tensors.items():
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
            if k.endswith(".gamma"):
                t = t * math.sqrt(t.shape[0])                      # fold RMS_norm's sqrt(C) into gamma
            elif t.ndim == 4:
                t = t.contiguous(memory_format=fmt)
            self.w[k] = t

    # -- layers ----------------------------------------------------------------------------------------------------
    def _conv(self, x: torch.Tensor, p: str, pad: int = 1) -> torch.Tensor:
        w = self.w[p + "weight"]                                   # [out, in, k, k]
        return F.conv2d(x, w, self.w[p + "bias"], padding=pad if w.shape[-1] > 1 else 0)

    def _norm(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """RMS_norm: x / ||x||_channels * sqrt(C) * gamma (sqrt(C) already folded into the stored gamma)."""
        inv = torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min_(NORM_EPS).reciprocal_()  # [1, 1, h, w]
        return torch.mul(x, inv).mul_(self.w[key].view(1, -1, 1, 1))

    def _residual(self, x: torch.Tensor, p: str) -> torch.Tensor:
        # x: [1, cin, h, w] -> [1, cout, h, w]
        h = self._conv(x, p + "shortcut.", 0) if p + "shortcut.weight" in self.w else x
        y = F.silu(self._norm(x, p + "residual.0.gamma"), inplace=True)
        y = self._conv(y, p + "residual.2.")
        y = F.silu(self._norm(y, p + "residual.3.gamma"), inplace=True)
        y = self._conv(y, p + "residual.6.")
        return y.add_(h)

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        b, c, h, w = x.shape                                       # x: [1, C, h, w]
        y = self._norm(x, p + "norm.gamma")
        qkv = self._conv(y, p + "to_qkv.", 0)                      # [1, 3C, h, w]
        qkv = qkv.flatten(2).transpose(1, 2).unsqueeze(1)          # [1, 1, hw, 3C]
        q, k, v = qkv.chunk(3, dim=-1)                             # each [1, 1, hw, C]
        o = F.scaled_dot_product_attention(q, k, v)                # [1, 1, hw, C], single head, scale 1/sqrt(C)
        o = o.squeeze(1).transpose(1, 2).reshape(b, c, h, w).contiguous(memory_format=self.fmt)
        return self._conv(o, p + "proj.", 0).add_(x)

    def _upsample(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Nearest x2 then 3x3 conv, computed as four 2x2 convs on the small grid (one per output phase)."""
        b, _, h, w = x.shape                                       # x: [1, C, h, w]
        wk, bias = self.w[p + "phases.weight"], self.w[p + "phases.bias"]   # [4 Co, C, 2, 2], [4 Co]
        co = wk.shape[0] // 4
        y = F.conv2d(x, wk, bias, padding=1)                       # y: [1, 4 Co, h+1, w+1]
        out = torch.empty(b, co, 2 * h, 2 * w, dtype=x.dtype, memory_format=self.fmt)   # [1, Co, 2h, 2w]
        for a in (0, 1):
            for c in (0, 1):
                k = 2 * a + c
                out[:, :, a::2, c::2] = y[:, k * co:(k + 1) * co, a:a + h, c:c + w]
        return out

    # -- network ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def trunk(self, z: torch.Tensor) -> torch.Tensor:
        """The latent-resolution part: z [1, z_dim, h, w] (VAE space) -> features [1, 384, h, w] f32.

        Holds the middle block's attention over all pixels; tiled decoding runs it whole (it is small: 1.5 KB per
        latent pixel), so tiles never see a different attention context."""
        x = z.contiguous(memory_format=self.fmt)
        x = self._conv(x, "conv2.", 0)                             # [1, z, h, w]
        x = self._conv(x, "decoder.conv1.")                        # [1, 384, h, w]
        x = self._residual(x, "decoder.middle.0.")
        x = self._attention(x, "decoder.middle.1.")
        return self._residual(x, "decoder.middle.2.")

    @torch.inference_mode()
    def upsampler(self, x: torch.Tensor) -> torch.Tensor:
        """Trunk features [1, 384, h, w] -> image [1, 3, 8h, 8w] f32: the stages and the head (all local convs)."""
        x = x.contiguous(memory_format=self.fmt)
        for i, (kind, _, _) in enumerate(self.plan):
            p = f"decoder.upsamples.{i}."
            x = self._residual(x, p) if kind == "res" else self._upsample(x, p)
        x = F.silu(self._norm(x, "decoder.head.0.gamma"), inplace=True)
        return self._conv(x, "decoder.head.2.").contiguous()      # [1, 3, 8h, 8w]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z: [1, z_dim, h, w] f32 in VAE space (already de-normalised) -> [1, 3, 8h, 8w] f32."""
        return self.upsampler(self.trunk(z))
