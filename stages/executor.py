"""The NPU branch executor stage: each BRANCH request runs through the one lifecycle (models/runtime/lifecycle.py), timed.

    python -m stages.executor --config run/pipeline.toml

Backends (models/runtime/backends/): `onnx` (ONNX Runtime, any machine; the default here), `rknn` (rknn-toolkit-lite2 on the
RK3588 board), `rknn-sim`, `board-sim`. Lifecycle policy (`[stage.executor] policy`, default "auto"; models/board/policy.py):
`on-demand`, `prefetch[N]`, `dual_core`, `resident` (with `resident_mb`), `interleave`, joined by `+`; the resolved
policy is in READY.info["policy"] (the scheduler reads it to decide whether to interleave the CFG passes).
Backend settings in the same table go to the backend's constructor when it takes them (`core_mask`, `lite` for
rknn); `dual_masks` are the dual_core contexts' core masks.
`[stage.executor] trace = "FILE"` (opt-in, for tests and debugging) appends one JSON line per branch call served:
{pid, job, step, block, branch, attempt, passes, hold, source, infer_at, infer_s}.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np

from models.runtime.backends import backend_class, backend_kwargs
from models.runtime.lifecycle import Lifecycle, LifecycleError, context_factory
from models.packs.pack import load_pack
from models.packs.sharded import ShardResolver
from models.dit.partition import branch_file
from models.board.policy import PolicyError, resolve_policy
from models.runtime.probes import process_memory_mb
from protocol import messages as m
from stages.base import RequestFailed, stage_main
from stages.config import ConfigError, PipelineConfig
from stages.memory import return_freed_memory
from stages.tensor_io import ReplyTensors, read_tensor

log = logging.getLogger(__name__)

MEMORY_EVERY = 16          # PSS (smaps_rollup) is read on every 16th call; RSS (statm) on every call
KEEPALIVE_SLICE_S = 0.05   # how often control requests (HEARTBEAT, CANCEL) are answered during a branch
STAGE_KEYS = ("policy", "resident_mb", "dual_masks", "threads", "trace")   # read here, never passed to a backend


def after_release() -> None:
    """Released runtime sessions sit in reference cycles: collect them now (cheap: start-up objects are frozen out
    of the collector) and hand the pages back to the OS (malloc_trim), so a branch's buffers leave the RSS at once."""
    gc.collect()
    return_freed_memory()


def _pack_id(pack_dir: Path | None) -> str:
    """The configured pack's identity (READY info: a remote scheduler checks it is computing the same pack)."""
    if pack_dir is None:
        return ""
    try:
        return load_pack(pack_dir, check=False).identity
    except (OSError, ValueError) as e:
        log.warning("pack %s: %s (requests will fail)", pack_dir, e)
        return ""


class ExecutorLogic:
    """Runs branch calls for the scheduler through one Lifecycle; no sockets here (StageProc wraps it)."""

    def __init__(self, config: PipelineConfig):
        settings = config.stage_settings("executor")
        where = f"{config.path}: stage.executor."
        self.backend_name = config.backend
        self.threads = int(settings.get("threads", config.threads))
        self.pack_dirs = tuple(Path(p).resolve() for p in config.packs)   # branch models come from these only
        self.remote = config.is_remote("executor")        # serving a scheduler on another machine over tcp
        if self.remote and not self.pack_dirs:
            raise ConfigError(f"{config.path}: pack_dir: a remote executor (tcp endpoint) needs its own copy of the "
                              "scheduler's pack")
        self.pack_ids = [_pack_id(d) for d in self.pack_dirs]
        try:
            self.backend_class = cls = backend_class(self.backend_name)
        except ValueError as e:
            raise ConfigError(f"{config.path}: backend: {e}") from None
        problem = cls.runtime_problem(settings)
        if problem:                        # found now (exit 2), not when the first job's first branch loads
            raise ConfigError(f"{config.path}: backend = {self.backend_name!r}: {problem}")
        try:
            self.policy = resolve_policy(settings.get("policy", "auto"), self.backend_name, cls, settings,
                                         self.pack_dirs)
        except PolicyError as e:
            raise ConfigError(f"{where}policy: {e}") from None
        factory = context_factory(cls, **backend_kwargs(cls, self.threads, settings, exclude=STAGE_KEYS))
        self.lifecycle = Lifecycle(factory, self.policy, after_release=after_release, shards_of=ShardResolver())
        gc.collect()
        gc.freeze()                     # the modules' ~30k objects: a full collection per call drops from ~30 ms to ~0
        self.calls = 0
        trace = settings.get("trace")
        self.trace = str(Path(config.path).parent / trace) if trace else None   # relative to the config file
        log.info("executor: backend %s, policy %s", self.backend_name, self.policy.name)

    def info(self) -> dict:
        return {"backend": self.backend_name, "threads": self.threads, "policy": self.policy.name,
                "resident_mb": self.policy.resident_mb, "packs": ",".join(str(p) for p in self.pack_dirs),
                "pack_ids": ",".join(self.pack_ids)}

    def _model_path(self, model: str, block: int | None = None, kind: str | None = None) -> str:
        if self.remote:         # the scheduler names its own copy: the same branch file in this machine's pack
            model = str(self._remote_path(model, block, kind))
        path = Path(model).resolve()
        if self.pack_dirs and not any(d in path.parents for d in self.pack_dirs):
            raise RequestFailed(f"model {model} is outside the configured packs "
                                f"({', '.join(str(d) for d in self.pack_dirs)})", code="bad_request", field="model")
        if not path.is_file():
            raise RequestFailed(f"branch model {model} does not exist", code="failed", field="model")
        return str(path)

    def _remote_path(self, model: str, block: int | None, kind: str | None) -> Path:
        """A scheduler on another machine names its copy PACK/onnx/bNN_kind.onnx: the same file of this host's pack
        of the same folder name (or of its only pack)."""
        p = Path(model)
        if block is not None and p.name != branch_file(block, kind):
            raise RequestFailed(f"model {model} is not block {block} {kind}", code="bad_request", field="model")
        same = [d for d in self.pack_dirs if d.name == p.parent.parent.name] or \
            (list(self.pack_dirs) if len(self.pack_dirs) == 1 else [])
        if len(same) != 1:
            raise RequestFailed(f"model {model}: none of this host's packs ({', '.join(d.name for d in self.pack_dirs)})"
                                f" is named {p.parent.parent.name!r}", code="bad_request", field="model")
        return same[0] / "onnx" / p.name

    def _ahead(self, refs) -> list:
        """The prefetch hints that name files of the pack; a bad one is skipped (it is only a hint)."""
        out = []
        for ref in refs[:self.policy.prefetch]:
            try:
                out.append(self._model_path(ref.model))
            except RequestFailed as e:
                log.warning("not prefetching: %s", e)
        return out

    def on_branch(self, msg: m.Branch, ctx) -> m.BranchDone:
        # 1) take the branch call: model path and every pass's inputs (views into the arena, or inline frames)
        path = self._model_path(msg.model, msg.block, msg.branch)
        feeds = []
        for i, p in enumerate(msg.passes):
            feeds.append({name: read_tensor(ctx, msg.arena, d, msg.inline, field=f"passes[{i}].inputs.{name}")
                          for name, d in p.inputs.items()})
        # 2)-3) the lifecycle on its worker thread, so heartbeats are answered while the model loads and runs (ORT
        # and RKNNLite release the GIL); a silent executor is then a dead one, and the scheduler resends at once
        future = self.lifecycle.submit(path, feeds, ahead=self._ahead(msg.next), hold=msg.hold)
        while True:
            try:
                outputs, times = future.result(KEEPALIVE_SLICE_S)
                break
            except FutureTimeout:
                ctx.keepalive()
            except LifecycleError as e:
                field = "model" if e.phase in ("load", "init") else f"passes[{e.pass_index}].inputs"
                raise RequestFailed(str(e), field=field) from None
        # 4) outputs into the slots the request named, and the reply
        reply_tensors = ReplyTensors(ctx, msg.arena)
        descs = tuple(reply_tensors.put(np.asarray(next(iter(y.values()))), p.output, field=f"passes[{i}].output")
                      for i, (y, p) in enumerate(zip(outputs, msg.passes)))          # y: [L, D] io dtype
        self.calls += 1
        if self.trace:
            self._trace(msg, times)
        mem = process_memory_mb(pss=self.calls % MEMORY_EVERY == 1)   # smaps_rollup costs ~7 ms: sampled
        log.debug("block %d %s %s: %s load %.3f init %.3f infer %s release %.3f wait %.3f (rss %.0f MB)", msg.block,
                  msg.branch, [p.name for p in msg.passes], times.source, times.load_s, times.init_s,
                  ["%.3f" % s for s in times.infer_s], times.release_s, times.wait_s, mem["rss"])
        return m.reply_to(msg, m.BranchDone, job=msg.job, step=msg.step, block=msg.block, branch=msg.branch,
                          attempt=msg.attempt, times=times, outputs=descs, rss_mb=mem["rss"], pss_mb=mem.get("pss"),
                          inline=reply_tensors.inline)

    def _trace(self, msg: m.Branch, times) -> None:
        """One JSON line per served call, appended with O_APPEND (one write: lines never interleave)."""
        rec = {"pid": os.getpid(), "job": msg.job, "step": msg.step, "block": msg.block, "branch": msg.branch,
               "attempt": msg.attempt, "passes": [p.name for p in msg.passes], "hold": msg.hold,
               "source": times.source, "context_mb": times.context_mb, "infer_at": list(times.infer_at),
               "infer_s": list(times.infer_s)}
        rec.update(self.backend_class.trace_fields())      # board-sim: the modelled board's running totals
        line = json.dumps(rec) + "\n"
        fd = os.open(self.trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def close(self) -> None:
        self.lifecycle.close()


def main(argv=None) -> int:
    return stage_main("executor", ExecutorLogic, argv)


if __name__ == "__main__":
    sys.exit(main())
