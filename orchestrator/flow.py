"""One job's flow: encode (encoder up, then down) → denoise (scheduler) → decode (VAE up, then down); retries."""
from __future__ import annotations

import io
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
from orchestrator.cond_cache import CondEntry, cache_key, encoder_identity, lora_identity
from orchestrator.estimate import safe_estimate
from orchestrator.job_arena import create_job_arena
from orchestrator.job_files import (COND_FILE, HIRES_COND_FILE, HIRES_TEXT_FILE, HIRES_UNCOND_FILE, INIT_IMAGE_FILE,
                                    INIT_LATENT_FILE, MASK_FILE, REPORT_FILE, TEXT_FILE, UNCOND_FILE, batch_name)
from orchestrator.loras import LoraRefused
from orchestrator.prompt_spec import PromptSpec, output_file
from orchestrator.report import JobReport, png_metadata, text_record
from orchestrator.stage_control import Cancelled, StageControl, StageFailed, Stopping
from protocol import messages as m
from protocol.arena import Arena, segment_name
from protocol.tensors import from_inline

log = logging.getLogger(__name__)

OFF_THREAD_POLL_S = 0.05     # the daemon's clients wait at most this long more while a LoRA is read off its thread

def lora_places(layers: dict, lora_rank: int) -> dict:
    """Where a LoRA's layers ({place: count}, models.lora.targets.PLACES) are applied in the pipeline."""
    where = {"branch": f"executor: the LoRA-ready pack's low-rank inputs (rank {lora_rank}), written by the scheduler",
             "host": "scheduler: merged into FP32 copies of the pack's host weights",
             "adapter": "encoder: merged into the LLM adapter for this job",
             "te": "encoder: merged into the Qwen3 text encoder for this job"}
    return {place: where[place] for place in layers}


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


def hires_texts(spec: PromptSpec) -> tuple[str, str] | None:
    """A job's second pass's (prompt, negative) when it has its own (hires.prompt / negative_prompt), else None."""
    h = spec.hires
    if h is None:
        return None
    texts = (spec.prompt if h.prompt is None else h.prompt,
             spec.negative_prompt if h.negative_prompt is None else h.negative_prompt)
    return None if texts == (spec.prompt, spec.negative_prompt) else texts


def _prompt_pairs(spec: PromptSpec, packs: dict) -> list:
    """[(prompt, negative, pack)] a job sends the encoder: its first pass's, and its hires pass's own (a size with no
    pack is left out: that job fails on its own)."""
    out, first, texts = [], packs.get((spec.width, spec.height)), hires_texts(spec)
    if first is not None:
        out.append((spec.prompt, spec.negative_prompt, first))
    hires = packs.get(spec.hires.size(spec.width, spec.height)) if texts is not None else None
    if hires is not None:
        out.append((*texts, hires))
    return out


class JobFlow:
    """Runs one job to done/failed/cancelled: its states, their transitions and what the job records (report, job
    folder). `d` is the Daemon (sockets, store, supervisor, idle pump); `control` drives the stages."""

    def __init__(self, daemon, job):
        self.d, self.job = daemon, job
        self.store, self.cfg, self.settings = daemon.store, daemon.cfg, daemon.settings
        self.dir = self.store.job_dir(job.id)
        self.spec = job.prompt()
        self.pack = daemon.packs.get((self.spec.width, self.spec.height))     # the job's size picks its pack
        self.first_pack = self.pack                           # the first pass's (`pack` turns to the hires one)
        self.report = JobReport(job.id, job.spec)
        self.report.estimate = safe_estimate(self.spec, self.cfg, daemon.packs)    # modelled, beside the measured
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

    # ------------------------------------------------------------ the flow

    def run(self) -> None:
        job, stages = self.job, ("encoding", "denoising", "decoding")
        start = job.state if job.active else (job.start_at or "encoding")
        self.d.current = self
        try:
            # 1) room on the job folder's disk, its pack, then the job's arena: contexts, latent, the scheduler's scratch
            self._check_disk()
            self._check_packs()
            self._make_arena()
            self._check_loras()
            # resumed past encoding: what the earlier stages left in the job folder goes into the arena, or the job
            # steps back to the stage that makes it again
            start, why = self._resume_point(start)
            for state in stages[stages.index(start):]:
                if self.store.get(job.id).state != state:
                    self.store.transition(job.id, state, why if state == start else "")
                self.control.check_cancel()
                # 2) encode, 3) denoise, 4) decode
                t0 = self.report.since_start()
                try:
                    {"encoding": self._encode_all, "denoising": self._denoise, "decoding": self._decode}[state]()
                finally:                     # a failed job's report shows how far each phase got
                    self.report.phases.append([state, round(t0, 3), round(self.report.since_start(), 3)])
            self.report.finished = time.time()
            self.report.write(self.dir / REPORT_FILE)
            self._timing_plot()
            self.store.transition(job.id, "done", (self.report.delivery or {}).get("note", ""),
                                  image=self.report.image, report=str(self.dir / REPORT_FILE))
        except Cancelled:
            self.control.stop_quietly()
            self.store.transition(job.id, "cancelled", "cancelled by the user")
        except StageFailed as e:
            log.error("job %s failed: %s", job.id, e)
            self.control.stop_quietly()
            self.report.write(self.dir / REPORT_FILE)
            self._timing_plot()
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

    def _timing_plot(self) -> None:
        """timing.png next to report.json, drawn by a short child process (orchestrator.timing_plot): matplotlib's
        import and memory stay out of this long-lived daemon, which keeps serving while it runs. Best effort: a
        failure, a timeout or a daemon stop leaves the job as it is, without the picture."""
        if not self.report.phases:           # failed before any stage ran (disk, arena): nothing to draw
            return
        limit = self.settings.timing_plot_timeout_s
        if not limit:                        # turned off ([stage.orchestrator] timing_plot_timeout_s = 0)
            return
        cmd = [sys.executable, "-m", "orchestrator.timing_plot", str(self.dir / REPORT_FILE),
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

    def _check_packs(self) -> None:
        have = ", ".join(f"{w}x{h}" for w, h in self.d.packs)
        if self.pack is None:
            raise StageFailed("orchestrator", f"no model pack for {self.spec.width}x{self.spec.height} any more "
                              f"(the config changed after the job was queued); the sizes with a pack: {have}")
        if self.spec.hires is not None and self.hires_pack is None:
            w, h = self.spec.hires.size(self.spec.width, self.spec.height)
            raise StageFailed("orchestrator", f"no model pack for the hires pass's {w}x{h} any more (the config "
                              f"changed after the job was queued); the sizes with a pack: {have}")

    def _to_hires_arena(self) -> None:
        """The rest of the job on the hires pack: its own arena (contexts, init latent, latent), the first closed.
        The same pack (a second pass at the first size) keeps its arena only if it has an init latent slot (a
        text-to-image job's has none)."""
        if self.pack is self.hires_pack and self.init_latent is not None:
            return
        self.arena.close()
        self.arena, self.pack = None, self.hires_pack
        self._make_arena(init_slots=True)

    def _make_arena(self, init_slots: bool | None = None) -> None:
        # a fresh name per arena: a stage still serving a dead daemon's request for this job can never attach the
        # new arena under the old name and mix the two (its writes would land in the resumed job's latent)
        name = segment_name(self.d.rf.root, f"{self.job.id}_{secrets.token_hex(3)}")
        try:
            made = create_job_arena(name, load_pack(self.pack.dir, check=False),               # manifest only
                                    self.img2img if init_slots is None else init_slots)
        except PackError as e:
            raise StageFailed("orchestrator", f"model pack {self.pack.dir}: {e}") from None
        except Exception as e:  # ArenaError: no space, a stale segment
            raise StageFailed("orchestrator", f"cannot create the job arena: {e}") from None
        self.arena, self.cond, self.uncond, self.latent = made.arena, made.cond, made.uncond, made.latent
        self.scratch = made.scratch
        self.image_slot, self.init_latent, self.noise_mask = made.image, made.init_latent, made.noise_mask

    def _check_loras(self) -> None:
        """The job's LoRAs checked again against its pack and the encoder (a file may have changed since submit),
        and recorded: what each changes where (report.json `loras`), the hashes the PNG names them by."""
        if not self.spec.loras:
            return

        def check_and_hash() -> tuple:
            uses, plan = self.d.loras.check(self.spec.loras, self.pack.size, self.pack.lora_rank)
            return uses, plan, [lora_short_hash(u.path) for u in uses]
        try:
            uses, plan, hashes = self._off_thread(check_and_hash)
        except LoraRefused as e:
            raise StageFailed("orchestrator", f"prompt.json field '{e.field}': {e.detail}") from None
        except OSError as e:
            raise StageFailed("orchestrator", f"LoRA {self.d.loras.told(e)}") from None
        for use, rep, short in zip(uses, plan, hashes):
            self.lora_hashes[use.name] = short
            self.report.loras.append({**rep, "short_hash": self.lora_hashes[use.name],
                                      "applied_in": lora_places(rep["layers"], self.pack.lora_rank)})

    def _off_thread(self, fn):
        """fn() on the daemon's LoRA workers (reading and hashing whole files), the daemon serving its clients and
        this job's cancel meanwhile (a cancelled job leaves the worker to finish on its own)."""
        work = self.d.lora_pool.submit(fn)
        while not work.done():
            self.d.pump(OFF_THREAD_POLL_S)
            self.control.check_cancel()
        return work.result()

    # ------------------------------------------------------------ stages

    def _resume_point(self, start: str) -> tuple[str, str]:
        """(the stage to go on from, why it is earlier than `start`). Decoding needs a whole latent.npy (else the
        scheduler gives the latent again from its final step state, or samples again: deterministic); denoising needs
        whole cond.npy/uncond.npy (else they are encoded again)."""
        why = ""
        if start == "decoding":
            latents = [self._final_latent(pos) for pos in range(self.batch)]                 # [C, H/8, W/8] f32
            if all(a is not None for a in latents):
                if self.spec.hires is not None:
                    self._to_hires_arena()
                self.arena.write(self.latent, latents[0])
                return start, why
            start, why = "denoising", "a latent .npy missing or unusable: denoising again (only the images without one)"
        if start == "denoising":
            if self._load_contexts() and (self._hires_texts() is None or self._hires_contexts() is not None) and \
                    (not self.img2img or self._init_latent() is not None):
                return start, why
            start, why = "encoding", "the contexts (.npy) or init_latent.npy missing or unusable: encoding again"
            self._resume_sampling = False    # steps saved with the old contexts are not reused: sample from step 0
        if why:
            log.warning("job %s: %s", self.job.id, why)
        return start, why

    def _load_contexts(self) -> bool:
        """The job folder's contexts (and their T5 token counts) into the arena and the report; False when any is
        missing or unusable (the counts only matter to a long-context pack: they set its mask)."""
        arrays = [_load_npy(self.dir / f"{name}.npy", self.pack.context_shape) for name in ("cond", "uncond")]
        text = self._load_text(TEXT_FILE)
        if any(a is None for a in arrays) or (text is None and self.pack.text_tokens > TEXT_TOKENS):
            return False
        self.arena.write(self.cond, arrays[0])                                               # [S, Dc] f32
        self.arena.write(self.uncond, arrays[1])
        self.report.text = text or {}
        return True

    def _hires_texts(self) -> tuple[str, str] | None:
        """The second pass's (prompt, negative) when it has its own (hires.prompt / negative_prompt), else None."""
        return hires_texts(self.spec)

    def _hires_contexts(self) -> tuple | None:
        """(cond, uncond, text) of the second pass's own prompts from the job folder, or None when any is unusable."""
        arrays = [_load_npy(self.dir / f"hires_{name}.npy", self.hires_pack.context_shape)
                  for name in ("cond", "uncond")]
        text = self._load_text(HIRES_TEXT_FILE)
        if any(a is None for a in arrays) or (text is None and self.hires_pack.text_tokens > TEXT_TOKENS):
            return None
        return arrays[0], arrays[1], text or {}

    def _load_text(self, name: str) -> dict | None:
        try:
            text = json.loads((self.dir / name).read_text())
            if not isinstance(text, dict):
                raise ValueError(f"a {type(text).__name__}, not an object")
            return text
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("%s is unusable: %s", self.dir / name, e)
            return None

    def _encode_all(self) -> None:
        self._encode()
        if self.img2img:
            self._encode_image()

    def _init_latent(self) -> np.ndarray | None:
        return _load_npy(self.dir / INIT_LATENT_FILE, self.pack.latent_shape)            # [C, H/8, W/8] f32

    def _encode_image(self) -> None:
        """img2img: the kept init_image.png through the VAE stage's encoder into init_latent.npy (once: a resume
        reads the file, so the job samples from the same latent bitwise); the VAE is stopped before the denoise."""
        from orchestrator.job_inputs import image_tensor
        if self._init_latent() is not None:
            return
        t0, remote = time.monotonic(), self.cfg.is_remote("vae")
        try:
            grey = (self.dir / MASK_FILE).read_bytes() if self.spec.grow_mask_by is not None else None
            image = image_tensor((self.dir / INIT_IMAGE_FILE).read_bytes(), grey)   # [3, H, W] f32 in [-1, 1]
        except (OSError, ValueError) as e:     # removed or damaged since submit: the job cannot start from it
            raise StageFailed("orchestrator", f"the job's init image {self.dir / INIT_IMAGE_FILE} cannot be read "
                                              f"({e}); submit the job again") from None
        self.control.bring_up("vae")
        _save_npy(self.dir / INIT_LATENT_FILE, self._vae_encode(image, self.pack.latent_shape, inline=remote))
        self.control.bring_down("vae")
        self.report.stages["vae"].wall_s += time.monotonic() - t0

    def _vae_encode(self, image: np.ndarray, shape: tuple, inline: bool) -> np.ndarray:
        """VAE_ENCODE of an image [3, H, W] f32 in [-1, 1] -> its latent, checked to be `shape` and finite: through the
        arena's image and init-latent slots, or `inline` (a remote VAE; an arena of another size or without them)."""
        if inline:
            from protocol.tensors import InlineFrames
            frames = InlineFrames()
            msg = m.VaeEncode(job=self.job.id, image=frames.add(image), inline=tuple(frames.frames))
        else:
            self.arena.write(self.image_slot, image)
            msg = m.VaeEncode(job=self.job.id, image=self.image_slot, arena=self.arena.name, latent=self.init_latent)
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.VaeEncoded, "vae")
        if reply.latent.inline:
            latent = from_inline(reply.latent, reply.inline)
        elif inline or reply.latent.slot != self.init_latent.slot:
            raise StageFailed("vae", f"VAE_ENCODED points at slot {reply.latent.slot!r}, expected "
                                     f"{'an inline latent' if inline else repr(self.init_latent.slot)}")
        else:
            latent = self.arena.read(self.init_latent)
        if tuple(latent.shape) != tuple(shape) or not np.isfinite(latent).all():
            raise StageFailed("vae", f"the encoded latent is {list(latent.shape)}, expected {list(shape)} and finite")
        self.report.vae_encode_timings = dict(reply.timings)
        return np.ascontiguousarray(latent, dtype=np.float32)

    def _encode(self) -> None:
        """The job's prompts, and the second pass's own when it has them, in one encoder session (the encoder down
        before any DENOISE); what a restart finds in the job folder or the conditioning cache is not encoded again,
        and a job that needs nothing encoded starts no encoder (report `encoder_started`)."""
        t0 = time.monotonic()
        first = not self._load_contexts() and not self._first_from_cache()
        second = self._hires_texts() is not None and self._hires_contexts() is None and not self._hires_from_cache()
        if not (first or second):            # encoded before a restart, or cached: no encoder needed
            return
        self.control.bring_up("encoder")
        self.report.encoder_started = True
        if first:
            self._encode_first()
        if second:
            self._encode_hires()
        self._encode_queued()                # one encoder start for the queue: its jobs' prompts into the cache
        self.control.bring_down("encoder")   # stopped (and seen STOPPED) before DENOISE goes out
        self.report.stages["encoder"].wall_s += time.monotonic() - t0

    # ------------------------------------------------------------ the conditioning cache (orchestrator/cond_cache.py)

    def _cond_key(self, loras, prompt: str, negative: str, rows: int) -> str | None:
        """The cache key of one ENCODE, or None when it cannot be known here (cache off, a remote encoder whose
        files this machine cannot see, a file gone: then the encoder answers as before)."""
        if not self.d.cond_cache.on or self.cfg.is_remote("encoder"):
            return None
        try:
            if self._encoder_id is None:         # once per job: a file changed between jobs is a new encoder
                self._encoder_id = encoder_identity(self.cfg)
            return cache_key(prompt, negative, rows, lora_identity(loras, self.cfg.models_dir), self._encoder_id)
        except Exception as e:  # noqa: BLE001 - OSError, ModelsDirError: the encoder stage says it better
            log.info("job %s: conditioning not cached: %s", self.job.id, e)
            return None

    def _cached(self, prompt: str, negative: str, pack) -> CondEntry | None:
        key = self._cond_key(self.spec.loras, prompt, negative, pack.text_tokens)
        return None if key is None else self.d.cond_cache.get(key, pack.context_shape)

    def _first_from_cache(self) -> bool:
        entry = self._cached(self.spec.prompt, self.spec.negative_prompt, self.pack)
        if entry is None:
            return False
        self.arena.write(self.cond, entry.cond)                                              # [S, Dc] f32
        self.arena.write(self.uncond, entry.uncond)
        self._keep_first(entry)
        return True

    def _hires_from_cache(self) -> bool:
        entry = self._cached(*self._hires_texts(), self.hires_pack)
        if entry is not None:
            self._keep_hires(entry)
        return entry is not None

    def _encode_queued(self) -> None:
        """While the encoder is up: every queued job's prompts that the cache lacks, encoded into it (first pass and a
        hires pass's own). Best effort: a prompt the encoder refuses is left for its own job to report."""
        if not self.d.cond_cache.on:
            return
        for job in self.store.pending():
            if job.id == self.job.id or job.cancel_requested or job.id in self.d.cancel_requests:
                continue
            try:
                spec = job.prompt()
            except Exception:  # noqa: BLE001 - its own flow reports a prompt that no longer reads
                continue
            for prompt, negative, pack in _prompt_pairs(spec, self.d.packs):
                key = self._cond_key(spec.loras, prompt, negative, pack.text_tokens)
                if key is None or self.d.cond_cache.get(key, pack.context_shape) is not None:
                    continue
                try:
                    entry = self._encode_inline(prompt, negative, pack, spec.loras, job.id)
                except StageFailed as e:
                    log.info("job %s: queued job %s's prompts not encoded ahead: %s", self.job.id, job.id, e)
                    return
                self.d.cond_cache.put(key, entry)

    # ------------------------------------------------------------ the encoder

    def _encode_inline(self, prompt: str, negative: str, pack, loras, job_id: str) -> CondEntry:
        """One ENCODE answered inline (the rows of `pack`, which this job's arena slots may not have)."""
        msg = m.Encode(job=job_id, prompt=prompt, negative=negative, rows=pack.text_tokens, loras=loras)
        reply = m.expect(self.control.call("encoder", msg, self.settings.encode_timeout_s), m.Encoded, "encoder")
        arrays = [from_inline(d, reply.inline) if d.inline else None for d in (reply.cond, reply.uncond)]
        if any(a is None or tuple(a.shape) != tuple(pack.context_shape) for a in arrays):
            raise StageFailed("encoder", f"ENCODED for {job_id}'s prompts is not inline {list(pack.context_shape)}")
        cond, uncond = (np.ascontiguousarray(a, dtype=np.float32) for a in arrays)
        return CondEntry(cond, uncond, reply.tokens_cond, reply.tokens_uncond, reply.truncated)

    def _encode_hires(self) -> None:
        """hires.prompt / negative_prompt -> hires_cond.npy, hires_uncond.npy (inline: the hires pack's rows, which
        the first arena's slots may not have) and hires_text.json, the counts first (a resume reads all three)."""
        prompt, negative = self._hires_texts()
        entry = self._encode_inline(prompt, negative, self.hires_pack, self.spec.loras, self.job.id)
        self._keep_hires(entry)
        self._cache_put(prompt, negative, self.hires_pack, entry)

    def _keep_hires(self, entry: CondEntry) -> None:
        text = text_record(entry.tokens_cond, entry.tokens_uncond, entry.truncated, self.hires_pack.text_tokens)
        atomic_write(self.dir / HIRES_TEXT_FILE, json.dumps(text))
        _save_npy(self.dir / HIRES_COND_FILE, entry.cond)
        _save_npy(self.dir / HIRES_UNCOND_FILE, entry.uncond)

    def _cache_put(self, prompt: str, negative: str, pack, entry: CondEntry) -> None:
        key = self._cond_key(self.spec.loras, prompt, negative, pack.text_tokens)
        if key is not None:
            self.d.cond_cache.put(key, entry)

    def _encode_first(self) -> None:
        remote = self.cfg.is_remote("encoder")
        # cfg 1 everywhere: no unconditional pass reads the negative prompt's context, so it is not encoded
        negative = "" if self.spec.negative_ignored() else self.spec.negative_prompt
        msg = m.Encode(job=self.job.id, prompt=self.spec.prompt, negative=negative,
                       arena=None if remote else self.arena.name, cond=None if remote else self.cond,
                       uncond=None if remote else self.uncond, rows=self.pack.text_tokens, loras=self.spec.loras)
        reply = m.expect(self.control.call("encoder", msg, self.settings.encode_timeout_s), m.Encoded, "encoder")
        for mine, theirs in ((self.cond, reply.cond), (self.uncond, reply.uncond)):
            if theirs.inline:
                self.arena.write(mine, from_inline(theirs, reply.inline))
            elif theirs.slot != mine.slot:
                raise StageFailed("encoder", f"ENCODED points at slot {theirs.slot!r}, expected {mine.slot!r}")
        entry = CondEntry(self.arena.read(self.cond), self.arena.read(self.uncond), reply.tokens_cond,
                          reply.tokens_uncond, reply.truncated)
        self._keep_first(entry)
        self._cache_put(self.spec.prompt, self.spec.negative_prompt, self.pack, entry)
        self.report.encoder_timings = dict(reply.timings)

    def _keep_first(self, entry: CondEntry) -> None:
        """The first pass's contexts and token counts into the report and the job folder (text.json first: a resume
        reads both)."""
        self.report.text = text_record(entry.tokens_cond, entry.tokens_uncond, entry.truncated, self.pack.text_tokens)
        atomic_write(self.dir / TEXT_FILE, json.dumps(self.report.text))
        _save_npy(self.dir / COND_FILE, entry.cond)
        _save_npy(self.dir / UNCOND_FILE, entry.uncond)

    def _context_rows(self) -> tuple:
        """Per pass, the rows of ComfyUI's context a long-context pack leaves unmasked; () for a 512-row pack."""
        t, S = self.report.text, self.pack.text_tokens
        if S <= TEXT_TOKENS or "t5_tokens_prompt" not in t:
            return ()
        return (context_rows(t["t5_tokens_prompt"], S), context_rows(t["t5_tokens_negative"], S))

    def _batch_latent(self, pos: int) -> np.ndarray | None:
        """Image `pos`'s first-pass latent from the job folder (None: missing or unusable)."""
        return _load_npy(self.dir / batch_name("latent", ".npy", pos), self.first_pack.latent_shape)

    def _final_latent(self, pos: int) -> np.ndarray | None:
        """Image `pos`'s latent to decode: its second pass's with a hires fix, else its first pass's."""
        return self._batch_latent(pos) if self.spec.hires is None else self._hires_latent(pos)

    def _denoise(self) -> None:
        """Each image of the batch whose latent is not in the job folder yet: a DENOISE of its own, as its place in
        ComfyUI's batch (noise_index, batch_size/batch_pos: one randn over the batch tensor, sliced to it)."""
        for pos in range(self.batch):
            if (self.batch > 1 or self.spec.hires) and self._batch_latent(pos) is not None:   # before a restart
                continue
            self._denoise_one(pos)
        if self.batch > 1 and self.spec.hires is None:
            self.arena.write(self.latent, self._batch_latent(0))
        if self.spec.hires is not None:
            self._hires_pass()

    def _hires_latent(self, pos: int = 0) -> np.ndarray | None:
        return _load_npy(self.dir / batch_name("hires_latent", ".npy", pos), self.hires_pack.latent_shape)

    def _hires_pass(self) -> None:
        """Each image's first-pass latent (latent.npy, latent_1.npy ...) to the second pass's start, then sampled
        again from it on the hires pack (ComfyUI's second KSampler, with hires' own settings where it has them); its
        per-step state in hires/ (hires_1/ ...), its latent hires_latent.npy (hires_latent_1.npy ...): a resume goes
        on from either, and runs only the images without one."""
        firsts = [self._batch_latent(pos) for pos in range(self.batch)]
        for pos, first in enumerate(firsts):
            if first is None:
                raise StageFailed("orchestrator", f"{self.dir / batch_name('latent', '.npy', pos)} is missing or "
                                                  "unusable (resume the job)")
        todo = [pos for pos in range(self.batch) if self._hires_latent(pos) is None]
        if todo and self.spec.hires.space == "pixel":
            self._pixel_starts(firsts, todo)             # on the VAE, before the hires arena: it needs none
        self._to_hires_arena()
        if todo:
            self._hires_contexts_to_arena()
        for pos in todo:
            self._hires_one(pos, self._hires_start(pos, firsts[pos]))
        self.arena.write(self.latent, self._hires_latent(0))

    def _hires_contexts_to_arena(self) -> None:
        """The second pass's contexts into the hires arena: its own prompts' (hires_cond.npy ...), or the job's."""
        if self._hires_texts() is None:
            if not self._load_contexts():
                raise StageFailed("orchestrator", "cond.npy/uncond.npy are missing or unusable (resume the job)")
            return
        got = self._hires_contexts()
        if got is None:
            raise StageFailed("orchestrator", "hires_cond.npy/hires_uncond.npy are missing or unusable (resume the "
                                              "job)")
        self.arena.write(self.cond, got[0])                                                  # [S, Dc] f32
        self.arena.write(self.uncond, got[1])
        self.report.text = got[2]                        # the second pass's token counts set a long pack's mask

    def _hires_start(self, pos: int, first: np.ndarray) -> np.ndarray:
        """The latent the second pass of image `pos` starts from: LatentUpscale[By] of its first latent, or the pixel
        path's encoded image (hires_init.npy, made by _pixel_starts)."""
        h = self.spec.hires
        if h.space == "pixel":
            name = batch_name("hires_init", ".npy", pos)
            start = _load_npy(self.dir / name, self.pack.latent_shape)
            if start is None:
                raise StageFailed("orchestrator", f"{self.dir / name} is missing or unusable (resume the job)")
            return start
        from models.sampling.latent_ops import common_upscale
        _, lat_h, lat_w = self.pack.latent_shape
        # in VAE space, as ComfyUI's LatentUpscale sees a KSampler's LATENT (process_latent_out); only bislerp, which
        # slerps across channels, is changed by the per-channel std/mean (the others are affine per channel)
        from models.vae.latent import denormalize, normalize
        return normalize(common_upscale(denormalize(first)[None], lat_w, lat_h, h.method)[0])

    def _hires_one(self, pos: int, start: np.ndarray) -> None:
        """One image's second DENOISE: hires' steps and denoise, its sampler, scheduler, cfg and seed or the job's
        (a batch image draws its place in the seed's batch noise, as ComfyUI's second KSampler on the batch does)."""
        from models.sampling.sampler import spectrum_refusal
        from models.sampling.spectrum import SpectrumSettings
        h, s = self.spec.hires, self.spec
        sampler = h.sampler or s.sampler
        # the job's Spectrum, unless the second pass's sampler is one it does not fit (asked for: refused at submit)
        spectrum = s.spectrum if spectrum_refusal(sampler) is None else SpectrumSettings(enabled=False)
        batch = dict(noise_index=pos, batch_size=self.batch, batch_pos=pos) if self.batch > 1 else {}
        params = m.DenoiseParams(seed=s.seed if h.seed is None else h.seed, steps=h.steps or s.steps,
                                 cfg=s.cfg if h.cfg is None else h.cfg, sampler=sampler,
                                 scheduler=h.scheduler or s.scheduler, width=self.pack.width, height=self.pack.height,
                                 spectrum=spectrum, denoise=h.denoise, cache=s.cache, **batch)
        self.arena.write(self.init_latent, start)
        self._run_denoise(params, self.dir / batch_name("hires", "", pos), {"init_latent": self.init_latent},
                          batch_name("hires_latent", ".npy", pos), sampling_pass="hires")

    def _pixel_starts(self, firsts: list, todo: list) -> None:
        """The pixel path (ImageScale[By] + VAEEncode) for the images in `todo`: the first latent decoded at the first
        size (first.png, kept), scaled to the second size, encoded again (hires_init.npy, kept: a resume never encodes
        twice, so it samples from the same latent bitwise). The VAE is up for these only, down before the DENOISE."""
        from models.sampling.latent_ops import image_scale
        shape, t0 = self.hires_pack.latent_shape, time.monotonic()
        todo = [pos for pos in todo if _load_npy(self.dir / batch_name("hires_init", ".npy", pos), shape) is None]
        if not todo:
            return
        self.control.bring_up("vae")
        for pos in todo:
            pixels = self._first_image(pos, firsts[pos])                             # [H, W, 3] uint8
            unit = image_scale(pixels, self.hires_pack.width, self.hires_pack.height, self.spec.hires.method)
            # bicubic's overshoot clipped: the encoder takes [-1, 1] (ComfyUI's VAEEncode is not given it clipped)
            image = np.clip(unit, 0.0, 1.0) * np.float32(2.0) - np.float32(1.0)
            _save_npy(self.dir / batch_name("hires_init", ".npy", pos), self._vae_encode(image, shape, inline=True))
        self.control.bring_down("vae")
        self.report.stages["vae"].wall_s += time.monotonic() - t0

    def _first_image(self, pos: int, latent: np.ndarray) -> np.ndarray:
        """Image `pos`'s first pass as 8-bit pixels: first.png (first_1.png ...) when whole, else the latent decoded
        by the VAE stage (inline both ways: it is not the arena's size) and kept there."""
        from PIL import Image
        from protocol.tensors import InlineFrames
        path = self.dir / batch_name("first", ".png", pos)
        try:
            with Image.open(path) as im:
                return np.asarray(im.convert("RGB"), dtype=np.uint8)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:            # torn by a power cut: decoded again (the same pixels)
            log.warning("%s is unusable: %s", path, e)
        frames = InlineFrames()
        desc = frames.add(np.ascontiguousarray(latent, dtype=np.float32))
        msg = m.Decode(job=self.job.id, latent=desc, return_png=True, inline=tuple(frames.frames))
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.Decoded, "vae")
        if reply.png is None:
            raise StageFailed("vae", "DECODED has no PNG, which DECODE asked for (return_png)")
        data = from_inline(reply.png, reply.inline).tobytes()
        atomic_write(path, data)
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)

    def _denoise_one(self, pos: int) -> None:
        s = self.spec
        batch = dict(noise_index=pos, batch_size=self.batch, batch_pos=pos) if self.batch > 1 else {}
        params = m.DenoiseParams(seed=s.seed, steps=s.steps, cfg=s.cfg, sampler=s.sampler, scheduler=s.scheduler,
                                 width=self.pack.width, height=self.pack.height,
                                 spectrum=s.spectrum, denoise=s.denoise, cache=s.cache, start_step=s.start_step,
                                 end_step=s.end_step, add_noise=s.add_noise, leftover_noise=s.leftover_noise,
                                 latent_fill=s.latent_fill, denoise_steps=s.denoise_steps, **batch)
        state_dir = self.dir if pos == 0 else self.dir / f"batch_{pos}"      # each image's per-step sampler state
        self._run_denoise(params, state_dir, self._start_latent(), batch_name("latent", ".npy", pos))

    def _run_denoise(self, params: m.DenoiseParams, state_dir: Path, start: dict, latent_file: str,
                     sampling_pass: str = "first") -> None:
        """One DENOISE on the arena's pack: the latent back, checked, written to the job folder as `latent_file`."""
        t0 = time.monotonic()
        self.control.tear_down_on_demand()
        state_dir.mkdir(exist_ok=True)
        # the report keeps what the backend models (board-sim: the board) apart from the time measured here
        self.report.board = backend_class(self.cfg.backend).report_section(self.pack.dir,
                                                                           self.cfg.stage_settings("executor"))
        msg = m.Denoise(job=self.job.id, job_dir=str(state_dir), pack_dir=str(self.pack.dir), arena=self.arena.name,
                        params=params, cond=self.cond, uncond=self.uncond, latent=self.latent, scratch=self.scratch,
                        executor=self.cfg.endpoint("executor"), resume=self._resume_sampling,
                        context_rows=self._context_rows(), loras=self.spec.loras, **start)
        reply = self.control.denoise(msg, self.settings.denoise_timeout_s, sampling_pass)
        if reply.latent.inline:
            self.arena.write(self.latent, from_inline(reply.latent, reply.inline))
        latent = self.arena.read(self.latent)                                  # [C, H/8, W/8] f32
        if not np.isfinite(latent).all():
            raise StageFailed("scheduler", "the final latent holds NaN or Inf")
        _save_npy(self.dir / latent_file, latent)
        self.report.stages["scheduler"].wall_s += time.monotonic() - t0
        # the executor's critical path: lifecycle it could not hide plus inference (prefetched loads run beside it)
        self.report.stages["executor"].wall_s += sum(b.total_s for b in reply.branches.values())

    def _start_latent(self) -> dict:
        """img2img: DENOISE's init_latent (init_latent.npy) and noise_mask (mask.png at the latent's size, bilinear
        and repeated over the channels as ComfyUI's SetLatentNoiseMask is applied) written into their slots."""
        if not self.img2img:
            return {}
        from models.sampling.latent_ops import prepare_mask
        from orchestrator.job_inputs import mask_array
        latent = self._init_latent()
        if latent is None:
            raise StageFailed("orchestrator", f"{self.dir / INIT_LATENT_FILE} is missing or unusable (resume the "
                                              "job to encode the init image again)")
        self.arena.write(self.init_latent, latent)
        out = {"init_latent": self.init_latent}
        mask_png = self.dir / MASK_FILE
        if mask_png.exists():
            mask = prepare_mask(mask_array(mask_png.read_bytes(), self.spec.grow_mask_by),
                                (1, *self.pack.latent_shape))[0]
            self.arena.write(self.noise_mask, mask)                       # [C, H/8, W/8] f32 in [0, 1]
            out["noise_mask"] = self.noise_mask
        return out

    def _decode(self) -> None:
        """Each image of the batch to its own PNG (a batch's PNGs already written before a restart are kept)."""
        t0 = time.monotonic()                # the first latent is in the arena: denoised now, or read by _resume_point
        self.control.bring_up("vae")
        for pos in range(self.batch):
            image = self.dir / batch_name("image", ".png", pos)
            if not (self.batch > 1 and image.exists()):
                if self.batch > 1:
                    latent = self._final_latent(pos)
                    if latent is None:
                        raise StageFailed("orchestrator", f"{self.dir / self._latent_name(pos)} is missing or "
                                                          "unusable (resume the job to denoise it again)")
                    self.arena.write(self.latent, latent)
                self._decode_one(pos, image)
        self.control.bring_down("vae")
        # copied to `output` once all are decoded: a restart mid-batch finds none of its own copies in the way
        where = [self._deliver(self.dir / batch_name("image", ".png", pos), pos) for pos in range(self.batch)]
        self.report.stages["vae"].wall_s += time.monotonic() - t0
        self.report.image = where[0]
        if self.batch > 1:
            self.report.images = [{"batch_index": pos, "seed": self.spec.seed, "image": w,
                                   "latent": str(self.dir / self._latent_name(pos))}
                                  for pos, w in enumerate(where)]

    def _latent_name(self, pos: int) -> str:
        return batch_name("latent" if self.spec.hires is None else "hires_latent", ".npy", pos)

    def _decode_one(self, pos: int, image: Path) -> None:
        remote = self.cfg.is_remote("vae")
        msg = m.Decode(job=self.job.id, latent=self.latent, arena=None if remote else self.arena.name,
                       output=None if remote else str(image), return_png=remote,
                       metadata=png_metadata(self.spec, self.pack, self.job.id, self._model_names(),
                                             graph=self._client_graph(), lora_hashes=self.lora_hashes,
                                             batch_pos=pos))
        if remote:
            from protocol.tensors import InlineFrames
            frames = InlineFrames()
            desc = frames.add(self.arena.read(self.latent))
            msg = m.Decode(job=msg.job, latent=desc, arena=None, output=None, return_png=True,
                           metadata=msg.metadata, inline=tuple(frames.frames))
        reply = m.expect(self.control.call("vae", msg, self.settings.decode_timeout_s), m.Decoded, "vae")
        if reply.png is not None:
            atomic_write(image, from_inline(reply.png, reply.inline).tobytes())
        elif reply.path != str(image):
            raise StageFailed("vae", f"DECODED names {reply.path!r}, expected {image}")
        self.report.vae_timings = dict(reply.timings)

    def _client_graph(self) -> dict | None:
        """The API graph a ComfyUI client sent for this job (its node ids, titles, loader names, optional nodes), as
        ComfyUI itself would store it in the PNG; None for jobs from elsewhere (their graph is made from the job)."""
        origin = self.job.origin or {}
        graph = origin.get("graph") if origin.get("api") == "comfyui" else None
        return graph if isinstance(graph, dict) and graph else None

    def _model_names(self):
        """The loaders' file names in the PNG's ComfyUI graph: the pack's checkpoint, the text encoder's and VAE's
        (Daemon.model_files: a bundle's packs' sources, else the models folder's files)."""
        from orchestrator.comfy_graph import ModelNames
        files = self.d.model_files()
        return ModelNames(unet=tuple(filter(None, [self.pack.source_name])),
                          clip=tuple(filter(None, [files.get("text_encoder")])),
                          vae=tuple(filter(None, [files.get("vae")])))

    def _deliver(self, image: Path, pos: int = 0) -> str:
        """Copy the PNG to the prompt's `output` (a .png path, or a folder that gets JOB.png) -> where the image is.

        The copy is a file created exclusively next to the destination (atomic_write: no planted link is followed)
        and renamed over it only when the job says `overwrite`; otherwise an existing destination (a file, a link,
        anything) is kept and the job's image stays where it always is, in the job folder."""
        out = self.spec.output
        if not out:
            return str(image)
        dest = output_file(out, self.job.id)
        if pos:                              # a batch's other images next to the first: NAME_1.png ...
            dest = dest.with_name(batch_name(dest.stem, dest.suffix, pos))
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
        if pos == 0:                         # a batch's record is its first image's, unless a later one was kept
            self.report.delivery = {"output": str(dest), "written": True}
        return str(dest)
