"""The VAE encoder as fixed-shape ONNX graphs (opset 19, FP32 weights, NCHW, batch 1), built with onnx.helper from the
checkpoint's tensors (no torch), with the decoder graphs' ops (models/vae/graphs.py: the FP16-safe RMS_norm, SiLU as
x * Sigmoid, attention by MatMul): the **features** tile (conv1 and the downsampling stages on an image tile) and the
**head** (latent resolution, the whole image: the middle block with its attention, the head, the quant conv, the mean's
channels). A downsample is ZeroPad2d(0, 1, 0, 1) + a 3x3 stride-2 conv: one Conv with pads [0, 0, 1, 1].
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from models.vae.graphs import Graph, _attention, _model, _residual
from models.vae.keys import VAEConfig, encoder_plan

FEATS_IN, FEATS_OUT = "image", "feats"      # image: [1, 3, 8 th, 8 tw] in [-1, 1]; feats: [1, mid_dim, th, tw]
HEAD_IN, HEAD_OUT = "feats", "mean"         # feats: [1, mid_dim, h, w]; mean: [1, z_dim, h, w] VAE space


def _downsample(g: Graph, x: str, w: Mapping, p: str) -> str:
    wk = g.const("down_w", np.asarray(w[p + "resample.1.weight"], np.float32))
    b = g.const("down_b", np.asarray(w[p + "resample.1.bias"], np.float32))
    return g.op("Conv", [x, wk, b], "down", kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])


def features_graph(w: Mapping, cfg: VAEConfig, th: int, tw: int, scales: Mapping = None) -> tuple:
    """image [1, 3, 8 th, 8 tw] -> feats [1, mid_dim, th, tw]; -> (model, {norm key: input tensor})."""
    scales = scales or {}
    g, s = Graph(), cfg.upscale
    x = g.conv(FEATS_IN, w["encoder.conv1.weight"], w["encoder.conv1.bias"], "conv1")     # [1, 96, H, W]
    for i, (kind, _, _) in enumerate(encoder_plan(cfg)):
        p = f"encoder.downsamples.{i}."
        x = _residual(g, x, w, p, scales) if kind == "res" else _downsample(g, x, w, p)
    model = _model(g, x, "vae_enc_features", (FEATS_IN, (1, cfg.out_channels, s * th, s * tw)),
                   (FEATS_OUT, (1, cfg.mid_dim, th, tw)), f"Qwen-Image VAE encoder features, latent {th}x{tw}")
    return model, dict(g.norm_inputs)


def head_graph(w: Mapping, cfg: VAEConfig, h: int, wd: int, scales: Mapping = None) -> tuple:
    """feats [1, mid_dim, h, w] -> mean [1, z_dim, h, w] (VAE space); -> (model, {norm key: input tensor})."""
    scales = scales or {}
    g, c, z = Graph(), cfg.mid_dim, cfg.z_dim
    x = _residual(g, HEAD_IN, w, "encoder.middle.0.", scales)
    x = _attention(g, x, w, "encoder.middle.1.", c, h, wd, scales)
    x = _residual(g, x, w, "encoder.middle.2.", scales)
    x = g.silu(g.norm(x, w["encoder.head.0.gamma"], "encoder.head.0.gamma", scales))
    x = g.conv(x, w["encoder.head.2.weight"], w["encoder.head.2.bias"], "head")           # [1, 2z, h, w]
    # the quant conv's mean rows only: the logvar half is never used (ComfyUI's VAEEncode takes the mean)
    qw, qb = np.asarray(w["conv1.weight"], np.float32), np.asarray(w["conv1.bias"], np.float32)
    x = g.conv(x, qw[:z], qb[:z], "quant")                                                 # [1, z, h, w]
    model = _model(g, x, "vae_enc_head", (HEAD_IN, (1, c, h, wd)), (HEAD_OUT, (1, z, h, wd)),
                   f"Qwen-Image VAE encoder head, latent {h}x{wd}")
    return model, dict(g.norm_inputs)
