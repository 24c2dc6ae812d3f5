"""STAND-IN for rknn-toolkit-lite2's `rknnlite.api` — NOT the NPU. For x86 tests only: we have no RK3588 here.

It offers the same surface as the real package (class RKNNLite with the NPU_CORE_* constants; load_rknn,
init_runtime, inference, release, get_sdk_version; 0 / -1 return codes; inference -> list of float32 arrays or None)
but runs the branch's ONNX graph with ONNX Runtime on the CPU. The ONNX file is found through the pack manifest: the
.rknn path's pack is its grandparent folder, whose manifest.json names the ONNX graph each .rknn was compiled from.
Nothing it measures says anything about NPU speed or memory; the backend labels every report made with it.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

IS_STANDIN = True
STANDIN_LABEL = "rknnlite STAND-IN (ONNX Runtime on the CPU; not an RK3588 NPU)"
LITE_VERSION = "2.5.0"          # the rknn-toolkit-lite2 release this stand-in imitates (the board pin, pyproject.toml)


def onnx_for_rknn(rknn_path) -> Path:
    """The ONNX graph a pack's .rknn was compiled from (manifest branch entry whose rknn.file is this file)."""
    from models.pack import pack_member
    from models.backends.rknn import branch_entry          # the backend's one manifest reader
    pack, entry = branch_entry(rknn_path)
    return pack_member(pack, entry["onnx"])


class RKNNLite:
    """Same constants and return conventions as rknnlite.api.RKNNLite (2.x); computes with ONNX Runtime."""
    NPU_CORE_AUTO = 0
    NPU_CORE_0 = 1
    NPU_CORE_1 = 2
    NPU_CORE_2 = 4
    NPU_CORE_0_1 = 3
    NPU_CORE_0_1_2 = 7
    NPU_CORE_ALL = 0xFFFF
    _MASKS = (0, 1, 2, 4, 3, 7, 0xFFFF)
    calls: list = []                     # class-wide (method, rknn file, core_mask, thread name) record, for tests
    _calls_lock = threading.Lock()

    def __init__(self, verbose=False, verbose_file=None):
        self.verbose = verbose
        self._path = None
        self._bytes = None
        self._onnx = None
        self._sess = None
        self.core_mask = None

    def _record(self, method: str) -> None:
        with RKNNLite._calls_lock:
            RKNNLite.calls.append((method, self._path and os.path.basename(self._path), self.core_mask,
                                   threading.current_thread().name))

    def load_rknn(self, path):
        """Read the model file; 0 on success, -1 on failure (as the real API)."""
        self._path = os.fspath(path)
        try:
            with open(self._path, "rb") as f:
                self._bytes = f.read()
            self._onnx = onnx_for_rknn(self._path)
        except (OSError, ValueError, KeyError, RuntimeError) as e:     # RuntimeError: the manifest lookup's
            log.error("load_rknn %s: %s", self._path, e)
            return -1
        self._record("load_rknn")
        return 0

    def init_runtime(self, target=None, device_id=None, async_mode=False, core_mask=NPU_CORE_AUTO):
        """Create the runtime context on `core_mask`; 0 on success, -1 on failure."""
        import onnxruntime as ort
        if self._bytes is None:
            log.error("init_runtime: no model loaded")
            return -1
        if core_mask not in self._MASKS:
            log.error("init_runtime: invalid core_mask %r", core_mask)
            return -1
        self.core_mask = core_mask
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1        # one "core" per context, so two contexts really run side by side
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._sess = ort.InferenceSession(str(self._onnx), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT's own exception types
            log.error("init_runtime %s: %s", self._onnx, e)
            return -1
        self._record("init_runtime")
        return 0

    def inference(self, inputs, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False):
        """inputs: list of arrays in the model's input order -> list of float32 arrays, or None on failure.

        As the real runtime, a 4-D input is read as NHWC unless data_format says 'nchw' (one value or one per input);
        4-D outputs come back NCHW (what rknn-toolkit2's simulator returns for these graphs)."""
        if self._sess is None:
            log.error("inference: runtime not initialised")
            return None
        specs = self._sess.get_inputs()
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(specs):
            log.error("inference: expected %d inputs, got %r", len(specs), type(inputs).__name__)
            return None
        fmts = list(data_format) if isinstance(data_format, (list, tuple)) else [data_format] * len(specs)
        feed = {}
        for s, x, fmt in zip(specs, inputs, fmts):
            dt = np.float16 if s.type == "tensor(float16)" else np.float32
            a = np.asarray(x)
            if len(s.shape) == 4 and (fmt or "nhwc") == "nhwc":     # the real default for 4-D inputs: NHWC
                n, c, h, w = s.shape
                if a.shape != (n, h, w, c):
                    log.error("inference: input %s shape %s is wrong, expect 'nhwc' like %s (or pass "
                              "data_format='nchw')", s.name, a.shape, (n, h, w, c))
                    return None
                a = a.transpose(0, 3, 1, 2)
            feed[s.name] = a.astype(dt, copy=False)
        self._record("inference")
        outs = self._sess.run(None, feed)
        return [np.asarray(o, np.float32) for o in outs]

    def get_sdk_version(self):
        import onnxruntime as ort
        return f"{STANDIN_LABEL}; onnxruntime {ort.__version__}"

    def release(self):
        self._record("release")
        self._sess = None
        self._bytes = None
        return None
