"""The VAE decoder as fixed-shape ONNX graphs (opset 19, FP32 weights, NCHW, batch 1), built with onnx.helper from
the checkpoint's tensors (no torch): the **trunk** (latent resolution, the whole image: conv2, conv1, middle block with
its attention) and one upsampler **tile** (the upsampling stages and the head). VAE packs hold both; ONNX Runtime runs
them as they are, rknn-toolkit2 compiles them for the NPU (FP16).

Op choices (what rknn-toolkit2 2.5.0 maps to NPU ops; docs/vae.md lists the build-log placement):
- RMS_norm without a norm op: squares, a 1x1 Conv with a power-of-two constant for the channel sum (so the weight is
  exact in FP16), + a tiny floor, Pow(-0.5), Mul by x and gamma (with sqrt(C / 2^k) folded in). Its input is first
  multiplied by an exact power of two 1/s chosen from the activation ranges measured at pack time (`norm_scales`),
  so the squares cannot overflow FP16 (max 65504: |x| > 255 would) and x / rms(x) is unchanged;
- SiLU as x * Sigmoid(x) (fused into one exSwish op);
- nearest x2 + 3x3 conv as four 2x2 convs on the small grid with asymmetric pads (one per output phase), Concat,
  DepthToSpace (DCR): the compiler makes the interleave one NPU deconvolution;
- attention: q, k, v as three 1x1 convs (no Split), the 1/sqrt(C) scale folded into q's weights, scores by MatMul,
  Softmax over the last axis, MatMul with v.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper

from models.graphs.builder import OPSET, GraphBuilder
from models.vae.keys import VAEConfig, decoder_plan
from models.vae.subpixel import PHASES, subpixel_weights

TRUNK_IN, TRUNK_OUT = "z", "feats"           # z: [1, z_dim, h, w] VAE space; feats: [1, mid_dim, h, w]
TILE_IN, TILE_OUT = "feats", "image"         # feats: [1, mid_dim, th, tw]; image: [1, 3, 8 th, 8 tw] (≈[-1, 1])
NORM_INTERNAL = ("norm_in_", "norm_sq_", "norm_ms_", "norm_floor_", "norm_r_", "norm_x_")   # tensors inside a norm
NORM_FLOOR = 2.0 ** -24                      # added to the mean square (smallest FP16 subnormal): keeps Pow(-0.5)
                                             # finite on an all-zero pixel, changes nothing else in FP16 and < 1e-5
                                             # relative in FP32 (an Add: a Max with a constant lands on the CPU)


class Graph(GraphBuilder):
    """GraphBuilder (FP32) that also records which tensor feeds each RMS_norm (for the activation-range pass)."""

    def __init__(self):
        super().__init__("f32")
        self.norm_inputs: dict = {}          # norm key (its gamma's checkpoint name) -> input tensor name

    def conv(self, x: str, w: np.ndarray, b: Optional[np.ndarray], stem: str, pads=None) -> str:
        w = np.asarray(w, np.float32)
        k = w.shape[-1]
        pads = pads if pads is not None else [k // 2] * 4
        ins = [x, self.const(stem + "_w", w)] + ([self.const(stem + "_b", b)] if b is not None else [])
        return self.op("Conv", ins, stem, kernel_shape=[w.shape[-2], k], pads=list(pads))

    def norm(self, x: str, gamma: np.ndarray, key: str, scales: Mapping) -> str:
        """RMS_norm over channels: x / ||x|| * sqrt(C) * gamma == xs * rsqrt(sum(xs^2) / 2^k) * gamma * sqrt(C / 2^k)
        with xs = x / s (s a power of two from `scales`, 1 when absent)."""
        self.norm_inputs[key] = x
        c = int(np.asarray(gamma).shape[0])
        s = float(scales.get(key, 1.0))
        xs = x if s == 1.0 else self.op("Mul", [x, self.const("inv_s", 1.0 / s)], "norm_in")
        k = int(math.floor(math.log2(c)))
        sq = self.op("Mul", [xs, xs], "norm_sq")                                       # [1, C, h, w]
        ms = self.conv(sq, np.full((1, c, 1, 1), 2.0 ** -k, np.float32), None, "norm_ms")   # [1, 1, h, w]
        r = self.op("Pow", [self.op("Add", [ms, self.const("floor", NORM_FLOOR)], "norm_floor"),
                            self.const("m_half", -0.5)], "norm_r")                    # [1, 1, h, w]
        g = np.asarray(gamma, np.float32).reshape(1, c, 1, 1) * np.float32(math.sqrt(c / 2.0 ** k))
        return self.op("Mul", [self.op("Mul", [xs, r], "norm_x"), self.const("gamma", g)], "norm")

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])], "silu")


def _residual(g: Graph, x: str, w: Mapping, p: str, scales: Mapping) -> str:
    """x: [1, cin, h, w] -> [1, cout, h, w]: norm, SiLU, 3x3 conv, norm, SiLU, 3x3 conv, + (1x1 shortcut of) x."""
    h = g.conv(x, w[p + "shortcut.weight"], w[p + "shortcut.bias"], "shortcut") if p + "shortcut.weight" in w else x
    y = g.silu(g.norm(x, w[p + "residual.0.gamma"], p + "residual.0.gamma", scales))
    y = g.conv(y, w[p + "residual.2.weight"], w[p + "residual.2.bias"], "conv")
    y = g.silu(g.norm(y, w[p + "residual.3.gamma"], p + "residual.3.gamma", scales))
    y = g.conv(y, w[p + "residual.6.weight"], w[p + "residual.6.bias"], "conv")
    return g.op("Add", [y, h], "res")


def _attention(g: Graph, x: str, w: Mapping, p: str, c: int, h: int, wd: int, scales: Mapping) -> str:
    """Single-head attention over all h*w pixels, + x. x: [1, C, h, w]."""
    n = h * wd
    y = g.norm(x, w[p + "norm.gamma"], p + "norm.gamma", scales)
    wqkv, bqkv = np.asarray(w[p + "to_qkv.weight"], np.float32), np.asarray(w[p + "to_qkv.bias"], np.float32)
    inv = np.float32(1.0 / math.sqrt(c))                                   # softmax(q kᵀ / sqrt(C)): folded into q
    q = g.conv(y, wqkv[:c] * inv, bqkv[:c] * inv, "q")                     # [1, C, h, w]
    k = g.conv(y, wqkv[c:2 * c], bqkv[c:2 * c], "k")
    v = g.conv(y, wqkv[2 * c:], bqkv[2 * c:], "v")
    flat = g.shape([1, c, n])
    qt = g.op("Transpose", [g.op("Reshape", [q, flat], "q3")], "qT", perm=[0, 2, 1])    # [1, N, C]
    k3 = g.op("Reshape", [k, flat], "k3")                                               # [1, C, N]
    vt = g.op("Transpose", [g.op("Reshape", [v, flat], "v3")], "vT", perm=[0, 2, 1])    # [1, N, C]
    probs = g.op("Softmax", [g.op("MatMul", [qt, k3], "scores")], "probs", axis=-1)     # [1, N, N]
    o = g.op("Transpose", [g.op("MatMul", [probs, vt], "attn")], "oT", perm=[0, 2, 1])  # [1, C, N]
    o = g.op("Reshape", [o, g.shape([1, c, h, wd])], "o4")                              # [1, C, h, w]
    o = g.conv(o, w[p + "proj.weight"], w[p + "proj.bias"], "proj")
    return g.op("Add", [o, x], "attn_res")


def _upsample(g: Graph, x: str, w: Mapping, p: str) -> str:
    """Nearest x2 then 3x3 conv: x [1, C, h, w] -> [1, Co, 2h, 2w], as four phase convs + DepthToSpace (DCR)."""
    wk, bias = subpixel_weights(w[p + "resample.1.weight"], w[p + "resample.1.bias"])   # [4 Co, C, 2, 2], [4 Co]
    co = wk.shape[0] // 4
    phases = []
    for k, (a, c) in enumerate(PHASES):      # phase (a, c) reads rows i-1+a, i+a and columns j-1+c, j+c
        phases.append(g.conv(x, wk[k * co:(k + 1) * co], bias[k * co:(k + 1) * co], f"phase{a}{c}",
                             pads=[1 - a, 1 - c, a, c]))                                  # [1, Co, h, w]
    cat = g.op("Concat", phases, "phases", axis=1)                                       # [1, 4 Co, h, w]
    return g.op("DepthToSpace", [cat], "up", blocksize=2, mode="DCR")                    # [1, Co, 2h, 2w]


def _model(g: Graph, out: str, name: str, inp: tuple, outp: tuple, doc: str) -> onnx.ModelProto:
    g.nodes.append(helper.make_node("Identity", [out], [outp[0]], name="output"))
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))    # noqa: E731
    graph = helper.make_graph(g.nodes, name, [vi(*inp)], [vi(*outp)], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="anima-npu",
                              doc_string=doc)
    model.ir_version = min(model.ir_version, 9)      # readable by rknn-toolkit2's onnx
    return model


def trunk_graph(w: Mapping, cfg: VAEConfig, h: int, wd: int, scales: Mapping = None) -> tuple:
    """z [1, z_dim, h, w] (VAE space) -> feats [1, mid_dim, h, w]; -> (model, {norm key: input tensor})."""
    scales = scales or {}
    g, c = Graph(), cfg.mid_dim
    x = g.conv(TRUNK_IN, w["conv2.weight"], w["conv2.bias"], "conv2")                    # [1, z, h, w]
    x = g.conv(x, w["decoder.conv1.weight"], w["decoder.conv1.bias"], "conv1")          # [1, C, h, w]
    x = _residual(g, x, w, "decoder.middle.0.", scales)
    x = _attention(g, x, w, "decoder.middle.1.", c, h, wd, scales)
    x = _residual(g, x, w, "decoder.middle.2.", scales)
    model = _model(g, x, "vae_trunk", (TRUNK_IN, (1, cfg.z_dim, h, wd)), (TRUNK_OUT, (1, c, h, wd)),
                   f"Qwen-Image VAE decoder trunk, latent {h}x{wd}")
    return model, dict(g.norm_inputs)


def tile_graph(w: Mapping, cfg: VAEConfig, th: int, tw: int, scales: Mapping = None) -> tuple:
    """feats [1, mid_dim, th, tw] -> image [1, 3, 8 th, 8 tw] (unclamped); -> (model, {norm key: input tensor})."""
    scales = scales or {}
    g, s = Graph(), cfg.upscale
    x = TILE_IN
    for i, (kind, _, _) in enumerate(decoder_plan(cfg)):
        p = f"decoder.upsamples.{i}."
        x = _residual(g, x, w, p, scales) if kind == "res" else _upsample(g, x, w, p)
    x = g.silu(g.norm(x, w["decoder.head.0.gamma"], "decoder.head.0.gamma", scales))
    x = g.conv(x, w["decoder.head.2.weight"], w["decoder.head.2.bias"], "head")        # [1, 3, 8 th, 8 tw]
    model = _model(g, x, "vae_tile", (TILE_IN, (1, cfg.mid_dim, th, tw)),
                   (TILE_OUT, (1, cfg.out_channels, s * th, s * tw)), f"Qwen-Image VAE decoder tile, {th}x{tw}")
    return model, dict(g.norm_inputs)


def with_absmax_outputs(model: onnx.ModelProto) -> tuple:
    """A copy of `model` with one extra scalar output max|t| per float node output t (ReduceMax of Abs: the tensors
    themselves are never returned, so the pass costs one inference's memory); -> (model, {tensor: output name})."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = {}
    tensors = [i.name for i in m.graph.input] + [n.output[0] for n in m.graph.node
                                                   if n.output and n.op_type not in ("Reshape", "Identity")]
    for t in tensors:
        a, r = f"absmax_abs/{t}", f"absmax/{t}"
        m.graph.node.extend([helper.make_node("Abs", [t], [a]), helper.make_node("ReduceMax", [a], [r], keepdims=0)])
        m.graph.output.append(helper.make_tensor_value_info(r, TensorProto.FLOAT, []))
        names[t] = r
    return m, names
