"""`rknn` branch backend: compiled branches on the RK3588 NPU through rknn-toolkit-lite2 (RKNNLite), with
per-phase memory figures; one instance is one context on one core mask (dual_core = two instances, see
models/runtime/lifecycle.py)."""
from __future__ import annotations

import gc
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

from models.base.lazy import import_target
from models.records.manifest import ManifestError, toolkit_release
from models.runtime import probes
from models.runtime.backends.base import BackendError, BranchBackend
from models.runtime.backends.core_mask import CORE_MASKS, core_mask_word
from models.runtime.backends.compiled import branch_entry, compiled_path

log = logging.getLogger(__name__)

REAL_MODULE = "rknnlite.api"
STANDIN_MODULE = "models.runtime.backends.standin.rknnlite"
STANDIN_ENV = "ANIMA_RKNN_STANDIN"       # "1": use the labelled stand-in (x86 tests); never chosen silently
NP_DTYPES = {"f16": np.float16, "f32": np.float32}
LITE_TYPES = {"f16": "float16", "f32": "float32"}       # RKNNLite's data_type names (P9, docs/board-figures.md)


def lite_module(which: Optional[str] = None):
    """The RKNNLite provider: "real" (rknnlite.api), "standin", or None = real unless $ANIMA_RKNN_STANDIN=1."""
    which = which or ("standin" if os.environ.get(STANDIN_ENV) == "1" else "real")
    if which not in ("real", "standin"):
        raise ValueError(f"lite {which!r}: choose 'real' or 'standin'")
    name = STANDIN_MODULE if which == "standin" else REAL_MODULE
    try:
        return import_target(name)
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
        want = toolkit_release(pack)
    except ManifestError as e:
        raise BackendError(f"{pack}: cannot read its manifest ({e})") from None
    if not want or want == "unknown":
        raise BackendError(f"{pack}: the manifest records no rknn-toolkit2 version (run `anima-models compile {pack} "
                           "--target rk3588` with the toolkit in .venv-rknn)")
    problem = runtime_mismatch(want, api)
    if problem:
        raise BackendError(f"{pack} was compiled with rknn-toolkit2 {want}, but {problem}, or compile the pack again "
                           "with the toolkit that matches")
    return _release(want)


def runtime_mismatch(want: str, api) -> str:
    """"" when the rknn-toolkit-lite2 behind `api` is the release `want` (the rknn-toolkit2 that compiled a pack),
    else what is installed and the command that installs the right one."""
    have = installed_lite_version(api)
    if _release(have) == _release(want):
        return ""
    now = f"rknn-toolkit-lite2 {have} is installed" if have else "rknn-toolkit-lite2 is not installed"
    return (f"{now}: install the same release, pip install 'rknn-toolkit-lite2=={_release(want)}' (with librknnrt.so "
            f"{_release(want)} in /usr/lib, docs/board.md)")


def output_as(y: np.ndarray, shape, path, name: str) -> np.ndarray:
    """A runtime output in the manifest's shape: as it is; a 4-D one given as NHWC transposed to NCHW; any other of
    the same size reshaped (the DiT branches' [L, D] may come back with unit dimensions around it)."""
    shape = tuple(int(d) for d in shape)
    if y.shape == shape:
        return y
    if len(shape) == 4 and y.shape == (shape[0], shape[2], shape[3], shape[1]):
        return y.transpose(0, 3, 1, 2)
    if len(shape) != 4 and y.size == int(np.prod(shape)):
        return y.reshape(shape)
    raise BackendError(f"{path}: output {name!r} came back as {list(y.shape)}, expected {list(shape)}")


def core_mask_value(lite_cls, mask) -> int:
    """"auto" | "0" | "1" | "2" | "0_1" | "0_1_2" | "all" | an int -> the RKNNLite constant."""
    if isinstance(mask, int):
        return mask
    return getattr(lite_cls, CORE_MASKS[core_mask_word(mask)].constant)


class RknnLiteBackend(BranchBackend):
    """ONE RKNNLite context on one core mask: load(.rknn) -> init() -> infer() -> release(), one branch at a time.

    The lifecycle (models/runtime/lifecycle.py) makes one instance per context: `dual_core` is two instances on the policy's
    `dual_masks` whose passes run from two threads (inference releases the GIL). `report` holds the current
    branch's phases: seconds, PSS before/after, dma-buf before/after, each pass, NPU load after release.
    """
    name = "rknn"
    parallel_contexts = 3           # the RK3588 NPU's cores; a context keeps the core mask it was initialised with
    takes_core_mask = True
    needs_compiled_pack = True
    device = "npu"
    SETTINGS = ("pass_through",)    # [stage.executor] / [stage.vae]: false hands every input converted (docs/board.md)

    @classmethod
    def auto_policy(cls, ctx):
        """The policy that fits this board's memory now (its MemAvailable, measured), chosen on the modelled board's
        timeline (models/board/auto.py)."""
        from models.board.auto import choose_policy
        from models.packs.memory_fit import for_pack
        packs = tuple(getattr(ctx, "packs", ()) or ())
        return choose_policy(ctx, mem_available_mib=probes.mem_available_mib(),
                             memory=for_pack(packs[0] if packs else None))

    @classmethod
    def runtime_problem(cls, settings: dict) -> str:
        try:
            lite_module(settings.get("lite"))
        except (BackendError, ValueError) as e:
            return str(e)
        return ""

    def __init__(self, threads: Optional[int] = None, core_mask="auto", lite: Optional[str] = None,
                 pass_through: bool = True):
        self.pass_through = bool(pass_through)
        self.api = lite_module(lite)
        self.cls = self.api.RKNNLite
        self.is_standin = bool(getattr(self.api, "IS_STANDIN", False))
        if self.is_standin:
            log.warning("rknn backend is using the %s", self.api.STANDIN_LABEL)
        self.mask = core_mask_value(self.cls, core_mask)
        self._ctx = None
        self._path: Optional[str] = None
        self._entry: Optional[dict] = None
        self.report: dict = {}

    # -- accounting -------------------------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str):
        before = probes.pss_kb(), probes.dma_buf_bytes()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            after = probes.pss_kb(), probes.dma_buf_bytes()
            self.report.setdefault("phases", {})[name] = {
                "s": dt, "pss_before_kb": before[0], "pss_after_kb": after[0],
                "dma_buf_before": before[1], "dma_buf_after": after[1]}

    def context_mb(self) -> Optional[float]:
        """Measured: the process's PSS growth from before load_rknn to after init_runtime (the reference board saw
        ~155 MiB per FP16 branch context at 512x512); None where PSS is unreadable."""
        ph = self.report.get("phases", {})
        try:
            return max(0, ph["init"]["pss_after_kb"] - ph["load"]["pss_before_kb"]) / 1024
        except (KeyError, TypeError):
            return None

    # -- lifecycle --------------------------------------------------------------------------------------------
    def load(self, path) -> None:
        self._path = os.fspath(compiled_path(path))      # the scheduler names the ONNX file; run its .rknn
        if not os.path.isfile(self._path):
            raise BackendError(f"{self._path}: no such compiled branch")
        pack, self._entry = branch_entry(self._path)
        if pack not in _checked_packs:                   # once per pack: the runtime must match the compiler
            check_toolkit_version(pack, self.api)
            _checked_packs.add(pack)
        self.report = {"branch": os.path.basename(self._path), "standin": self.is_standin, "core_mask": self.mask,
                       "passes": []}
        with self._phase("load"):
            ctx = self.cls(verbose=False)
            if ctx.load_rknn(self._path) != 0:
                ctx.release()
                raise BackendError(f"{self._path}: load_rknn failed")
            self._ctx = ctx

    def init(self) -> None:
        if self._ctx is None:
            raise BackendError("init() before load()")
        with self._phase("init"):
            if self._ctx.init_runtime(core_mask=self.mask) != 0:
                raise BackendError(f"{self._path}: init_runtime(core_mask={self.mask}) failed (is librknnrt.so "
                                   "in /usr/lib and the driver loaded? see docs/board.md)")

    def _feed(self, inputs: dict) -> tuple:
        """Inputs as RKNNLite wants them (P9): one array per model input in the manifest's order, contiguous, in the
        model's own dtype (FP16 for an FP16 pack: the runtime converts nothing; `data_type` says so), and passed
        through unconverted where the input's layout is the NPU's own: every input but a 4-D one (assumed: the
        runtime's native layout of a 1-D / 2-D FP16 tensor is the tensor itself; a 4-D one is NC1HWC2, so the VAE's
        feature maps go converted, as NCHW). -> (arrays, inference() keyword arguments, bytes in)."""
        feed, types, through = [], [], []
        for spec in self._entry["inputs"]:
            if spec["name"] not in inputs:
                raise BackendError(f"{self._path}: missing input {spec['name']!r} (wants {spec['shape']})")
            a = np.asarray(inputs[spec["name"]])
            if list(a.shape) != list(spec["shape"]):
                raise BackendError(f"{self._path}: input {spec['name']!r} has shape {list(a.shape)}, "
                                   f"expected {spec['shape']}")
            feed.append(np.ascontiguousarray(a, NP_DTYPES.get(spec["dtype"], a.dtype)))
            types.append(LITE_TYPES.get(spec["dtype"], str(feed[-1].dtype)))
            through.append(int(self.pass_through and len(spec["shape"]) != 4))
        kw = {"data_type": types, "inputs_pass_through": through}
        # 4-D inputs (the VAE's NCHW feature maps): RKNNLite reads them as NHWC unless data_format says otherwise
        if any(len(spec["shape"]) == 4 for spec in self._entry["inputs"]):
            kw["data_format"] = ["nchw"] * len(feed)
        return feed, kw, sum(a.nbytes for a in feed)

    def _outputs(self, outs) -> tuple:
        """RKNNLite's outputs (float32 always: it has no output dtype argument, P9) in the manifest's shapes and
        dtypes: FP16 for an FP16 pack, exact (the NPU computed FP16), half the bytes on to the host's FP32 add.
        -> (outputs by name, bytes RKNNLite returned)."""
        res, nbytes = {}, 0
        for spec, y in zip(self._entry["outputs"], outs):
            y = np.asarray(y)
            nbytes += y.nbytes
            y = output_as(y, spec["shape"], self._path, spec["name"])
            res[spec["name"]] = y.astype(NP_DTYPES.get(spec["dtype"], y.dtype), copy=False)
        return res, nbytes

    def infer(self, inputs: dict) -> dict:
        """One pass: inputs in the manifest's order and dtype, outputs cast to the manifest's dtypes."""
        return self.infer_timed(inputs, split=False)[0]

    def infer_timed(self, inputs: dict, split: bool = True) -> tuple:
        """One pass -> (outputs, {"in_s", "npu_s", "out_s"} or None). With `split` (bench/board.py --calibrate) the
        three steps inference() is made of (rknn_runtime.set_inputs, run, get_outputs, as rknnlite/api/rknn_lite.py
        calls them) are timed one by one: tensor I/O in, the NPU, tensor I/O out. Where the wrapper has no such
        runtime object, inference() runs whole and the split is None."""
        if self._ctx is None:
            raise BackendError("infer() before init()")
        feed, kw, bytes_in = self._feed(inputs)
        rt = getattr(self._ctx, "rknn_runtime", None) if split else None
        steps = rt is not None and all(hasattr(rt, f) for f in ("set_inputs", "run", "get_outputs"))
        split_s = None
        with self._phase(f"infer{len(self.report['passes'])}"):
            t0 = time.perf_counter()
            if steps:
                try:
                    rt.set_inputs(feed, kw["data_type"], kw.get("data_format"),
                                  inputs_pass_through=kw["inputs_pass_through"])
                    t1 = time.perf_counter()
                    rt.run(False)
                    t2 = time.perf_counter()
                    outs = rt.get_outputs(False)
                    split_s = {"in_s": t1 - t0, "npu_s": t2 - t1, "out_s": time.perf_counter() - t2}
                except Exception as e:  # noqa: BLE001 - the runtime's own errors: the call failed
                    log.error("%s: inference: %s", self._path, e)
                    outs = None
            else:
                outs = self._ctx.inference(inputs=feed, **kw)
            dt = time.perf_counter() - t0
        if outs is None:
            raise BackendError(f"{self._path}: inference failed on core mask {self.mask}")
        res, bytes_out = self._outputs(outs)
        self.report["passes"].append({"core_mask": self.mask, "s": dt, "t0": t0, "bytes_in": bytes_in,
                                      "bytes_out": bytes_out, **(split_s or {})})
        return res, split_s

    def release(self) -> None:
        with self._phase("release"):
            if self._ctx is not None:
                try:
                    self._ctx.release()
                except Exception as e:  # a failing release must not hide the branch's result
                    log.warning("%s: release: %s", self._path, e)
                self._ctx = None
            gc.collect()            # RKNNLite objects hold native buffers; free them now, not at some later GC
        self.report["npu_load"] = probes.npu_load()
