"""The job daemon: serves the CLI, collects stage events, runs queued jobs one at a time (`orchestrator serve`)."""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import zmq

from models.base.schema import SchemaError, convert
from orchestrator.engine.cond_cache import CondCache
from orchestrator.engine.plan.build import decoded_sizes, entries_pack_refusal
from orchestrator.engine.plan.run import PlanRunner
from orchestrator.engine.heartbeat import Heartbeats
from orchestrator.engine.job_record import ORIGIN, UNREADABLE, JobEntry, info_of, remember
from orchestrator.engine.jobs import JobError, JobStore, QueueFull
from orchestrator.engine.loras import LoraRefused, RunLoras
from orchestrator.engine.png_text import PngFormat
from orchestrator.engine.packs import pack_model_files, read_packs, vae_pack_sizes
from orchestrator.engine.prompt_spec import PromptError, resolve_prompt
from orchestrator.engine.runfolder import ALWAYS_ON_STAGES, ON_DEMAND_STAGES, RunFolder
from orchestrator.engine.supervisor import Supervisor
from orchestrator.engine.watchdog import HangWatch
from protocol import messages as m
from protocol.arena import reap, run_prefix
from protocol.sockets import EventPull, LazyPirate, Server
from protocol.version import VERSION
from stages.config import ConfigError
from stages.config_digest import record_start, stale_stages_message

log = logging.getLogger(__name__)

POLL_S = 0.1                 # longest wait between looks at the CLI socket and the events
RESCAN_S = 2.0               # the queue folder is re-read at least this often (at once after a SUBMIT/RESUME)
SUBMIT_MEMORY = 256          # request ids of recent SUBMITs (a resent SUBMIT returns the same job)
# replies of recent PRUNEs by request id: a PRUNE is not idempotent, and a client that timed out (the daemon busy
# reading its records) resends it; the resend gets the first one's answer, so no removed job goes uncounted
PRUNE_MEMORY = 8
DETAIL_BUDGET_BYTES = 768 * 1024     # a detailed STATUS reply stops adding jobs here (frame 0 is capped at 1 MiB)
PRUNE_BATCH_S = 1.0          # one PRUNE removes jobs this long at most (then `more`), well within a client's timeout
# LoRA files are read (headers at submit, whole files hashed at a job's start) on worker threads, so one large file
# costs its own submitter time, not every client's; two, so a job's hashing does not hold up the next submit's check
LORA_WORKERS = 2
DEFERRED = object()          # handle()'s "answered later": a SUBMIT whose LoRAs are being checked


@dataclass
class _PendingSubmit:
    """A SUBMIT waiting for its LoRA check: answered along `req` (the latest resend's envelope) when `check` is done."""
    msg: m.Submit
    spec: object
    origin: object
    check: Future
    req: object = None


class Daemon:
    """Queue + flow + sockets. Single-threaded: while a stage request is out, `idle()` keeps serving."""

    def __init__(self, config, rf: RunFolder, *, supervisor: Supervisor | None = None, ctx: zmq.Context | None = None,
                 png_formats: Sequence[PngFormat] = ()):
        """`png_formats`: the PNG text chunks other tools read, handed in by the way in that starts the daemon
        (orchestrator.http.png_formats.PNG_FORMATS; none: a PNG carries only the engine's own `anima` chunk)."""
        if not config.packs:
            raise ConfigError(f"{config.path}: pack_dir is not set; the orchestrator needs a model pack")
        self.cfg, self.rf = config, rf
        self.png_formats = tuple(png_formats)
        self.settings = config.settings("orchestrator")
        self.packs = read_packs(config.packs)              # (width, height) -> PackInfo; a job picks by its size
        self.pack = next(iter(self.packs.values()))        # the default: a job that names no size gets this one
        self.loras = RunLoras(config, self.packs)          # a job's LoRAs checked at submit
        self.vae_sizes = vae_pack_sizes(config)            # None: the VAE decodes any size
        self.cond_cache = CondCache(rf.root, self.settings.cond_cache_mb)   # prompts' contexts across jobs
        self._model_files: dict[str, str] | None = None
        self.store = JobStore(rf.root, max_queue=self.settings.max_queue, min_free_mb=self.settings.min_free_mb,
                              cached=True)          # the single writer: records kept in memory, written through
        self.sup = supervisor or Supervisor(rf.supervisor_sock)
        self.ctx = ctx or zmq.Context()
        self.links: dict[str, LazyPirate] = {}
        self.progress: dict[str, m.Progress] = {}          # job -> latest PROGRESS
        self.denoise_pass: dict[str, m.DenoisePass] = {}   # job -> the DENOISE out now (StageControl.denoise)
        self.dying: dict[str, tuple[float, m.Dying]] = {}  # stage -> (unix time, last DYING)
        self.config_exits: set[str] = set()     # stages whose last start ended in a config exit (files looked for first)
        self.ready: dict[str, tuple[float, int]] = {}      # stage -> (unix time, pid) of the last READY event
        self.cancel_requests: set[str] = set()
        self.current: PlanRunner | None = None
        self.stopping = False
        self._submits: OrderedDict[int, str] = OrderedDict()
        self._prunes: OrderedDict[int, m.Jobs] = OrderedDict()
        self.lora_pool = ThreadPoolExecutor(LORA_WORKERS, thread_name_prefix="lora")
        self._pending: dict[int, _PendingSubmit] = {}      # SUBMIT id -> its LoRA check under way
        self._wake = True                                  # re-read the queue now
        self.server: Server | None = None
        self.events: EventPull | None = None
        self.heartbeats: Heartbeats | None = None
        self.hangs: HangWatch | None = None

    # ------------------------------------------------------------ set-up / tear-down

    def open(self) -> None:
        # 1) the CLI socket and the event sink
        self.server = Server(self.ctx, self.rf.daemon_endpoint)
        ev = self.cfg.endpoint("events")
        self.events = EventPull(self.ctx, ev, curve=self.cfg.curve_server() if self.cfg.is_remote("events") else None,
                                allow_plaintext=self.cfg.security.allow_plaintext_loopback)
        always_on = list(ALWAYS_ON_STAGES) + [s for s in ON_DEMAND_STAGES if self.cfg.is_remote(s)]
        self.heartbeats = Heartbeats(self.ctx, self.cfg, always_on)
        self.hangs = HangWatch(self.sup, self.heartbeats, self.settings.hang_timeout_s,
                               local=[s for s in always_on if not self.cfg.is_remote(s)])
        branch_timeout_s = self.cfg.stage_settings("scheduler").get("branch_timeout_s")  # unset: the table's default
        if isinstance(branch_timeout_s, (int, float)) and 0 < branch_timeout_s <= self.settings.hang_timeout_s:
            log.warning("[stage.orchestrator] hang_timeout_s %.0f is not below [stage.scheduler] branch_timeout_s "
                        "%.0f: the scheduler gives up on a hung executor before it is restarted",
                        self.settings.hang_timeout_s, branch_timeout_s)
        # 2) the queue: torn writes cleaned, one running job kept
        running = self.store.recover()
        # 3) shared memory: every segment of this run folder goes (a resumed job builds a fresh arena)
        reap(run_prefix(self.rf.root), keep=set())
        log.info("orchestrator serving %s; %d job(s) pending%s", self.rf.daemon_endpoint, len(self.store.pending()),
                 f", resuming {running[0].id} at {running[0].state}" if running else "")

    def close(self) -> None:
        self.lora_pool.shutdown(wait=False, cancel_futures=True)
        if self.heartbeats is not None:
            self.heartbeats.close()
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self.server is not None:
            self.server.close()
        if self.events is not None:
            self.events.close()

    def link(self, stage: str) -> LazyPirate:
        """The request client of a stage (one REQ at a time; Lazy Pirate reconnects it after a lost reply)."""
        if stage not in self.links:
            remote = self.cfg.is_remote(stage)
            self.links[stage] = LazyPirate(self.ctx, self.cfg.endpoint(stage), peer=stage,
                                           timeout_s=self.cfg.timeouts.request_s, retries=self.cfg.timeouts.retries,
                                           curve=self.cfg.curve_client(stage) if remote else None,
                                           allow_plaintext=self.cfg.security.allow_plaintext_loopback)
        return self.links[stage]

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """Serve until `stopping`: 1) take the next job (a running one first) 2) run its flow 3) else wait."""
        next_scan = 0.0
        while not self.stopping:
            # the queue is re-read when a request changed it, else every RESCAN_S (cheap with many finished jobs)
            if not self._wake and time.monotonic() < next_scan:
                self.pump(POLL_S)
                continue
            self._wake, next_scan = False, time.monotonic() + RESCAN_S
            self.pump(0.0)           # requests that came while a job ran first: a job cancelled meanwhile never starts
            job = self.store.next_job()
            if job is None:
                continue
            if job.cancel_requested or job.id in self.cancel_requests:
                self.store.transition(job.id, "cancelled", "cancelled before it ran")
                self._wake = True
                continue
            PlanRunner(self, job).run()
            self.cancel_requests.discard(job.id)
            self._wake = True

    def idle(self) -> None:
        """Called while a stage request is out: answer the CLI, take events (at once when one comes: `wake`)."""
        self.pump(0.0)

    @property
    def wake(self) -> tuple:
        """The sockets `idle` serves: a stage request's wait runs it as soon as one of them has input."""
        return (self.server.sock, self.events.sock)

    def pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for CLI requests and events; handle everything that came; heartbeats."""
        if self.heartbeats is not None:
            self.heartbeats.tick()
        if self.hangs is not None:
            self.hangs.tick()
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        poller.register(self.events.sock, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        while self.server.sock in ready or self.events.sock in ready:
            if self.server.sock in ready:
                req = self.server.recv(0.0)
                if req is not None:
                    if req.error is not None:
                        self.server.reply_error(req, req.error)
                    else:
                        reply = self.handle(req.msg, defer=True)
                        if reply is DEFERRED:
                            self._pending[req.msg.id].req = req
                        else:
                            self.server.reply(req, reply)
            if self.events.sock in ready:
                ev = self.events.recv(0.0)
                if ev is not None:
                    try:
                        self.on_event(ev)
                    except Exception:  # noqa: BLE001 - a stage's odd event must not end the job waiting in idle
                        log.exception("event %s not handled", ev.KIND)
            ready = dict(poller.poll(0))
        self._answer_checked()

    def _answer_checked(self) -> None:
        """Answer the SUBMITs whose LoRA check is done: queued, or refused naming the field."""
        for mid, p in list(self._pending.items()):
            if p.check.done():
                del self._pending[mid]
                reply = self._guard(p.msg, lambda p=p: self._queue_checked(p))
                if p.req is not None:
                    self.server.reply(p.req, reply)

    def _queue_checked(self, p: _PendingSubmit) -> m.Message:
        try:
            p.check.result()
        except LoraRefused as e:
            raise PromptError(e.field, e.detail) from None
        return self._queue(p.msg, p.spec, p.origin)

    # ------------------------------------------------------------ events from stages

    def on_event(self, ev: m.Message) -> None:
        if isinstance(ev, m.Progress):
            self.progress[ev.job] = ev
        elif isinstance(ev, m.Dying):
            log.warning("%s (pid %d) is dying: %s", ev.stage, ev.pid, ev.reason)
            self.dying[ev.stage] = (time.time(), ev)
        elif isinstance(ev, m.Ready):
            self.ready[ev.stage] = (time.time(), ev.pid)
        else:
            log.debug("ignored event %s", ev.KIND)

    # ------------------------------------------------------------ CLI requests

    def handle(self, msg: m.Message, defer: bool = False) -> m.Message:
        """The reply to one request; with `defer`, a SUBMIT with LoRAs may be DEFERRED (answered by pump() when its
        check on a worker thread is done)."""
        return self._guard(msg, lambda: self._dispatch(msg, defer))

    def _dispatch(self, msg: m.Message, defer: bool) -> m.Message:
        if isinstance(msg, m.Submit):
            return self._submit(msg, defer)
        if isinstance(msg, m.EstimateJob):
            return self._estimate(msg)
        if isinstance(msg, m.Status):
            return self._status(msg)
        if isinstance(msg, m.Info):
            return self._info(msg)
        if isinstance(msg, m.Cancel):
            return self._cancel(msg)
        if isinstance(msg, m.Resume):
            job = self.store.resume(msg.job)
            self._wake = True
            return m.reply_to(msg, m.Submitted, job=job.id, seed=int(job.spec["seed"]),
                              position=self._position(job.id))
        if isinstance(msg, m.Prune):
            return self._prune(msg)
        if isinstance(msg, m.Hello):
            return m.reply_to(msg, m.Ready, stage="orchestrator", pid=os.getpid(), version=VERSION,
                              info={"run": str(self.rf.root), "pack": str(self.pack.dir),
                                    "sizes": ",".join(f"{w}x{h}" for w, h in self.packs)})
        if isinstance(msg, m.Heartbeat):
            cur = self.current.job.id if self.current else None
            return m.reply_to(msg, m.Pong, stage="orchestrator", pid=os.getpid(), busy=cur is not None, job=cur,
                              uptime_s=0.0)
        return m.error_reply(msg.id, "unknown_kind", f"the orchestrator does not serve {msg.KIND}", field="kind")

    def _cancel(self, msg: m.Cancel) -> m.Message:
        cur = self.current.job.id if self.current is not None else None
        if msg.queued_only and (cur == msg.job or self.store.view(msg.job).state != "queued"):
            return m.reply_to(msg, m.Ok, note=f"job {msg.job} is not waiting: left as it is")
        if cur == msg.job and self.store.get(cur).state == "queued":   # taken, not yet marked running (its
            self.cancel_requests.add(cur)                              # LoRAs read meanwhile): the flow stops it
            return m.reply_to(msg, m.Ok, note=f"job {cur} is being cancelled (it was starting)")
        job = self.store.cancel(msg.job)
        if job.active:
            self.cancel_requests.add(job.id)
            return m.reply_to(msg, m.Ok, note=f"job {job.id} is being cancelled (it was {job.state})")
        return m.reply_to(msg, m.Ok, note=f"job {job.id} cancelled")

    def _guard(self, msg: m.Message, fn) -> m.Message:
        """fn()'s reply, or the error reply its exception means (one bad request never ends the daemon)."""
        try:
            return fn()
        except PromptError as e:
            return m.error_reply(msg.id, "bad_request", str(e), field=e.field)
        except QueueFull as e:
            return m.error_reply(msg.id, "busy", str(e), retry=True)
        except JobError as e:
            return m.error_reply(msg.id, "failed", str(e))
        except Exception as e:  # noqa: BLE001 - one bad request is an error reply; the daemon and its job go on
            log.exception("orchestrator: %s request %d failed", msg.KIND, msg.id)
            return m.error_reply(msg.id, "failed", f"the orchestrator could not serve {msg.KIND}: "
                                                   f"{type(e).__name__}: {e}")

    def _file_config(self):
        """pipeline.toml as it is now (what a stage started now would run), else the daemon's own copy: a running
        stage is stale when it differs from the file, not from what this daemon read at its start (an executor
        restarted on an edited file runs what the file says)."""
        from stages.config import load_config
        try:
            return load_config(self.cfg.path)
        except (ConfigError, OSError):
            return self.cfg

    def _submit(self, msg: m.Submit, defer: bool = False) -> m.Message:
        if msg.id in self._submits:                     # a resend of a SUBMIT we already queued
            job = self.store.get(self._submits[msg.id])
            return m.reply_to(msg, m.Submitted, job=job.id, seed=int(job.spec["seed"]), position=self._position(job.id))
        if msg.id in self._pending:                     # a resend while its LoRAs are checked: answered with it
            return DEFERRED
        self._check_answer_by(msg)                      # waited behind another request past its client's wait
        base = Path(msg.base_dir)
        if not base.is_absolute():
            return m.error_reply(msg.id, "bad_request", "base_dir must be an absolute path", field="base_dir")
        # on-demand stages start on the file as it is; this daemon's own packs and settings are those of its start
        stale = stale_stages_message(self._file_config(), ALWAYS_ON_STAGES + ("orchestrator",))
        if stale:
            return m.error_reply(msg.id, "failed", stale)
        spec = resolve_prompt(msg.prompt, base_dir=base, resolution=list(self.packs),
                              sampling=self._pack_sampling())
        size = self._check_vae_size(spec)
        origin = None
        if msg.origin:
            try:
                origin = json.loads(msg.origin)
            except ValueError as e:
                return m.error_reply(msg.id, "bad_request", f"origin is not JSON: {e}", field="origin")
            try:
                origin = convert(origin, ORIGIN, where="origin")     # as the job's record keeps it
            except SchemaError as e:
                return m.error_reply(msg.id, "bad_request", str(e), field=e.field)
        check = self.lora_pool.submit(self.loras.check, spec.loras, size, self.packs[size].lora_rank) if \
            spec.loras else None
        pending = _PendingSubmit(msg, spec, origin, check) if check is not None else None
        if pending is not None and defer:
            self._pending[msg.id] = pending
            return DEFERRED
        if pending is not None:
            check.exception()                          # called directly (tests, tools): the check is waited for
            return self._queue_checked(pending)
        return self._queue(msg, spec, origin)

    @staticmethod
    def _check_answer_by(msg: m.Submit) -> None:
        """QueueFull (busy, retry) once the client stopped waiting: it was told the SUBMIT failed, so a job queued
        now would run beside the one its retry queues."""
        if msg.answer_by and time.time() > msg.answer_by:
            late = time.time() - msg.answer_by
            raise QueueFull(f"the SUBMIT was decided {late:.1f} s after its client stopped waiting (answer_by); "
                            "nothing was queued: send it again")

    def _check_vae_size(self, spec) -> tuple:
        """The job's size; refused when the VAE cannot decode a size its plan decodes (the final image's, the first
        pass's on the pixel hires path), or its entries would run on a long-context pack: found at submit, not after
        the whole denoise."""
        size = (spec.width, spec.height)                # resolve_prompt fitted it to the packs
        refusal = entries_pack_refusal(spec, self.packs)
        if refusal is not None:
            raise PromptError(*refusal)
        if self.vae_sizes is None:
            return size
        have = ", ".join(f"{w}x{h}" for w, h in self.vae_sizes) or "none readable"
        for field, (w, h) in decoded_sizes(spec):
            if (w, h) not in self.vae_sizes:
                which = "" if field == "width" else "the second pass at "
                raise PromptError(field, f"{which}{w}x{h} has a model pack but no VAE pack (stage.vae.vae_pack "
                                         f"has: {have}); add the VAE pack of that size (anima-models pack-vae, or the "
                                         "bundle's)")
        return size

    def _pack_sampling(self) -> dict:
        """{(width, height): the sampling settings that size's pack records, or None} for resolve_prompt."""
        return {size: p.sampling for size, p in self.packs.items()}

    def _estimate(self, msg: m.EstimateJob) -> m.Message:
        """The job a SUBMIT of this prompt would queue, checked as _submit checks it, priced on the board model
        (orchestrator/engine/estimate.py; modelled seconds); nothing is queued."""
        from orchestrator.engine.estimate import EstimateError, estimate_with_config
        base = Path(msg.base_dir)
        if not base.is_absolute():
            return m.error_reply(msg.id, "bad_request", "base_dir must be an absolute path", field="base_dir")
        spec = resolve_prompt(msg.prompt, base_dir=base, check_output=False, resolution=list(self.packs),
                              sampling=self._pack_sampling())
        self._check_vae_size(spec)
        try:
            est = estimate_with_config(spec, self.cfg, self.packs)
        except EstimateError as e:
            return m.error_reply(msg.id, "failed", str(e))
        return m.reply_to(msg, m.Estimated, estimate=json.dumps(est.to_dict()))

    def _queue(self, msg: m.Submit, spec, origin) -> m.Message:
        """A checked SUBMIT into the queue, with its init image and mask (read, fitted and kept in the job folder
        before the answer: orchestrator.engine.job_inputs)."""
        from orchestrator.engine.job_inputs import job_inputs
        inputs = job_inputs(self.rf.root, spec)
        self._check_answer_by(msg)                      # the image work above may outlast the client's wait
        job = self.store.submit(remember(spec), origin, inputs=inputs)   # its record checked once
        self._wake = True
        self._submits[msg.id] = job.id
        while len(self._submits) > SUBMIT_MEMORY:
            self._submits.popitem(last=False)
        return m.reply_to(msg, m.Submitted, job=job.id, seed=spec.seed, position=self._position(job.id))

    def _position(self, job_id: str) -> int:
        ids = [j.id for j in self.store.pending()]
        return ids.index(job_id) if job_id in ids else 0

    def _status(self, msg: m.Status) -> m.Jobs:
        """One job, or the newest `limit` (queued and running ones with `active`; older than `before`), oldest first;
        with `detail` each carries its spec and origin, as many as fit in one reply (`more` says older ones were left:
        the running job is the oldest active one, so a client that needs it pages back with `before`). The store's
        index answers it: the cost does not grow with the finished jobs."""
        if msg.job:
            job = self.store.view(msg.job)
            return m.reply_to(msg, m.Jobs, jobs=(self.job_info(JobEntry.of(job), self._pending_ids(),
                                                               detail=msg.detail, record=job),))
        entries, more = self.store.entries(active=msg.active, before=msg.before,
                                           limit=msg.limit or m.MAX_JOBS_LISTED)
        pending = self._pending_ids() if any(e.state == "queued" for e in entries) else []
        out, used = [], 0
        for entry in reversed(entries):                # newest first, so a cut leaves the oldest out
            info = self.job_info(entry, pending, detail=msg.detail)
            used += len(info.spec_json.encode()) + len(info.origin.encode()) + 1024
            if out and used > DETAIL_BUDGET_BYTES:
                break
            out.append(info)
        return m.reply_to(msg, m.Jobs, jobs=tuple(reversed(out)), more=more or len(out) < len(entries))

    def _pending_ids(self) -> list[str]:
        return [j.id for j in self.store.pending()]

    def _prune(self, msg: m.Prune) -> m.Jobs:
        """At most MAX_JOBS_LISTED jobs removed per request, within PRUNE_BATCH_S (a client waits seconds for its
        reply): `more` says others are still to go, and the CLI asks again, counting every removed job."""
        if msg.id in self._prunes:                      # a resend: its first reply was lost, its jobs removed
            return self._prunes[msg.id]
        removed = self.store.prune(keep=msg.keep, older_than_s=msg.older_than_s, max_jobs=m.MAX_JOBS_LISTED,
                                   max_s=PRUNE_BATCH_S)
        more = bool(removed) and bool(self.store.prunable(keep=msg.keep, older_than_s=msg.older_than_s))
        reply = m.reply_to(msg, m.Jobs, jobs=tuple(self.job_info(e, []) for e in removed), more=more)
        self._prunes[msg.id] = reply
        while len(self._prunes) > PRUNE_MEMORY:
            self._prunes.popitem(last=False)
        return reply

    def _info(self, msg: m.Info) -> m.Pipeline:
        packs = tuple(m.PackRef(width=p.width, height=p.height, dir=str(p.dir), dtype=p.io_dtype, blocks=p.blocks,
                                source_name=p.source_name[:m.MAX_PATH_CHARS], source_sha256=p.source_sha256[:64],
                                lora_rank=p.lora_rank, sampling=m.SamplingRef(**p.sampling) if p.sampling else None)
                      for p in self.packs.values())
        loras = tuple(self.loras.names()[:m.MAX_LORAS_LISTED])
        return m.reply_to(msg, m.Pipeline, packs=packs, models=self.model_files(), max_queue=self.settings.max_queue,
                          version=VERSION, loras=loras)

    def model_files(self) -> dict[str, str]:
        """File names of the text encoder and VAE (what a ComfyUI loader names): those the packs the stages run were
        made from, else the models folder's; {} unknown."""
        if self._model_files is None:
            from models.setup.models_dir import resolve_models
            self._model_files = pack_model_files(self.cfg)         # a bundle's: the files its packs came from
            need = tuple(k for k in ("text_encoder", "vae") if k not in self._model_files)
            try:
                paths = resolve_models(self.cfg.models_dir, {}, need=need) if need else None
                self._model_files.update({k: getattr(paths, k).name for k in need})
            except (ValueError, OSError) as e:
                log.info("model file names unknown (%s)", e)
        return self._model_files

    def job_info(self, entry: JobEntry, pending_ids: list[str], detail: bool = False, record=None) -> m.JobInfo:
        """A job's JobInfo from its index entry; with `detail` its spec and origin from the record (`record`, else read
        from the store: a finished job's from its file)."""
        if detail and entry.state != UNREADABLE:
            try:
                record = record or self.store.view(entry.id)
            except JobError as e:                   # removed or broken since it was listed: listed without detail
                log.warning("job %s: no detail: %s", entry.id, e)
        return info_of(entry, record if detail else None, progress=self.progress.get(entry.id),
                       denoise_pass=self.denoise_pass.get(entry.id),
                       position=pending_ids.index(entry.id) if entry.id in pending_ids else 0)


def serve(rf: RunFolder, config_path: Path, png_formats: Sequence[PngFormat] = ()) -> int:
    """`orchestrator serve --config FILE`: the daemon process (SIGTERM: finish the current request's wait, exit 0);
    `png_formats` as Daemon takes them."""
    import setproctitle
    from stages.config import load_config
    cfg = load_config(config_path)
    if cfg.run_dir.resolve() != rf.root:
        raise ConfigError(f"{config_path}: run_dir {cfg.run_dir} differs from the run folder {rf.root} "
                         "(--run / ANIMA_RUN)")
    logging.getLogger().setLevel(cfg.log_level.upper())
    setproctitle.setproctitle("anima-orchestrator")
    d = Daemon(cfg, rf, png_formats=png_formats)
    record_start(cfg, "orchestrator")     # its packs and settings: an edit of the file asks for `orchestrator reload`

    def on_signal(signum, frame):
        log.info("orchestrator received %s, stopping", signal.Signals(signum).name)
        d.stopping = True                  # a running job is left in its state on disk: the next daemon resumes it
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    d.open()
    try:
        d.run()
    finally:
        d.close()
        d.ctx.term()
    return 0
