"""Analytic FLOP count of the single-image decoder and encoder (2 FLOPs per multiply-add; convs and attention matmuls
only)."""
from __future__ import annotations

from models.vae.keys import VAEConfig, decoder_plan, encoder_plan


def conv_flops(cin: int, cout: int, k: int, h: int, w: int) -> int:
    return 2 * cin * cout * k * k * h * w


def trunk_flops(cfg: VAEConfig, h: int, w: int) -> int:
    """The latent-resolution part (conv2, conv1, middle block with its attention) for a latent [z, h, w]."""
    c, n = cfg.mid_dim, h * w
    conv = conv_flops(cfg.z_dim, cfg.z_dim, 1, h, w) + conv_flops(cfg.z_dim, c, 3, h, w)   # conv2, decoder.conv1
    conv += 4 * conv_flops(c, c, 3, h, w)                                                  # middle residuals
    conv += conv_flops(c, 3 * c, 1, h, w) + conv_flops(c, c, 1, h, w)                      # to_qkv, proj
    return conv + attention_flops(cfg, h, w)


def attention_flops(cfg: VAEConfig, h: int, w: int) -> int:
    n = h * w
    return 2 * (2 * n * n * cfg.mid_dim)                                                   # q kᵀ and softmax · v


def upsampler_flops(cfg: VAEConfig, h: int, w: int) -> dict:
    """The upsampling stages and the head on trunk features [C, h, w]: {"nominal" (nearest x2 then 3x3 conv),
    "executed" (each upsample conv as four 2x2 phase convs on the small grid with padding 1, as VAEDecoder runs
    it), "graph" (the pack graphs' four phase convs with exact pads: no padding row)}."""
    conv, saved, saved_graph = 0, 0, 0
    for kind, a, b in decoder_plan(cfg):
        if kind == "res":
            conv += conv_flops(a, b, 3, h, w) + conv_flops(b, b, 3, h, w)
            if a != b:
                conv += conv_flops(a, b, 1, h, w)                                          # shortcut
        else:
            saved += conv_flops(a, b, 3, 2 * h, 2 * w) - conv_flops(a, 4 * b, 2, h + 1, w + 1)
            saved_graph += conv_flops(a, b, 3, 2 * h, 2 * w) - conv_flops(a, 4 * b, 2, h, w)
            h, w = 2 * h, 2 * w
            conv += conv_flops(a, b, 3, h, w)                                              # conv after nearest x2
    conv += conv_flops(cfg.base_dim, cfg.out_channels, 3, h, w)                            # head
    return {"nominal": conv, "executed": conv - saved, "graph": conv - saved_graph}


def tile_flops(cfg: VAEConfig, th: int, tw: int) -> int:
    """One upsampler tile of a VAE pack (models.vae.graphs.tile_graph)."""
    return upsampler_flops(cfg, th, tw)["graph"]


def decoder_flops(cfg: VAEConfig, h: int, w: int) -> dict:
    """FLOPs to decode a latent [z, h, w] with 2D convs: {"conv", "attention", "total"} as nominally written
    (nearest x2 then 3x3 conv), and "executed": what VAEDecoder runs (upsample convs as four 2x2 phases)."""
    att = attention_flops(cfg, h, w)
    trunk_conv = trunk_flops(cfg, h, w) - att
    up = upsampler_flops(cfg, h, w)
    conv = trunk_conv + up["nominal"]
    return {"conv": conv, "attention": att, "total": conv + att, "executed": trunk_conv + up["executed"] + att}


def features_flops(cfg: VAEConfig, width: int, height: int) -> int:
    """The encoder's pixel part on a width x height image (tile): conv1 and the downsampling stages (a residual block
    is two 3x3 convs and a 1x1 shortcut where the channels change; a downsample one 3x3 stride-2 conv)."""
    h, w = height, width
    total = conv_flops(cfg.out_channels, cfg.base_dim, 3, h, w)                            # encoder.conv1
    for kind, a, b in encoder_plan(cfg):
        if kind == "res":
            total += conv_flops(a, b, 3, h, w) + conv_flops(b, b, 3, h, w)
            if a != b:
                total += conv_flops(a, b, 1, h, w)
        else:
            h, w = h // 2, w // 2
            total += conv_flops(a, b, 3, h, w)                                             # stride 2: output grid
    return total


def head_flops(cfg: VAEConfig, h: int, w: int) -> int:
    """The encoder's latent-resolution part on features [mid, h, w]: the middle block with its attention, the head
    conv and the quant conv's mean half (the logvar half is never used, and the head graph leaves it out)."""
    c, z2 = cfg.mid_dim, 2 * cfg.z_dim
    total = 4 * conv_flops(c, c, 3, h, w)                                                  # middle residuals
    total += conv_flops(c, 3 * c, 1, h, w) + conv_flops(c, c, 1, h, w) + attention_flops(cfg, h, w)
    return total + conv_flops(c, z2, 3, h, w) + conv_flops(z2, cfg.z_dim, 1, h, w)     # quant conv: the mean only
