"""`board-sim` branch backend: the rknn backend's lifecycle on a MODELLED RK3588 board.

Outputs are real (ONNX Runtime runs the pack's graph, so jobs and images stay real); every phase is paced to the
board's time for the FULL-SIZE model at the pack's resolution (models/board/cost.toml, reference board figures) x
`time_scale`, so a tiny pack runs at the real model's board pace:

    load     CPU slot, read the graph (real), sleep to the modelled load_rknn time
    init     memory check (modelled MemAvailable must stay >= 1.5 GiB, else BackendError as a board would fail),
             CPU slot, ONNX Runtime session (real), sleep to the modelled init_runtime time; the context keeps its
             core mask
    infer    tensor I/O in and out (modelled by the bytes the call moves, CPU; one sleep), then an NPU core of the
             context's mask (exclusive: waits while it is busy), the real inference, and the modelled NPU time: the
             NPU work of every context inferring at once progresses at concurrent_speedup[n-1] / n of one context's
             speed (n of them; 1.78x / 2 and 2.39x / 3, peer figures), so two or three contexts side by side take
             as long as the board's cores do
    release  CPU slot, drop the session (real), sleep to the modelled release time; memory returned

The modelled board (3 NPU cores, `cpu_slots` CPU slots for load/init/release, the memory ledger) is shared by every
context of the process (`Board.shared`). One backend instance is one context.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from models.runtime.backends.base import BackendError, BranchBackend
from models.runtime.backends.core_mask import CORE_MASKS, core_mask_word
from models.runtime.backends.onnx import OnnxBackend
from models.board.cost import BOARD_RAMS_GB, GIB, LABEL, MODELS, BoardModel, CostModelError
from models.board.pace import Chain, HostPacer, PaceTotals, Paced, check_time_scale, clock, scale_note
from models.dit.partition import parse_branch_file

log = logging.getLogger(__name__)
SHARD_RE = re.compile(r"\.s(\d+)\.onnx$")          # a sharded pack's shard graph: bNN_kind.sI.onnx

class Board:
    """The modelled board one executor process runs on: NPU cores, CPU slots, the memory ledger, paced totals."""

    _shared: dict = {}
    _shared_lock = threading.Lock()

    def __init__(self, ram_gb: int = 8, time_scale: float = 1.0, board_model: str = "full", board_cost=None):
        if ram_gb not in BOARD_RAMS_GB:
            raise ValueError(f"board_ram_gb {ram_gb!r}: choose one of {', '.join(map(str, BOARD_RAMS_GB))}")
        if board_model not in MODELS:
            raise ValueError(f"board_model {board_model!r}: choose one of {', '.join(MODELS)}")
        self.ram_gb, self.time_scale, self.board_model = ram_gb, check_time_scale(time_scale), board_model
        self.board_cost = str(board_cost) if board_cost else None     # a board's own figures, else cost.toml
        try:
            base = BoardModel.for_pack(None, board_model, self.board_cost)
        except CostModelError as e:
            raise ValueError(str(e)) from None
        self.cores = base.cores
        self._busy = [False] * self.cores
        self.peak_busy = 0                         # most cores busy at once (what dual_core reaches)
        self._cores_cv = threading.Condition()
        self.cpu = threading.BoundedSemaphore(base.cpu_slots)
        self.cpu_slots = base.cpu_slots
        self._models: dict = {}                    # pack folder -> BoardModel
        self._lock = threading.Lock()
        self.contexts = 0                          # resident (initialised) contexts
        self.units = 0.0                           # their memory, in whole-branch contexts (a heads shard less)
        self.peak_contexts = 0
        self.totals = {ph: PaceTotals() for ph in ("load", "init", "io", "npu", "release")}
        self.core_wait_s = self.cpu_wait_s = 0.0
        self.refusals = 0
        self._announced = False
        self._shares: dict = {}                   # NPU work in progress: id -> _Share (guarded by _cores_cv)
        self._share_t = clock()
        self._rates = base                         # concurrent_speedup (the cost model's)

    @classmethod
    def shared(cls, ram_gb: int = 8, time_scale: float = 1.0, board_model: str = "full",
               board_cost=None) -> "Board":
        """The process's board for these settings (every context of an executor shares it)."""
        key = (ram_gb, float(time_scale), board_model, str(board_cost) if board_cost else None)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(ram_gb, time_scale, board_model, board_cost)
            return cls._shared[key]

    def model(self, pack_dir: Path) -> BoardModel:
        with self._lock:
            m = self._models.get(pack_dir)
            if m is None:
                try:
                    m = self._models[pack_dir] = BoardModel.for_pack(pack_dir, self.board_model, self.board_cost)
                except CostModelError as e:
                    raise BackendError(str(e)) from None
            first, self._announced = not self._announced, True
        if first:
            for line in m.describe() + [self.describe_memory(m)]:
                log.info("%s; %s", line, scale_note(self.time_scale))
        return m

    # -- memory -------------------------------------------------------------------------------------------------
    def mem_available_gib(self, model: BoardModel, units: Optional[float] = None) -> float:
        n = self.units if units is None else units
        mem = model.cost["memory"]
        return model.usable_gib(self.ram_gb) - mem["baseline_gib"] - model.mem_drop_mib(n) / GIB

    def describe_memory(self, model: BoardModel) -> str:
        budget = model.context_budget_mib(self.ram_gb)
        return (f"{LABEL} {self.ram_gb} GB board: {model.usable_gib(self.ram_gb):.2f} GiB usable, baseline "
                f"{model.cost['memory']['baseline_gib']:.3f} GiB, {budget:.0f} MiB for contexts before MemAvailable "
                f"< {model.cost['memory']['stop_mem_available_gib']} GiB: {model.contexts_fit(budget)} contexts")

    def reserve(self, model: BoardModel, what: str, units: float = 1.0) -> float:
        """One more resident context (`units` of a whole branch's memory: a heads shard less) -> its MiB, or
        BackendError when it would leave MemAvailable under the stop rule."""
        stop = model.cost["memory"]["stop_mem_available_gib"]
        with self._lock:
            after = self.mem_available_gib(model, self.units + units)
            if after < stop:
                self.refusals += 1
                raise BackendError(
                    f"{LABEL} board ({self.ram_gb} GB, reference board figures): init of {what} would leave "
                    f"MemAvailable at {after:.2f} GiB, under the {stop} GiB stop rule; {self.contexts} contexts "
                    f"already hold {model.mem_drop_mib(self.units):.0f} MiB (use fewer resident contexts, or "
                    f"a bigger board_ram_gb); {scale_note(self.time_scale)}")
            self.contexts += 1
            self.units += units
            self.peak_contexts = max(self.peak_contexts, self.contexts)
            return model.mem_drop_mib(self.units) - model.mem_drop_mib(self.units - units)

    def unreserve(self, units: float = 1.0) -> None:
        with self._lock:
            self.contexts = max(0, self.contexts - 1)
            self.units = max(0.0, self.units - units)

    # -- resources ----------------------------------------------------------------------------------------------
    @contextmanager
    def cpu_slot(self):
        t0 = clock()
        self.cpu.acquire()
        with self._lock:
            self.cpu_wait_s += clock() - t0
        try:
            yield
        finally:
            self.cpu.release()

    @contextmanager
    def npu(self, mask_key: str, cores: tuple):
        """Exclusive use of the context's core(s): any idle core of an auto mask, every core of a multi-core mask,
        else its one core. Waits while they are busy. -> the cores taken."""
        t0 = clock()
        with self._cores_cv:
            while True:
                free = [c for c in cores if not self._busy[c]]
                if CORE_MASKS[mask_key].spread:
                    take = tuple(cores) if len(free) == len(cores) else None
                else:
                    take = (free[0],) if free else None
                if take:
                    break
                self._cores_cv.wait()
            for c in take:
                self._busy[c] = True
            self.peak_busy = max(self.peak_busy, sum(self._busy))
        with self._lock:
            self.core_wait_s += clock() - t0
        try:
            yield take
        finally:
            with self._cores_cv:
                for c in take:
                    self._busy[c] = False
                self._cores_cv.notify_all()

    # -- the NPU's cores shared by the contexts inferring at once ------------------------------------------------
    def _advance(self) -> None:
        """Bring every share's progress up to now (under _cores_cv): piecewise, since the rate changes whenever one
        finishes its work."""
        now = clock()
        dt = (now - self._share_t) / self.time_scale          # board seconds since the last update
        self._share_t = now
        while dt > 1e-12:
            busy = [sh for sh in self._shares.values() if sh.remaining > 0]
            if not busy:
                return
            rate = self._rates.rate(len(busy))
            step = min(dt, min(sh.remaining / (rate * sh.mult) for sh in busy))
            for sh in busy:
                sh.remaining = max(0.0, sh.remaining - step * rate * sh.mult)
                sh.elapsed += step
            dt -= step

    def npu_work(self, t1: float, work_s: float, mult: float, credit_s: float, real) -> tuple:
        """Run `real()` (the inference here) as one context's NPU work of `work_s` board seconds (at one context's
        speed x `mult`), begun at `t1`, shared with whatever else infers meanwhile -> (real()'s result, Paced)."""
        share = _Share(max(0.0, work_s - credit_s / self.time_scale), mult)
        key = object()
        with self._cores_cv:
            self._advance()
            self._shares[key] = share
            self._cores_cv.notify_all()
        try:
            out = real()
            t_real = clock()
            with self._cores_cv:
                while True:
                    self._advance()
                    if share.remaining <= 0:
                        break
                    n = sum(1 for sh in self._shares.values() if sh.remaining > 0)
                    left = share.remaining / (self._rates.rate(n) * share.mult) * self.time_scale
                    self._cores_cv.wait(max(left, 1e-4))
        finally:
            with self._cores_cv:
                self._advance()
                self._shares.pop(key, None)
                self._cores_cv.notify_all()
        modelled = share.elapsed + credit_s / self.time_scale
        return out, Paced(modelled, modelled * self.time_scale, t_real - t1, clock() - t1, credit_s)

    def add(self, phase: str, p: Paced) -> None:
        with self._lock:
            self.totals[phase].add(p)

    def ledger(self) -> dict:
        """Totals so far (board seconds modelled; paced and real seconds here), for traces and benches."""
        with self._lock:
            return {"label": LABEL, "ram_gb": self.ram_gb, "time_scale": self.time_scale,
                    "contexts": self.contexts, "peak_contexts": self.peak_contexts, "refusals": self.refusals,
                    "peak_busy_cores": self.peak_busy,
                    "core_wait_s": self.core_wait_s, "cpu_wait_s": self.cpu_wait_s,
                    "phases": {k: t.to_dict() for k, t in self.totals.items()}}


class _Share:
    """One context's NPU work in progress: board seconds left at one context's speed, board seconds it has run."""

    def __init__(self, remaining: float, mult: float):
        self.remaining, self.mult, self.elapsed = remaining, mult, 0.0


def shared_ledgers() -> list:
    """Ledgers of every board this process models (what the executor's trace records)."""
    with Board._shared_lock:
        boards = list(Board._shared.values())
    return [b.ledger() for b in boards]


class BoardSimBackend(BranchBackend):
    """One context on the modelled board (see the module docstring)."""
    name = "board-sim"
    max_contexts = None            # memory (the modelled ledger) is the limit
    parallel_contexts = 3          # three NPU cores
    takes_core_mask = True
    device = "npu"
    SETTINGS = ("time_scale", "board_ram_gb", "board_model", "board_cost")   # besides threads, core_mask

    @classmethod
    def auto_policy(cls, ctx):
        """The policy that fits the modelled `board_ram_gb` board, chosen on its timeline (models/board/auto.py)."""
        from models.board.auto import choose_policy
        from models.packs.memory_fit import for_pack
        packs = tuple(getattr(ctx, "packs", ()) or ())
        return choose_policy(ctx, memory=for_pack(packs[0] if packs else None))

    @classmethod
    def host_pacer(cls, pack_dir, settings: dict) -> HostPacer:
        """Each host op held to the modelled board's host time x time_scale, so a policy that hides host time shows
        it in wall time (ValueError for a pack the cost model cannot size)."""
        return HostPacer.for_pack(pack_dir, settings.get("time_scale", 1.0), settings.get("board_model", "full"),
                                  settings.get("board_cost"))

    @classmethod
    def report_section(cls, pack_dir, settings: dict) -> dict:
        """The modelled board the job ran on: the report computes its `board` block (models/board/account.py) from
        it, in board seconds apart from what was measured here."""
        return {"pack_dir": str(pack_dir), **{k: settings[k] for k in cls.SETTINGS if k in settings}}

    @classmethod
    def trace_fields(cls) -> dict:
        """The modelled board's running totals (modelled, paced, overruns)."""
        return {"board": shared_ledgers()}

    def __init__(self, threads: Optional[int] = None, core_mask="auto", time_scale: float = 1.0,
                 board_ram_gb: int = 8, board_model: str = "full", board_cost: Optional[str] = None,
                 board: Optional[Board] = None):
        self.board = board or Board.shared(board_ram_gb, time_scale, board_model, board_cost)
        self.mask_key = core_mask_word(core_mask)
        self.cores = CORE_MASKS[self.mask_key].cores
        self.onnx = OnnxBackend(threads)
        self._path: Optional[str] = None
        self._kind: Optional[str] = None
        self._fig = None                       # the branch's (or its shard's) modelled figures
        self._model: Optional[BoardModel] = None
        self._reserved = False
        self._context_mib: Optional[float] = None
        self._chain = Chain()                  # one model's load, init, inferences, release back to back share slack
        self.report: dict = {}

    @property
    def time_scale(self) -> float:
        return self.board.time_scale

    def _phase(self, name: str, p: Paced, **extra) -> None:
        self.board.add(name if name in self.board.totals else "npu", p)
        self.report.setdefault("phases", []).append({"phase": name, **p.to_dict(), **extra})

    # -- lifecycle --------------------------------------------------------------------------------------------
    def load(self, path) -> None:
        p = Path(path).absolute()
        try:
            _, kind = parse_branch_file(p.name)
        except ValueError as e:
            raise BackendError(f"{p}: {e}") from None
        self._model = self.board.model(p.parent.parent)            # PACK/onnx/bNN_kind.onnx (.sI.onnx: shard I)
        self._path, self._kind = str(p), kind
        self.report = {"branch": p.name, "label": LABEL, "time_scale": self.time_scale, "core_mask": self.mask_key}
        shard = SHARD_RE.search(p.name)
        parts = self._model.parts[kind]
        if (shard is None) != (len(parts) == 1) or (shard is not None and int(shard.group(1)) >= len(parts)):
            raise BackendError(f"{p}: the pack's manifest says its {kind} branches run as {len(parts)} graph(s)")
        self._fig = fig = parts[int(shard.group(1)) if shard else 0]
        self._chain = Chain()                                        # a new model: no credit from the last one
        with self.board.cpu_slot():
            t0 = clock()
            self.onnx.load(p)                                        # real: the graph's bytes
            self._phase("load", self._chain.pace(t0, fig.load_s, self.time_scale))

    def init(self) -> None:
        if self._path is None:
            raise BackendError("init() before load()")
        self._context_mib = self.board.reserve(self._model, os.path.basename(self._path), self._fig.units)
        self._reserved = True
        fig = self._fig
        with self.board.cpu_slot():
            t0 = clock()
            try:
                self.onnx.init()                                     # real: an ONNX Runtime session
            finally:
                self._phase("init", self._chain.pace(t0, fig.init_s, self.time_scale))

    def infer(self, inputs: dict) -> dict:
        if self._model is None or not self._reserved:
            raise BackendError("infer() before init()")
        fig, scale = self._fig, self.time_scale
        t0 = clock()                                                 # tensor I/O in and out (CPU)
        self._phase("io", self._chain.pace(t0, fig.io_s, scale))
        with self.board.npu(self.mask_key, self.cores) as taken:
            t1 = clock()
            credit = min(self._chain.start(t1), fig.npu_s * scale)
            mult = self._model.multi_core_speedup if len(taken) > 1 else 1.0
            out, p = self.board.npu_work(t1, fig.npu_s, mult, credit,
                                         lambda: self.onnx.infer(inputs))    # real: the branch's outputs
            self._phase("npu", self._chain.end(p), cores=list(taken), at=t1, end=clock())
        return out

    def release(self) -> None:
        if self._path is None:
            return
        fig = self._fig
        with self.board.cpu_slot():
            t0 = clock()
            self.onnx.release()
            self._phase("release", self._chain.pace(t0, fig.release_s, self.time_scale))
        if self._reserved:
            self.board.unreserve(self._fig.units)
        self._reserved, self._path, self._context_mib = False, None, None

    def context_mb(self) -> Optional[float]:
        """The modelled MemAvailable cost of this context (MiB; reference memory table), None before init."""
        return self._context_mib
