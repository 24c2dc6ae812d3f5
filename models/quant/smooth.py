"""SmoothQuant factors for a W8A8 pack, and which projections of a branch are INT8.

For a projection y = X·Wᵀ whose input X is the host's modulated activation, channel j of X is divided by s_j and
column j of W (the weight's input row) multiplied by s_j: y is unchanged in exact arithmetic, while X's massive
channels shrink and W's matching columns grow until both quantize well. s_j = max|X_j|^α / max|W_j|^(1-α) (Xiao et
al., "SmoothQuant", arXiv 2211.10438, eq. 4), max|X_j| from the calibration, max|W_j| over every projection that
reads X (self-attention: q, k and v share one X, so one s). The division of X costs nothing here: the host computes
X = norm(x)·(1+scale)+shift in FP32 every step, and X/s = norm(x)·((1+scale)/s) + shift/s is the same modulation
with other per-channel factors (host_ops.fold_smoothing); fc2's input (the GELU output, inside the branch) has no
host step to fold into, so fc2 is never smoothed.
"""
from __future__ import annotations

import numpy as np

# --int8 names -> (branch kind, the weights it makes INT8, smoothable: its input is the host's modulated xn)
INT8_LAYERS = {
    "fc1": ("ffn", ("layer1.weight",), True),
    "qkv": ("self", ("q_proj.weight", "k_proj.weight", "v_proj.weight"), True),
    "q": ("cross", ("q_proj.weight",), True),
    "fc2": ("ffn", ("layer2.weight",), False),
}
DEFAULT_INT8 = ("fc1", "qkv", "q")
DEFAULT_ALPHA = 0.5
SMOOTH_KEY = "quant.smooth"             # host weight [blocks, 3 (self/cross/ffn), D] f32: the factors s
S_RANGE = (1e-4, 1e4)                  # a channel that never fired (max 0) or a zero column keeps s within this
# graph stems (models/packs/branch_graphs.py) of each weight's MatMul: the tensors the toolkit keeps INT8
MATMUL_STEMS = {("self", "q_proj.weight"): ("qa", "qb"), ("self", "k_proj.weight"): ("ka", "kb"),
                ("self", "v_proj.weight"): ("v",), ("cross", "q_proj.weight"): ("q",),
                ("ffn", "layer1.weight"): ("h",), ("ffn", "layer2.weight"): ("out",)}


def parse_int8(text) -> tuple:
    """"fc1,qkv,q" -> the layer names, checked; ValueError naming --int8."""
    names = tuple(dict.fromkeys(t.strip() for t in str(text).split(",") if t.strip()))
    bad = [n for n in names if n not in INT8_LAYERS]
    if not names or bad:
        raise ValueError(f"--int8 {text!r}: choose from {', '.join(INT8_LAYERS)} (comma-separated)")
    return names


def parse_smooth(text):
    """"off" -> None; a number in (0, 1) -> alpha; ValueError naming --smooth."""
    if str(text).strip().lower() == "off":
        return None
    try:
        a = float(text)
    except ValueError:
        raise ValueError(f"--smooth {text!r}: an alpha in (0, 1) or 'off'") from None
    if not 0.0 < a < 1.0:
        raise ValueError(f"--smooth {text!r}: alpha must be in (0, 1)")
    return a


def smooth_factors(absmax: np.ndarray, weights: list, alpha: float) -> np.ndarray:
    """s [D] f32 for an input channel maximum absmax [D] and the [out, D] weights reading that input."""
    wmax = np.max(np.stack([np.abs(np.asarray(w, np.float64)).max(axis=0) for w in weights]), axis=0)   # [D]
    xmax = np.asarray(absmax, np.float64)
    s = np.ones_like(xmax)
    ok = (xmax > 0) & (wmax > 0)
    s[ok] = xmax[ok] ** alpha / wmax[ok] ** (1.0 - alpha)
    return np.clip(s, *S_RANGE).astype(np.float32)


def branch_int8(kind: str, int8: tuple) -> list:
    """The weights of one branch kind that are INT8 under the layer names `int8`."""
    return [w for n in int8 for w in INT8_LAYERS[n][1] if INT8_LAYERS[n][0] == kind]


def smoothed_weights(kind: str, int8: tuple) -> list:
    """The weights of a branch kind whose input gets divided by s (its smoothable INT8 layers)."""
    return [w for n in int8 for w in INT8_LAYERS[n][1] if INT8_LAYERS[n][0] == kind and INT8_LAYERS[n][2]]


def apply_smoothing(weights: dict, kind: str, s: np.ndarray, int8: tuple) -> dict:
    """A branch's weights with the input columns of its smoothed projections multiplied by s."""
    out = dict(weights)
    for w in smoothed_weights(kind, int8):
        out[w] = np.asarray(weights[w], np.float32) * s[None, :]
    return out


def int8_tensors(model, kind: str, int8: tuple) -> list:
    """The output names of a built branch graph's INT8 MatMuls (a projection against a constant weight)."""
    stems = {st for w in branch_int8(kind, int8) for st in MATMUL_STEMS[(kind, w)]}
    inits = {i.name for i in model.graph.initializer}
    names = [n.output[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
             and n.output[0].rsplit("_", 1)[0] in stems]
    if len(names) != sum(len(MATMUL_STEMS[(kind, w)]) for w in branch_int8(kind, int8)):
        raise ValueError(f"{kind} branch: found INT8 MatMuls {names} for {list(int8)}; the graph's stems changed")
    return names
