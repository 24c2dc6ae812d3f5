"""The NPU branch executor stage: per BRANCH request load → init → infer(cond) → infer(uncond) → release, timed.

    python -m stages.executor --config run/pipeline.toml

Backends: `onnx` (ONNX Runtime, any machine; the default here), `rknn` (rknn-toolkit-lite2 on the RK3588 board,
stages/backends/rknn.py). Lifecycle policies (`[stage.executor] policy`): `on-demand` (what the board needs today:
nothing stays loaded between calls) and `prefetch` (load and init the branch named in the request's `next` hint on
a helper thread while the current one runs, so its set-up overlaps this branch's inference, the transport and the
scheduler's host ops; needs memory for two models).
`[stage.executor] trace = "FILE"` (opt-in, for tests and debugging) appends one JSON line per branch call served:
{pid, job, step, block, branch, attempt}.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np

from models.branch_runtime import BackendError
from protocol import messages as m
from stages.backends import make_backend
from stages.base import RequestFailed, stage_main
from stages.config import PipelineConfig
from stages.memory import process_memory_mb, return_freed_memory
from stages.tensor_io import ReplyTensors, read_tensor

log = logging.getLogger(__name__)

POLICIES = ("on-demand", "prefetch")
MEMORY_EVERY = 16          # PSS (smaps_rollup) is read on every 16th call; RSS (statm) on every call
KEEPALIVE_SLICE_S = 0.05   # how often lifecycle requests are answered while a branch runs


BACKEND_SETTINGS = ("core_mask", "dual_core", "dual_masks", "lite")   # [stage.executor] keys for the rknn backend


def make_branch_backend(name: str, threads: int | None, settings: dict):
    """A backend instance by name (stages.backends: onnx, rknn-sim from models; rknn for the board)."""
    kwargs = {"threads": threads} if threads else {}
    if name == "rknn":
        kwargs.update({k: settings[k] for k in BACKEND_SETTINGS if k in settings})
        if "dual_masks" in kwargs:
            kwargs["dual_masks"] = tuple(kwargs["dual_masks"])
    return make_backend(name, **kwargs)


class _Prepared:
    """A backend whose model is loaded and initialised ahead of its request (prefetch policy)."""

    def __init__(self, path: str, backend, pool: ThreadPoolExecutor):
        self.path, self.backend = path, backend
        self.load_s = self.init_s = 0.0
        self.error: Exception | None = None
        self.future = pool.submit(self._run)

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.backend.load(self.path)
            t1 = time.perf_counter()
            self.backend.init()
            self.load_s, self.init_s = t1 - t0, time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - reported when the request comes; it then loads normally
            self.error = e

    def take(self):
        self.future.result()
        return self


class ExecutorLogic:
    """Runs one branch model at a time for the scheduler; no sockets here (StageProc wraps it)."""

    def __init__(self, config: PipelineConfig):
        settings = config.stage_settings("executor")
        self.policy = settings.get("policy", "on-demand")
        if self.policy not in POLICIES:
            raise ValueError(f"stage.executor.policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        self.backend_name = config.backend
        self.threads = int(settings.get("threads", config.threads))
        self.pack_dirs = tuple(Path(p).resolve() for p in config.packs)   # branch models come from these only
        self.backend = make_branch_backend(self.backend_name, self.threads, settings)
        self._spare = make_branch_backend(self.backend_name, self.threads, settings) if self.policy == "prefetch" \
            else None
        self._prepared: _Prepared | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="branch")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if self._spare is not None else None
        gc.collect()
        gc.freeze()                     # the modules' ~30k objects: a full collection per call drops from ~30 ms to ~0
        self.calls = 0
        trace = settings.get("trace")
        self.trace = str(Path(config.path).parent / trace) if trace else None   # relative to the config file

    def info(self) -> dict:
        return {"backend": self.backend_name, "threads": self.threads, "policy": self.policy,
                "packs": ",".join(str(p) for p in self.pack_dirs)}

    def _model_path(self, model: str) -> str:
        path = Path(model).resolve()
        if self.pack_dirs and not any(d in path.parents for d in self.pack_dirs):
            raise RequestFailed(f"model {model} is outside the configured packs "
                                f"({', '.join(str(d) for d in self.pack_dirs)})", code="bad_request", field="model")
        if not path.is_file():
            raise RequestFailed(f"branch model {model} does not exist", code="failed", field="model")
        return str(path)

    def on_branch(self, msg: m.Branch, ctx) -> m.BranchDone:
        # 1) take the branch call: model path and every pass's inputs (views into the arena, or inline frames)
        path = self._model_path(msg.model)
        feeds = []
        for i, p in enumerate(msg.passes):
            feeds.append({name: read_tensor(ctx, msg.arena, d, msg.inline, field=f"passes[{i}].inputs.{name}")
                          for name, d in p.inputs.items()})
        # 2)-4) on a worker thread, so heartbeats are answered while the model loads and runs (ORT and RKNNLite
        # release the GIL); a silent executor is then a dead one, and the scheduler resends at once
        nxt = msg.next.model if self.policy == "prefetch" and msg.next is not None else None
        future = self._worker.submit(self._run, path, feeds, nxt)      # one long-lived thread: no per-call
        while True:                                                     # thread (and malloc arena) churn
            try:
                outputs, load_s, init_s, infer_s, release_s, cached = future.result(KEEPALIVE_SLICE_S)
                break
            except FutureTimeout:
                ctx.keepalive()
        reply_tensors = ReplyTensors(ctx, msg.arena)
        descs = tuple(reply_tensors.put(np.asarray(y), p.output, field=f"passes[{i}].output")
                      for i, (y, p) in enumerate(zip(outputs, msg.passes)))
        self.calls += 1
        if self.trace:
            self._trace(msg)
        mem = process_memory_mb(pss=self.calls % MEMORY_EVERY == 1)   # smaps_rollup costs ~7 ms: sampled
        times = m.PhaseTimes(load_s=load_s, init_s=init_s, infer_s=tuple(infer_s), release_s=release_s)
        log.debug("block %d %s: load %.3f init %.3f infer %s release %.3f (rss %.0f MB)", msg.block,
                  msg.branch, load_s, init_s, ["%.3f" % s for s in infer_s], release_s, mem["rss"])
        return m.reply_to(msg, m.BranchDone, job=msg.job, step=msg.step, block=msg.block, branch=msg.branch,
                          attempt=msg.attempt, times=times, outputs=descs, cached=cached, rss_mb=mem["rss"],
                          pss_mb=mem.get("pss"), inline=reply_tensors.inline)

    def _run(self, path: str, feeds: list, next_model: str | None):
        """-> (outputs per pass, load_s, init_s, [infer_s], release_s, cached)."""
        # 2) load and init (or pick up what prefetch prepared); prefetch: the next branch loads while this one runs
        backend, load_s, init_s, cached = self._acquire(path)
        if next_model is not None:
            self._prefetch(next_model)
        try:
            # 3) run both passes on the same loaded model, conditional first
            outputs, infer_s = [], []
            if getattr(backend, "dual_core", False) and len(feeds) == 2:
                t0 = time.perf_counter()                                     # both passes at once, two NPU cores
                try:
                    outs = backend.infer_many(feeds)
                except BackendError as e:
                    raise RequestFailed(str(e), field="passes") from None
                infer_s = [time.perf_counter() - t0]
                outputs = [next(iter(o.values())) for o in outs]
            for i, feed in enumerate(feeds if not outputs else ()):
                t0 = time.perf_counter()
                try:
                    out = backend.infer(feed)
                except BackendError as e:
                    raise RequestFailed(str(e), field=f"passes[{i}].inputs") from None
                infer_s.append(time.perf_counter() - t0)
                outputs.append(next(iter(out.values())))                    # y: [L, D] io dtype
        finally:
            # 4) release (on-demand: nothing stays loaded) and reply
            t0 = time.perf_counter()
            backend.release()
            gc.collect()                # released sessions sit in reference cycles: free their weights now (cheap:
                                        # start-up objects are frozen out of the collector, see __init__)
            return_freed_memory()       # and give the pages back to the OS (malloc_trim)
            release_s = time.perf_counter() - t0
        return outputs, load_s, init_s, infer_s, release_s, cached

    def _trace(self, msg: m.Branch) -> None:
        """One JSON line per served call, appended with O_APPEND (one write: lines never interleave)."""
        line = json.dumps({"pid": os.getpid(), "job": msg.job, "step": msg.step, "block": msg.block,
                           "branch": msg.branch, "attempt": msg.attempt}) + "\n"
        fd = os.open(self.trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _acquire(self, path: str):
        """-> (backend ready to infer, load_s, init_s, cached)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.take()
            if prepared.path == path and prepared.error is None:
                self.backend, self._spare = prepared.backend, self.backend
                return self.backend, prepared.load_s, prepared.init_s, True
            prepared.backend.release()
            if prepared.error is not None:
                log.warning("prefetch of %s failed (%s); loading on demand", prepared.path, prepared.error)
        try:
            t0 = time.perf_counter()
            self.backend.load(path)
            t1 = time.perf_counter()
            self.backend.init()
            t2 = time.perf_counter()
        except BackendError as e:
            self.backend.release()
            raise RequestFailed(str(e), field="model") from None
        return self.backend, t1 - t0, t2 - t1, False

    def _prefetch(self, model: str) -> None:
        try:
            path = self._model_path(model)
        except RequestFailed as e:
            log.warning("not prefetching: %s", e)
            return
        self._prepared = _Prepared(path, self._spare, self._prefetcher)

    def close(self) -> None:
        if self._prepared is not None:
            self._prepared.take().backend.release()
        self.backend.release()
        for pool in (self._worker, self._prefetcher):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def main(argv=None) -> int:
    return stage_main("executor", ExecutorLogic, argv)


if __name__ == "__main__":
    sys.exit(main())
