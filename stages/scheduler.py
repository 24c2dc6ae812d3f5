"""The scheduler stage: host ops + sampler over a pack; drives the executor branch by branch in strict block order.

    python -m stages.scheduler --config run/pipeline.toml

Per computed step, for block 0…N−1: self, cross, ffn; each branch is ONE request to the executor carrying both CFG
passes (conditional first), or, when the executor's policy interleaves, one request per pass (the first with
hold=true), the host ops of one pass running while the executor infers the other. LayerNorm + modulation, gates and the FP32 residual stay here. A step is one
model call (both passes) or more (heun, dpmpp_sde, sa_solver_pece ...: models/sampling/sampler.py SAMPLERS). After every
finished step the sampler state (latent, the sampler's history and noise generator position, Spectrum history, seed)
is written to the job folder (write-then-rename), so a restarted scheduler resumes at the last finished step and the
result is bitwise identical to an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from models.runtime.backends import backend_class
from models.dit.config import expected_dit_shapes
from models.sampling.cond_mix import Conditioning, CondPass
from models.sampling.denoise import make_sampler, model_call, save_state, start_or_resume
from models.runtime.dit_runner import BranchCall, DiTRunner
from models.lora import LoraError, TargetTable, plan_loras
from models.lora.choice import lora_uses
from models.setup.models_dir import ModelsDirError, lora_relative
from models.runtime.phase_times import PhaseSums
from models.packs.pack import PackError, load_pack
from models.dit.partition import KINDS, branch_index, parse_branch_file
from models.board.policy import Policy, PolicyError, parse_policy
from models.packs.sharded import shard_count
from models.packs.scratch import scratch_plan
from protocol import messages as m
from protocol.fields import ProtocolError
from protocol.liveness import PeerLost, PeerWatch
from protocol.sockets import LazyPirate, PeerUnavailable, parse_endpoint
from protocol.tensors import InlineFrames, from_inline
from protocol.version import VERSION
from stages.base import RequestFailed, stage_main
from stages.latent_start import from_latent, latent_sampler_and_state
from stages.config import ConfigError, PipelineConfig
from stages.eta import EtaClock
from stages.step_account import step_times
from stages.tensor_io import read_tensor

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.2           # executor answered `busy`: ask again after this long
MAX_BUSY_RETRIES = 3000
STATE_HEADROOM_MB = 16.0     # free space kept on the job folder's disk beyond two copies of a step state


class BranchClient:
    """The runner's branch side in the pipeline: each BranchCall becomes one BRANCH request through the job arena.

    One request is outstanding at a time (one REQ socket, strict order): submit() first finishes the previous one.
    With interleave the runner does the other pass's host ops between submit() and result(); the inputs and output
    slots a request names are per pass, so the other pass's host work never touches them before the reply."""

    def __init__(self, ctx, msg: m.Denoise, pack, link: LazyPirate, watch: PeerWatch, arena, step_ref: list,
                 max_lost: int, interleave: bool = False, computed_steps=(), steps: int | None = None):
        self.stage_ctx, self.msg, self.pack, self.link, self.arena = ctx, msg, pack, link, arena
        # the ETA's clock: 1-based steps that run the model (the rest are forecast)
        self.steps = steps or msg.params.steps       # the sampler's (a latent start's schedule may be shorter)
        self.eta = EtaClock(self.steps, pack.config.blocks, computed_steps)
        self.remote = parse_endpoint(msg.executor)[0] == "tcp"     # another machine: tensors travel inline
        self.watch, self.max_lost = watch, max_lost
        self.interleave = interleave
        self.resends = 0
        self.step_ref = step_ref                      # [current 1-based step], read when a call goes out
        # every branch input and output slot, carved as the orchestrator sized the region: models/packs/scratch.py
        self.plan = scratch_plan(pack.config, pack.geometry, pack.dtype, len(m.PASS_NAMES),
                                 shard_count(pack.manifest))
        region = arena.region(msg.scratch.offset, msg.scratch.nbytes)
        self.slots = {s.name: region.alloc(s.name, s.dtype, s.shape) for s in self.plan.slots}
        self.xn = [self._desc("xn", p) for p in range(len(m.PASS_NAMES))]          # [L, D] io dtype
        self.y = [self._desc("y", p) for p in range(len(m.PASS_NAMES))]            # [L, D] io dtype
        self.written: dict = {}                      # slot name -> the array it holds (inputs that stay a while)
        self._out: _Pending | None = None            # the request on the wire
        self.calls = 0
        self.blocked_s = 0.0                         # scheduler time spent sending, waiting and reading replies
        self.transport_s = 0.0
        self.started = time.monotonic()

    def _desc(self, tensor: str, p: int):
        return self.slots[self.plan.slot(tensor, p).name]

    def _input(self, p: int, name: str, array: np.ndarray):
        """An input of pass `p` into its slot: xn for every call; those that stay for the job (the context and its
        mask per pass, RoPE tables shared: the partition table's `lifetime`) once; a LoRA-ready branch's factors
        ("branch") when they are not the array the slot already holds (the runner hands both passes of a branch, and
        every branch without a LoRA, the same array)."""
        slot = self.plan.slot(name, p)
        desc = self.slots[slot.name]
        held = self.written.get(slot.name)
        # a "pass" input (the context) is written again when the runner hands another array: several conditionings
        # take turns in one pass's slots (models/sampling/cond_mix.py)
        if slot.lifetime == "call" or held is None or (slot.lifetime in ("branch", "pass") and held is not array):
            self.arena.write(desc, array)
            self.written[slot.name] = array
        return desc

    def submit(self, call: BranchCall) -> "_Pending":
        if self._out is not None:
            self._out.finish()
        job, step = self.msg.job, self.step_ref[0]
        # 1) heartbeats and cancellation between branches
        self.stage_ctx.check(job)
        t0 = time.perf_counter()
        # 2) inputs into the arena: xn per pass; context and RoPE once per job (a remote executor: all inline, and
        # the outputs come back inline)
        passes, frames = [], InlineFrames()
        for p, feed in zip(call.passes, call.feeds):
            inputs = {}
            for name, array in feed.items():
                if self.remote:
                    inputs[name] = frames.add(array, self.pack.io_dtype)
                else:
                    inputs[name] = self._input(p, name, array)
            passes.append(m.BranchPass(name=m.PASS_NAMES[p], inputs=inputs, output=None if self.remote else self.y[p]))
        nxt = []
        for path in call.ahead[:m.MAX_AHEAD]:
            nb, nk = parse_branch_file(Path(path).name)
            nxt.append(m.BranchRef(block=nb, branch=nk, model=str(path), index=branch_index(nb, nk)))
        req = m.Branch(job=job, step=step, block=call.block, branch=call.kind, model=str(call.path),
                       index=branch_index(call.block, call.kind), arena=None if self.remote else self.arena.name,
                       passes=tuple(passes), next=tuple(nxt), hold=call.hold, inline=tuple(frames.frames))
        # 3) the call goes out; its reply is taken by the next submit() or by result()
        self.link.send(req)
        self._out = _Pending(self, call, req, time.perf_counter() - t0)
        return self._out

    def _request(self, req: m.Branch, sent: bool) -> m.BranchDone:
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
                reply = self.link.request(req, should_stop=lambda: self.stage_ctx.stopping, idle=idle, sent=sent)
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
                req = req.replace(attempt=min(req.attempt + 1, 1000))
                sent = False
                continue
            except PeerUnavailable as e:
                raise RequestFailed(f"executor unreachable at step {req.step}, block {req.block}, {req.branch}: {e}",
                                    field="executor", retry=True) from None
            sent = False
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


class _Pending:
    """One BRANCH on the wire: finish() waits for its reply and reads the outputs back (once)."""

    def __init__(self, client: BranchClient, call: BranchCall, req: m.Branch, send_s: float):
        self.client, self.call, self.req, self.send_s = client, call, req, send_s
        self.value = None

    def result(self):
        if self.value is None:
            self.finish()
        return self.value

    def finish(self) -> None:
        if self.value is not None:
            return
        c, call, req = self.client, self.call, self.req
        t0 = time.perf_counter()
        try:
            reply = c._request(req, sent=True)
        finally:
            c._out = None
        # 4) outputs back: y per pass, checked for NaN/Inf
        ys = []
        for p, desc in zip(call.passes, reply.outputs):
            if c.remote and desc.inline and (desc.dtype, desc.shape) == (c.y[p].dtype, c.y[p].shape):
                y = from_inline(desc, reply.inline)                                  # [L, D] io dtype
            elif desc.inline or desc.slot != c.y[p].slot or c.remote:
                want = f"inline {c.y[p].dtype} {list(c.y[p].shape)}" if c.remote else f"slot {c.y[p].slot!r}"
                raise RequestFailed(f"executor put pass {m.PASS_NAMES[p]} of block {req.block} {req.branch} elsewhere "
                                    f"than {want}", field="executor")
            else:
                y = c.arena.read(c.y[p])                                             # [L, D] io dtype
            if not np.isfinite(y).all():
                raise RequestFailed(f"non-finite branch output at step {req.step}, block {req.block}, branch "
                                    f"{req.branch}, pass {m.PASS_NAMES[p]}", field="executor")
            ys.append({"y": y})
        blocked = self.send_s + time.perf_counter() - t0
        t = reply.times
        c.calls += 1
        c.blocked_s += blocked
        c.transport_s += max(0.0, blocked - t.total_s)      # waiting beyond the executor's critical path
        if not call.hold:                     # a branch is done when its every pass is (with interleave, two)
            c.eta.call_done()
        cfg_pass = "both" if len(call.passes) > 1 else m.PASS_NAMES[call.passes[0]]
        elapsed = time.monotonic() - c.started
        c.stage_ctx.emit(m.Progress(job=req.job, step=req.step, steps=c.steps, block=req.block,
                                    branch=req.branch, cfg_pass=cfg_pass, elapsed_s=elapsed,
                                    eta_s=c.eta.eta(elapsed, req.step, req.block, req.branch),
                                    blocks=c.pack.config.blocks))
        self.value = (ys, t)


def _cheap_progress(msg: m.Denoise, ctx, client: BranchClient, step: int, steps: int) -> None:
    """The PROGRESS of a step that made no branch call (forecast, or the step cache's), priced as the rest."""
    blocks = client.pack.config.blocks
    elapsed = time.monotonic() - client.started
    ctx.emit(m.Progress(job=msg.job, step=step, steps=steps, block=blocks - 1, branch=KINDS[-1], forecast=True,
                        elapsed_s=elapsed, eta_s=client.eta.eta(elapsed, step), blocks=blocks))


def check_state_room(job_dir: str, state) -> None:
    """Before a step state is written: room for it twice (written, then renamed over the old one) plus headroom,
    else a clear error naming the folder (the job fails; free space, then `orchestrator resume JOB`)."""
    need_mb = 2 * state.nbytes / 2**20 + STATE_HEADROOM_MB
    try:
        free_mb = shutil.disk_usage(job_dir).free / 2**20
    except OSError as e:
        raise RequestFailed(f"job folder {job_dir}: {e}", field="job_dir") from None
    if free_mb < need_mb:
        raise RequestFailed(f"only {free_mb:.1f} MB free in {job_dir}; the state of step {state.step} needs "
                            f"{need_mb:.1f} MB (free some space, then `orchestrator resume JOB`)", field="job_dir")


def check_remote_pack(info: dict, pack, endpoint: str) -> None:
    """RequestFailed unless a remote executor's READY info lists this pack's id among its packs' ids."""
    theirs = [i for i in str(info.get("pack_ids", "")).split(",") if i]
    if pack.identity not in theirs:
        raise RequestFailed(f"remote executor at {endpoint} serves pack(s) {', '.join(theirs) or '(none)'} "
                            f"({info.get('packs')}), this job's pack {pack.dir} is {pack.identity}: copy the pack "
                            "there (same folder name) and list it in its pack_dir or packs", field="executor")


class SchedulerLogic:
    """DENOISE handler: sampler loop over a DiTRunner whose branches run in the executor process."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        try:
            self._backend = backend_class(config.backend)       # the executor's: asked for its host pacer per job
        except ValueError as e:
            raise ConfigError(f"{config.path}: backend: {e}") from None
        self.zctx = zmq.Context.instance()
        self._packs: dict = {}

    def info(self) -> dict:
        return {"packs": ",".join(str(p) for p in self.config.packs)}

    def _pack(self, pack_dir: str, ctx):
        """The job's pack (one of the configured ones; checked against its manifest's hashes when loaded); only the
        last used stays loaded (host weights are ~1 GB at full size: a second size must not double them). Hashing and
        reading take a while on a board, so heartbeats are answered meanwhile: a stage that stops answering for
        `hang_timeout_s` is restarted by the orchestrator."""
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
        return pack

    def _executor_policy(self, link: LazyPirate, msg: m.Denoise, pack, ctx) -> tuple[Policy, str]:
        """The executor's resolved lifecycle policy and its backend (READY.info): with interleave, each CFG pass is
        its own call.
        A remote executor computes its own copy of the pack: it must be this pack, else every result would be wrong.
        While the executor is waited for, the scheduler answers its own heartbeats and honours a stop."""
        try:
            ready = m.expect(link.request(m.Hello(peer="scheduler", pid=os.getpid(), version=VERSION),
                                          timeout_s=self.config.timeouts.request_s, idle=ctx.keepalive,
                                          should_stop=lambda: ctx.stopping), m.Ready, "executor")
            policy = parse_policy(str(ready.info.get("policy", "on-demand")),
                                  {"resident_mb": ready.info.get("resident_mb") or None})
        except PeerUnavailable as e:
            raise RequestFailed(f"executor unreachable: {e}", field="executor", retry=True) from None
        except (m.RemoteError, PolicyError) as e:
            raise RequestFailed(f"executor's HELLO: {e}", field="executor", retry=True) from None
        if parse_endpoint(msg.executor)[0] == "tcp":
            check_remote_pack(ready.info, pack, link.endpoint)
        return policy, str(ready.info.get("backend", ""))[:m.MAX_NAME_CHARS]

    def _host_pacer(self, pack_dir: str):
        """The backend's own pace for the host ops (board-sim: each held to the modelled board's host time x
        time_scale, so policies that hide host time show it in wall time); None: this machine's pace."""
        try:
            pacer = self._backend.host_pacer(pack_dir, self.config.stage_settings("executor"))
        except ValueError as e:
            raise RequestFailed(f"{self.config.backend} host pacing: {e}", field="pack_dir") from None
        if pacer is not None:
            log.info("%s", pacer.describe())
        return pacer

    def _set_lora(self, runner: DiTRunner, msg: m.Denoise, ctx) -> None:
        """The job's LoRAs on the DiT: host layers merged into FP32 copies of the pack's weights, branch layers as
        the LoRA-ready pack's low-rank inputs (written into the scratch slots the partition table gives them). The
        adapter's and text encoder's layers are the encoder's. A plain pack refuses branch layers, naming the fix."""
        try:
            plan = plan_loras(lora_uses(msg.loras, self.config.models_dir),
                              TargetTable(expected_dit_shapes(runner.cfg)))
            runner.set_lora(plan, where=f"model pack {runner.pack.dir}: ", between=lambda: ctx.interrupted(msg.job))
        except (ModelsDirError, LoraError) as e:
            raise RequestFailed(f"scheduler: {lora_relative(self.config.models_dir, str(e))}", field="loras") from None
        log.info("job %s: LoRAs %s (pack LoRA rank %d)", msg.job, [c.name for c in msg.loras],
                 runner.geom.lora_rank)

    def _checked_request(self, msg: m.Denoise, ctx):
        """The job's pack, arena and both contexts, the request checked against the pack: (pack, arena, cond, uncond,
        latent shape)."""
        params = msg.params
        pack = self._pack(msg.pack_dir, ctx)
        g, cfg = pack.geometry, pack.config
        if (params.width, params.height) != (g.width, g.height):
            raise ProtocolError("params.width", f"{params.width}x{params.height} does not match the pack's "
                                f"{g.width}x{g.height}")
        arena = ctx.arena(msg.arena)
        ctx_shape = (g.text_tokens, cfg.context_dim)
        cond = read_tensor(ctx, msg.arena, msg.cond, msg.inline, field="cond", dtype="f32", shape=ctx_shape, copy=True)
        uncond = read_tensor(ctx, msg.arena, msg.uncond, msg.inline, field="uncond", dtype="f32", shape=ctx_shape,
                             copy=True)
        for name, c in (("cond", cond), ("uncond", uncond)):      # a bad request, not a broken stage: no exit
            _finite_context(name, c)
        lat_shape = (cfg.latent_channels, g.latent_h, g.latent_w)
        if msg.latent.dtype != "f32" or tuple(msg.latent.shape) != lat_shape:
            raise ProtocolError("latent", f"expected f32 {list(lat_shape)}, got {msg.latent.dtype} "
                                f"{list(msg.latent.shape)}")
        if msg.conds:
            cond = _conditioning(ctx, msg, ctx_shape)
        return pack, arena, cond, uncond, lat_shape

    @staticmethod
    def _sampler_and_state(msg: m.Denoise, lat_shape: tuple):
        """The job's sampler and its state, fresh or resumed from the job folder (an unusable state: step 0)."""
        params = msg.params
        try:
            sampler = make_sampler(params.steps, params.cfg, params.scheduler, params.spectrum, params.sampler,
                                   cache=params.cache)
        except ValueError as e:                     # an unknown name, Spectrum with a sampler or with a cache
            field = "params.cache" if str(e).startswith("cache:") else "params.sampler"
            raise RequestFailed(str(e), code="bad_request", field=field) from None
        return sampler, start_or_resume(sampler, params.seed, lat_shape, msg.job_dir, msg.resume)

    def _executor_side(self, msg: m.Denoise, ctx, pack, arena, sampler, step_ref: list,
                       calls=None) -> _ExecutorSide:
        """The executor link, its heartbeat watch, the branch client over them and the DiT runner that drives it,
        the job's LoRAs set on it."""
        sched = self.config.stage_settings("scheduler")
        curve = self.config.curve_client("executor") if msg.executor == self.config.endpoint("executor") else None
        plain = self.config.security.allow_plaintext_loopback
        t = self.config.timeouts
        link = LazyPirate(self.zctx, msg.executor, peer="executor", curve=curve, allow_plaintext=plain,
                          timeout_s=sched["branch_timeout_s"], retries=t.retries)
        watch = PeerWatch(self.zctx, msg.executor, peer="executor", interval_s=t.heartbeat_s, liveness=t.liveness,
                          curve=curve, allow_plaintext=plain)
        policy, backend = self._executor_policy(link, msg, pack, ctx)
        client = BranchClient(ctx, msg, pack, link, watch, arena, step_ref, max_lost=t.retries,
                              interleave=policy.interleave, computed_steps=calls or sampler.plan(),
                              steps=sampler.steps)
        pacer = self._host_pacer(msg.pack_dir)
        runner = ctx.keep_alive_while(DiTRunner, pack, branches=client, host_pace=pacer.op if pacer else None)
        if msg.loras:                  # a runner per job: the next job starts again from the pack's own weights
            ctx.keep_alive_while(self._set_lora, runner, msg, ctx)
        return _ExecutorSide(link, watch, client, pacer, runner, backend)

    @staticmethod
    def _step_loop(msg: m.Denoise, ctx, sampler, state, ex: _ExecutorSide, step_ref: list, cond,
                   uncond) -> _StepTally:
        """The steps, each one model call or more (or a Spectrum forecast); the state is saved after each."""
        client, pacer = ex.client, ex.pacer
        tally = _StepTally(clocks_shared=not msg.executor.startswith("tcp://"))
        while not sampler.done(state):
            step_ref[0] = state.step + 1
            t_step, timing = time.monotonic(), None
            marks = (client.transport_s, client.calls, pacer.totals.real_s if pacer else 0.0)
            if sampler.needs_model(state):
                timing = tally.model_step(ex.runner, sampler, state, cond, uncond, msg.context_rows or None)
            else:
                ctx.check(msg.job)
                sampler.step_forecast(state)
            if timing is None:                      # a forecast step, or every call of it from the step cache
                _cheap_progress(msg, ctx, client, state.step, sampler.steps)
            if not np.isfinite(state.latent).all():
                raise RequestFailed(f"latent has NaN/Inf after step {state.step}", field="latent")
            check_state_room(msg.job_dir, state)
            save_state(state, msg.job_dir)
            tally.steps.append(step_times(state.step, time.monotonic() - t_step, timing,
                                          transport_s=client.transport_s - marks[0], calls=client.calls - marks[1],
                                          host_work_s=pacer.totals.real_s - marks[2] if pacer else None,
                                          clocks_shared=tally.clocks_shared, nfe=state.nfe[-1]))
            if timing is None:
                client.eta.cheap_step(time.monotonic() - t_step)
        return tally

    def on_denoise(self, msg: m.Denoise, ctx) -> m.Denoised:
        t_start = time.monotonic()
        pack, arena, cond, uncond, lat_shape = self._checked_request(msg, ctx)
        if from_latent(msg):                        # img2img, inpaint, a hires pass, KSamplerAdvanced, a batch image
            sampler, state = latent_sampler_and_state(msg, ctx, lat_shape)
        else:
            sampler, state = self._sampler_and_state(msg, lat_shape)
        resumed_from = state.step
        step_ref = [state.step + 1]
        ex = self._executor_side(msg, ctx, pack, arena, sampler, step_ref,
                                 cond.sweep_plan(sampler) if isinstance(cond, Conditioning) else None)
        try:
            tally = self._step_loop(msg, ctx, sampler, state, ex, step_ref, cond, uncond)
        except FloatingPointError as e:
            raise RequestFailed(str(e), field="executor") from None
        except LoraError as e:                      # a LoRA file changed under the job (cut short, rewritten)
            raise RequestFailed(f"scheduler: {lora_relative(self.config.models_dir, str(e))}", field="loras") from None
        finally:
            ex.link.close()
            ex.watch.close()
        # the final latent into its slot, and the sums
        arena.write(msg.latent, sampler.result(state))
        wall, client, steps = time.monotonic() - t_start, ex.client, tally.steps
        return m.reply_to(msg, m.Denoised, job=msg.job, latent=msg.latent, computed_steps=tuple(state.computed),
                          forecast_steps=tuple(state.forecast), branch_calls=client.calls, branches=tally.sums,
                          host_s=max(0.0, wall - client.blocked_s), host_hidden_s=tally.host_hidden,
                          transport_s=client.transport_s, wall_s=wall, resumed_from=resumed_from,
                          resends=ex.link.resends + client.resends, steps=tuple(steps),
                          host_work_s=sum(st.host_work_s for st in steps), model_calls=sum(state.nfe),
                          reused_calls=sum(state.skipped), executor_backend=ex.backend)


def _finite_context(name: str, c: np.ndarray) -> None:
    if not np.isfinite(c).all():
        raise RequestFailed(f"{name}: the context has NaN/Inf values (from the encoder: a prompt weight too large "
                            "for float32, or broken text-encoder weights)", field=name)


def _conditioning(ctx, msg: m.Denoise, ctx_shape: tuple) -> Conditioning:
    """DENOISE's `conds` as both sides' entry lists (each context read and checked); a side with none keeps its
    plain context."""
    sides = {"positive": [], "negative": []}
    for i, ref in enumerate(msg.conds):
        field = f"conds[{i}].context"
        c = read_tensor(ctx, msg.arena, ref.context, msg.inline, field=field, dtype="f32", shape=ctx_shape, copy=True)
        _finite_context(field, c)
        sides[ref.side].append(CondPass(c, ref.strength, ref.start, ref.end))
    if msg.context_rows:
        raise ProtocolError("conds", "several conditionings need a 512-row pack (context_rows is set)")
    for side in sides:
        if not sides[side]:
            raise ProtocolError("conds", f"names no {side} conditioning (each side needs one at least)")
    return Conditioning(tuple(sides["positive"]), tuple(sides["negative"]))


@dataclasses.dataclass
class _ExecutorSide:
    """What one DENOISE talks to the executor through; link and watch are closed when the steps end."""

    link: LazyPirate
    watch: PeerWatch
    client: BranchClient
    pacer: object            # the backend's host pacer, or None
    runner: DiTRunner
    backend: str = ""        # the executor's backend (its READY), for the job's report


@dataclasses.dataclass
class _StepTally:
    """What the steps add up to for the DENOISED reply: per-kind branch sums, hidden host time, each step's times."""

    clocks_shared: bool      # monotonic stamps compare on one host only
    sums: dict = dataclasses.field(default_factory=lambda: {k: PhaseSums() for k in KINDS})
    host_hidden: float = 0.0
    steps: list = dataclasses.field(default_factory=list)

    def model_step(self, runner: DiTRunner, sampler, state, cond, uncond, context_rows):
        """One step's model calls (one, or more for a multi-call sampler), their timings merged and summed; a call
        the step cache reuses makes no branch call. None when no call ran the model."""
        timing, finished = None, False
        while not finished:
            if sampler.reuses(state):
                finished = sampler.step_reused(state)
                continue
            x_in, sigma = sampler.point(state)
            if isinstance(cond, Conditioning):              # several conditionings: a pass each (DENOISE.conds)
                v_c, v_u, ran = cond.call(runner, sampler, x_in, sigma)
                if not ran:                                 # no entry active on either side: no model pass
                    finished = sampler.step_computed(state, v_c, v_u)
                    continue
            else:
                v_c, v_u = model_call(runner, sampler, x_in, sigma, cond, uncond, context_rows)
            call = runner.last_timing
            for k, ps in call.per_kind.items():
                self.sums[k].merge(ps)
            self.host_hidden += call.host_hidden_s if self.clocks_shared else 0.0
            timing = call if timing is None else timing.merged(call)
            finished = sampler.step_computed(state, v_c, v_u)
        return timing


def main(argv=None) -> int:
    return stage_main("scheduler", SchedulerLogic, argv)


if __name__ == "__main__":
    sys.exit(main())
