"""FP16 safety of the VAE graphs: activation ranges measured with ONNX Runtime (FP32) at pack time, the power-of-two
input scale of every RMS_norm derived from them, and a headroom report the manifest keeps.

The NPU runs the graphs in FP16 (max 65504). The one place this decoder can overflow by construction is the norm's
sum of squares (|x| > 255 already squares past it), so each norm's input is divided by s = 2^k chosen from the
calibrated max|x| (exact in FP16 and FP32: x / rms(x) does not change). Every other activation is checked against the
FP16 maximum; a model whose activations come within HEADROOM_MIN of it is reported (and `anima-models pack-vae`
warns): such a checkpoint needs a rescaled graph, not a silent overflow on the board.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable, Mapping, Optional

import numpy as np

from models.vae.graphs import NORM_INTERNAL, with_absmax_outputs

log = logging.getLogger(__name__)

FP16_MAX = 65504.0
SCALE_TARGET = 8.0     # calibrated max|x| / s at a norm input stays <= 8: squares <= 64, ~1000x below FP16's max
HEADROOM_MIN = 4.0     # an activation within 4x of FP16's max (> 16376) is a risk worth a warning


def ort_session(model_or_bytes, threads: Optional[int] = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or 0
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    data = model_or_bytes if isinstance(model_or_bytes, bytes) else model_or_bytes.SerializeToString()
    return ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])


def activation_ranges(model, feeds: Iterable[Mapping], threads: Optional[int] = None) -> dict:
    """{tensor name: max |value| over every feed} for the model's inputs and node outputs (FP32, ONNX Runtime)."""
    probe, names = with_absmax_outputs(model)
    sess = ort_session(probe, threads)
    outs = list(names.values())
    ranges = dict.fromkeys(names, 0.0)
    for feed in feeds:
        for t, v in zip(names, sess.run(outs, dict(feed))):
            ranges[t] = max(ranges[t], float(v))
    return ranges


def norm_scales(norm_inputs: Mapping, ranges: Mapping) -> dict:
    """{norm key: s}: the smallest power of two with max|x| / s <= SCALE_TARGET (1 when the input is small)."""
    out = {}
    for key, tensor in norm_inputs.items():
        m = float(ranges.get(tensor, 0.0))
        if not math.isfinite(m):
            raise ValueError(f"norm {key}: its input {tensor} is not finite in FP32 at calibration")
        out[key] = float(2.0 ** max(0, math.ceil(math.log2(m / SCALE_TARGET)))) if m > SCALE_TARGET else 1.0
    return out


def headroom(ranges: Mapping, norm_inputs: Mapping, scales: Mapping) -> dict:
    """The FP16 report of one model from the ranges of its unscaled graph: the largest activation (and where) and
    FP16_MAX over it, and the largest square a norm forms once its input is divided by its scale. The tensors inside
    a norm (x / s, its square, the mean square, its rsqrt, x / rms) are the ones the scales change; they are bounded
    by that square (x / rms(x) by sqrt(C)), so they are left out of the activation maximum."""
    acts = {t: v for t, v in ranges.items() if not t.startswith(NORM_INTERNAL)}
    at, m = max(acts.items(), key=lambda kv: kv[1]) if acts else ("", 0.0)
    sq = max(((float(ranges.get(t, 0.0)) / scales.get(k, 1.0)) ** 2 for k, t in norm_inputs.items()), default=0.0)
    room = FP16_MAX / m if m > 0 else math.inf
    return {"max_abs": round(m, 4), "at": at, "headroom": round(room, 1) if math.isfinite(room) else None,
            "norm_square_max": round(sq, 3), "ok": bool(room >= HEADROOM_MIN and sq * HEADROOM_MIN <= FP16_MAX)}
