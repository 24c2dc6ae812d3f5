"""ONNX graph checks before compiling: known rknn-toolkit2 regressions, keyed by toolkit version and graph pattern."""
from __future__ import annotations

import onnx

# toolkit version -> (pattern name, what goes wrong). Checked before any build; the compile refuses the combination.
KNOWN_REGRESSIONS = {
    "2.3.2": ("adaln", "rknn-toolkit2 2.3.2 segfaults (exit 139) building a LayerNorm multiplied by an in-graph "
                       "Linear output (the AdaLN modulation pattern); 2.3.0 and 2.5.0 build it. Use 2.5.0 "
                       "(scripts/rknn_venv.sh) or keep the modulation on the host"),
}
LINEAR_OPS = ("MatMul", "Gemm")
NORM_OPS = ("LayerNormalization",)
PASS_THROUGH = ("Reshape", "Unsqueeze", "Squeeze", "Transpose", "Add", "Sub", "Slice", "Split", "Cast", "Identity",
                "Expand")
MAX_HOPS = 4                      # how far back through PASS_THROUGH ops a source is traced


def _producers(graph: onnx.GraphProto) -> dict:
    return {out: node for node in graph.node for out in node.output}


def _comes_from(name: str, ops: tuple, prod: dict, hops: int = MAX_HOPS) -> bool:
    """Whether tensor `name` is the output of one of `ops`, possibly through a few pass-through ops."""
    node = prod.get(name)
    if node is None:
        return False
    if node.op_type in ops:
        return True
    if hops <= 0 or node.op_type not in PASS_THROUGH:
        return False
    return any(_comes_from(i, ops, prod, hops - 1) for i in node.input if i)


def _is_layernorm_output(name: str, prod: dict) -> bool:
    """LayerNormalization, or its decomposed form ending in Div(x - mean, Sqrt(var + eps))."""
    if _comes_from(name, NORM_OPS, prod, hops=1):
        return True
    node = prod.get(name)
    if node is None or node.op_type not in ("Div", "Mul"):
        return False
    return any(_comes_from(i, ("Sqrt", "Reciprocal", "Pow"), prod, hops=1) for i in node.input) and \
        any(_comes_from(i, ("Sub",), prod, hops=0) for i in node.input)


def find_adaln(model: onnx.ModelProto) -> list:
    """Names of Mul nodes that multiply a LayerNorm output by a value computed by an in-graph Linear (MatMul/Gemm)."""
    prod = _producers(model.graph)
    hits = []
    for node in model.graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        a, b = node.input
        if (_is_layernorm_output(a, prod) and _comes_from(b, LINEAR_OPS, prod)) or \
                (_is_layernorm_output(b, prod) and _comes_from(a, LINEAR_OPS, prod)):
            hits.append(node.name or node.output[0])
    return hits


PATTERNS = {"adaln": find_adaln}


def regression_for(toolkit_version: str, model: onnx.ModelProto):
    """-> a refusal message when this toolkit version is known to fail on a pattern present in `model`, else None."""
    known = KNOWN_REGRESSIONS.get(str(toolkit_version).strip())
    if known is None:
        return None
    pattern, why = known
    hits = PATTERNS[pattern](model)
    if not hits:
        return None
    return f"{why} (found at node(s) {', '.join(hits[:3])}{' …' if len(hits) > 3 else ''})"
