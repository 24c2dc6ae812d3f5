"""The text encoder as two FP32 ONNX graphs (opset 19) for ONNX Runtime: Qwen3 and the LLM adapter.

    qwen3.onnx    input_ids [S] i64                          -> hidden [S, hidden] f32   (after the last RMSNorm)
    adapter.onnx  t5_ids [T] i64, source [S, source_dim] f32 -> rows [T, width] f32      (before weights/padding)

S and T are dynamic. Written with onnx.helper from the checkpoint tensors (no torch, no exporter tracing), the
same math as models/text/qwen3.py (transformers Qwen3Model: causal, GQA, q/k RMSNorm, rotate-half RoPE θ 1e6)
and models/text/adapter.py (RoPE θ 1e4, no masks, exact GELU). Weights are stored as external data in one file
next to the graph, written tensor by tensor (the full Qwen3 is 2.4 GB in FP32, past protobuf's 2 GB limit), at
aligned offsets so ONNX Runtime can map them. Every projection's weight is an initializer named after its checkpoint
key (projections stored transposed, [in, out]; embeddings as they are); the builders return {key: (name, offset,
stored shape, transposed)}, which the encoder pack's manifest keeps, so a LoRA can replace those initializers when a
session is made (models/text/compute_onnx.py).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.graphs.builder import OPSET, GraphBuilder

IR_VERSION = 9
ALIGN = 4096                    # external-data offset alignment (page size: mappable)
INLINE_MAX = 64                 # constants up to this many elements stay inside the graph file
NEG = float(np.finfo(np.float32).min)   # the causal mask's additive bias (what transformers uses)
ADAPTER_KEY_PREFIX = "llm_adapter."     # the adapter's keys in the DiT file (and in a LoRA's names)


class _Graph(GraphBuilder):
    """branch_graphs' GraphBuilder in FP32, its large constants written to the external data file as they are made."""

    def __init__(self, data_path: Path):
        super().__init__("f32")
        self.data_path = Path(data_path)
        self._data = open(self.data_path, "wb")
        self._off = 0
        self.weights: dict = {}          # checkpoint key -> (initializer name, data file offset, stored shape, transposed)

    def close(self) -> None:
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()

    def const(self, stem: str, arr, dtype=np.float32, name: str = None, transposed: bool = False) -> str:
        """A constant; `name` given (a checkpoint key): that initializer name, always in the data file, recorded in
        `weights` (a LoRA may replace it); `transposed`: stored as the key's weight transposed."""
        a = np.ascontiguousarray(np.asarray(arr, dtype))
        fixed = name is not None
        name = name if fixed else self._name(stem)
        if a.size <= INLINE_MAX and not fixed:
            self.inits.append(numpy_helper.from_array(a, name))
            return name
        pad = (-self._off) % ALIGN
        if pad:
            self._data.write(b"\0" * pad)
            self._off += pad
        self._data.write(a.tobytes())
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(a.dtype)
        t.dims.extend(a.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_path.name), ("offset", str(self._off)), ("length", str(a.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        if fixed:
            self.weights[name] = (name, self._off, [int(d) for d in a.shape], transposed)
        self._off += a.nbytes
        self.inits.append(t)
        return name

    def ints(self, values) -> str:
        return self.const("i", np.asarray(values, np.int64), np.int64)

    def linear(self, x: str, w_out_in: np.ndarray, stem: str, bias=None, key: str = None) -> str:
        """x @ Wᵀ (+ b) with the checkpoint's [out, in] weight stored as [in, out], named `key` (its checkpoint key)
        when given."""
        if key is None:
            y = self.matmul(x, w_out_in, stem)
        else:
            w = self.const(stem + "_w", np.asarray(w_out_in, np.float32).T, name=key, transposed=True)
            y = self.op("MatMul", [x, w], stem)
        return y if bias is None else self.op("Add", [y, self.const(stem + "_b", bias)], stem + "_b")

    def rms(self, x: str, weight, eps: float, stem: str) -> str:
        """x / sqrt(mean(x², last axis) + eps) · weight."""
        ms = self.op("ReduceMean", [self.op("Mul", [x, x]), self.ints([-1])], stem + "_ms", keepdims=1)
        r = self.op("Sqrt", [self.op("Add", [ms, self.const("eps", eps)])])
        return self.op("Mul", [self.op("Div", [x, r]), self.const(stem + "_g", weight)], stem)

    def rope_tables(self, n: str, head_dim: int, theta: float, stem: str) -> tuple:
        """cos, sin [n, head_dim] for positions 0..n-1 (n a scalar i64): angles duplicated over the two halves."""
        inv = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)))
        pos = self.op("Cast", [self.op("Range", [self.ints(0), n, self.ints(1)])], stem + "_pos", to=TensorProto.FLOAT)
        ang = self.op("Mul", [self.op("Unsqueeze", [pos, self.ints([1])]),                     # [n, 1] × [hd/2]
                              self.const(stem + "_inv", inv.astype(np.float32))], stem + "_ang")
        ang = self.op("Concat", [ang, ang], stem + "_ang2", axis=-1)                          # [n, hd]
        return self.op("Cos", [ang], stem + "_cos"), self.op("Sin", [ang], stem + "_sin")

    def rope(self, x: str, cos: str, sin: str, head_dim: int, stem: str) -> str:
        """x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1] over the last axis (pairs k, k + hd/2)."""
        a, b = (self._name(stem + "_a"), self._name(stem + "_b"))
        self.nodes.append(helper.make_node("Split", [x, self.ints([head_dim // 2, head_dim // 2])], [a, b],
                                           name=a, axis=-1))
        rot = self.op("Concat", [self.op("Neg", [b]), a], stem + "_rot", axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])], stem)


def _length(g: _Graph, x: str) -> str:
    """The first dimension of x as a scalar i64."""
    return g.op("Squeeze", [g.op("Shape", [x], start=0, end=1), g.ints([0])], "len")


def _model(g: _Graph, name: str, inputs: list, outputs: list, doc: str, props: dict) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="anima-npu",
                              doc_string=doc)
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {k: str(v) for k, v in props.items()})
    return model


def _write(model: onnx.ModelProto, g: _Graph, onnx_path: Path) -> None:
    g.close()
    with open(onnx_path, "wb") as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    onnx.checker.check_model(str(onnx_path))      # by path: the checker follows the external data


# -- Qwen3 ------------------------------------------------------------------------------------------------------------
def build_qwen3(get: Callable[[str], np.ndarray], shape, onnx_path, rope_theta: float, eps: float) -> dict:
    """Qwen3 (keys `model.*`, `get(key)` -> f32 array) -> onnx_path + onnx_path.data; returns the projections'
    {key: (initializer name, data offset, stored shape, transposed)}."""
    onnx_path = Path(onnx_path)
    g = _Graph(onnx_path.with_name(onnx_path.name + ".data"))
    H, KV, hd, D = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden
    rep = H // KV

    def lin(x: str, key: str, stem: str) -> str:
        return g.linear(x, get(key), stem, key=key)
    try:
        embed = g.const("embed", get("model.embed_tokens.weight"), name="model.embed_tokens.weight")
        x = g.op("Gather", [embed, "input_ids"], "x", axis=0)                                        # [S, D]
        n = _length(g, "input_ids")
        cos, sin = g.rope_tables(n, hd, rope_theta, "rope")                                    # [S, hd] each
        cos, sin = (g.op("Unsqueeze", [t, g.ints([1])]) for t in (cos, sin))                   # [S, 1, hd]
        # causal mask: key j > query i gets NEG
        r = g.op("Range", [g.ints(0), n, g.ints(1)], "r")
        later = g.op("Greater", [g.op("Unsqueeze", [r, g.ints([0])]), g.op("Unsqueeze", [r, g.ints([1])])])  # [S, S]
        mask = g.op("Where", [later, g.const("neg", NEG), g.const("zero", 0.0)], "mask")        # [S, S] f32
        scale = g.const("scale", 1.0 / math.sqrt(hd))
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            h = g.rms(x, get(p + "input_layernorm.weight"), eps, f"l{i}_in")                    # [S, D]
            q = g.op("Reshape", [lin(h, p + "self_attn.q_proj.weight", f"l{i}_q"), g.ints([-1, H, hd])])
            k = g.op("Reshape", [lin(h, p + "self_attn.k_proj.weight", f"l{i}_k"), g.ints([-1, KV, hd])])
            v = g.op("Reshape", [lin(h, p + "self_attn.v_proj.weight", f"l{i}_v"), g.ints([-1, KV, hd])])
            q = g.rope(g.rms(q, get(p + "self_attn.q_norm.weight"), eps, f"l{i}_qn"), cos, sin, hd, f"l{i}_qr")
            k = g.rope(g.rms(k, get(p + "self_attn.k_norm.weight"), eps, f"l{i}_kn"), cos, sin, hd, f"l{i}_kr")
            # grouped-query attention: query head h = kv·rep + j reads key/value head kv
            q = g.op("Transpose", [g.op("Reshape", [q, g.ints([-1, KV, rep, hd])])], perm=[1, 2, 0, 3])  # [KV,rep,S,hd]
            kt = g.op("Unsqueeze", [g.op("Transpose", [k], perm=[1, 2, 0]), g.ints([1])])               # [KV,1,hd,S]
            vt = g.op("Unsqueeze", [g.op("Transpose", [v], perm=[1, 0, 2]), g.ints([1])])               # [KV,1,S,hd]
            s = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, kt]), scale]), mask], f"l{i}_scores")    # [KV,rep,S,S]
            o = g.op("MatMul", [g.op("Softmax", [s], axis=-1), vt])                                   # [KV,rep,S,hd]
            o = g.op("Reshape", [g.op("Transpose", [o], perm=[2, 0, 1, 3]), g.ints([-1, H * hd])])      # [S, H·hd]
            x = g.op("Add", [x, lin(o, p + "self_attn.o_proj.weight", f"l{i}_o")], f"l{i}_x1")
            h = g.rms(x, get(p + "post_attention_layernorm.weight"), eps, f"l{i}_post")
            gate = lin(h, p + "mlp.gate_proj.weight", f"l{i}_gate")                          # [S, I]
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]),
                               lin(h, p + "mlp.up_proj.weight", f"l{i}_up")], f"l{i}_act")
            x = g.op("Add", [x, lin(act, p + "mlp.down_proj.weight", f"l{i}_down")], f"l{i}_x")
        out = g.rms(x, get("model.norm.weight"), eps, "norm")
        g.nodes.append(helper.make_node("Identity", [out], ["hidden"], name="output"))
        model = _model(g, "qwen3", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["S"])],
                       [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["S", D])],
                       "Qwen3 text encoder: token ids -> final hidden states (after the last RMSNorm), FP32",
                       {"part": "qwen3", "rope_theta": rope_theta, "rms_eps": eps})
        _write(model, g, onnx_path)
    except BaseException:
        g._data.close()
        raise
    return g.weights


# -- LLM adapter ------------------------------------------------------------------------------------------------------
def _adapter_linear(g: _Graph, get, x: str, key: str, stem: str, bias=None) -> str:
    """An adapter projection, its initializer named after the DiT file's key (llm_adapter.<key>)."""
    return g.linear(x, get(key), stem, bias=bias, key=ADAPTER_KEY_PREFIX + key)


def _attention(g: _Graph, get, p: str, x: str, src: str, rope_x: tuple, rope_src: tuple, c, eps: float) -> str:
    H, hd = c.heads, c.head_dim
    q = g.op("Reshape", [_adapter_linear(g, get, x, p + "q_proj.weight", p + "q"), g.ints([-1, H, hd])])   # [n, H, hd]
    k = g.op("Reshape", [_adapter_linear(g, get, src, p + "k_proj.weight", p + "k"), g.ints([-1, H, hd])])  # [m, H, hd]
    v = g.op("Reshape", [_adapter_linear(g, get, src, p + "v_proj.weight", p + "v"), g.ints([-1, H, hd])])  # [m, H, hd]
    q = g.op("Transpose", [g.rms(q, get(p + "q_norm.weight"), eps, p + "qn")], perm=[1, 0, 2])        # [H, n, hd]
    k = g.op("Transpose", [g.rms(k, get(p + "k_norm.weight"), eps, p + "kn")], perm=[1, 0, 2])        # [H, m, hd]
    q = g.rope(q, *rope_x, hd, p + "qr")
    k = g.rope(k, *rope_src, hd, p + "kr")
    s = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])]),
                     g.const("scale", 1.0 / math.sqrt(hd))], p + "scores")                             # [H, n, m]
    o = g.op("MatMul", [g.op("Softmax", [s], axis=-1), g.op("Transpose", [v], perm=[1, 0, 2])])        # [H, n, hd]
    o = g.op("Reshape", [g.op("Transpose", [o], perm=[1, 0, 2]), g.ints([-1, H * hd])])                # [n, H·hd]
    return _adapter_linear(g, get, o, p + "o_proj.weight", p + "o")


def build_adapter(get: Callable[[str], np.ndarray], c, onnx_path, rope_theta: float, eps: float) -> dict:
    """LLM adapter (keys without the `llm_adapter.` prefix, `get(key)` -> f32) -> onnx_path + onnx_path.data;
    returns the weights' {llm_adapter.key: (initializer name, data offset, stored shape, transposed)}."""
    onnx_path = Path(onnx_path)
    g = _Graph(onnx_path.with_name(onnx_path.name + ".data"))
    try:
        embed = g.const("embed", get("embed.weight"), name=ADAPTER_KEY_PREFIX + "embed.weight")
        x = g.op("Gather", [embed, "t5_ids"], "x", axis=0)                                          # [T, W]
        rope_x = tuple(g.op("Unsqueeze", [t, g.ints([0])]) for t in g.rope_tables(_length(g, "t5_ids"), c.head_dim,
                                                                                      rope_theta, "rope_t"))
        rope_s = tuple(g.op("Unsqueeze", [t, g.ints([0])]) for t in g.rope_tables(_length(g, "source"), c.head_dim,
                                                                                      rope_theta, "rope_s"))
        sqrt2 = g.const("sqrt2", math.sqrt(2.0))
        for i in range(c.blocks):
            b = f"blocks.{i}."
            h = g.rms(x, get(b + "norm_self_attn.weight"), eps, b + "n1")
            x = g.op("Add", [x, _attention(g, get, b + "self_attn.", h, h, rope_x, rope_x, c, eps)], b + "x1")
            h = g.rms(x, get(b + "norm_cross_attn.weight"), eps, b + "n2")
            x = g.op("Add", [x, _attention(g, get, b + "cross_attn.", h, "source", rope_x, rope_s, c, eps)], b + "x2")
            h = _adapter_linear(g, get, g.rms(x, get(b + "norm_mlp.weight"), eps, b + "n3"), b + "mlp.0.weight",
                                b + "mlp0", bias=get(b + "mlp.0.bias"))                               # [T, mlp]
            act = g.op("Mul", [g.op("Mul", [h, g.op("Add", [g.op("Erf", [g.op("Div", [h, sqrt2])]),
                                                            g.const("one", 1.0)])]), g.const("half", 0.5)], b + "gelu")
            x = g.op("Add", [x, _adapter_linear(g, get, act, b + "mlp.2.weight", b + "mlp2",
                                                bias=get(b + "mlp.2.bias"))], b + "x")
        out = g.rms(_adapter_linear(g, get, x, "out_proj.weight", "out_proj", bias=get("out_proj.bias")),
                    get("norm.weight"), eps, "norm")
        g.nodes.append(helper.make_node("Identity", [out], ["rows"], name="output"))
        model = _model(g, "llm_adapter",
                       [helper.make_tensor_value_info("t5_ids", TensorProto.INT64, ["T"]),
                        helper.make_tensor_value_info("source", TensorProto.FLOAT, ["S", c.source_dim])],
                       [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["T", c.width])],
                       "Anima LLM adapter: T5 ids + Qwen3 states -> context rows (before weights and padding), FP32",
                       {"part": "adapter", "rope_theta": rope_theta, "rms_eps": eps})
        _write(model, g, onnx_path)
    except BaseException:
        g._data.close()
        raise
    return g.weights
