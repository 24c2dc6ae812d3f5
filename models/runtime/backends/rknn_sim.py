"""`rknn-sim` branch backend: each branch ONNX built by rknn-toolkit2 and run in its simulator (one shared worker)."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from models.runtime.backends.base import BackendError, BranchBackend, checked_input
from models.rknn.client import ToolkitError, ToolkitWorker, toolkit_python

log = logging.getLogger(__name__)

ONNX_NP = {1: np.float32, 10: np.float16}          # onnx TensorProto elem_type -> numpy
_WORKERS: dict = {}                                  # toolkit venv -> ToolkitWorker (kept across branches)
_LOCK = threading.Lock()


def shared_worker(venv=None) -> ToolkitWorker:
    """The process-wide simulator worker for `venv`: started once (the toolkit import costs seconds), restarted if
    it died."""
    key = str(toolkit_python(venv).absolute())             # the same environment, however it was named
    with _LOCK:
        w = _WORKERS.get(key)
        if w is None or not w.alive:
            w = ToolkitWorker(venv)
            _WORKERS[key] = w
        return w


@atexit.register
def close_workers() -> None:
    """Stop every shared simulator worker (also called at interpreter exit)."""
    with _LOCK:
        for w in _WORKERS.values():
            w.close()
        _WORKERS.clear()


def _graph_io(path: str) -> tuple:
    """(inputs, outputs) of an ONNX file as [(name, numpy dtype, shape)] in graph order (weights not decoded)."""
    import onnx
    m = onnx.load(path, load_external_data=False)
    init = {i.name for i in m.graph.initializer}

    def spec(v):
        t = v.type.tensor_type
        return v.name, ONNX_NP.get(t.elem_type), tuple(d.dim_value for d in t.shape.dim)
    ins = [spec(v) for v in m.graph.input if v.name not in init]
    outs = [spec(v) for v in m.graph.output]
    return ins, outs


class RknnSimBackend(BranchBackend):
    """load(ONNX path) -> init(): load_onnx + build + init_runtime() in the simulator -> infer -> release.

    The simulator cannot run a compiled .rknn (load_rknn output needs a board), so this backend builds from the
    ONNX graph each time; the numbers it gives are those of the same compiler that `anima-models compile` uses.
    Outputs come back in float32 from the simulator and are cast to the graph's output dtype.
    """
    name = "rknn-sim"
    device = "npu"
    max_contexts = 1                 # one shared simulator worker holds one built model

    def __init__(self, threads: Optional[int] = None, venv=None, target: str = "rk3588", log_dir=None):
        self.venv, self.target = venv, target
        self.log_dir = Path(log_dir) if log_dir else None
        self._path: Optional[str] = None
        self._io = None
        self._ready = False
        self._tmp: Optional[str] = None
        self.last: dict = {}             # the toolkit's own timings for the current branch (build_s, infer_s, ...)

    def _log(self, stem: str) -> Optional[str]:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return str(self.log_dir / f"{Path(self._path).stem}.{stem}.log")

    def load(self, path) -> None:
        p = os.path.abspath(os.fspath(path))        # the worker runs in its own scratch folder
        if p.endswith(".rknn"):
            raise BackendError(f"{p}: the rknn-toolkit2 simulator cannot run a compiled .rknn (load_rknn needs a "
                               "board); give the branch's ONNX graph")
        if not os.path.isfile(p):
            raise BackendError(f"{p}: no such branch model")
        self._path = p
        try:
            self._io = _graph_io(p)
        except Exception as e:  # onnx raises DecodeError and friends
            raise BackendError(f"{p}: not a readable ONNX graph ({e})") from None

    def init(self) -> None:
        if self._path is None:
            raise BackendError("init() before load()")
        try:
            r = shared_worker(self.venv).request("sim_load", onnx=self._path, target=self.target, log=self._log("build"))
        except ToolkitError as e:
            raise BackendError(f"{self._path}: simulator build failed: {e.args[0]}") from None
        self.last = {k: r[k] for k in ("load_s", "build_s", "init_s", "peak_rss_kb") if k in r}
        log.info("rknn-sim %s: built in %.1f s", Path(self._path).stem, r.get("build_s", 0.0))
        self._tmp = tempfile.mkdtemp(prefix="anima-rknn-sim-")
        self._ready = True

    def infer(self, inputs: dict) -> dict:
        if not self._ready:
            raise BackendError("infer() before init()")
        ins, outs = self._io
        paths = []
        for i, (name, dt, shape) in enumerate(ins):
            a = checked_input(self._path, inputs, name, dt, shape)
            p = os.path.join(self._tmp, f"in{i}.npy")
            np.save(p, np.ascontiguousarray(a))
            paths.append(p)
        # 4-D inputs are NCHW here; the toolkit assumes NHWC unless told (the DiT branches have none)
        fmt = {"data_format": ["nchw"] * len(ins)} if any(len(shape) == 4 for _, _, shape in ins) else {}
        try:
            r = shared_worker(self.venv).request("sim_infer", inputs=paths, out_dir=self._tmp, log=self._log("infer"),
                                                 **fmt)
        except ToolkitError as e:
            raise BackendError(f"{self._path}: simulator inference failed: {e.args[0]}") from None
        self.last["infer_s"] = r["infer_s"]
        res = {}
        for (name, dt, shape), p in zip(outs, r["outputs"]):
            y = np.load(p)                                          # y: [L, D] f32 from the simulator
            if tuple(y.shape) != shape:
                y = y.reshape(shape)
            res[name] = y.astype(dt) if dt is not None else y
        return res

    def release(self) -> None:
        if self._ready:
            try:
                shared_worker(self.venv).request("sim_release")
            except ToolkitError as e:
                log.warning("%s: simulator release: %s", self._path, e.args[0])
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._ready, self._tmp = False, None
