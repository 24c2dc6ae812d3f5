"""A whole denoising run in one process (sampler + DiT runner): the baseline the multi-process pipeline must equal."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from models.sampling.noise import DEFAULT_NOISE_MODE, initial_noise
from models.sampling.sampler import DEFAULT_SAMPLER, DEFAULT_SCHEDULER, Sampler
from models.sampling.sampler_state import SamplerState, SamplerStateError
from models.sampling.spectrum import SpectrumSettings
from models.sampling.step_cache import CacheSettings

log = logging.getLogger(__name__)

STATE_FILE = "sampler_state.safetensors"


def make_sampler(steps: int, cfg: float, scheduler: str = DEFAULT_SCHEDULER,
                 spectrum: Optional[SpectrumSettings] = SpectrumSettings(), sampler: str = DEFAULT_SAMPLER,
                 cache: Optional[CacheSettings] = None) -> Sampler:
    return Sampler(steps=steps, cfg=cfg, scheduler=scheduler, spectrum=spectrum, sampler=sampler, cache=cache)


def start_or_resume(sampler: Sampler, seed: int, latent_shape: tuple, job_dir=None, resume: bool = True,
                    noise: str = DEFAULT_NOISE_MODE, fresh: Optional[Callable[[], SamplerState]] = None,
                    usable: Optional[Callable[[SamplerState], None]] = None) -> SamplerState:
    """The state to run from: the job folder's saved state when `resume` and a usable one exists, else fresh noise
    (or `fresh()`, e.g. a run from an init latent). `usable(state)` may refuse a saved state by raising.

    A state file that cannot be used (cut short or emptied by a power loss, or made for other settings) is not an
    error: sampling is deterministic, so starting again from step 0 gives the same result, only later."""
    path = Path(job_dir) / STATE_FILE if job_dir is not None else None
    if resume and path is not None and path.exists():
        try:
            state = SamplerState.load(path)
            sampler.check_state(state)
            if state.seed != seed or tuple(state.latent.shape) != tuple(latent_shape):
                raise SamplerStateError(f"{path}: saved for seed {state.seed} / latent {list(state.latent.shape)}, "
                                        f"this job has seed {seed} / latent {list(latent_shape)}")
            if not np.isfinite(state.latent).all():
                raise SamplerStateError(f"{path}: the saved latent holds NaN or Inf")
            if usable is not None:
                usable(state)
        except Exception as e:  # noqa: BLE001 - whatever a torn file raises, it only costs the steps done so far
            log.warning("%s is unusable (%s: %s); sampling again from step 0", path, type(e).__name__, e)
        else:
            log.info("resuming at step %d of %d from %s", state.step + 1, sampler.steps, path)
            return state
    if fresh is not None:
        return fresh()
    latent = initial_noise(seed, latent_shape, noise)                              # [C, h, w] f32
    return sampler.init_state(latent, seed=seed, noise=noise)


def save_state(state: SamplerState, job_dir) -> None:
    os.makedirs(job_dir, exist_ok=True)
    state.save(Path(job_dir) / STATE_FILE)


def model_call(runner, sampler: Sampler, x: np.ndarray, sigma: float, cond: np.ndarray, uncond: np.ndarray,
               context_rows=None) -> tuple:
    """One model call at (x, sigma): (v_cond, v_uncond) from `runner.forward_cfg` (both CFG passes per branch), or
    (v_cond, None) from the conditional pass alone when the sampler runs one pass (cfg 1)."""
    if sampler.passes == 1:
        rows = list(context_rows)[:1] if context_rows else None
        return runner.forward_passes([x], sigma, [cond], context_rows=rows)[0], None
    return runner.forward_cfg(x, sigma, cond, uncond, context_rows=context_rows)


def denoise(runner, sampler: Sampler, state: SamplerState, cond: np.ndarray, uncond: np.ndarray,
            on_step: Optional[Callable[[SamplerState], None]] = None, context_rows=None) -> SamplerState:
    """Run `state` to the end with model_call; returns the final state (sampler.result(state) is the final latent).
    context_rows: (cond, uncond) rows a long-context pack leaves unmasked (partition.context_rows)."""
    return sampler.sample(lambda x, sigma: model_call(runner, sampler, x, sigma, cond, uncond, context_rows),
                          state=state, on_step=on_step)
