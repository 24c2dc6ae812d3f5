"""THE branch lifecycle: load → init → infer every pass → release, with the policies of models/board/policy.py plugged in.

Used by the in-process runner (models/runtime/dit_runner.py) and by the executor stage (stages/executor.py) alike, for every
backend (ONNX Runtime, the rknn-toolkit2 simulator, RKNNLite on the board, board-sim). One backend instance is one
context (one loaded model on one core mask); the lifecycle makes as many as the policy needs through a factory.

    lc = Lifecycle(context_factory("onnx", threads=2), parse_policy("prefetch2"))
    outs, times = lc.run(pack.branch_path(0, "self"), [feed_cond, feed_uncond], ahead=[next1, next2])
    fut = lc.submit(path, [feed_cond], hold=True)    # the same on the lifecycle's worker thread (a Future)

Calls are served strictly in order (one worker thread). Per call:
  1) take the model: held from the previous pass of this branch, resident, prefetched (waiting if it is not ready
     yet), or loaded and initialised now;
  2) queue the branches `ahead` for loading on the helper thread (prefetch);
  3) infer every pass: in order on one context, or (dual_core) pass i on context i % 2, the two contexts at once;
     a sharded pack's branch (`shards_of` says so) is its N shard contexts per pass: at once (the `shards` policy:
     shard i on core i) or in turn, each fed its part of the pass (models/dit/shards.py), outputs combined in FP32;
  4) keep the model (hold, resident) or release it: now (on-demand, and a call with nothing ahead, the last of a
     forward, so nothing stays loaded while the executor idles) or on the helper thread (prefetch), in which case
     its release time is reported by the next call as `prev_release_s`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from models.runtime.backends import backend_class
from models.runtime.backends.base import BackendError, BranchBackend
from models.runtime.phase_times import PhaseTimes
from models.board.policy import Policy
from models.dit.shards import MAX_SHARDS, combine, shard_feed

log = logging.getLogger(__name__)


class LifecycleError(BackendError):
    """A phase failed: `phase` is load | init | infer, `pass_index` the pass for infer."""

    def __init__(self, message: str, phase: str, pass_index: Optional[int] = None):
        super().__init__(message)
        self.phase, self.pass_index = phase, pass_index


class _Context:
    """One branch model loaded and initialised on 1 (or, dual_core, 2) backend instances."""

    def __init__(self, path: str, backends: list):
        self.path, self.backends = path, backends
        self.masks: list = []                # the core mask each backend was made for (its spare pool)
        self.files: list = []                # shards opened one at a time, in the call (a one-context backend)
        self.specs: Optional[list] = None    # a sharded branch's ShardSpecs (backends copy-major: copy * N + shard)
        self.load_s = self.init_s = 0.0
        self.mb: Optional[float] = 0.0       # summed context_mb of its backends; None when one does not know
        self.pinned = False


class _Prepared:
    """A context being prepared on the helper thread."""

    def __init__(self, path: str):
        self.path = path
        self.ctx: Optional[_Context] = None
        self.error: Optional[Exception] = None
        self.future: Optional[Future] = None


def context_factory(backend, **kwargs) -> Callable[[Optional[str]], BranchBackend]:
    """new_context(core_mask) for a backend name or class: kwargs go to every instance; core_mask (None: the
    backend's default or kwargs' core_mask) only to backends that take one (`takes_core_mask`)."""
    cls = backend_class(backend) if isinstance(backend, str) else backend

    def new_context(core_mask: Optional[str] = None) -> BranchBackend:
        kw = dict(kwargs)
        if getattr(cls, "takes_core_mask", False):
            if core_mask is not None:
                kw["core_mask"] = core_mask
        else:
            kw.pop("core_mask", None)
        return cls(**kw)
    new_context.backend_class = cls
    return new_context


def single_context(backend: BranchBackend) -> Callable[[Optional[str]], BranchBackend]:
    """A factory that always gives the same instance: enough for on-demand and interleave (one context at a time)."""
    def new_context(core_mask: Optional[str] = None) -> BranchBackend:
        return backend
    new_context.backend_class = type(backend)
    new_context.single = True
    return new_context


def run_branch(backend: BranchBackend, path, passes: list) -> tuple:
    """One on-demand call on one backend instance: load, init, every pass, release -> (outputs per pass, PhaseTimes)."""
    return Lifecycle(single_context(backend)).run(path, passes)


class Lifecycle:
    """Serves branch calls under a Policy; see the module docstring for the four steps of a call."""

    def __init__(self, new_context: Callable[[Optional[str]], BranchBackend], policy: Policy = Policy(), *,
                 after_release: Optional[Callable[[], None]] = None,
                 shards_of: Optional[Callable[[str], Optional[tuple]]] = None):
        """shards_of(path) -> ([shard file, ...], [ShardSpec, ...]) for a sharded pack's branch, None for one graph
        (the pack's manifest knows; models.packs.pack)."""
        if getattr(new_context, "single", False) and (policy.prefetch or policy.dual_core or policy.resident):
            raise ValueError(f"policy {policy.name!r} needs several contexts: give a backend factory "
                             "(context_factory), not one backend instance")
        self.policy = policy
        self._new = new_context
        self._after_release = after_release
        masks = list(policy.dual_masks) if policy.dual_core else [None]
        self._masks = masks
        self._spare: dict = {m: [] for m in masks}        # released instances, reused (no re-import, no churn)
        self._prepared: OrderedDict = OrderedDict()        # path -> _Prepared (prefetch, in the order asked)
        self._resident: dict = {}                          # path -> pinned _Context
        self.resident_mb = 0.0                             # summed context_mb of the pinned contexts
        self._decided: set = set()                         # paths whose pinning was decided (once each)
        self._held: Optional[_Context] = None
        self._pending_release: Optional[Future] = None     # the previous model's background release
        self._lock = threading.Lock()                      # one call at a time (inline run or worker)
        self._spare_lock = threading.Lock()
        self._worker: Optional[ThreadPoolExecutor] = None  # created on first submit(); long-lived
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="lifecycle-helper") if policy.prefetch else None
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="lifecycle-lane1") if policy.dual_core else None
        # dual_core: the second context of a pair loads, inits and releases here while the first does on the calling
        # thread (two CPU cores: a pair costs one context's time); two threads, so a release on the worker never
        # queues behind a prefetch on the helper
        self._pair = ThreadPoolExecutor(2, thread_name_prefix="lifecycle-pair") if policy.dual_core else None
        self._shards_of = shards_of
        self._aside: Optional[ThreadPoolExecutor] = None   # a sharded branch's contexts beside the calling thread
        self.closed = False

    # ---- public ------------------------------------------------------------------------------------------------
    def run(self, path, passes: list, ahead=(), hold: bool = False) -> tuple:
        """One branch call on the caller's thread -> (outputs per pass [dict name -> array], PhaseTimes)."""
        with self._lock:
            return self._call(os.fspath(path), list(passes), [os.fspath(a) for a in ahead], hold)

    def submit(self, path, passes: list, ahead=(), hold: bool = False) -> Future:
        """The same call on the lifecycle's worker thread (calls run in submission order) -> Future of run()'s
        result; the caller may do host work meanwhile (interleave) or answer heartbeats (the executor)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="lifecycle")
        return self._worker.submit(self.run, path, passes, ahead, hold)

    @property
    def resident_paths(self) -> list:
        return list(self._resident)

    def loaded(self) -> dict:
        """What is loaded now: {"resident": [...], "prepared": [...], "held": path | None} (for tests, logs)."""
        return {"resident": list(self._resident), "prepared": [p for p, pr in self._prepared.items()],
                "held": self._held.path if self._held else None}

    def drop(self) -> None:
        """Release everything not pinned: held, prepared (the job ended or moved elsewhere)."""
        with self._lock:
            self._drop_unpinned()

    def close(self) -> None:
        """Release everything, resident contexts included, and stop the threads."""
        if self.closed:
            return
        with self._lock:
            self._drop_unpinned()
            for ctx in list(self._resident.values()):
                self._release_now(ctx)
            self._resident.clear()
            self.resident_mb = 0.0
            self._join_release()
        for pool in (self._worker, self._helper, self._lane, self._pair, self._aside):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self.closed = True

    # ---- one call ----------------------------------------------------------------------------------------------
    def _call(self, path: str, passes: list, ahead: list, hold: bool) -> tuple:
        wait = 0.0
        # 1) take the model
        if self._held is not None and self._held.path != path:
            if not self._held.pinned:              # the other pass never came (a restarted scheduler moved on)
                self._release_now(self._held)
            self._held = None
        if self._held is not None:
            ctx, source, self._held = self._held, "held", None
        elif path in self._resident:
            ctx, source = self._resident[path], "resident"
        else:
            ctx, source, wait = self._take_prepared(path)
            if ctx is None:
                ctx, source = self._open(path), "load"
        load_s, init_s = (ctx.load_s, ctx.init_s) if source in ("load", "prefetch") else (0.0, 0.0)
        # 2) prefetch: queue what comes next; drop prepared models nobody will ask for
        if self._helper is not None:
            self._prefetch(ahead[:self.policy.prefetch], keep=path)
        # 3) every pass on the model
        try:
            outs, infer_s, infer_at = self._infer(ctx, passes)
        except BaseException:
            if not ctx.pinned:
                self._release_now(ctx)
            raise
        # 4) keep it (hold, resident) or release it: now, or on the helper thread behind the next call
        release_s, background = 0.0, None
        if hold:
            self._held = ctx
        else:
            self._pin_or_not(ctx)
            if not ctx.pinned:
                if self._helper is not None and ahead:   # more calls follow: release behind them
                    background = ctx
                else:
                    release_s = self._release_now(ctx)
        prev = self._join_release()
        if background is not None:
            self._pending_release = self._helper.submit(self._release_now, background)
        return outs, self._times(load_s, init_s, infer_s, infer_at, release_s, wait, source, ctx, prev)

    def _times(self, load_s, init_s, infer_s, infer_at, release_s, wait, source, ctx, prev) -> PhaseTimes:
        prev_s, prev_wait = prev
        return PhaseTimes(load_s=load_s, init_s=init_s, infer_s=tuple(infer_s), release_s=release_s,
                          wait_s=wait + prev_wait, prev_release_s=prev_s, source=source, context_mb=ctx.mb or 0.0,
                          infer_at=tuple(infer_at))

    def _join_release(self) -> tuple:
        """(seconds the previous background release took, seconds waited for it now)."""
        fut, self._pending_release = self._pending_release, None
        if fut is None:
            return 0.0, 0.0
        t0 = time.perf_counter()
        done = fut.done()
        took = fut.result()
        return took, 0.0 if done else time.perf_counter() - t0

    # ---- phases ------------------------------------------------------------------------------------------------
    def _instance(self, mask) -> BranchBackend:
        with self._spare_lock:
            if self._spare.setdefault(mask, []):
                return self._spare[mask].pop()
        return self._new(mask)

    def _aside_pool(self) -> ThreadPoolExecutor:
        if self._aside is None:
            self._aside = ThreadPoolExecutor(2 * MAX_SHARDS, thread_name_prefix="lifecycle-shard")
        return self._aside

    def _open(self, path: str) -> _Context:
        """Load and init on every context the policy needs; a dual_core pair at once (the second on a pair thread),
        a sharded branch's contexts all at once (on shard threads), so the phase times are their wall (the longest)."""
        ctx = _Context(path, [])
        shards = self._shards_of(path) if self._shards_of is not None else None
        if shards:
            files, ctx.specs = shards
            if getattr(self._new.backend_class, "max_contexts", None) == 1:
                ctx.files = list(files)           # one context at a time (rknn-sim): each shard opens in its turn
                return ctx                        # (so one backend instance serves them too: quant-check's)
            if getattr(self._new, "single", False):
                raise LifecycleError(f"{path}: a sharded branch runs one context per shard: give a backend factory "
                                     "(context_factory), not one backend instance", "load")
            # `shards`: shard i on NPU core i, in every copy; in turn: each copy's contexts on its own mask
            jobs = [(f, str(i % MAX_SHARDS) if self.policy.shards else m) for m in self._masks
                    for i, f in enumerate(files)]
            pool = self._aside_pool()
        else:
            jobs, pool = [(path, m) for m in self._masks], self._pair
        others = [pool.submit(self._open_one, f, m) for f, m in jobs[1:]]
        results = []
        try:
            results.append(self._open_one(*jobs[0]))
        finally:
            results += [o.result() for o in others]      # waits even when the first failed: all are released
        ctx.backends = [be for be, *_ in results if be is not None]
        ctx.masks = [m for (_, m), r in zip(jobs, results) if r[0] is not None]
        error = next((r[4] for r in results if r[4] is not None), None)
        if error is not None:
            self._release_now(ctx)
            raise error
        ctx.load_s, ctx.init_s = max(r[1] for r in results), max(r[2] for r in results)
        mbs = [r[3] for r in results]
        ctx.mb = None if any(mb is None for mb in mbs) else sum(float(mb) for mb in mbs)
        return ctx

    def _open_one(self, path: str, mask) -> tuple:
        """One context loaded and initialised -> (backend or None, load_s, init_s, context_mb, error or None); never
        raises, so a pair's other half is always waited for and released."""
        be = load_s = init_s = None
        try:
            be = self._instance(mask)
            t0 = time.perf_counter()
            try:
                be.load(path)
            except BackendError as e:
                raise LifecycleError(str(e), "load") from None
            t1 = time.perf_counter()
            try:
                be.init()
            except BackendError as e:
                raise LifecycleError(str(e), "init") from None
            load_s, init_s = t1 - t0, time.perf_counter() - t1
            return be, load_s, init_s, be.context_mb(), None
        except Exception as e:  # noqa: BLE001 - handed to _open, which releases the pair and raises it
            return be, 0.0, 0.0, None, e

    def _infer(self, ctx: _Context, passes: list) -> tuple:
        if ctx.specs is not None:
            return self._infer_shards(ctx, passes)
        n = len(ctx.backends)
        infer_s, infer_at = [0.0] * len(passes), [0.0] * len(passes)
        outs: list = [None] * len(passes)

        def lane(i0: int) -> None:
            for i in range(i0, len(passes), n):
                t0 = time.monotonic()
                try:
                    outs[i] = ctx.backends[i0].infer(passes[i])
                except BackendError as e:
                    raise LifecycleError(str(e), "infer", i) from None
                infer_at[i], infer_s[i] = t0, time.monotonic() - t0
        other = self._lane.submit(lane, 1) if n == 2 and len(passes) > 1 else None
        try:
            lane(0)
        finally:
            if other is not None:
                other.result()                 # re-raises lane 1's error; waits even when lane 0 failed
        return outs, infer_s, infer_at

    def _infer_shards(self, ctx: _Context, passes: list) -> tuple:
        """Every pass of a sharded branch: lanes (one per shard with `shards`, one per copy otherwise; dual_core's
        copies take the passes by turn) run at once; each pass's shard outputs are combined in FP32 in shard order."""
        specs, n = ctx.specs, len(ctx.specs)
        if ctx.files:
            return self._infer_shards_in_turn(ctx, passes)
        copies = len(ctx.backends) // n
        got = [[None] * n for _ in passes]
        spans = [[] for _ in passes]

        def lane(copy: int, shards: list) -> None:
            for p in range(copy, len(passes), copies):
                for i in shards:
                    t0 = time.monotonic()
                    try:
                        got[p][i] = ctx.backends[copy * n + i].infer(shard_feed(specs[i], passes[p]))
                    except BackendError as e:
                        raise LifecycleError(str(e), "infer", p) from None
                    spans[p].append((t0, time.monotonic()))
        lanes = [(c, [i]) for c in range(copies) for i in range(n)] if self.policy.shards else \
            [(c, list(range(n))) for c in range(copies)]
        others = [self._aside_pool().submit(lane, *ln) for ln in lanes[1:]]
        try:
            lane(*lanes[0])
        finally:
            errors = []
            for f in others:                   # every lane ends before the call does; the first error is raised
                try:
                    f.result()
                except LifecycleError as e:
                    errors.append(e)
            if errors:
                raise errors[0]
        outs = [{name: combine(specs, [g[name] for g in row], name) for name in row[0]} for row in got]
        infer_at = [min(a for a, _ in sp) for sp in spans]
        return outs, [max(b for _, b in sp) - a for sp, a in zip(spans, infer_at)], infer_at

    def _infer_shards_in_turn(self, ctx: _Context, passes: list) -> tuple:
        """A backend that holds one context (the simulator): each shard loaded, run for every pass and released in
        turn; the call's inference time then includes the shards' lifecycles."""
        got = [[] for _ in passes]
        t0 = time.monotonic()
        for f, spec in zip(ctx.files, ctx.specs):
            be, _, _, _, error = self._open_one(f, self._masks[0])
            if error is not None:
                if be is not None:
                    be.release()
                raise error
            try:
                for p, feed in enumerate(passes):
                    try:
                        got[p].append(be.infer(shard_feed(spec, feed)))
                    except BackendError as e:
                        raise LifecycleError(str(e), "infer", p) from None
            finally:
                be.release()
        dt = time.monotonic() - t0
        outs = [{name: combine(ctx.specs, [g[name] for g in row], name) for name in row[0]} for row in got]
        return outs, [dt / len(passes)] * len(passes), [t0] * len(passes)

    def _release_now(self, ctx: _Context) -> float:
        t0 = time.perf_counter()

        def release(be) -> None:
            try:
                be.release()
            except Exception as e:  # noqa: BLE001 - a failing release must not hide the call's result
                log.warning("%s: release: %s", ctx.path, e)
        pool = self._aside_pool() if ctx.specs is not None else self._pair
        others = [pool.submit(release, be) for be in ctx.backends[1:]] if pool is not None else []
        for be in ctx.backends[:1] if others else ctx.backends:
            release(be)
        for f in others:                                   # a dual_core pair, a branch's shards release at once
            f.result()
        masks = ctx.masks if len(ctx.masks) == len(ctx.backends) else [None] * len(ctx.backends)
        with self._spare_lock:
            for be, mask in zip(ctx.backends, masks):
                if not getattr(self._new, "single", False):
                    self._spare.setdefault(mask, []).append(be)
        ctx.backends = []
        if self._after_release is not None:
            self._after_release()
        return time.perf_counter() - t0

    # ---- prefetch ----------------------------------------------------------------------------------------------
    def _take_prepared(self, path: str) -> tuple:
        """(context, "prefetch", seconds waited) when `path` was prepared, else (None, "load", 0)."""
        pr = self._prepared.pop(path, None)
        if pr is None:
            return None, "load", 0.0
        t0 = time.perf_counter()
        done = pr.future.done()
        pr.future.result()
        waited = 0.0 if done else time.perf_counter() - t0
        if pr.error is not None:
            log.warning("prefetch of %s failed (%s); loading on demand", path, pr.error)
            return None, "load", waited
        return pr.ctx, "prefetch", waited

    def _prefetch(self, ahead: list, keep: str) -> None:
        for p in [p for p in self._prepared if p not in ahead and p != keep]:
            pr = self._prepared.pop(p)                            # stale: asked for, then never needed
            self._helper.submit(self._discard, pr)
        for p in ahead:
            if p == keep or p in self._prepared or p in self._resident:
                continue
            pr = _Prepared(p)
            pr.future = self._helper.submit(self._prepare, pr)
            self._prepared[p] = pr

    def _prepare(self, pr: _Prepared) -> None:
        try:
            pr.ctx = self._open(pr.path)
        except Exception as e:  # noqa: BLE001 - reported when the call comes; it then loads on demand
            pr.error = e

    def _discard(self, pr: _Prepared) -> None:
        if pr.future is not None:
            pr.future.result()
        if pr.ctx is not None:
            self._release_now(pr.ctx)

    def _drop_unpinned(self) -> None:
        if self._held is not None:
            if not self._held.pinned:
                self._release_now(self._held)
            self._held = None
        for pr in list(self._prepared.values()):
            pr.future.result()
            if pr.ctx is not None:
                self._release_now(pr.ctx)
        self._prepared.clear()

    # ---- resident ----------------------------------------------------------------------------------------------
    def _pin_or_not(self, ctx: _Context) -> None:
        """Decided once per model, the first time it is used: pinned while the budget allows (first fit in the
        fixed cycle order)."""
        if not self.policy.resident or ctx.path in self._decided:
            return
        self._decided.add(ctx.path)
        if ctx.mb is None:
            log.warning("resident: %s not pinned: its backend does not report context_mb", ctx.path)
            return
        if self.resident_mb + ctx.mb <= self.policy.resident_mb:
            ctx.pinned = True
            self._resident[ctx.path] = ctx
            self.resident_mb += ctx.mb
            log.info("resident: %s pinned (%.1f MiB; %.1f of %.1f MiB used)", os.path.basename(ctx.path), ctx.mb,
                     self.resident_mb, self.policy.resident_mb)
