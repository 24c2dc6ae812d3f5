"""`onnx` branch backend: ONNX Runtime on the CPU (any machine; what the other backends are checked against)."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from models.runtime.backends.base import BackendError, BranchBackend, checked_input
from models.runtime.probes import rss_bytes

ORT_DTYPES = {"tensor(float16)": np.float16, "tensor(float)": np.float32}


class OnnxBackend(BranchBackend):
    """ONNX Runtime on the CPU: load = read the file's bytes, init = InferenceSession (the bytes are dropped once the
    session holds its own copy), release = drop the session. Two sessions infer at once from two threads (ORT
    releases the GIL), each with `threads` intra-op threads, so dual_core gives the same numbers as one context."""
    name = "onnx"
    parallel_contexts = 2

    def __init__(self, threads: Optional[int] = None):
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads {threads!r} must be a positive integer or None (all cores)")
        self.threads = threads
        self._path: Optional[str] = None
        self._bytes: Optional[bytes] = None
        self._sess = None
        self._inputs: dict = {}
        self._rss0 = 0
        self._mb: Optional[float] = None

    def load(self, path) -> None:
        self._path = os.fspath(path)
        self._rss0 = rss_bytes()
        try:
            with open(self._path, "rb") as f:
                self._bytes = f.read()
        except OSError as e:
            raise BackendError(f"{self._path}: cannot read branch model ({e.strerror})") from None

    def init(self) -> None:
        import onnxruntime as ort
        if self._bytes is None:
            raise BackendError("init() before load()")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads or 0
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._sess = ort.InferenceSession(self._bytes, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types
            raise BackendError(f"{self._path}: ONNX Runtime cannot initialise the model: {e}") from None
        self._inputs = {i.name: (ORT_DTYPES.get(i.type), tuple(i.shape)) for i in self._sess.get_inputs()}
        nbytes = len(self._bytes)
        self._bytes = None
        # measured: the process's RSS growth over load + init, at least the weights the session holds (other
        # threads allocating meanwhile make the growth noisy; the file size is a floor that cannot be wrong)
        self._mb = max(rss_bytes() - self._rss0, nbytes) / 2**20

    def context_mb(self) -> Optional[float]:
        return self._mb

    def infer(self, inputs: dict) -> dict:
        if self._sess is None:
            raise BackendError("infer() before init()")
        feed = {}
        for name, (dt, shape) in self._inputs.items():
            feed[name] = checked_input(self._path, inputs, name, dt, shape)
        names = [o.name for o in self._sess.get_outputs()]
        return dict(zip(names, self._sess.run(names, feed)))

    def release(self) -> None:
        self._sess = None
        self._bytes = None
        self._inputs = {}
        self._mb = None
