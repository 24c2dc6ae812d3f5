"""The Qwen-Image (Wan 2.1) VAE encoder for one image, every causal 3D conv as a 2D conv, in torch (CPU): the
reference the ONNX graphs and the NPU packs are checked against.

One frame: the causal convs' temporal padding puts zeros in front, so only their last tap meets the image
(models.vae.checkpoint.collapse), and the temporal downsamples (`time_conv`) keep the first frame as it is. The
layers are the decoder's (RMS_norm, SiLU, residual blocks, single-head attention); a downsample is ZeroPad2d(0, 1, 0,
1) then a 3x3 stride-2 conv. The output is the posterior's mean (ComfyUI's VAEEncode takes the mean, not a sample),
normalised to model space as ComfyUI's Wan 2.1 latent format does: (mean - latents_mean) / latents_std.

Two parts, as the decoder: `features` (conv1 and the downsampling stages: local convs, tiled) and `head` (latent
resolution, the whole image: the middle block with its attention, the head and the quant conv).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from models.vae.checkpoint import VAEWeights
from models.vae.decoder import VAEDecoder
from models.vae.keys import encoder_plan


class VAEEncoder:
    """Image [1, 3, H, W] in [-1, 1] -> the posterior mean [1, z, H/8, W/8] in VAE space; weights as torch tensors."""

    _conv = VAEDecoder._conv
    _norm = VAEDecoder._norm
    _residual = VAEDecoder._residual
    _attention = VAEDecoder._attention

    def __init__(self, weights: VAEWeights, channels_last: bool = True):
        self.config = weights.config
        self.plan = encoder_plan(self.config)
        self.fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.w = {}
        for k, a in weights.tensors.items():
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
            if k.endswith(".gamma"):
                t = t * math.sqrt(t.shape[0])                      # fold RMS_norm's sqrt(C) into gamma
            elif t.ndim == 4:
                t = t.contiguous(memory_format=self.fmt)
            self.w[k] = t

    def _downsample(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """ZeroPad2d((0, 1, 0, 1)) then a 3x3 stride-2 conv: [1, C, h, w] -> [1, C, h/2, w/2] (h, w even)."""
        x = F.pad(x, (0, 1, 0, 1))
        return F.conv2d(x, self.w[p + "resample.1.weight"], self.w[p + "resample.1.bias"], stride=2)

    @torch.inference_mode()
    def features(self, image: torch.Tensor) -> torch.Tensor:
        """image [1, 3, H, W] -> features [1, mid_dim, H/8, W/8] f32: conv1 and the downsampling stages."""
        x = self._conv(image.contiguous(memory_format=self.fmt), "encoder.conv1.")
        for i, (kind, _, _) in enumerate(self.plan):
            p = f"encoder.downsamples.{i}."
            x = self._residual(x, p) if kind == "res" else self._downsample(x, p)
        return x.contiguous()

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """features [1, mid_dim, h, w] -> the posterior mean [1, z, h, w] (VAE space): middle block, head, conv1."""
        x = x.contiguous(memory_format=self.fmt)
        x = self._residual(x, "encoder.middle.0.")
        x = self._attention(x, "encoder.middle.1.")
        x = self._residual(x, "encoder.middle.2.")
        x = F.silu(self._norm(x, "encoder.head.0.gamma"), inplace=True)
        x = self._conv(x, "encoder.head.2.")                       # [1, 2z, h, w]
        x = self._conv(x, "conv1.", 0)                             # the quant conv: mean, then logvar
        return x[:, :self.config.z_dim].contiguous()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """image [1, 3, H, W] f32 in [-1, 1] -> mean [1, z, H/8, W/8] f32 in VAE space."""
        return self.head(self.features(image))
