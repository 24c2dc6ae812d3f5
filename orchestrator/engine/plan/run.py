"""One job run as its plan (orchestrator.engine.plan.build): its steps in the plan's order, grouped by the stage they need so
the board's memory rule holds (an on-demand stage, the encoder or the VAE, comes up once for a run of consecutive steps
that need it and goes down before any other stage's step: never up while the DiT denoises), the job's state the
phase of the step running. A resume skips the steps whose outputs are whole in the job folder: a step runs when one
of its outputs is missing or torn and a later step that runs needs it, and the steps writing what it reads run too
when their outputs are not whole (docs/plan.md)."""
from __future__ import annotations

import logging
import time

from models.dit.partition import TEXT_TOKENS
from orchestrator.engine.estimate import safe_prompts_cached
from orchestrator.engine.job_files import (COND_FILE, ENTRIES_FILE, ENTRY_FILE, HIRES_COND_FILE, HIRES_INIT_FILE,
                                           HIRES_LATENT_FILE, HIRES_TEXT_FILE, HIRES_UNCOND_FILE, INIT_ENCODED_FILE,
                                           INIT_LATENT_FILE, JOB_FILES, LATENT_FILE, MIX_ENCODED_FILE,
                                           MIXED_LATENT_FILE, REPORT_FILE, TEXT_FILE, TIMING_FILE, UNCOND_FILE, names)
from orchestrator.engine.job_record import STAGES
from orchestrator.engine.plan.build import build_plan
from orchestrator.engine.plan.checks import JobChecks
from orchestrator.engine.plan.deliver import DeliverStep
from orchestrator.engine.plan.denoise import DenoiseSteps
from orchestrator.engine.plan.encode import TextSteps
from orchestrator.engine.plan.entries import EntrySteps
from orchestrator.engine.plan.job_io import load_npy, load_text
from orchestrator.engine.plan.image_ops import ImageSteps
from orchestrator.engine.plan.latent_steps import LatentSteps
from orchestrator.engine.plan.report_step import ReportStep
from orchestrator.engine.plan.steps import ENCODER, CropImage, Decode, Deliver, Denoise, EncodeImage, EncodeText, \
    HiresDenoise, MixLatent, MixStart, PixelStart, Report, Step
from orchestrator.engine.plan.vae import VaeSteps
from orchestrator.engine.report import JobReport
from orchestrator.engine.stage_control import Cancelled, StageControl, StageFailed, Stopping
from protocol.arena import Arena

log = logging.getLogger("orchestrator.engine.plan")

KIND = {n: f.name for f in JOB_FILES for n in names(f)}     # latent_1.npy -> latent.npy: the file's kind
EXECUTORS = {EncodeText: TextSteps._step_encode_text, EncodeImage: VaeSteps._step_encode_image,
             Denoise: DenoiseSteps._step_denoise, PixelStart: VaeSteps._step_pixel_start,
             HiresDenoise: DenoiseSteps._step_hires, Decode: VaeSteps._step_decode,
             MixLatent: LatentSteps._step_mix_latent, MixStart: LatentSteps._step_mix_start,
             CropImage: ImageSteps._step_crop_image, Deliver: DeliverStep._step_deliver,
             Report: ReportStep._step_report}


class PlanRunner(JobChecks, TextSteps, EntrySteps, VaeSteps, DenoiseSteps, LatentSteps, ImageSteps, DeliverStep,
                 ReportStep):
    """Runs one job to done/failed/cancelled: its plan's steps, its states and what the job records (report, job
    folder). `d` is the Daemon (sockets, store, supervisor, idle pump); `control` drives the stages."""

    def __init__(self, daemon, job):
        self.d, self.job = daemon, job
        self.store, self.cfg, self.settings = daemon.store, daemon.cfg, daemon.settings
        self.dir = self.store.job_dir(job.id)
        self.spec = job.prompt()
        self.pack = daemon.packs.get((self.spec.width, self.spec.height))     # the job's size picks its pack
        self.first_pack = self.pack                           # the first pass's (`pack` turns to the hires one)
        self.report = JobReport(job.id, job.spec)
        # the estimate (modelled, beside the measured) is priced when the report is written (_write_report): the
        # board model's search takes seconds, wasted on a job that fails before any stage. Whether its prompts are
        # in the conditioning cache is looked at now, before this job's own encode puts them there.
        self.prompts_cached = safe_prompts_cached(self.spec, self.cfg, daemon.packs)
        for name in ("encoder", "executor", "vae"):
            self.report.stages[name].remote = self.cfg.is_remote(name)
        self.report.teardown.encoder_remote = self.cfg.is_remote("encoder")
        self.report.teardown.vae_remote = self.cfg.is_remote("vae")
        self.control = StageControl(daemon, job, self.report)  # starting, stopping and calling the stages
        self.arena: Arena | None = None
        self._resume_sampling = True                          # DENOISE resume: go on from the per-step state
        self.lora_hashes: dict = {}                           # LoRA name -> A1111's short hash (the PNG's)
        self._encoder_id: str | None = None                   # cond_cache.encoder_identity, read when first needed
        self.img2img = self.spec.init_image is not None       # init_image.png (and mask.png) kept in the job folder
        self.batch = self.spec.batch                          # images run one after another, each its own DENOISE
        h = self.spec.hires                                   # hires fix: the second pass's pack, by its size
        self.hires_pack = daemon.packs.get(h.size(self.spec.width, self.spec.height)) if h is not None else None
        self.plan = build_plan(self.spec)
        self._up: set[str] = set()                            # the on-demand stages the current group brought up
        self._group, self._group_t0 = None, 0.0               # the stage of the steps running, since when
        self._phase: list | None = None                       # [state, start_s] of the phase running
        self._ran: set[Step] = set()                          # the steps this run has done (report `plan`)

    def run(self) -> None:
        job = self.job
        self.d.current = self
        try:
            # room on the job folder's disk, its packs, then the job's arena: contexts, latent, the scheduler's scratch
            self._check_disk()
            self._check_packs()
            self._make_arena()
            self._check_loras()
            self._run_plan()                 # its last step, Report, wrote report.json (or found it whole)
            self.store.transition(job.id, "done", (self.report.delivery or {}).get("note", ""),
                                  image=self.report.image, report=str(self.dir / REPORT_FILE))
        except Cancelled:
            self.control.stop_quietly()
            self.store.transition(job.id, "cancelled", "cancelled by the user")
        except StageFailed as e:
            log.error("job %s failed: %s", job.id, e)
            self.control.stop_quietly()
            if self._reached_a_stage():
                self._write_report()         # how far it got: the Report step's files, from here
            self.store.fail(job.id, e.stage, e.message)
        except Stopping:
            log.info("job %s left at %s for the next orchestrator", job.id, self.store.get(job.id).state)
        except Exception as e:  # noqa: BLE001 - a bug or an unreachable supervisord fails the job, not the daemon
            log.exception("job %s: orchestrator error", job.id)
            self.control.stop_quietly()
            self.store.fail(job.id, "orchestrator", f"{type(e).__name__}: {e}")
        finally:
            self.d.current = None
            self.d.progress.pop(job.id, None)
            if self.arena is not None:
                self.arena.close()           # the owner unlinks: no segment outlives its job
                self.arena = None

    def _reached_a_stage(self) -> bool:
        """Whether this run started or used a stage, or ran a step. A job failing before (the disk, its packs, its
        arena, a stage its preflight would not start) has its failure record in job.json and nothing more: no
        report.json, estimate or timing plot, which would show only that nothing ran."""
        return bool(self._ran or self._up or any(self.report.stage_starts.values()))

    # ------------------------------------------------------------ the plan

    def _run_plan(self) -> None:
        """The steps to run, phase by phase from the job's (a job found running: its state; a resumed one: where it
        stopped), or from an earlier phase when a step there must run again (a file it wrote was lost)."""
        todo, missing = self._steps_to_run()
        start = STAGES.index(self.job.state if self.job.active else (self.job.start_at or "encoding"))
        first = min(STAGES.index(todo[0].phase), start)
        why = ""
        if first < start:
            lost = [f for step in todo if STAGES.index(step.phase) < start for f in missing[step]]
            why = f"{', '.join(lost)} missing or unusable: {STAGES[first]} again"
            log.warning("job %s: %s", self.job.id, why)
            # encoded again: the scheduler's per-step state, saved with the old contexts, is not reused
            self._resume_sampling = STAGES[first] != "encoding"
        for phase in STAGES[first:]:
            if self.store.get(self.job.id).state != phase:
                self.store.transition(self.job.id, phase, why if phase == STAGES[first] else "")
            self.control.check_cancel()
            self._phase = [phase, round(self.report.since_start(), 3)]
            try:                             # a failed job's report shows how far each phase got
                self._run_steps([s for s in todo if s.phase == phase])
            finally:
                self._close_phase()

    def _close_phase(self) -> None:
        """The running phase's [state, start_s, end_s] into the report, once (the Report step closes its own, so the
        report it writes shows it)."""
        if self._phase is not None:
            self.report.phases.append([*self._phase, round(self.report.since_start(), 3)])
            self._phase = None

    def _steps_to_run(self) -> tuple[list[Step], dict]:
        """(the steps a resume cannot skip, in plan order; {step: its outputs not whole}). From the last step back: a
        step whose outputs that later running steps read are whole is done (what only it reads is not needed); one
        that is not runs, and so do the steps writing its inputs, by the same rule."""
        missing: dict = {}

        def need(step: Step, files: tuple[str, ...]) -> None:
            lost = [f for f in files if not self._whole(f)]
            if step in missing:              # runs already: it makes every output it has
                missing[step] += [f for f in lost if f not in missing[step]]
                return
            if step.outputs and not lost:
                return
            missing[step] = lost
            for producer in self.plan.producers(step):
                need(producer, tuple(f for f in producer.outputs if f in step.inputs))
        # the steps no other reads: Deliver (outside the job folder: always runs), then Report, which runs when its
        # files are not whole or when a step writing what it reports runs again (its record would be stale)
        for last in self._last_steps():
            if last.outputs and last not in missing and any(p in missing for p in self.plan.producers(last)):
                missing[last] = []
            need(last, last.outputs)
        return [s for s in self.plan.steps if s in missing], missing

    def _last_steps(self) -> list[Step]:
        read = {f for s in self.plan.steps for f in s.inputs}
        return [s for s in self.plan.steps if not read.intersection(s.outputs)]

    def _whole(self, name: str) -> bool:
        """A step's output in the job folder as a resume may use it: an array whole, f32, its pack's shape and
        finite; the token counts readable (a long-context pack's mask needs them); a PNG there (written atomically)."""
        first, hires, kind = self.first_pack, self.hires_pack, KIND[name]
        shapes = {COND_FILE: first.context_shape, UNCOND_FILE: first.context_shape, ENTRY_FILE: first.context_shape,
                  INIT_LATENT_FILE: first.latent_shape, LATENT_FILE: first.latent_shape,
                  MIXED_LATENT_FILE: first.latent_shape, INIT_ENCODED_FILE: first.latent_shape,
                  MIX_ENCODED_FILE: first.latent_shape}
        if hires is not None:
            shapes.update({HIRES_COND_FILE: hires.context_shape, HIRES_UNCOND_FILE: hires.context_shape,
                           HIRES_INIT_FILE: hires.latent_shape, HIRES_LATENT_FILE: hires.latent_shape})
        if kind in shapes:
            return load_npy(self.dir / name, shapes[kind]) is not None
        if kind == ENTRIES_FILE:
            return load_text(self.dir / name) is not None
        if kind == REPORT_FILE:
            return self._report_whole()
        if kind == TIMING_FILE:              # not drawn by this daemon: whole as it is
            return not self._plots() or (self.dir / name).exists()
        if kind in (TEXT_FILE, HIRES_TEXT_FILE):
            pack = first if kind == TEXT_FILE else hires
            return pack.text_tokens <= TEXT_TOKENS or load_text(self.dir / name) is not None
        return (self.dir / name).exists()

    def _run_steps(self, steps: list[Step]) -> None:
        for step in steps:
            self.control.check_cancel()
            self._open_group(step.stage)
            log.info("job %s: %s", self.job.id, step.name)
            EXECUTORS[type(step)](self, step)
            self._ran.add(step)
        self._open_group(None)

    def _open_group(self, stage: str | None) -> None:
        """Consecutive steps on one stage are a group: an on-demand stage the group brought up goes down when it ends
        (the encoder after encoding the queue's prompts ahead), before the next group's first step."""
        if stage == self._group:
            return
        if self._up:
            if ENCODER in self._up:
                self._encode_queued()        # one encoder start for the queue: its jobs' prompts into the cache
            for name in sorted(self._up):
                self.control.bring_down(name)        # stopped (and seen STOPPED) before DENOISE goes out
            self.report.stages[self._group].wall_s += time.monotonic() - self._group_t0
            self._up.clear()
        self._group, self._group_t0 = stage, time.monotonic()

    def _need_up(self, stage: str) -> None:
        """A step about to call `stage`: brought up, once for its group (report `encoder_started`)."""
        if stage not in self._up:
            self.control.bring_up(stage)
            self._up.add(stage)
            if stage == ENCODER:
                self.report.encoder_started = True
