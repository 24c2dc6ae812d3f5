"""`rknn` executor backend: compiled branches on the RK3588 NPU through rknn-toolkit-lite2 (RKNNLite), timed and
with per-phase memory figures; cond and uncond can run on two NPU cores at once with two contexts."""
from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

from models.branch_runtime import BackendError, BranchBackend, PhaseTimes
from stages.backends import board_stats

log = logging.getLogger(__name__)

REAL_MODULE = "rknnlite.api"
STANDIN_MODULE = "stages.backends.rknnlite_standin"
STANDIN_ENV = "ANIMA_RKNN_STANDIN"       # "1": use the labelled stand-in (x86 tests); never chosen silently
# --core-mask words -> RKNNLite constant names (NPU_CORE_0_1_2 only speeds up conv-type ops: see docs/board.md)
CORE_MASKS = {"auto": "NPU_CORE_AUTO", "0": "NPU_CORE_0", "1": "NPU_CORE_1", "2": "NPU_CORE_2",
              "0_1": "NPU_CORE_0_1", "0_1_2": "NPU_CORE_0_1_2", "all": "NPU_CORE_ALL"}
NP_DTYPES = {"f16": np.float16, "f32": np.float32}


def lite_module(which: Optional[str] = None):
    """The RKNNLite provider: "real" (rknnlite.api), "standin", or None = real unless $ANIMA_RKNN_STANDIN=1."""
    which = which or ("standin" if os.environ.get(STANDIN_ENV) == "1" else "real")
    if which not in ("real", "standin"):
        raise ValueError(f"lite {which!r}: choose 'real' or 'standin'")
    name = STANDIN_MODULE if which == "standin" else REAL_MODULE
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BackendError(f"rknn backend: cannot import {name} ({e}); on an RK3588 board install "
                           "rknn-toolkit-lite2 and librknnrt.so (docs/board.md)") from None


LITE_DIST = "rknn-toolkit-lite2"
_checked_packs: set = set()


def _release(version: Optional[str]) -> Optional[str]:
    """'2.5.0+81f21f4d' -> '2.5.0' (a local build tag does not change the release)."""
    return None if version is None else str(version).split("+", 1)[0].strip()


def installed_lite_version(api) -> Optional[str]:
    """The rknn-toolkit-lite2 release behind `api` (the stand-in reports the release it imitates); None if absent."""
    if getattr(api, "IS_STANDIN", False):
        return getattr(api, "LITE_VERSION", None)
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(LITE_DIST)
    except PackageNotFoundError:
        return None


def check_toolkit_version(pack_dir, api) -> str:
    """The pack's manifest records the rknn-toolkit2 that compiled it; the board's rknn-toolkit-lite2 must be the same
    release (a .rknn file is read by the runtime of its toolkit). BackendError saying what to install when not."""
    pack = Path(pack_dir)
    try:
        want = (json.loads((pack / "manifest.json").read_text()).get("rknn") or {}).get("toolkit")
    except (OSError, ValueError, AttributeError) as e:
        raise BackendError(f"{pack}: cannot read its manifest ({e})") from None
    if not want or want == "unknown":
        raise BackendError(f"{pack}: the manifest records no rknn-toolkit2 version (run `anima-models compile {pack} "
                           "--target rk3588` with the toolkit in .venv-rknn)")
    have = installed_lite_version(api)
    if _release(have) != _release(want):
        now = f"rknn-toolkit-lite2 {have} is installed" if have else "rknn-toolkit-lite2 is not installed"
        raise BackendError(f"{pack} was compiled with rknn-toolkit2 {want}, but {now}: install the same release, "
                           f"pip install 'rknn-toolkit-lite2=={_release(want)}' (with librknnrt.so {_release(want)} in "
                           f"/usr/lib, docs/board.md), or compile the pack again with the toolkit that matches")
    return _release(want)


def _pack_branches(p: Path) -> tuple:
    """(pack folder, manifest branch entries, p relative to the pack) for a file PACK/<dir>/<name>."""
    pack = p.parent.parent
    try:
        m = json.loads((pack / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise BackendError(f"{p}: cannot read its pack manifest {pack / 'manifest.json'} ({e})") from None
    return pack, m.get("branches", []), p.relative_to(pack).as_posix()


def branch_entry(rknn_path) -> tuple:
    """(pack folder, manifest branch entry) for a compiled branch file PACK/rknn/bNN_kind.rknn."""
    p = Path(rknn_path).absolute()
    pack, branches, rel = _pack_branches(p)
    for b in branches:
        if isinstance(b.get("rknn"), dict) and b["rknn"].get("file") == rel:
            return pack, b
    raise BackendError(f"{p}: not a compiled branch of {pack} (no manifest entry with rknn.file {rel!r}; "
                       "run `anima-models compile`)")


def compiled_path(model_path) -> Path:
    """The .rknn file of a branch: itself, or, for PACK/onnx/bNN_kind.onnx (what the scheduler names), the compiled
    file the pack manifest records for that branch."""
    p = Path(model_path).absolute()
    if p.suffix == ".rknn":
        return p
    pack, branches, rel = _pack_branches(p)
    for b in branches:
        if b.get("onnx") == rel:
            if not isinstance(b.get("rknn"), dict) or not b["rknn"].get("file"):
                raise BackendError(f"{pack}: branch {rel} is not compiled for the NPU (run `anima-models compile "
                                   f"{pack} --target rk3588`)")
            return pack / b["rknn"]["file"]
    raise BackendError(f"{p}: not a branch of pack {pack}")


def core_mask_value(lite_cls, mask) -> int:
    """"auto" | "0" | "1" | "2" | "0_1" | "0_1_2" | "all" | an int -> the RKNNLite constant."""
    if isinstance(mask, int):
        return mask
    key = str(mask).strip().lower().removeprefix("npu_core_")
    if key not in CORE_MASKS:
        raise ValueError(f"core_mask {mask!r}: choose one of {list(CORE_MASKS)}")
    return getattr(lite_cls, CORE_MASKS[key])


class RknnLiteBackend(BranchBackend):
    """load(.rknn) -> init() -> infer()/infer_many() -> release(), one branch at a time.

    dual_core: two RKNNLite contexts (each with its own copy of the weights) on `dual_masks`; infer_many() runs the
    conditional and unconditional passes on them from two threads (inference releases the GIL).
    `report` holds the current branch's phases: seconds, PSS before/after, dma-buf before/after, NPU load, passes.
    """
    name = "rknn"

    def __init__(self, threads: Optional[int] = None, core_mask="auto", dual_core: bool = False,
                 dual_masks=("0", "1"), lite: Optional[str] = None):
        self.api = lite_module(lite)
        self.cls = self.api.RKNNLite
        self.is_standin = bool(getattr(self.api, "IS_STANDIN", False))
        if self.is_standin:
            log.warning("rknn backend is using the %s", self.api.STANDIN_LABEL)
        self.dual_core = bool(dual_core)
        masks = list(dual_masks) if self.dual_core else [core_mask]
        if self.dual_core and len(masks) != 2:
            raise ValueError(f"dual_masks {dual_masks!r}: need exactly two core masks")
        self.masks = [core_mask_value(self.cls, m) for m in masks]
        self._ctx: list = []
        self._path: Optional[str] = None
        self._entry: Optional[dict] = None
        self.report: dict = {}

    # -- accounting -------------------------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str):
        before = board_stats.pss_kb(), board_stats.dma_buf_bytes()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            after = board_stats.pss_kb(), board_stats.dma_buf_bytes()
            self.report.setdefault("phases", {})[name] = {
                "s": dt, "pss_before_kb": before[0], "pss_after_kb": after[0],
                "dma_buf_before": before[1], "dma_buf_after": after[1]}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def load(self, path) -> None:
        self._path = os.fspath(compiled_path(path))      # the scheduler names the ONNX file; run its .rknn
        if not os.path.isfile(self._path):
            raise BackendError(f"{self._path}: no such compiled branch")
        pack, self._entry = branch_entry(self._path)
        if pack not in _checked_packs:                   # once per pack: the runtime must match the compiler
            check_toolkit_version(pack, self.api)
            _checked_packs.add(pack)
        self.report = {"branch": os.path.basename(self._path), "standin": self.is_standin,
                       "core_masks": self.masks, "passes": []}
        with self._phase("load"):
            for _ in self.masks:
                ctx = self.cls(verbose=False)
                if ctx.load_rknn(self._path) != 0:
                    self._drop()
                    raise BackendError(f"{self._path}: load_rknn failed")
                self._ctx.append(ctx)

    def init(self) -> None:
        if not self._ctx:
            raise BackendError("init() before load()")
        with self._phase("init"):
            for ctx, mask in zip(self._ctx, self.masks):
                if ctx.init_runtime(core_mask=mask) != 0:
                    raise BackendError(f"{self._path}: init_runtime(core_mask={mask}) failed (is librknnrt.so "
                                       "in /usr/lib and the driver loaded? see docs/board.md)")

    def _run(self, i: int, inputs: dict) -> dict:
        """One pass on context i: inputs in the manifest's order, outputs cast to the manifest's dtypes."""
        feed = []
        for spec in self._entry["inputs"]:
            if spec["name"] not in inputs:
                raise BackendError(f"{self._path}: missing input {spec['name']!r} (wants {spec['shape']})")
            a = np.asarray(inputs[spec["name"]])
            if list(a.shape) != list(spec["shape"]):
                raise BackendError(f"{self._path}: input {spec['name']!r} has shape {list(a.shape)}, "
                                   f"expected {spec['shape']}")
            feed.append(np.ascontiguousarray(a, NP_DTYPES.get(spec["dtype"], a.dtype)))
        t0 = time.perf_counter()
        outs = self._ctx[i].inference(inputs=feed)
        dt = time.perf_counter() - t0
        if outs is None:
            raise BackendError(f"{self._path}: inference failed on core mask {self.masks[i]}")
        self.report["passes"].append({"context": i, "core_mask": self.masks[i], "s": dt, "t0": t0})
        res = {}
        for spec, y in zip(self._entry["outputs"], outs):
            y = np.asarray(y).reshape(spec["shape"])                       # y: [L, D] f32 from the runtime
            res[spec["name"]] = y.astype(NP_DTYPES.get(spec["dtype"], y.dtype), copy=False)
        return res

    def infer(self, inputs: dict) -> dict:
        if not self._ctx:
            raise BackendError("infer() before init()")
        with self._phase(f"infer{len(self.report['passes'])}"):
            return self._run(0, inputs)

    def infer_many(self, passes: list) -> list:
        """Both CFG passes: on two contexts at once when dual_core, else one after the other on the first."""
        if not self._ctx:
            raise BackendError("infer_many() before init()")
        if not (self.dual_core and len(passes) == 2):
            return [self.infer(p) for p in passes]
        outs, errs = [None, None], []

        def go(i):
            try:
                outs[i] = self._run(i, passes[i])
            except BaseException as e:  # re-raised in the caller's thread
                errs.append(e)
        with self._phase("infer_dual"):
            th = [threading.Thread(target=go, args=(i,), name=f"rknn-core{i}") for i in (0, 1)]
            for t in th:
                t.start()
            for t in th:
                t.join()
        if errs:
            raise errs[0]
        return outs

    def _drop(self) -> None:
        for ctx in self._ctx:
            try:
                ctx.release()
            except Exception as e:  # a failing release must not hide the branch's result
                log.warning("%s: release: %s", self._path, e)
        self._ctx = []

    def release(self) -> None:
        with self._phase("release"):
            self._drop()
            gc.collect()            # RKNNLite objects hold native buffers; free them now, not at some later GC
        self.report["npu_load"] = board_stats.npu_load()


def run_branch(backend: BranchBackend, path, passes: list) -> tuple:
    """load -> init -> every pass (infer_many when the backend has it) -> release; -> (outputs, PhaseTimes)."""
    t = PhaseTimes()
    t0 = time.perf_counter()
    backend.load(path)
    t1 = time.perf_counter()
    t.load_s = t1 - t0
    try:
        backend.init()
        t2 = time.perf_counter()
        t.init_s = t2 - t1
        many = getattr(backend, "infer_many", None)
        outs = many(passes) if many else [backend.infer(p) for p in passes]
        t.infer_s = time.perf_counter() - t2
    finally:
        t3 = time.perf_counter()
        backend.release()
        t.release_s = time.perf_counter() - t3
    return outs, t
