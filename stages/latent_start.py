"""The scheduler's run from a latent: a DENOISE whose params or tensors ask for more than text-to-image (denoise,
KSamplerAdvanced's window, an init latent, a noise mask, an image of a batch) gets models.sampling.img2img's
LatentSampler, its init latent and mask read from the job's arena and checked."""
from __future__ import annotations

import numpy as np

from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
from protocol import messages as m
from stages.base import RequestFailed
from stages.tensor_io import read_tensor

_PLAN_FIELDS = {"denoise": "params.denoise", "start_at_step": "params.start_step", "end_at_step": "params.end_step",
                "batch_pos": "params.batch_pos"}


def from_latent(msg: m.Denoise) -> bool:
    """True when the request samples from a latent (anything text-to-image's Sampler would not do)."""
    p = msg.params
    return (msg.init_latent is not None or msg.noise_mask is not None or p.denoise != 1.0 or p.start_step is not None
            or p.denoise_steps != "comfyui"
            or p.end_step is not None or not p.add_noise or p.leftover_noise or p.noise_index != 0 or p.batch_size != 1
            or p.latent_fill is not None)


def plan_of(msg: m.Denoise) -> LatentPlan:
    p = msg.params
    try:
        return LatentPlan(denoise=float(p.denoise), denoise_steps=p.denoise_steps, start_step=p.start_step,
                          last_step=p.end_step,
                          force_full_denoise=not p.leftover_noise, add_noise=p.add_noise,
                          masked=msg.noise_mask is not None, batch_size=p.batch_size, batch_pos=p.batch_pos)
    except ValueError as e:
        raise RequestFailed(str(e), code="bad_request", field=_field(str(e))) from None


def _field(text: str) -> str:
    return next((f for k, f in _PLAN_FIELDS.items() if text.startswith(k)), "params")


def _inputs(msg: m.Denoise, ctx, lat_shape: tuple) -> tuple:
    """(init latent or None, mask or None) from the arena: f32 of the latent's shape, finite, the mask in [0, 1]."""
    out = []
    for name, desc in (("init_latent", msg.init_latent), ("noise_mask", msg.noise_mask)):
        if desc is None:
            out.append(None)
            continue
        a = read_tensor(ctx, msg.arena, desc, msg.inline, field=name, dtype="f32", shape=lat_shape, copy=True)
        if not np.isfinite(a).all():
            raise RequestFailed(f"{name} holds NaN or Inf", code="bad_request", field=name)
        if name == "noise_mask" and (a.min() < 0 or a.max() > 1):
            raise RequestFailed("noise_mask values must be within [0, 1]", code="bad_request", field=name)
        out.append(a)
    return tuple(out)


def latent_sampler_and_state(msg: m.Denoise, ctx, lat_shape: tuple):
    """The job's LatentSampler and its state, fresh from the init latent or resumed from the job folder."""
    p = msg.params
    plan = plan_of(msg)
    try:
        sampler = LatentSampler(steps=p.steps, cfg=p.cfg, scheduler=p.scheduler, spectrum=p.spectrum,
                                sampler=p.sampler, cache=p.cache, plan=plan)
    except ValueError as e:                     # an unknown name, Spectrum with a sampler or a cache, no step left,
        field = ("params.start_step" if "start_at_step" in str(e) else
                 "params.denoise" if str(e).startswith("denoise") else     # a schedule past MAX_SCHEDULE_STEPS
                 "params.cache" if str(e).startswith("cache:") else "params.sampler")
        raise RequestFailed(str(e), code="bad_request", field=field) from None
    image, mask = _inputs(msg, ctx, lat_shape)
    if p.latent_fill is not None and (image is None or mask is None):
        raise RequestFailed("latent_fill needs an init_latent and a noise_mask", code="bad_request",
                            field="params.latent_fill")
    state = start_or_resume_latent(sampler, p.seed, lat_shape, msg.job_dir, msg.resume, image=image, mask=mask,
                                   noise_index=p.noise_index, fill=p.latent_fill)
    return sampler, state
