"""Branch model backends behind one interface (load -> init -> infer -> release) with per-phase timing; ONNX Runtime."""
from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

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


@dataclass
class PhaseTimes:
    """Seconds spent in each lifecycle phase (summed when added)."""
    load_s: float = 0.0
    init_s: float = 0.0
    infer_s: float = 0.0
    release_s: float = 0.0

    def __add__(self, o: "PhaseTimes") -> "PhaseTimes":
        return PhaseTimes(self.load_s + o.load_s, self.init_s + o.init_s, self.infer_s + o.infer_s,
                          self.release_s + o.release_s)

    @property
    def total_s(self) -> float:
        return self.load_s + self.init_s + self.infer_s + self.release_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


class BranchBackend:
    """The interface every executor backend implements. One model at a time per instance.

    load(path): read the model file (no compute); init(): build the runtime context; infer(inputs) -> outputs
    (dicts of name -> numpy array, names as in models.partition); release(): free the context and the bytes.
    """
    name = "abstract"

    def load(self, path) -> None:
        raise NotImplementedError

    def init(self) -> None:
        raise NotImplementedError

    def infer(self, inputs: dict) -> dict:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


class OnnxBackend(BranchBackend):
    """ONNX Runtime on the CPU: load = read the file's bytes, init = InferenceSession, release = drop both."""
    name = "onnx"

    def __init__(self, threads: Optional[int] = None):
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads {threads!r} must be a positive integer or None (all cores)")
        self.threads = threads
        self._path: Optional[str] = None
        self._bytes: Optional[bytes] = None
        self._sess = None
        self._inputs: dict = {}

    def load(self, path) -> None:
        self._path = os.fspath(path)
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


def run_branch(backend: BranchBackend, path, passes: list, next_path=None) -> tuple:
    """The on-demand lifecycle for one branch: load, init, infer every pass (e.g. CFG cond then uncond), release.

    -> (outputs: [dict per pass], PhaseTimes). `next_path` names the branch that comes next; on-demand ignores it,
    a prefetch policy will load and init it while this one runs.
    """
    t = PhaseTimes()
    t0 = time.perf_counter()
    try:
        # 1) read the model  2) build the runtime context  3) every pass on the same context
        backend.load(path)
        t1 = time.perf_counter()
        t.load_s = t1 - t0
        backend.init()
        t2 = time.perf_counter()
        t.init_s = t2 - t1
        outs = [backend.infer(p) for p in passes]
        t.infer_s = time.perf_counter() - t2
    finally:
        # 4) release, also after a failure, so a backend never holds a stale model
        t3 = time.perf_counter()
        backend.release()
        t.release_s = time.perf_counter() - t3
    log.debug("branch %s: %s", os.fspath(path), t)
    return outs, t
