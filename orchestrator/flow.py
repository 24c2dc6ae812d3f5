"""One job's flow: encode (encoder up, then down) → denoise (scheduler) → decode (VAE up, then down); retries."""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from models.runtime.backends import backend_class
from models.durable import atomic_write
from models.lora.choice import lora_short_hash
from models.packs.pack import PackError, load_pack
from models.dit.partition import TEXT_TOKENS, context_rows
from orchestrator.job_arena import create_job_arena
from orchestrator.loras import LoraRefused
from orchestrator.prompt_spec import PromptSpec, output_file
from orchestrator.report import JobReport, current_rss_mb, peak_rss_mb, png_metadata, text_record
from orchestrator.runfolder import ALWAYS_ON_STAGES, ON_DEMAND_STAGES
from orchestrator.supervisor import SupervisorError
from protocol import messages as m
from protocol.arena import Arena, segment_name
from protocol.fields import ProtocolError
from protocol.sockets import PeerUnavailable
from protocol.tensors import from_inline
from protocol.version import VERSION
from stages.base import EXIT_CONFIG

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.5           # a stage that answers `busy` is asked again after this long (at most the call's timeout)
READY_TIMEOUT_S = 5.0        # one HELLO while a stage comes up (repeated until start_timeout_s)
DYING_WAIT_S = 2.0           # a stage's last word (DYING) is looked for this long after its config exit
START_ATTEMPTS = 3           # a stage that dies while supervisord starts it (within startsecs) is started again


def lora_places(layers: dict, lora_rank: int) -> dict:
    """Where a LoRA's layers ({place: count}, models.lora.targets.PLACES) are applied in the pipeline."""
    where = {"branch": f"executor: the LoRA-ready pack's low-rank inputs (rank {lora_rank}), written by the scheduler",
             "host": "scheduler: merged into FP32 copies of the pack's host weights",
             "adapter": "encoder: merged into the LLM adapter for this job",
             "te": "encoder: merged into the Qwen3 text encoder for this job"}
    return {place: where[place] for place in layers}


class StageFailed(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage, self.message = stage, message


class Cancelled(Exception):
    pass


class Stopping(Exception):
    """The daemon is shutting down: the job stays in its state on disk for the next daemon to resume."""


TEXT_FILE = "text.json"          # the prompts' T5 token counts (report `text`), kept for a resume


def _save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def _load_npy(path: Path, shape: tuple) -> np.ndarray | None:
    """A job-folder array if it is whole and as expected (f32, `shape`, finite), else None with the reason logged:
    after a power cut a file may be empty or cut short (np.load then raises EOFError, ValueError or OSError)."""
    try:
        a = np.load(path, allow_pickle=False)
        if a.dtype != np.float32 or tuple(a.shape) != tuple(shape) or not np.isfinite(a).all():
            raise ValueError(f"{a.dtype} {list(a.shape)}, expected float32 {list(shape)} and finite")
        return a
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - whatever a torn file raises, it is unusable
        log.warning("%s is unusable: %s: %s", path, type(e).__name__, e)
        return None


class JobFlow:
    """Runs one job to done/failed/cancelled. `d` is the Daemon (sockets, store, supervisor, idle pump)."""

    def __init__(self, daemon, job):
        self.d, self.job = daemon, job
        self.store, self.sup, self.cfg, self.settings = daemon.store, daemon.sup, daemon.cfg, daemon.settings
        self.dir = self.store.job_dir(job.id)
        self.spec = PromptSpec.from_dict(job.spec)
        self.pack = daemon.packs.get((self.spec.width, self.spec.height))     # the job's size picks its pack
        self.report = JobReport(job.id, job.spec)
        for name in ("encoder", "executor", "vae"):
            self.report.stages[name].remote = self.cfg.is_remote(name)
        self.report.teardown.encoder_remote = self.cfg.is_remote("encoder")
        self.report.teardown.vae_remote = self.cfg.is_remote("vae")
        self.arena: Arena | None = None
        self._watch: tuple[str, int, float] | None = None     # (stage, pid at request start, start time)
        self._died: str | None = None
        self._config_exit, self._up_since = False, 0.0
        self._sampling: set[str] = set()                      # stages whose RSS is sampled now
        self._denoising = False
        self._last_sample = 0.0
        self._resume_sampling = True                          # DENOISE resume: go on from the per-step state
        self.lora_hashes: dict = {}                           # LoRA name -> A1111's short hash (the PNG's)

    # ------------------------------------------------------------ the flow

    def run(self) -> None:
        job, stages = self.job, ("encoding", "denoising", "decoding")
        start = job.state if job.active else (job.start_at or "encoding")
        self.d.current = self
        try:
            # 1) room on the job folder's disk, its pack, then the job's arena: contexts, latent, the scheduler's scratch
            self._check_disk()
            if self.pack is None:
                have = ", ".join(f"{w}x{h}" for w, h in self.d.packs)
                raise StageFailed("orchestrator", f"no model pack for {self.spec.width}x{self.spec.height} any more "
                                  f"(the config changed after the job was queued); the sizes with a pack: {have}")
            self._make_arena()
            self._check_loras()
            # resumed past encoding: what the earlier stages left in the job folder goes into the arena, or the job
            # steps back to the stage that makes it again
            start, why = self._resume_point(start)
            for state in stages[stages.index(start):]:
                if self.store.get(job.id).state != state:
                    self.store.transition(job.id, state, why if state == start else "")
                self._check_cancel()
                # 2) encode, 3) denoise, 4) decode
                t0 = self.report.since_start()
                try:
                    {"encoding": self._encode, "denoising": self._denoise, "decoding": self._decode}[state]()
                finally:                     # a failed job's report shows how far each phase got
                    self.report.phases.append([state, round(t0, 3), round(self.report.since_start(), 3)])
            self.report.finished = time.time()
            self.report.write(self.dir / "report.json")
            self._timing_plot()
            self.store.transition(job.id, "done", (self.report.delivery or {}).get("note", ""),
                                  image=self.report.image, report=str(self.dir / "report.json"))
        except Cancelled:
            self._stop_quietly()
            self.store.transition(job.id, "cancelled", "cancelled by the user")
        except StageFailed as e:
            log.error("job %s failed: %s", job.id, e)
            self._stop_quietly()
            self.report.write(self.dir / "report.json")
            self._timing_plot()
            self.store.fail(job.id, e.stage, e.message)
        except Stopping:
            log.info("job %s left at %s for the next orchestrator", job.id, self.store.get(job.id).state)
        except Exception as e:  # noqa: BLE001 - a bug or an unreachable supervisord fails the job, not the daemon
            log.exception("job %s: orchestrator error", job.id)
            self._stop_quietly()
            self.store.fail(job.id, "orchestrator", f"{type(e).__name__}: {e}")
        finally:
            self.d.current = None
            self.d.progress.pop(job.id, None)
            if self.arena is not None:
                self.arena.close()           # the owner unlinks: no segment outlives its job
                self.arena = None

    def _timing_plot(self) -> None:
        """timing.png next to report.json, drawn by a short child process (orchestrator.timing_plot): matplotlib's
        import and memory stay out of this long-lived daemon, which keeps serving while it runs. Best effort: a
        failure, a timeout or a daemon stop leaves the job as it is, without the picture."""
        if not self.report.phases:           # failed before any stage ran (disk, arena): nothing to draw
            return
        limit = self.settings.timing_plot_timeout_s
        if not limit:                        # turned off ([stage.orchestrator] timing_plot_timeout_s = 0)
            return
        cmd = [sys.executable, "-m", "orchestrator.timing_plot", str(self.dir / "report.json"),
               "--parent", str(os.getpid())]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)   # stderr: our log
        except OSError as e:
            log.warning("job %s: no timing plot: %s", self.job.id, e)
            return
        deadline = time.monotonic() + limit
        while proc.poll() is None:
            if self.d.stopping or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.warning("job %s: timing plot %s", self.job.id, "stopped" if self.d.stopping else "timed out")
                return
            self.d.pump(0.05)
        if proc.returncode != 0:
            log.warning("job %s: the timing plot failed (exit %s; its message is above)", self.job.id,
                        proc.returncode)

    def _check_disk(self) -> None:
        """A queued job may wait while the disk fills: before it starts, the queue's free-space floor holds again."""
        free_mb = shutil.disk_usage(self.dir).free / 2**20
        if free_mb < self.store.min_free_mb:
            raise StageFailed("orchestrator", f"only {free_mb:.0f} MB free in {self.dir}; a job needs at least "
                              f"{self.store.min_free_mb:.0f} MB (free some space, then `orchestrator resume "
                              f"{self.job.id}`)")

    def _make_arena(self) -> None:
        # a fresh name per arena: a stage still serving a dead daemon's request for this job can never attach the
        # new arena under the old name and mix the two (its writes would land in the resumed job's latent)
        name = segment_name(self.d.rf.root, f"{self.job.id}_{secrets.token_hex(3)}")
        try:
            made = create_job_arena(name, load_pack(self.pack.dir, check=False))     # the manifest, no weights
        except PackError as e:
            raise StageFailed("orchestrator", f"model pack {self.pack.dir}: {e}") from None
        except Exception as e:  # ArenaError: no space, a stale segment
            raise StageFailed("orchestrator", f"cannot create the job arena: {e}") from None
        self.arena, self.cond, self.uncond, self.latent = made.arena, made.cond, made.uncond, made.latent
        self.scratch = made.scratch

    def _check_loras(self) -> None:
        """The job's LoRAs checked again against its pack and the encoder (a file may have changed since submit),
        and recorded: what each changes where (report.json `loras`), the hashes the PNG names them by."""
        if not self.spec.loras:
            return
        try:
            uses, plan = self.d.loras.check(self.spec.loras, self.pack.size, self.pack.lora_rank)
        except LoraRefused as e:
            raise StageFailed("orchestrator", f"prompt.json field '{e.field}': {e.detail}") from None
        for use, rep in zip(uses, plan):
            try:
                self.lora_hashes[use.name] = lora_short_hash(use.path)
            except OSError as e:
                raise StageFailed("orchestrator", f"LoRA {use.path}: {e}") from None
            self.report.loras.append({**rep, "short_hash": self.lora_hashes[use.name],
                                      "applied_in": lora_places(rep["layers"], self.pack.lora_rank)})

    # ------------------------------------------------------------ stages

    def _resume_point(self, start: str) -> tuple[str, str]:
        """(the stage to go on from, why it is earlier than `start`). Decoding needs a whole latent.npy (else the
        scheduler gives the latent again from its final step state, or samples again: deterministic); denoising needs
        whole cond.npy/uncond.npy (else they are encoded again)."""
        why = ""
        if start == "decoding":
            latent = _load_npy(self.dir / "latent.npy", self.pack.latent_shape)              # [C, H/8, W/8] f32
            if latent is not None:
                self.arena.write(self.latent, latent)
                return start, why
            start, why = "denoising", "latent.npy missing or unusable: denoising again"
        if start == "denoising":
            if self._load_contexts():
                return start, why
            start, why = "encoding", "cond.npy/uncond.npy missing or unusable: encoding again"
            self._resume_sampling = False    # steps saved with the old contexts are not reused: sample from step 0
        if why:
            log.warning("job %s: %s", self.job.id, why)
        return start, why

    def _load_contexts(self) -> bool:
        """The job folder's contexts (and their T5 token counts) into the arena and the report; False when any is
        missing or unusable (the counts only matter to a long-context pack: they set its mask)."""
        arrays = [_load_npy(self.dir / f"{name}.npy", self.pack.context_shape) for name in ("cond", "uncond")]
        text = self._load_text()
        if any(a is None for a in arrays) or (text is None and self.pack.text_tokens > TEXT_TOKENS):
            return False
        self.arena.write(self.cond, arrays[0])                                               # [S, Dc] f32
        self.arena.write(self.uncond, arrays[1])
        self.report.text = text or {}
        return True

    def _load_text(self) -> dict | None:
        try:
            text = json.loads((self.dir / TEXT_FILE).read_text())
            if not isinstance(text, dict):
                raise ValueError(f"a {type(text).__name__}, not an object")
            return text
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("%s is unusable: %s", self.dir / TEXT_FILE, e)
            return None

    def _encode(self) -> None:
        t0 = time.monotonic()
        if self._load_contexts():            # encoded before a restart: no encoder needed
            return
        remote = self.cfg.is_remote("encoder")
        self._bring_up("encoder")
        msg = m.Encode(job=self.job.id, prompt=self.spec.prompt, negative=self.spec.negative_prompt,
                       arena=None if remote else self.arena.name, cond=None if remote else self.cond,
                       uncond=None if remote else self.uncond, rows=self.pack.text_tokens, loras=self.spec.loras)
        reply = m.expect(self._call("encoder", msg, self.settings.encode_timeout_s), m.Encoded, "encoder")
        for mine, theirs in ((self.cond, reply.cond), (self.uncond, reply.uncond)):
            if theirs.inline:
                self.arena.write(mine, from_inline(theirs, reply.inline))
            elif theirs.slot != mine.slot:
                raise StageFailed("encoder", f"ENCODED points at slot {theirs.slot!r}, expected {mine.slot!r}")
        self.report.text = text_record(reply.tokens_cond, reply.tokens_uncond, reply.truncated, self.pack.text_tokens)
        atomic_write(self.dir / TEXT_FILE, json.dumps(self.report.text))   # before the contexts: a resume reads both
        _save_npy(self.dir / "cond.npy", self.arena.read(self.cond))
        _save_npy(self.dir / "uncond.npy", self.arena.read(self.uncond))
        self.report.encoder_timings = dict(reply.timings)
        self._bring_down("encoder")          # stopped (and seen STOPPED) before DENOISE goes out
        self.report.stages["encoder"].wall_s += time.monotonic() - t0

    def _context_rows(self) -> tuple:
        """Per pass, the rows of ComfyUI's context a long-context pack leaves unmasked; () for a 512-row pack."""
        t, S = self.report.text, self.pack.text_tokens
        if S <= TEXT_TOKENS or "t5_tokens_prompt" not in t:
            return ()
        return (context_rows(t["t5_tokens_prompt"], S), context_rows(t["t5_tokens_negative"], S))

    def _denoise(self) -> None:
        t0 = time.monotonic()
        for name in ON_DEMAND_STAGES:      # nothing heavy may be up while denoising
            if not self.cfg.is_remote(name) and self.sup.info(name).live:
                self.sup.stop(name, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
        s = self.spec
        params = m.DenoiseParams(seed=s.seed, steps=s.steps, cfg=s.cfg, sampler=s.sampler, scheduler=s.scheduler,
                                 width=self.pack.width, height=self.pack.height,
                                 spectrum=s.spectrum)
        # the report keeps what the backend models (board-sim: the board) apart from the time measured here
        self.report.board = backend_class(self.cfg.backend).report_section(self.pack.dir,
                                                                           self.cfg.stage_settings("executor"))
        msg = m.Denoise(job=self.job.id, job_dir=str(self.dir), pack_dir=str(self.pack.dir), arena=self.arena.name,
                        params=params, cond=self.cond, uncond=self.uncond, latent=self.latent, scratch=self.scratch,
                        executor=self.cfg.endpoint("executor"), resume=self._resume_sampling,
                        context_rows=self._context_rows(), loras=self.spec.loras)
        self._denoising = True
        self._sampling = set(ALWAYS_ON_STAGES)
        try:
            self._sample(force=True)
            reply = m.expect(self._call("scheduler", msg, self.settings.denoise_timeout_s), m.Denoised, "scheduler")
            self._sample(force=True)
        finally:
            self._denoising = False
            self._sampling = set()
        if reply.latent.inline:
            self.arena.write(self.latent, from_inline(reply.latent, reply.inline))
        latent = self.arena.read(self.latent)                                  # [C, H/8, W/8] f32
        if not np.isfinite(latent).all():
            raise StageFailed("scheduler", "the final latent holds NaN or Inf")
        _save_npy(self.dir / "latent.npy", latent)
        self.report.denoised = reply.to_wire()                                 # branches: PhaseSums, steps: StepTimes, as maps
        self.report.stages["scheduler"].wall_s += time.monotonic() - t0
        # the executor's critical path: lifecycle it could not hide plus inference (prefetched loads run beside it)
        self.report.stages["executor"].wall_s += sum(b.total_s for b in reply.branches.values())

    def _decode(self) -> None:
        t0 = time.monotonic()                # the latent is in the arena: denoised now, or read by _resume_point
        remote = self.cfg.is_remote("vae")
        self._bring_up("vae")
        image = self.dir / "image.png"
        msg = m.Decode(job=self.job.id, latent=self.latent, arena=None if remote else self.arena.name,
                       output=None if remote else str(image), return_png=remote,
                       metadata=png_metadata(self.spec, self.pack, self.job.id, self._model_names(),
                                             graph=self._client_graph(), lora_hashes=self.lora_hashes))
        if remote:
            from protocol.tensors import InlineFrames
            frames = InlineFrames()
            desc = frames.add(self.arena.read(self.latent))
            msg = m.Decode(job=msg.job, latent=desc, arena=None, output=None, return_png=True,
                           metadata=msg.metadata, inline=tuple(frames.frames))
        reply = m.expect(self._call("vae", msg, self.settings.decode_timeout_s), m.Decoded, "vae")
        if reply.png is not None:
            atomic_write(image, from_inline(reply.png, reply.inline).tobytes())
        elif reply.path != str(image):
            raise StageFailed("vae", f"DECODED names {reply.path!r}, expected {image}")
        self.report.vae_timings = dict(reply.timings)
        self._bring_down("vae")
        self.report.stages["vae"].wall_s += time.monotonic() - t0
        self.report.image = self._deliver(image)

    def _client_graph(self) -> dict | None:
        """The API graph a ComfyUI client sent for this job (its node ids, titles, loader names, optional nodes), as
        ComfyUI itself would store it in the PNG; None for jobs from elsewhere (their graph is made from the job)."""
        origin = self.job.origin or {}
        graph = origin.get("graph") if origin.get("api") == "comfyui" else None
        return graph if isinstance(graph, dict) and graph else None

    def _model_names(self):
        """The loaders' file names in the PNG's ComfyUI graph: the pack's checkpoint, the models folder's files."""
        from orchestrator.comfy_graph import ModelNames
        files = self.d.model_files()
        return ModelNames(unet=tuple(filter(None, [self.pack.source_name])),
                          clip=tuple(filter(None, [files.get("text_encoder")])),
                          vae=tuple(filter(None, [files.get("vae")])))

    def _deliver(self, image: Path) -> str:
        """Copy the PNG to the prompt's `output` (a .png path, or a folder that gets JOB.png) -> where the image is.

        The copy is a file created exclusively next to the destination (atomic_write: no planted link is followed)
        and renamed over it only when the job says `overwrite`; otherwise an existing destination (a file, a link,
        anything) is kept and the job's image stays where it always is, in the job folder."""
        out = self.spec.output
        if not out:
            return str(image)
        dest = output_file(out, self.job.id)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(dest, image.read_bytes(), overwrite=self.spec.overwrite)
        except FileExistsError:
            note = f"output {dest} exists and the job does not say overwrite: kept; the image is {image}"
            log.warning("job %s: %s", self.job.id, note)
            self.report.delivery = {"output": str(dest), "written": False, "note": note}
            return str(image)
        except OSError as e:
            raise StageFailed("orchestrator", f"cannot write the image to output {dest}: {e} (the image is kept "
                                              f"at {image})") from None
        self.report.delivery = {"output": str(dest), "written": True}
        return str(dest)

    # ------------------------------------------------------------ starting and stopping stages

    def _bring_up(self, stage: str, *, gone_pid: int = 0) -> None:
        """Local: start through supervisord (after the dead process `gone_pid` has left) and wait RUNNING; then HELLO
        until READY. A remote stage is only health-checked."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        self._up_since = time.time()             # a DYING after this is this start's last word
        if not self.cfg.is_remote(stage):
            while gone_pid and time.monotonic() < deadline:      # its last word is out; wait for the exit itself
                info = self.sup.info(stage)
                if info.pid != gone_pid:
                    break
                self.d.pump(0.05)
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self.sup.start(stage, timeout_s=self.settings.start_timeout_s, sleep=self.d.pump)
                    break
                except SupervisorError as e:  # e.g. killed within startsecs: EXITED/BACKOFF, not RUNNING
                    why = self._config_exit_reason(stage, self.sup.info(stage))
                    if why:
                        raise StageFailed(stage, why) from None
                    if attempt == START_ATTEMPTS or time.monotonic() > deadline:
                        raise StageFailed(stage, f"could not start ({attempt} attempts): {e}") from None
                    log.warning("job %s: %s did not start (%s); again (%d/%d)", self.job.id, stage, e, attempt,
                                START_ATTEMPTS)
                    self.d.pump(1.0)
            self._sampling.add(stage)
        check = self._start_failed(stage)
        while True:
            try:
                reply = self.d.link(stage).request(m.Hello(peer="orchestrator", pid=os.getpid(), version=VERSION),
                                                   timeout_s=READY_TIMEOUT_S, retries=0, should_stop=check,
                                                   idle=self.d.idle)
                m.expect(reply, m.Ready, stage)
                if stage in self._sampling:          # loaded and ready: the first point of its memory trace
                    self._sample_one(stage)
                return
            except PeerUnavailable:
                self._check_cancel()
                if self._config_exit:
                    raise StageFailed(stage, self._died) from None
                if self._died or time.monotonic() > deadline:
                    where = self.cfg.endpoint(stage)
                    why = self._died or f"no READY within {self.settings.start_timeout_s:.0f} s"
                    raise StageFailed(stage, f"not reachable at {where}: {why}") from None
            except (m.RemoteError, ProtocolError) as e:
                raise StageFailed(stage, f"bad READY: {e}") from None

    def _start_failed(self, stage: str):
        """A should_stop for HELLO while a stage comes up: FATAL ends it; an exit is started again (twice at most)."""
        self._died, self._config_exit = None, False
        restarts = [0]

        def check() -> bool:
            self._sample()                   # its memory while it loads (the longest part of a stage's phase)
            if self.d.stopping or self.job.id in self.d.cancel_requests:
                return True
            if not self.cfg.is_remote(stage):
                info = self.sup.info(stage)
                why = self._config_exit_reason(stage, info)
                if why:
                    self._died, self._config_exit = why, True
                    return True
                if info.state in ("EXITED", "STOPPED") and restarts[0] < 2:
                    restarts[0] += 1
                    self.sup.start(stage, wait=False)
                elif info.state in ("FATAL", "EXITED", "STOPPED"):
                    self._died = f"{info.state}: {info.spawnerr or info.description} (see its log)"
                    return True
            return False
        return check

    def _config_exit_reason(self, stage: str, info) -> str:
        """Why a stage that exited EXIT_CONFIG did (its DYING of this start, else a pointer to its log); "" for any
        other state. A config or pack problem fails the same way every time: it is not retried, and its cause is
        the job's error, not only a line in the stage's log."""
        if info.state != "EXITED" or info.exitstatus != EXIT_CONFIG:
            return ""
        said, until = "", time.monotonic() + DYING_WAIT_S
        while True:                     # its DYING went out before the exit; it may not have been read yet
            dying = self.d.dying.get(stage)
            said = dying[1].reason if dying is not None and dying[0] >= self._up_since else ""
            if said or time.monotonic() > until:
                break
            self.d.pump(0.05)
        return (f"{said} (exit {EXIT_CONFIG}, not retried)" if said else
                f"exited {EXIT_CONFIG} (a config or pack problem, not retried; see orchestrator logs {stage})")

    def _bring_down(self, stage: str) -> None:
        if self.cfg.is_remote(stage):
            return
        info = self.sup.info(stage)
        if info.pid:
            self.report.stages[stage].see_rss(peak_rss_mb(info.pid))
            self.report.memory.add(stage, self.report.since_start(), current_rss_mb(info.pid))   # its last look
        self._sampling.discard(stage)
        try:
            self.sup.stop(stage, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
        except SupervisorError as e:
            raise StageFailed(stage, f"could not stop: {e}") from None

    def _stop_quietly(self) -> None:
        for stage in ON_DEMAND_STAGES:
            if not self.cfg.is_remote(stage):
                try:
                    self.sup.stop(stage, timeout_s=self.settings.stop_timeout_s, sleep=self.d.pump)
                except SupervisorError as e:
                    log.warning("could not stop %s: %s", stage, e)

    # ------------------------------------------------------------ requests with death detection

    def _call(self, stage: str, msg: m.Message, timeout_s: float) -> m.Message:
        """Send one request; a stage that dies meanwhile is waited for and asked again (bounded), then StageFailed."""
        deaths, busy_since, last_error = 0, None, ""
        while True:
            self._check_cancel()
            self._arm(stage)
            pid0 = self._watch[1]
            try:
                reply = self.d.link(stage).request(msg, timeout_s=timeout_s, retries=0, should_stop=self._abort,
                                                   idle=self.d.idle)
            except PeerUnavailable as e:
                self._check_cancel()
                last_error, dead = self._died or str(e), self._died is not None
                reply = None
            finally:
                self._watch = None
            if isinstance(reply, m.Error) and reply.code == "busy":
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since > timeout_s:   # e.g. still serving a dead orchestrator's request
                    raise StageFailed(stage, f"busy for {timeout_s:.0f} s: {reply.message}")
                self.d.pump(BUSY_RETRY_S)
                continue
            if isinstance(reply, m.Error) and reply.code == "cancelled" and self.job.id in self.d.cancel_requests:
                raise Cancelled()
            if reply is None or (isinstance(reply, m.Error) and reply.retry):
                if reply is not None:                # `internal` (ERROR, DYING, exit) or a retryable failure
                    last_error, dead = f"{reply.code}: {reply.message}", reply.code == "internal"
                deaths += 1
                if deaths > self.settings.stage_retries:
                    raise StageFailed(stage, f"gave up after {deaths} failed attempts; last error: {last_error}")
                log.warning("job %s: %s failed (%s); waiting for it to come back (%d/%d)", self.job.id, stage,
                            last_error, deaths, self.settings.stage_retries)
                try:
                    self._bring_up(stage, gone_pid=pid0 if dead else 0)
                except StageFailed as e:
                    raise StageFailed(stage, f"{e.message}; last error: {last_error}") from None
                continue
            if isinstance(reply, m.Error):
                raise StageFailed(stage, f"{reply.code}: {reply.message}" + (f" (field {reply.field})"
                                                                            if reply.field else ""))
            return reply

    def _arm(self, stage: str) -> None:
        pid = 0 if self.cfg.is_remote(stage) else self.sup.info(stage).pid
        self._watch, self._died = (stage, pid, time.time()), None

    def _abort(self) -> bool:
        """Polled while a request is out: cancel asked, or the stage's process is gone (supervisord / DYING)."""
        if self.d.stopping or self.job.id in self.d.cancel_requests:
            return True
        self._sample()
        return self._died is not None

    def _sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_sample < self.settings.sample_interval_s:
            return
        self._last_sample = now
        try:
            infos = self.sup.all_info()
        except SupervisorError as e:
            log.warning("supervisord sample failed: %s", e)
            return
        if self._denoising:                                   # the teardown record, read from supervisord
            self.report.teardown.sample({n: None if self.cfg.is_remote(n) else infos.get(n)
                                         for n in ON_DEMAND_STAGES})
        for stage in self._sampling:
            self._sample_one(stage, infos.get(stage))
        if self._watch is not None:
            stage, pid0, t0 = self._watch
            dying = self.d.dying.get(stage)
            if dying is not None and dying[0] >= t0:
                self._died = f"{stage} died: {dying[1].reason}"
            elif not self.cfg.is_remote(stage):
                info = infos.get(stage)
                if info is None or not info.live or (pid0 and info.pid != pid0):
                    state = "gone" if info is None else f"{info.state} {info.description}".strip()
                    self._died = f"{stage} process {pid0} is gone (supervisord: {state})"

    def _sample_one(self, stage: str, info=None) -> None:
        """One RSS look at a local stage: its peak so far and a point of the report's memory trace."""
        try:
            info = info or self.sup.info(stage)
        except SupervisorError:
            return
        if info.live:
            mb = current_rss_mb(info.pid)
            self.report.stages[stage].see_rss(mb)
            self.report.memory.add(stage, self.report.since_start(), mb)

    def _check_cancel(self) -> None:
        if self.d.stopping:
            raise Stopping()
        if self.job.id in self.d.cancel_requests:
            link = self.d.links.get("scheduler")
            if self._denoising and link is not None:
                try:
                    link.request(m.Cancel(job=self.job.id), timeout_s=2.0, retries=0)
                except PeerUnavailable:
                    pass
            raise Cancelled()
