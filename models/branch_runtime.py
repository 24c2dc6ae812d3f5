"""Branch model backends behind one interface (load -> init -> infer -> release); ONNX Runtime.

The lifecycle around them (timing, policies: prefetch, dual_core, resident, interleave) is models/lifecycle.py."""
from __future__ import annotations

import importlib
import logging
import os
from typing import Optional

import numpy as np

from models.probes import rss_bytes

log = logging.getLogger(__name__)

# name -> "module:Class", imported only when asked for (rknn-sim pulls rknn-toolkit2; the board backend lives in
# stages/backends/ and implements the same interface).
BACKENDS = {
    "onnx": "models.branch_runtime:OnnxBackend",
    "rknn-sim": "models.rknn.sim:RknnSimBackend",
}
ORT_DTYPES = {"tensor(float16)": np.float16, "tensor(float)": np.float32}


class BackendError(RuntimeError):
    """A backend could not load, initialise or run a branch model; the message names the file or input."""


class BranchBackend:
    """The interface every executor backend implements. One instance = one context: one model at a time.

    load(path): read the model file (no compute); init(): build the runtime context; infer(inputs) -> outputs
    (dicts of name -> numpy array, names as in models.partition); release(): free the context and the bytes;
    context_mb(): memory the loaded and initialised context costs (MiB), asked right after init(), None = unknown.
    Capabilities the lifecycle policies are checked against (models/policy.py: check_policy) are class attributes.
    """
    name = "abstract"
    max_contexts: Optional[int] = None   # contexts one process can hold loaded at once (None: memory is the limit)
    parallel_contexts = 1                # contexts that can infer at the same time (dual_core needs 2)
    takes_core_mask = False              # the constructor takes core_mask= (NPU backends: a context keeps its mask)

    @classmethod
    def auto_policy(cls, ctx):
        """What `policy = "auto"` means on this backend (ctx: models.policy.AutoContext) -> a Policy, a policy
        string, or None: the documented safe choice (models.policy.safe_auto)."""
        return None

    def context_mb(self) -> Optional[float]:
        return None

    def load(self, path) -> None:
        raise NotImplementedError

    def init(self) -> None:
        raise NotImplementedError

    def infer(self, inputs: dict) -> dict:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


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


def checked_input(path, inputs: dict, name: str, dtype, shape: tuple) -> np.ndarray:
    """inputs[name] as an array of the model's shape and dtype (None: any), or a BackendError naming the file."""
    if name not in inputs:
        raise BackendError(f"{path}: missing input {name!r} (wants {list(shape)})")
    a = np.asarray(inputs[name])
    if tuple(a.shape) != tuple(shape):
        raise BackendError(f"{path}: input {name!r} has shape {list(a.shape)}, expected {list(shape)}")
    if dtype is not None and a.dtype != dtype:
        raise BackendError(f"{path}: input {name!r} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    return a


def backend_class(name: str):
    """Resolve a backend name from BACKENDS to its class (imported now)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"backend {name!r} is not available here ({module}: {e})") from None


def make_backend(name: str, **kwargs) -> BranchBackend:
    """An instance of the named backend; kwargs (e.g. threads) go to its constructor."""
    return backend_class(name)(**kwargs)
