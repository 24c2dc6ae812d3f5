"""The scheduler stage: host ops + sampler over a pack; drives the executor branch by branch in strict block order.

    python -m stages.scheduler --config run/pipeline.toml

Per computed step, for block 0…N−1: self, cross, ffn; each branch is ONE request to the executor carrying both CFG
passes (conditional first). LayerNorm + modulation, gates and the FP32 residual stay here. After every step the
sampler state (latent, Spectrum history, seed) is written to the job folder (write-then-rename), so a restarted
scheduler resumes at the last finished step and the result is bitwise identical to an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from models.branch_runtime import PhaseTimes
from models.denoise import make_sampler, save_state, spectrum_settings, start_or_resume
from models.dit_runner import DiTRunner
from models.pack import PackError, load_pack
from models.partition import KINDS, LIFETIMES, parse_branch_file
from models.spectrum import plan as spectrum_plan
from protocol import messages as m
from protocol.fields import ProtocolError
from protocol.liveness import PeerLost, PeerWatch
from protocol.sockets import LazyPirate, PeerUnavailable
from stages.base import Interrupted, RequestFailed, stage_main
from stages.config import PipelineConfig
from stages.tensor_io import read_tensor

log = logging.getLogger(__name__)

BRANCH_TIMEOUT_S = 600.0     # one branch call, both passes (a full-size branch on a slow CPU takes tens of seconds)
BUSY_RETRY_S = 0.2           # executor answered `busy`: ask again after this long
MAX_BUSY_RETRIES = 3000
STATE_HEADROOM_MB = 16.0     # free space kept on the job folder's disk beyond two copies of a step state


class BranchClient:
    """Sends one branch call (both CFG passes) to the executor through the job arena; times the transport."""

    def __init__(self, ctx, msg: m.Denoise, runner: DiTRunner, link: LazyPirate, watch: PeerWatch, arena,
                 step_ref: list, max_lost: int, computed_steps=()):
        self.stage_ctx, self.msg, self.runner, self.link, self.arena = ctx, msg, runner, link, arena
        self.computed_steps = sorted(computed_steps)  # 1-based steps that run the model (the rest are forecast)
        self.watch, self.max_lost = watch, max_lost
        self.resends = 0
        self.step_ref = step_ref                      # [current 1-based step], read when a call goes out
        io = runner.pack.io_dtype                     # "f16" | "f32"
        L, D = runner.geom.tokens, runner.cfg.width
        slots = arena.region(msg.scratch.offset, msg.scratch.nbytes)
        self.xn = [slots.alloc(f"xn.{p}", io, (L, D)) for p in m.PASS_NAMES]           # [L, D] io
        self.y = [slots.alloc(f"y.{p}", io, (L, D)) for p in m.PASS_NAMES]             # [L, D] io
        self.fixed: dict = {}                        # (pass, input name) -> desc written once per job
        self._slots = slots
        self.sums = {k: PhaseTimes() for k in KINDS}
        self.kind_calls = {k: 0 for k in KINDS}
        self.calls = 0
        self.transport_s = 0.0
        self.started = time.monotonic()

    def _fixed(self, p: int, name: str, array: np.ndarray):
        """Inputs that do not change during a job (the context and its mask per pass, RoPE tables shared): written
        to the arena once; which is which is the partition table's `lifetime`."""
        key = (p if LIFETIMES.get(name) == "pass" else 0, name)
        if key not in self.fixed:
            desc = self._slots.alloc(f"{name}.{key[0]}", self.runner.pack.io_dtype, tuple(array.shape))
            self.arena.write(desc, array)
            self.fixed[key] = desc
        return self.fixed[key]

    def __call__(self, block: int, kind: str, path, feeds: list, next_path):
        job, step = self.msg.job, self.step_ref[0]
        # 1) heartbeats and cancellation between branches
        self.stage_ctx.check(job)
        t0 = time.perf_counter()
        # 2) inputs into the arena: xn per pass; context and RoPE once per job
        passes = []
        for p, feed in enumerate(feeds):
            inputs = {}
            for name, array in feed.items():
                if name == "xn":
                    self.arena.write(self.xn[p], array)
                    inputs[name] = self.xn[p]
                else:
                    inputs[name] = self._fixed(p, name, array)
            passes.append(m.BranchPass(name=m.PASS_NAMES[p], inputs=inputs, output=self.y[p]))
        nxt = None
        if next_path is not None:
            nb, nk = parse_branch_file(Path(next_path).name)
            nxt = m.BranchRef(block=nb, branch=nk, model=str(next_path), index=3 * nb + KINDS.index(nk))
        req = m.Branch(job=job, step=step, block=block, branch=kind, model=str(path), index=3 * block + KINDS.index(kind),
                       arena=self.arena.name, passes=tuple(passes), next=nxt)
        # 3) the call (Lazy Pirate: resent on timeout; `busy` answered by waiting)
        reply = self._request(req)
        # 4) outputs back: y per pass, checked for NaN/Inf
        ys = []
        for p, desc in enumerate(reply.outputs):
            if desc.inline or desc.slot != self.y[p].slot:
                raise RequestFailed(f"executor put pass {m.PASS_NAMES[p]} of block {block} {kind} elsewhere than "
                                    f"slot {self.y[p].slot!r}", field="executor")
            y = self.arena.read(self.y[p])                                           # [L, D] io dtype
            if not np.isfinite(y).all():
                raise RequestFailed(f"non-finite branch output at step {step}, block {block}, branch {kind}, pass "
                                    f"{m.PASS_NAMES[p]}", field="executor")
            ys.append({"y": y})
        wall = time.perf_counter() - t0
        t = reply.times
        times = PhaseTimes(t.load_s, t.init_s, float(sum(t.infer_s)), t.release_s)
        self.sums[kind] = self.sums[kind] + times
        self.kind_calls[kind] += 1
        self.calls += 1
        self.transport_s += max(0.0, wall - times.total_s)
        elapsed = time.monotonic() - self.started
        self.stage_ctx.emit(m.Progress(job=job, step=step, steps=self.msg.params.steps, block=block, branch=kind,
                                       elapsed_s=elapsed, eta_s=self.eta_s(step, block, kind, elapsed)))
        return ys, times

    def eta_s(self, step: int, block: int, kind: str, elapsed_s: float) -> float:
        return eta_s(self.calls, elapsed_s, calls_left(step, block, kind, self.runner.cfg.blocks, self.computed_steps))

    def _request(self, req: m.Branch) -> m.BranchDone:
        """Lazy Pirate with a liveness watch: a dead executor is seen within LIVENESS heartbeats and the call is resent
        at once (idempotent: the inputs stay in the arena); a live but slow one is waited for up to the timeout.

        A restarted or idle executor counts against `max_lost`; a silent one (dead, or hung until the orchestrator
        has it restarted after `[stage.orchestrator] hang_timeout_s`) is resent to for up to the branch timeout."""
        busy = lost = 0
        first_sent = time.monotonic()
        while True:
            self.watch.reset(req.job)

            def idle():
                self.stage_ctx.keepalive()
                self.watch.tick()
            try:
                reply = self.link.request(req, should_stop=lambda: self.stage_ctx.stopping, idle=idle)
            except PeerLost as e:
                self.link.close()
                lost += 0 if e.silent else 1
                self.resends += 1
                silent_too_long = e.silent and time.monotonic() - first_sent > self.link.timeout_s
                if lost > self.max_lost or silent_too_long:
                    what = (f"silent for {time.monotonic() - first_sent:.0f} s" if silent_too_long
                            else f"lost {lost} times")
                    raise RequestFailed(f"executor {what} at step {req.step}, block {req.block}, {req.branch}: {e}",
                                        field="executor", retry=True) from None
                log.warning("%s; resending block %d %s (attempt %d)", e, req.block, req.branch, req.attempt + 1)
                req = dataclasses.replace(req, attempt=min(req.attempt + 1, 1000))
                continue
            except PeerUnavailable as e:
                raise RequestFailed(f"executor unreachable at step {req.step}, block {req.block}, {req.branch}: {e}",
                                    field="executor", retry=True) from None
            if isinstance(reply, m.Error) and reply.code == "busy" and busy < MAX_BUSY_RETRIES:
                busy += 1
                time.sleep(BUSY_RETRY_S)
                continue
            try:
                reply = m.expect(reply, m.BranchDone, "executor")
            except m.RemoteError as e:
                raise RequestFailed(f"executor failed block {req.block} {req.branch} at step {req.step}: {e}",
                                    field="executor", retry=e.retry) from None
            if (reply.block, reply.branch, reply.step) != (req.block, req.branch, req.step):
                raise RequestFailed(f"executor answered block {reply.block} {reply.branch}, expected {req.block} "
                                    f"{req.branch}", field="executor")
            return reply


def calls_left(step: int, block: int, kind: str, blocks: int, computed_steps) -> int:
    """Branch calls still to come after (step, block, kind): the rest of this step, then every later computed step's
    (forecast steps make none)."""
    rest = (blocks - 1 - block) * len(KINDS) + (len(KINDS) - 1 - KINDS.index(kind))
    return rest + len(KINDS) * blocks * sum(1 for s in computed_steps if s > step)


def eta_s(calls_done: int, elapsed_s: float, left: int) -> float:
    """Denoising time left: the calls to come at the mean wall time per call so far (host ops and transport
    included)."""
    return elapsed_s / max(calls_done, 1) * left


def _state_nbytes(state) -> int:
    """Bytes of the arrays a step state file holds (latent, Spectrum history), found by walking the state."""
    seen, total, todo = set(), 0, [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, np.ndarray):
            total += obj.nbytes
        elif id(obj) not in seen and (dataclasses.is_dataclass(obj) or isinstance(obj, (list, tuple, dict))):
            seen.add(id(obj))
            todo += list(obj.values() if isinstance(obj, dict) else obj if not dataclasses.is_dataclass(obj)
                         else vars(obj).values())
    return total


def check_state_room(job_dir: str, state) -> None:
    """Before a step state is written: room for it twice (written, then renamed over the old one) plus headroom,
    else a clear error naming the folder (the job fails; free space, then `orchestrator resume JOB`)."""
    need_mb = 2 * _state_nbytes(state) / 2**20 + STATE_HEADROOM_MB
    try:
        free_mb = shutil.disk_usage(job_dir).free / 2**20
    except OSError as e:
        raise RequestFailed(f"job folder {job_dir}: {e}", field="job_dir") from None
    if free_mb < need_mb:
        raise RequestFailed(f"only {free_mb:.1f} MB free in {job_dir}; the state of step {state.step} needs "
                            f"{need_mb:.1f} MB (free some space, then `orchestrator resume JOB`)", field="job_dir")


class SchedulerLogic:
    """DENOISE handler: sampler loop over a DiTRunner whose branches run in the executor process."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.zctx = zmq.Context.instance()
        self._packs: dict = {}

    def info(self) -> dict:
        return {"packs": ",".join(str(p) for p in self.config.packs)}

    def _runner(self, pack_dir: str, branch_fn, ctx) -> DiTRunner:
        """The job's pack (one of the configured ones; checked against its manifest's hashes when loaded; only the
        last used stays loaded: host weights are ~1 GB at full size, a second size must not double them) and a runner
        over its host weights. Both take a while on a board (GBs to hash and read), so heartbeats are answered
        meanwhile: a stage that stops answering for `hang_timeout_s` is restarted by the orchestrator."""
        allowed = {str(Path(p).resolve()) for p in self.config.packs}
        if allowed and str(Path(pack_dir).resolve()) not in allowed:
            raise RequestFailed(f"pack {pack_dir} is not one of the configured packs ({', '.join(sorted(allowed))})",
                                code="bad_request", field="pack_dir")
        pack = self._packs.get(pack_dir)
        if pack is None:
            self._packs.clear()
            try:
                pack = self._packs[pack_dir] = ctx.keep_alive_while(load_pack, pack_dir, check=True)
            except (PackError, FileNotFoundError) as e:
                raise RequestFailed(str(e), field="pack_dir") from None
        return ctx.keep_alive_while(DiTRunner, pack, branch_fn=branch_fn)

    def on_denoise(self, msg: m.Denoise, ctx) -> m.Denoised:
        t_start = time.monotonic()
        params = msg.params
        # 1) the pack, and the request checked against it
        holder = {}
        runner = self._runner(msg.pack_dir, lambda *a: holder["client"](*a), ctx)
        g, cfg = runner.geom, runner.cfg
        if (params.width, params.height) != (g.width, g.height):
            raise ProtocolError("params.width", f"{params.width}x{params.height} does not match the pack's "
                                f"{g.width}x{g.height}")
        arena = ctx.arena(msg.arena)
        ctx_shape = (g.text_tokens, cfg.context_dim)
        cond = read_tensor(ctx, msg.arena, msg.cond, msg.inline, field="cond", dtype="f32", shape=ctx_shape, copy=True)
        uncond = read_tensor(ctx, msg.arena, msg.uncond, msg.inline, field="uncond", dtype="f32", shape=ctx_shape,
                             copy=True)
        lat_shape = (cfg.latent_channels, g.latent_h, g.latent_w)
        if msg.latent.dtype != "f32" or tuple(msg.latent.shape) != lat_shape:
            raise ProtocolError("latent", f"expected f32 {list(lat_shape)}, got {msg.latent.dtype} "
                                f"{list(msg.latent.shape)}")
        # 2) the sampler, fresh or resumed from the job folder
        s = params.spectrum
        sampler = make_sampler(params.steps, params.cfg, params.schedule,
                               spectrum_settings(s.enabled, s.w, s.m, s.lam, s.window, s.flex, s.warmup, s.stop))
        state = start_or_resume(sampler, params.seed, lat_shape, msg.job_dir, msg.resume)   # unusable state: step 0
        resumed_from = state.step
        # 3) the executor link and the branch client
        step_ref = [state.step + 1]
        sched = self.config.stage_settings("scheduler")
        curve = self.config.curve_client("executor") if msg.executor == self.config.endpoint("executor") else None
        plain = self.config.security.allow_plaintext_loopback
        t = self.config.timeouts
        link = LazyPirate(self.zctx, msg.executor, peer="executor", curve=curve, allow_plaintext=plain,
                          timeout_s=float(sched.get("branch_timeout_s", BRANCH_TIMEOUT_S)), retries=t.retries)
        watch = PeerWatch(self.zctx, msg.executor, peer="executor", interval_s=t.heartbeat_s, liveness=t.liveness,
                          curve=curve, allow_plaintext=plain)
        computed = spectrum_plan(sampler.spectrum, params.steps)[0] if sampler.spectrum else range(1, params.steps + 1)
        client = holder["client"] = BranchClient(ctx, msg, runner, link, watch, arena, step_ref, max_lost=t.retries,
                                                 computed_steps=computed)
        try:
            # 4) the steps; the state is saved after each
            while not sampler.done(state):
                step_ref[0] = state.step + 1
                if sampler.needs_model(state):
                    v_c, v_u = runner.forward_cfg(state.latent, sampler.sigma(state), cond, uncond,
                                                  context_rows=msg.context_rows or None)
                    sampler.step_computed(state, v_c, v_u)
                else:
                    ctx.check(msg.job)
                    sampler.step_forecast(state)
                    ctx.emit(m.Progress(job=msg.job, step=state.step, steps=params.steps, block=cfg.blocks - 1,
                                        branch="ffn", forecast=True, elapsed_s=time.monotonic() - t_start))
                if not np.isfinite(state.latent).all():
                    raise RequestFailed(f"latent has NaN/Inf after step {state.step}", field="latent")
                check_state_room(msg.job_dir, state)
                save_state(state, msg.job_dir)
        except FloatingPointError as e:
            raise RequestFailed(str(e), field="executor") from None
        finally:
            link.close()
            watch.close()
            holder.clear()           # runner -> branch_fn -> holder -> client -> runner: a cycle that kept every
                                     # job's host weights (the whole FP32 host part of the model) until a full GC
        # 5) the final latent into its slot, and the sums
        arena.write(msg.latent, state.latent)
        wall = time.monotonic() - t_start
        branch_s = sum(t.total_s for t in client.sums.values())
        sums = {k: m.BranchSums(load_s=t.load_s, init_s=t.init_s, infer_s=t.infer_s, release_s=t.release_s,
                                calls=client.kind_calls[k]) for k, t in client.sums.items()}
        return m.reply_to(msg, m.Denoised, job=msg.job, latent=msg.latent, computed_steps=tuple(state.computed),
                          forecast_steps=tuple(state.forecast), branch_calls=client.calls, branches=sums,
                          host_s=max(0.0, wall - branch_s - client.transport_s), transport_s=client.transport_s,
                          wall_s=wall, resumed_from=resumed_from, resends=link.resends + client.resends)


def main(argv=None) -> int:
    return stage_main("scheduler", SchedulerLogic, argv)


if __name__ == "__main__":
    sys.exit(main())
