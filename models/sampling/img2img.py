"""Sampling from a latent (img2img, inpaint, a hires pass, KSamplerAdvanced) with ComfyUI's semantics, on top of the
pipeline's Sampler.

    plan = LatentPlan(denoise=0.6)                                  # or KSamplerAdvanced's window, a noise mask
    sampler = LatentSampler(steps=20, cfg=4.0, sampler="euler_ancestral", scheduler="karras", plan=plan)
    state = sampler.start(seed, image=latent, mask=None)            # latent [C, h, w] in the model's space

then driven exactly as a Sampler (point, step_computed, step_forecast, result, save/resume).

What ComfyUI does (github.com/comfyanonymous/ComfyUI):
- the sigmas: comfy/samplers.py KSampler.set_steps (denoise) and KSampler.sample (start/end step,
  force_full_denoise), models.sampling.latent_ops.
- the start: comfy/samplers.py KSAMPLER.sample, x = model_sampling.noise_scaling(sigmas[0], noise, latent_image);
  for Anima's flow model (CONST) sigma·noise + (1 - sigma)·latent_image. KSamplerAdvanced's add_noise "disable" makes
  the noise zeros (nodes.py common_ksampler), so the start is (1 - sigma)·latent_image.
- the noise mask: comfy/samplers.py KSamplerX0Inpaint.__call__, at every model call (a two-call step too):
      x_model = x·mask + noise_scaling(sigma, noise, latent_image)·(1 - mask)
      denoised = denoised·mask + latent_image·(1 - mask)
  the sampler's own x stays unblended; nothing else is blended at the end: the last call's denoised carries the
  latent_image outside the mask, and the final step lands on it.
- the end: model_sampling.inverse_noise_scaling(sigmas[-1], x) = x / (1 - sigma_last) (k_sampling.KSampler.result),
  which matters when KSamplerAdvanced returns with leftover noise.
ComfyUI feeds the sampler process_latent_in(latent) (the model's space) unless the latent is all zeros; the pipeline's
latents are in the model's space already (models.vae.latent.normalize), so a caller converts a VAE-space LATENT once.
The image, noise and mask travel in the sampler's run (its arrays), so a state saved after any step resumes bitwise.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from models.sampling import k_sampling as ks
from models.sampling.brownian import BrownianTreeNoise
from models.sampling import latent_ops as lo
from models.sampling.k_sampling import cfg_denoised
from models.sampling.denoise import start_or_resume
from models.sampling.noise import initial_noise
from models.sampling.sampler import Sampler
from models.sampling.sampler_state import SamplerState, SamplerStateError

F32 = np.float32
IMAGE, NOISE, MASK = "inpaint_image", "inpaint_noise", "inpaint_mask"
PLAN_KEY = "latent_plan"        # the plan's place in Sampler.settings()


DENOISE_STEPS = ("comfyui", "a1111")
LATER_FIELDS = {"denoise_steps"}            # absent from states saved before it existed


@dataclass(frozen=True)
class LatentPlan:
    """How a KSampler samples from a latent. KSampler: denoise. KSamplerAdvanced: add_noise, start_step,
    last_step (end_at_step), force_full_denoise (return_with_leftover_noise "disable"). masked: the latent has a
    noise mask (SetLatentNoiseMask)."""
    denoise: float = 1.0
    start_step: Optional[int] = None
    last_step: Optional[int] = None
    force_full_denoise: bool = False
    add_noise: bool = True
    masked: bool = False
    batch_size: int = 1         # the batch ComfyUI samples as one tensor, and this image's place in it: the noise
    batch_pos: int = 0          # samplers draw over the whole batch each time (see _Batched)
    # how `denoise` counts its steps: ComfyUI's KSampler ("comfyui") or A1111's img2img ("a1111", fewer steps)
    denoise_steps: str = "comfyui"

    def __post_init__(self):
        if self.last_step is None:              # force_full_denoise only acts on an end step: one spelling of each plan
            object.__setattr__(self, "force_full_denoise", False)
        d = self.denoise
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
            raise ValueError(f"denoise must be in (0, 1], got {d!r}")
        for name, v in (("start_at_step", self.start_step), ("end_at_step", self.last_step)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 10_000):
                raise ValueError(f"{name} must be an integer in 0..10000, got {v!r}")
        for name, v, low, high in (("batch_size", self.batch_size, 1, lo.MAX_BATCH),
                                   ("batch_pos", self.batch_pos, 0, max(0, self.batch_size - 1))):
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"{name} must be an integer in {low}..{high}, got {v!r}")
        if self.denoise_steps not in DENOISE_STEPS:
            raise ValueError(f"denoise_steps must be one of {', '.join(DENOISE_STEPS)}, got {self.denoise_steps!r}")
        for name in ("force_full_denoise", "add_noise", "masked"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def advanced(cls, add_noise: bool, start_at_step: int, end_at_step: int, return_with_leftover_noise: bool,
                 masked: bool = False) -> "LatentPlan":
        """KSamplerAdvanced's options as nodes.py maps them."""
        return cls(start_step=start_at_step, last_step=end_at_step, add_noise=add_noise,
                   force_full_denoise=not return_with_leftover_noise, masked=masked)

    @property
    def plain(self) -> bool:
        """True when this plan is text-to-image's (no field differs from the defaults)."""
        return self == LatentPlan()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "LatentPlan":
        known = set(cls.__dataclass_fields__)
        if not isinstance(d, dict) or not known - LATER_FIELDS <= set(d) <= known:   # a state saved before a field
            raise ValueError(f"a latent plan has exactly the fields {sorted(known)}, got {d!r}")  # was added: its
        return cls(**d)                                                                         # default


def plan_sigmas(sampler: str, scheduler: str, steps: int, shift: float, plan: LatentPlan) -> Optional[np.ndarray]:
    """The sigmas ComfyUI samples for `plan`; None when start_step leaves no step (the latent passes unchanged)."""
    if plan.denoise_steps == "a1111":
        sig = lo.a1111_img2img_sigmas(sampler, scheduler, steps, plan.denoise, shift)
    else:
        sig = lo.denoise_sigmas(sampler, scheduler, steps, plan.denoise, shift)
    return lo.window_sigmas(sig, plan.start_step, plan.last_step, plan.force_full_denoise)


class _Inpainting:
    """A k_sampling machine seen through ComfyUI's KSamplerX0Inpaint: the model's input and output blended by the
    run's mask (IMAGE, NOISE and MASK in the run's arrays). Everything else is the machine's."""

    def __init__(self, inner: ks.KSampler):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, noise: np.ndarray, latent: Optional[np.ndarray] = None, mask: Optional[np.ndarray] = None):
        noise = np.asarray(noise, dtype=np.float32)
        image = np.zeros_like(noise) if latent is None else np.asarray(latent, dtype=np.float32)
        st = self.inner.start(noise, image)
        st.arrays[IMAGE] = image.copy()
        st.arrays[NOISE] = noise.copy()
        st.arrays[MASK] = np.zeros_like(noise) if mask is None else np.asarray(mask, dtype=np.float32).copy()
        return st

    def point(self, st) -> tuple:
        x, sigma = self.inner.point(st)
        s, m = F32(sigma), st.arrays[MASK]
        scaled = s * st.arrays[NOISE] + (F32(1.0) - s) * st.arrays[IMAGE]       # CONST noise_scaling
        return x * m + scaled * (F32(1.0) - m), sigma

    def _blend(self, st, den: np.ndarray) -> np.ndarray:
        m = st.arrays[MASK]
        return np.asarray(den, dtype=np.float32) * m + st.arrays[IMAGE] * (F32(1.0) - m)

    def feed(self, st, denoised: np.ndarray) -> None:
        self.inner.feed(st, self._blend(st, denoised))

    def feed_cfg(self, st, v_cond, v_uncond, cfg: float) -> np.ndarray:
        """CFG on the velocities at the blended point, then the blend of the denoised (Euler's velocity form does
        not apply: ComfyUI's sampler sees the blended denoised against its unblended x)."""
        x_in, sigma = self.point(st)
        if v_uncond is None:                    # one pass (cfg 1): ComfyUI's result is the conditional denoised
            raw = x_in - np.asarray(v_cond, np.float32) * F32(sigma)
        else:
            raw = cfg_denoised(x_in, sigma, v_cond, v_uncond, cfg)
        den = self._blend(st, raw)
        self.inner.feed(st, den)
        return den


class _BatchDraws:
    """A noise generator seen by image `pos` of a batch of `size`: every draw is one randn over the whole batch
    [size, ...] (ComfyUI's default_noise_sampler draws over the batch tensor), of which this image keeps its own."""

    def __init__(self, gen, pos: int, size: int):
        self.gen, self.pos, self.size = gen, pos, size

    def randn(self, shape) -> np.ndarray:
        return self.gen.randn((self.size,) + tuple(shape))[self.pos]

    def state(self) -> dict:
        return self.gen.state()


class _Batched:
    """A k_sampling machine run for one image of a batch that ComfyUI samples as one tensor: its Gaussian draws and
    its Brownian tree are the batch's (models.sampling.brownian over [size, C, h, w]), sliced to the image. The
    deterministic samplers act on each image alone, so they need nothing of this."""

    def __init__(self, inner: ks.KSampler, pos: int, size: int):
        self.inner, self.pos, self.size = inner, pos, size
        if inner._bt is not None:
            sig = inner.noise_sigmas                    # the tree's span as KSampler builds it
            tree = BrownianTreeNoise((size,) + inner.shape, float(sig[sig > 0].min()), float(sig.max()), inner.seed)
            inner._bt = lambda s, s_next: tree(s, s_next)[pos:pos + 1]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _draws(self, st):
        if st.gen is not None and not isinstance(st.gen, _BatchDraws):     # a fresh or a restored run
            st.gen = _BatchDraws(st.gen, self.pos, self.size)
        return st

    def start(self, noise, latent=None):
        return self._draws(self.inner.start(noise, latent))

    def point(self, st):
        return self.inner.point(self._draws(st))

    def feed(self, st, denoised):
        self.inner.feed(self._draws(st), denoised)

    def feed_cfg(self, st, v_cond, v_uncond, cfg):
        return self.inner.feed_cfg(self._draws(st), v_cond, v_uncond, cfg)


class LatentSampler(Sampler):
    """The pipeline's Sampler over ComfyUI's sigmas for a LatentPlan, with the noise mask blended at every model call.
    A plain plan is text-to-image exactly as Sampler runs it."""

    def __init__(self, *args, plan: Optional[LatentPlan] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_plan(plan or LatentPlan())

    def _set_plan(self, plan: LatentPlan) -> None:
        if not isinstance(plan, LatentPlan):
            raise ValueError(f"plan must be a LatentPlan, got {type(plan).__name__}")
        sig = plan_sigmas(self.name, self.scheduler, self.requested, self.shift, plan)
        if sig is None:
            raise ValueError(f"start_at_step {plan.start_step} leaves no step to sample (ComfyUI returns the latent "
                             "unchanged: see passes_through)")
        self.latent_plan = plan
        self.sigmas, self.steps = sig, len(sig) - 1
        self._machines = {}

    def settings(self) -> dict:
        return {**super().settings(), PLAN_KEY: self.latent_plan.to_dict()}

    @classmethod
    def from_settings(cls, d: dict) -> "LatentSampler":
        if not isinstance(d, dict):
            raise ValueError(f"sampler settings must be a mapping, got {d!r}")
        d = dict(d)
        plan = LatentPlan.from_dict(d.pop(PLAN_KEY, LatentPlan().to_dict()))
        s = super().from_settings(d)
        s._set_plan(plan)
        return s

    def _machine(self, seed, shape):
        key = (seed, None if shape is None else tuple(shape))
        fresh = key not in self._machines
        machine = super()._machine(seed, shape)
        plan = getattr(self, "latent_plan", None)       # None while Sampler.__init__ runs
        if fresh and plan is not None and plan.batch_size > 1 and self.entry.stochastic:
            machine = self._machines[key] = _Batched(machine, plan.batch_pos, plan.batch_size)
        if fresh and plan is not None and plan.masked:
            machine = self._machines[key] = _Inpainting(machine)
        return machine

    def start(self, seed: int, image: Optional[np.ndarray] = None, mask: Optional[np.ndarray] = None,
              noise: Optional[np.ndarray] = None, noise_mode: str = "comfy") -> SamplerState:
        """A fresh run from `image` (the latent to start from, [C, h, w] model space; None: zeros) with `seed`'s
        noise (or `noise`, e.g. a batch image's slice of latent_ops.batch_noise) and `mask` ([C, h, w] in [0, 1],
        1 where the sampler may change the latent; latent_ops.prepare_mask gives it from a pixel mask)."""
        shape = None if image is None else np.shape(image)
        if noise is None:
            if shape is None:
                raise ValueError("give the image (latent) to start from or the noise")
            noise = initial_noise(seed, shape, noise_mode)
        noise = np.asarray(noise, dtype=np.float32)
        if not self.latent_plan.add_noise:
            noise = np.zeros_like(noise)                     # add_noise "disable": ComfyUI's noise is zeros
        for name, a in (("image", image), ("mask", mask)):
            if a is not None and np.shape(a) != noise.shape:
                raise ValueError(f"{name} has shape {list(np.shape(a))}, the latent is {list(noise.shape)}")
            if a is not None and not np.isfinite(a).all():
                raise ValueError(f"{name} holds NaN or Inf")
        if (mask is not None) != self.latent_plan.masked:
            raise ValueError("a mask is given but the plan is not masked" if mask is not None else
                             "the plan is masked: give the mask")
        if mask is not None and (np.min(mask) < 0 or np.max(mask) > 1):
            raise ValueError("mask values must be within [0, 1]")
        state = self.init_state(noise, seed=seed, noise=noise_mode)
        machine = self._ks(state)
        state.run = machine.start(noise, image, mask) if self.latent_plan.masked else machine.start(noise, image)
        return state


def passes_through(sampler: str, scheduler: str, steps: int, shift: float, plan: LatentPlan) -> bool:
    """True when ComfyUI would return the latent unchanged (start_at_step at or past the last step)."""
    return plan_sigmas(sampler, scheduler, steps, shift, plan) is None


def sampler_from_settings(d: dict) -> Sampler:
    """The sampler a settings record (or a saved state's settings) describes: a LatentSampler when it has a plan."""
    if isinstance(d, dict) and PLAN_KEY in d:
        return LatentSampler.from_settings(d)
    return Sampler.from_settings(d)


def job_noise(seed: int, shape, index: int = 0) -> np.ndarray:
    """Image `index`'s starting noise in ComfyUI's batch (prepare_noise: one randn over [B, C, h, w]): [C, h, w] f32.
    Index 0 is a single image's noise."""
    return lo.batch_noise(seed, (int(index) + 1,) + tuple(shape))[int(index)]


def start_or_resume_latent(sampler: LatentSampler, seed: int, shape, job_dir=None, resume: bool = True,
                           image: Optional[np.ndarray] = None, mask: Optional[np.ndarray] = None,
                           noise_index: int = 0, fill: Optional[str] = None) -> SamplerState:
    """The job folder's saved state when usable (for a masked run: made from this image, mask and noise), else a
    fresh run from `image` (None: zeros) with image `noise_index`'s noise of the seed's batch. `fill` (A1111's
    inpainting_fill 2 / 3, with a mask): the image's masked part replaced first by that noise ("noise") or by zeros
    ("nothing"), image·(1 - mask) + noise·mask as A1111 does to its init latent."""
    shape = tuple(int(s) for s in shape)
    noise = job_noise(seed, shape, noise_index)
    start = np.zeros(shape, np.float32) if image is None else image
    if fill is not None:
        keep = start * (np.float32(1.0) - mask)
        start = (keep + noise * mask if fill == "noise" else keep).astype(np.float32)

    def usable(state: SamplerState) -> None:
        if not sampler.latent_plan.masked:
            return
        want = {IMAGE: start, MASK: mask, NOISE: noise if sampler.latent_plan.add_noise else np.zeros_like(noise)}
        for key, a in want.items():
            if not np.array_equal(state.run.arrays.get(key), a):
                raise SamplerStateError(f"the saved run's {key} is not this job's")

    return start_or_resume(sampler, seed, shape, job_dir, resume, fresh=lambda: sampler.start(
        seed, image=start, mask=mask, noise=noise), usable=usable)
