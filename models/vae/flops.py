"""Analytic FLOP count of the single-image decoder (2 FLOPs per multiply-add; convs and attention matmuls only)."""
from __future__ import annotations

from models.vae.keys import VAEConfig, decoder_plan


def conv_flops(cin: int, cout: int, k: int, h: int, w: int) -> int:
    return 2 * cin * cout * k * k * h * w


def decoder_flops(cfg: VAEConfig, h: int, w: int) -> dict:
    """FLOPs to decode a latent [z, h, w] with 2D convs: {"conv", "attention", "total"} as nominally written
    (nearest x2 then 3x3 conv), and "executed": what VAEDecoder runs (upsample convs as four 2x2 phases)."""
    c, n = cfg.mid_dim, h * w
    conv = conv_flops(cfg.z_dim, cfg.z_dim, 1, h, w) + conv_flops(cfg.z_dim, c, 3, h, w)   # conv2, decoder.conv1
    conv += 4 * conv_flops(c, c, 3, h, w)                                                  # middle residuals
    conv += conv_flops(c, 3 * c, 1, h, w) + conv_flops(c, c, 1, h, w)                      # to_qkv, proj
    attention = 2 * (2 * n * n * c)                                                        # q kᵀ and softmax · v
    saved = 0
    for kind, a, b in decoder_plan(cfg):
        if kind == "res":
            conv += conv_flops(a, b, 3, h, w) + conv_flops(b, b, 3, h, w)
            if a != b:
                conv += conv_flops(a, b, 1, h, w)                                          # shortcut
        else:
            saved += conv_flops(a, b, 3, 2 * h, 2 * w) - conv_flops(a, 4 * b, 2, h + 1, w + 1)
            h, w = 2 * h, 2 * w
            conv += conv_flops(a, b, 3, h, w)                                              # conv after nearest x2
    conv += conv_flops(cfg.base_dim, cfg.out_channels, 3, h, w)                            # head
    return {"conv": conv, "attention": attention, "total": conv + attention, "executed": conv + attention - saved}
