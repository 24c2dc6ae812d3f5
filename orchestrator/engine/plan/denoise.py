"""The denoiser's steps: Denoise (each image's first pass) and HiresDenoise (the hires fix's second pass on its own
pack and arena), each one DENOISE to the scheduler with the encoder and the VAE down, its latent checked and kept in
the job folder."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from models.dit.partition import TEXT_TOKENS, context_rows
from models.runtime.backends import backend_class
from orchestrator.engine.job_files import INIT_LATENT_FILE, MASK_FILE, batch_name
from orchestrator.engine.plan.job_io import load_npy, save_npy
from orchestrator.engine.stage_control import StageFailed
from protocol import messages as m
from protocol.tensors import from_inline


def _end_step(end: int | None, steps: int) -> int | None:
    """A window's end_at_step on the wire: None ("to the end") for one at or past the schedule's last step, where
    ComfyUI's KSampler.sample cuts nothing (prompt.json takes KSamplerAdvanced's 0..10000, the wire 0..1000). A
    schedule has `steps` steps whatever the denoise (A1111's count: fewer, so an end past them cuts nothing either)."""
    return None if end is None or end >= steps else end


class DenoiseSteps:
    """The denoiser's steps of a job's runner (orchestrator.engine.plan.run.PlanRunner) and the latents they keep."""

    def _to_hires_arena(self) -> None:
        """The rest of the job on the hires pack: its own arena (contexts, init latent, latent), the first closed.
        The same pack (a second pass at the first size) keeps its arena only if it has an init latent slot (a
        text-to-image job's has none)."""
        if self.pack is self.hires_pack and self.init_latent is not None:
            return
        self.arena.close()
        self.arena, self.pack = None, self.hires_pack
        self._make_arena(init_slots=True)

    def _context_rows(self) -> tuple:
        """Per pass, the rows of ComfyUI's context a long-context pack leaves unmasked; () for a 512-row pack."""
        t, S = self.report.text, self.pack.text_tokens
        if S <= TEXT_TOKENS or "t5_tokens_prompt" not in t:
            return ()
        return (context_rows(t["t5_tokens_prompt"], S), context_rows(t["t5_tokens_negative"], S))

    def _batch_latent(self, pos: int) -> np.ndarray | None:
        """Image `pos`'s first-pass latent from the job folder (None: missing or unusable)."""
        return load_npy(self.dir / batch_name("latent", ".npy", pos), self.first_pack.latent_shape)

    def _final_latent(self, pos: int) -> np.ndarray | None:
        """Image `pos`'s latent to decode: its second pass's with a hires fix, the mixed one with latent_mix, else its
        first pass's."""
        if self.spec.hires is not None:
            return self._hires_latent(pos)
        return self._batch_latent(pos) if self.spec.latent_mix is None else self._mixed_latent(pos)

    def _mixed_latent(self, pos: int) -> np.ndarray | None:
        """Image `pos`'s first latent mixed with the init latent (latent_mix's MixLatent), None: missing or unusable."""
        return load_npy(self.dir / batch_name("mixed_latent", ".npy", pos), self.first_pack.latent_shape)

    def _step_denoise(self, step) -> None:
        """Denoise: image `step.pos`'s first pass, a DENOISE of its own as its place in ComfyUI's batch (noise_index,
        batch_size/batch_pos: one randn over the batch tensor, sliced to it)."""
        if self.plan.steps[0].mixed:                    # positive/negative entries: their own contexts
            self._denoise_one(step.pos, *self._entry_conds())
            return
        if not self._load_contexts():
            raise StageFailed("orchestrator", "cond.npy/uncond.npy are missing or unusable (resume the job)")
        self._denoise_one(step.pos)

    def _hires_latent(self, pos: int = 0) -> np.ndarray | None:
        return load_npy(self.dir / batch_name("hires_latent", ".npy", pos), self.hires_pack.latent_shape)

    def _step_hires(self, step) -> None:
        """HiresDenoise: image `step.pos`'s first-pass latent (latent.npy, latent_1.npy ...; mixed_latent.npy ... with
        latent_mix) to the second pass's
        start, then sampled again from it on the hires pack (ComfyUI's second KSampler, with hires' own settings where
        it has them); its per-step state in hires/ (hires_1/ ...), its latent hires_latent.npy (hires_latent_1.npy
        ...)."""
        first = self._batch_latent(step.pos) if self.spec.latent_mix is None else self._mixed_latent(step.pos)
        if first is None:
            raise StageFailed("orchestrator", f"{self.dir / step.inputs[-1]} is missing or unusable (resume the job)")
        self._to_hires_arena()
        if self.plan.steps[0].mixed:                    # positive/negative entries: the first pass's, on this pack
            self._hires_one(step.pos, self._hires_start(step.pos, first), *self._entry_conds())
            return
        self._hires_contexts_to_arena()
        self._hires_one(step.pos, self._hires_start(step.pos, first))

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
        path's encoded image (hires_init.npy, made by PixelStart)."""
        h = self.spec.hires
        if h.space == "pixel":
            name = batch_name("hires_init", ".npy", pos)
            start = load_npy(self.dir / name, self.pack.latent_shape)
            if start is None:
                raise StageFailed("orchestrator", f"{self.dir / name} is missing or unusable (resume the job)")
            return start
        from models.sampling.latent_ops import common_upscale
        from models.vae.latent import denormalize, normalize
        _, lat_h, lat_w = self.pack.latent_shape
        # a KSampler's LATENT is in VAE space (process_latent_out) and the next KSampler takes it back
        # (process_latent_in): a chained second pass gets that round trip, as ComfyUI's does
        if not h.upscaled:
            return normalize(denormalize(first))
        # LatentUpscale sees the VAE-space LATENT; only bislerp, which slerps across channels, is changed by the
        # per-channel std/mean (the others are affine per channel)
        return normalize(common_upscale(denormalize(first)[None], lat_w, lat_h, h.method)[0])

    def _hires_one(self, pos: int, start: np.ndarray, extra: dict | None = None, inline: tuple = ()) -> None:
        """One image's second DENOISE: hires' steps and denoise, its sampler, scheduler, cfg and seed or the job's
        (a batch image draws its place in the seed's batch noise, as ComfyUI's second KSampler on the batch does)."""
        from models.sampling.sampler import spectrum_refusal
        from models.sampling.spectrum import SpectrumSettings
        h, s = self.spec.hires, self.spec
        sampler = h.sampler or s.sampler
        # the job's Spectrum, unless the second pass's sampler is one it does not fit (asked for: refused at submit)
        spectrum = s.spectrum if spectrum_refusal(sampler) is None else SpectrumSettings(enabled=False)
        # the latent path keeps ComfyUI's batch_index through KSampler and LatentUpscale; VAEEncode's latent has none
        batch = self._batch_params(pos, self.spec.batch_index if h.space != "pixel" else 0)
        params = m.DenoiseParams(seed=s.seed if h.seed is None else h.seed, steps=h.steps or s.steps,
                                 cfg=s.cfg if h.cfg is None else h.cfg, sampler=sampler,
                                 scheduler=h.scheduler or s.scheduler, width=self.pack.width, height=self.pack.height,
                                 spectrum=spectrum, denoise=h.denoise, cache=s.cache, start_step=h.start_step,
                                 end_step=_end_step(h.end_step, h.steps or s.steps), add_noise=h.add_noise,
                                 leftover_noise=h.leftover_noise, **batch)
        self.arena.write(self.init_latent, start)
        self._run_denoise(params, self.dir / batch_name("hires", "", pos), {"init_latent": self.init_latent,
                                                                            **(extra or {})},
                          batch_name("hires_latent", ".npy", pos), sampling_pass="hires", inline=inline)

    def _batch_params(self, pos: int, first: int) -> dict:
        """Image `pos`'s place in ComfyUI's batch: its noise (the draw of index first + pos: one randn over the batch,
        or past a LatentFromBatch one draw per index, the same numbers) and its slot in the batch its samplers see."""
        if self.batch == 1 and first == 0:
            return {}
        return dict(noise_index=first + pos, batch_size=self.batch, batch_pos=pos)

    def _denoise_one(self, pos: int, extra: dict | None = None, inline: tuple = ()) -> None:
        s = self.spec
        batch = self._batch_params(pos, s.batch_index)
        params = m.DenoiseParams(seed=s.seed, steps=s.steps, cfg=s.cfg, sampler=s.sampler, scheduler=s.scheduler,
                                 width=self.pack.width, height=self.pack.height,
                                 spectrum=s.spectrum, denoise=s.denoise, cache=s.cache, start_step=s.start_step,
                                 end_step=_end_step(s.end_step, s.steps), add_noise=s.add_noise,
                                 leftover_noise=s.leftover_noise,
                                 latent_fill=s.latent_fill, denoise_steps=s.denoise_steps, **batch)
        state_dir = self.dir if pos == 0 else self.dir / f"batch_{pos}"      # each image's per-step sampler state
        self._run_denoise(params, state_dir, {**self._start_latent(), **(extra or {})},
                          batch_name("latent", ".npy", pos), inline=inline)

    def _run_denoise(self, params: m.DenoiseParams, state_dir: Path, start: dict, latent_file: str,
                     sampling_pass: str = "first", inline: tuple = ()) -> None:
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
                        context_rows=self._context_rows(), loras=self.spec.loras, inline=inline, **start)
        reply = self.control.denoise(msg, self.settings.denoise_timeout_s, sampling_pass)
        if reply.latent.inline:
            self.arena.write(self.latent, from_inline(reply.latent, reply.inline))
        latent = self.arena.read(self.latent)                                  # [C, H/8, W/8] f32
        if not np.isfinite(latent).all():
            raise StageFailed("scheduler", "the final latent holds NaN or Inf")
        save_npy(self.dir / latent_file, latent)
        self.report.stages["scheduler"].wall_s += time.monotonic() - t0
        # the executor's critical path: lifecycle it could not hide plus inference (prefetched loads run beside it)
        self.report.stages["executor"].wall_s += sum(b.total_s for b in reply.branches.values())

    def _start_latent(self) -> dict:
        """img2img: DENOISE's init_latent (init_latent.npy) and noise_mask (mask.png at the latent's size, bilinear
        and repeated over the channels as ComfyUI's SetLatentNoiseMask is applied) written into their slots."""
        if not self.img2img:
            return {}
        from models.sampling.latent_ops import prepare_mask
        from orchestrator.engine.job_inputs import mask_array
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
