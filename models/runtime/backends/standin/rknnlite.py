"""STAND-IN for rknn-toolkit-lite2's `rknnlite.api` — NOT the NPU. For x86 tests only: we have no RK3588 here.

It offers the same surface as the real package (class RKNNLite with the NPU_CORE_* constants; load_rknn,
init_runtime, inference, release, get_sdk_version; 0 / -1 return codes; inference -> list of float32 arrays or None;
its `rknn_runtime` with set_inputs / run / get_outputs, the three steps inference() is made of) and the same rules
for inputs (types, pass-through, layouts: `_Runtime`) but runs the branch's ONNX graph with ONNX Runtime on the CPU.
The ONNX file is found through the pack manifest: the .rknn path's pack is its grandparent folder, whose
manifest.json names the ONNX graph each .rknn was compiled from (a shard's too).
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
    from models.packs.pack import pack_member
    from models.runtime.backends.compiled import branch_entry     # the backend's one manifest reader
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
        self.rknn_runtime = None
        self.core_mask = None

    def _record(self, method: str) -> None:
        with RKNNLite._calls_lock:
            RKNNLite.calls.append((method, self._path and os.path.basename(self._path), self.core_mask,
                                   threading.current_thread().name))

    def load_rknn(self, path, key_path=None):
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
            self.rknn_runtime = _Runtime(ort.InferenceSession(str(self._onnx), sess_options=opts,
                                                              providers=["CPUExecutionProvider"]))
        except Exception as e:  # ORT's own exception types
            log.error("init_runtime %s: %s", self._onnx, e)
            return -1
        self._record("init_runtime")
        return 0

    def inference(self, inputs, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False,
                  reuse_outputs=False):
        """inputs: list of np.ndarray in the model's input order -> list of float32 arrays, or None on failure (the
        error logged). The three steps and their rules are the real wrapper's (rknn-toolkit-lite2 2.5.0, P9 in
        docs/board-figures.md): set_inputs, run, get_outputs on `rknn_runtime`."""
        if self.rknn_runtime is None:
            log.error("Runtime environment is not inited, please call init_runtime to init it first!")
            return None
        try:
            self.rknn_runtime.set_inputs(inputs, data_type, data_format, inputs_pass_through=inputs_pass_through)
            self.rknn_runtime.run(get_frame_id)
            outputs = self.rknn_runtime.get_outputs(get_frame_id, reuse_outputs=reuse_outputs)
        except StandinError as e:
            log.error("%s", e)
            return None
        self._record("inference")
        return outputs

    def get_sdk_version(self):
        import onnxruntime as ort
        return f"{STANDIN_LABEL}; onnxruntime {ort.__version__}"

    def release(self):
        self._record("release")
        self.rknn_runtime = None
        self._bytes = None
        return None


class StandinError(RuntimeError):
    """What the real runtime logs and answers with None (the stand-in logs it the same way)."""


DATA_TYPES = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "float16": np.float16, "float32": np.float32}


class _Runtime:
    """The runtime object behind RKNNLite (`rknn_runtime`): set_inputs, run, get_outputs, as the real wrapper calls
    them, with the real API's rules (P9): inputs a list of np.ndarray; `data_type` (one name or one per input) equal
    to each input's dtype; `inputs_pass_through` one 0/1 per input, and a passed-through buffer goes to the NPU
    unconverted, so it must be the model's own type and (native) layout: the stand-in refuses one that is not (the
    board would compute garbage), and 4-D ones (their native layout, NC1HWC2, is not emulated here); a 4-D input is
    read as NHWC unless data_format says 'nchw'; outputs come back float32 (no output dtype argument), 4-D ones NCHW
    (what rknn-toolkit2's simulator returns for these graphs)."""

    def __init__(self, sess):
        self.sess = sess
        self.specs = sess.get_inputs()
        self._feed = None
        self._outs = None
        self._reused = None
        self.passed_through = []              # per input of the last set_inputs: 1 = passed through (for tests)

    def set_inputs(self, inputs, data_type=None, data_format=None, inputs_pass_through=None):
        specs = self.specs
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(specs):
            raise StandinError(f"Inputs are invalid. (expected a list of {len(specs)} inputs)")
        for i, x in enumerate(inputs):
            if not isinstance(x, np.ndarray):
                raise StandinError(f"Type of inputs[{i}] is not np.ndarray!")
        types = list(data_type) if isinstance(data_type, (list, tuple)) else [data_type] * len(inputs)
        if len(types) != len(inputs):
            raise StandinError("The lengths of data_type and inputs are not equal.")
        for i, (x, t) in enumerate(zip(inputs, types)):
            if t is not None and (t not in DATA_TYPES or x.dtype != DATA_TYPES[t]):
                raise StandinError(f"inputs[{i}].dtype: {x.dtype} is not same as data_type[{i}]" if t in DATA_TYPES
                                   else f"Unsupport data type: {t}")
            if x.dtype not in [np.dtype(v) for v in DATA_TYPES.values()]:
                raise StandinError(f"Unsupport inputs[{i}].dtype: {x.dtype}")
        through = list(inputs_pass_through) if inputs_pass_through is not None else [0] * len(inputs)
        if len(through) != len(inputs):
            raise StandinError("The lengths of inputs_pass_through and inputs are not equal.")
        fmts = list(data_format) if isinstance(data_format, (list, tuple)) else [data_format] * len(specs)
        feed = {}
        for i, (s, x, fmt, pt) in enumerate(zip(specs, inputs, fmts, through)):
            dt = np.float16 if s.type == "tensor(float16)" else np.float32
            if pt:
                if len(s.shape) == 4:
                    raise StandinError(f"inputs[{i}] pass_through: the stand-in does not emulate the NPU's native "
                                       "4-D layout (NC1HWC2); pass 4-D inputs converted")
                if x.dtype != dt or x.size != int(np.prod(s.shape)):
                    raise StandinError(f"Size of inputs[{i}] is invalid! (pass_through needs the model's own "
                                       f"{np.dtype(dt)} {list(s.shape)}, got {x.dtype} {list(x.shape)})")
                feed[s.name] = x.reshape(s.shape)
                continue
            a = x
            if len(s.shape) == 4 and (fmt or "nhwc") == "nhwc":     # the real default for 4-D inputs: NHWC
                n, c, h, w = s.shape
                if a.shape != (n, h, w, c):
                    raise StandinError(f"input {s.name} shape {a.shape} is wrong, expect 'nhwc' like {(n, h, w, c)} "
                                       "(or pass data_format='nchw')")
                a = a.transpose(0, 3, 1, 2)
            if a.size != int(np.prod(s.shape)):
                raise StandinError(f"Size of inputs[{i}] is invalid!")
            feed[s.name] = a.reshape(s.shape).astype(dt, copy=False)      # the runtime converts the type
        self._feed, self.passed_through = feed, [int(bool(p)) for p in through]

    def run(self, get_frame_id=False):
        if self._feed is None:
            raise StandinError("run: no inputs set")
        self._outs = self.sess.run(None, self._feed)
        return 0, None

    def get_outputs(self, get_frame_id=False, reuse_outputs=False):
        if self._outs is None:
            raise StandinError("Get outputs failed, error code: -1")
        outs = [np.asarray(o, np.float32) for o in self._outs]       # float32 always (want_float)
        if reuse_outputs:                   # views of buffers the next call overwrites, as the real option says
            if self._reused is None or [r.shape for r in self._reused] != [o.shape for o in outs]:
                self._reused = [np.empty_like(o) for o in outs]
            for r, o in zip(self._reused, outs):
                r[...] = o
            return list(self._reused)
        return outs
