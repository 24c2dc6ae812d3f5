"""The ONNX graph builder every exported graph is made with (the DiT branches, the text encoder and adapter, the VAE
trunk and tiles): opset 19, constants in the graph's dtype, checked before they are written."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.dit.partition import NUMPY_DTYPES

OPSET = 19
ONNX_DTYPES = {"f16": TensorProto.FLOAT16, "f32": TensorProto.FLOAT}


class GraphBuilder:
    """A tiny node/initializer accumulator; every value name is unique and every constant has the graph's dtype."""

    def __init__(self, dt: str):
        self.dt = dt
        self.np_dt = NUMPY_DTYPES[dt]
        self.nodes, self.inits, self._n = [], [], 0

    def _name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, stem: str, arr) -> str:
        """A float constant in the graph dtype (weights are rounded to it here, once)."""
        name = self._name(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(np.asarray(arr, np.float32)
                                                                       .astype(self.np_dt)), name))
        return name

    def shape(self, dims) -> str:
        name = self._name("shape")
        self.inits.append(numpy_helper.from_array(np.asarray(dims, np.int64), name))
        return name

    def op(self, op_type: str, inputs, stem: str = None, **attrs) -> str:
        out = self._name(stem or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def matmul(self, x: str, w_out_in: np.ndarray, stem: str) -> str:
        """x @ Wᵀ with the checkpoint's [out, in] weight stored as a constant [in, out]."""
        return self.op("MatMul", [x, self.const(stem + "_w", np.asarray(w_out_in, np.float32).T)], stem)

    def low_rank(self, y: str, x: str, a: str, b: str, stem: str) -> str:
        """y + (x @ a) @ b: a LoRA-ready projection's run-time term, a [in, R] and b [R, out] graph inputs."""
        return self.op("Add", [y, self.op("MatMul", [self.op("MatMul", [x, a], stem + "_la"), b], stem + "_lb")],
                       stem + "_lora")


def serialize(model: onnx.ModelProto) -> bytes:
    """Model bytes (checked first: a malformed graph fails here, not on the board)."""
    onnx.checker.check_model(model)
    return model.SerializeToString()
