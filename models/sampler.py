"""Flow-matching sampler (numpy): sigma schedules, Euler with CFG, Spectrum forecasting, as a step API a process drives.

    sampler = Sampler(steps=20, cfg=4.0, schedule="sgm_uniform", spectrum=SpectrumSettings())
    state = sampler.init_state(initial_noise(seed, [16, h, w]), seed=seed, noise="comfy")
    while not sampler.done(state):
        if sampler.needs_model(state):                    # 1) this step runs the DiT (both CFG passes)
            v_c, v_u = model(state.latent, sampler.sigma(state))
            sampler.step_computed(state, v_c, v_u)
        else:                                             # 2) Spectrum forecasts it
            sampler.step_forecast(state)
        state.save(job_dir / "state.safetensors")         # 3) resumable after any step
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from models import schedules
from models import spectrum as sp
from models.schedules import DEFAULT_SHIFT
from models.sampler_state import SamplerState, SamplerStateError
from models.spectrum import SpectrumSettings

log = logging.getLogger(__name__)

# The schedules today's Euler pipeline accepts; models.schedules computes them (and ComfyUI's others).
SCHEDULES = ("sgm_uniform", "simple")
SIGMA_MIN_T = 0.001            # the smallest timestep of the model's 1000-entry sigma table


def make_sigmas(schedule: str, steps: int, shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """Sigmas for `steps` steps, descending from 1 and ending with 0: [steps + 1] f32 (models.schedules)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    return schedules.make_sigmas(schedule, steps, shift)


class Sampler:
    """Euler + CFG over a sigma schedule, optionally with Spectrum; holds settings only, all progress lives in the state."""

    def __init__(self, steps: int = 20, cfg: float = 4.0, schedule: str = "sgm_uniform", shift: float = DEFAULT_SHIFT,
                 spectrum: Optional[SpectrumSettings] = SpectrumSettings()):
        if not np.isfinite(cfg):
            raise ValueError(f"cfg must be a finite number, got {cfg!r}")
        if spectrum is not None and not isinstance(spectrum, SpectrumSettings):
            raise ValueError(f"spectrum must be SpectrumSettings or None, got {type(spectrum).__name__}")
        if spectrum is not None and not spectrum.enabled:
            spectrum = None                                                 # off: the plain baseline
        self.sigmas = make_sigmas(schedule, steps, shift)                   # [steps + 1] f32
        self.steps, self.cfg, self.schedule, self.shift, self.spectrum = int(steps), float(cfg), schedule, float(shift), spectrum

    # ---- settings --------------------------------------------------------------------------------------------------
    def settings(self) -> dict:
        return {"steps": self.steps, "cfg": self.cfg, "schedule": self.schedule, "shift": self.shift,
                "spectrum": None if self.spectrum is None else self.spectrum.to_dict()}

    @classmethod
    def from_settings(cls, d: dict) -> "Sampler":
        known = {"steps", "cfg", "schedule", "shift", "spectrum"}
        if not isinstance(d, dict) or set(d) != known:
            raise ValueError(f"sampler settings must have exactly the fields {sorted(known)}, got {d!r}")
        spec = None if d["spectrum"] is None else SpectrumSettings.from_dict(d["spectrum"])
        return cls(steps=d["steps"], cfg=d["cfg"], schedule=d["schedule"], shift=d["shift"], spectrum=spec)

    @classmethod
    def from_state(cls, state: SamplerState) -> "Sampler":
        """The sampler a saved state was made by (its settings travel with it)."""
        try:
            return cls.from_settings(state.settings)
        except (TypeError, ValueError) as e:
            raise SamplerStateError(f"sampler state has unusable settings: {e}") from None

    # ---- state -----------------------------------------------------------------------------------------------------
    def init_state(self, latent: np.ndarray, seed: Optional[int] = None, noise: Optional[str] = None) -> SamplerState:
        """A fresh run from the starting latent x at sigma 1: [C, h, w]."""
        latent = np.array(latent, dtype=np.float32, copy=True)             # [C, h, w] f32
        if latent.ndim != 3:
            raise ValueError(f"latent must be [C, h, w], got shape {latent.shape}")
        spec = None if self.spectrum is None else sp.new_state(self.spectrum)
        return SamplerState(settings=self.settings(), step=0, latent=latent, spectrum=spec, seed=seed, noise=noise)

    def check_state(self, state: SamplerState) -> None:
        try:                                # as this code writes them (older files name Spectrum's settings otherwise)
            saved = type(self).from_settings(state.settings).settings()
        except (TypeError, ValueError):
            saved = state.settings
        if saved != self.settings():
            raise SamplerStateError(f"sampler state was made with settings {state.settings}, this sampler has "
                                    f"{self.settings()}")
        if not 0 <= state.step <= self.steps:
            raise SamplerStateError(f"sampler state step {state.step} is outside 0..{self.steps}")
        if (state.spectrum is None) != (self.spectrum is None):
            raise SamplerStateError("sampler state and settings disagree on Spectrum")

    def done(self, state: SamplerState) -> bool:
        return state.step >= self.steps

    def sigma(self, state: SamplerState) -> float:
        """Sigma the model is evaluated at for the next step."""
        self._require_running(state)
        return float(self.sigmas[state.step])

    def needs_model(self, state: SamplerState) -> bool:
        """True when the next step must run the model (both CFG passes); False when Spectrum forecasts it."""
        self._require_running(state)
        if self.spectrum is None:
            return True
        return not sp.should_forecast(self.spectrum, state.spectrum, state.step, self.steps)

    def step_computed(self, state: SamplerState, v_cond: np.ndarray, v_uncond: np.ndarray) -> None:
        """Finish the step from the model's conditional and unconditional velocities at (latent, sigma): [C, h, w] each."""
        if not self.needs_model(state):
            raise RuntimeError(f"step {state.step + 1} is a Spectrum forecast; call step_forecast")
        v_c = self._velocity(state, v_cond, "v_cond")
        v_u = self._velocity(state, v_uncond, "v_uncond")
        s0, s1 = self.sigmas[state.step], self.sigmas[state.step + 1]       # f32 scalars
        x = state.latent                                                     # [C, h, w] f32
        v = v_u + np.float32(self.cfg) * (v_c - v_u)                         # [C, h, w] f32
        if self.spectrum is not None:
            x0 = x - s0 * v                                                  # CFG x0: [C, h, w] f32
            sp.record_computed(self.spectrum, state.spectrum, state.step, x0)
        state.latent = x + v * (s1 - s0)
        state.computed.append(state.step + 1)
        state.step += 1

    def step_forecast(self, state: SamplerState) -> None:
        """Finish the step from Spectrum's x0 forecast, without the model."""
        if self.needs_model(state):
            raise RuntimeError(f"step {state.step + 1} needs the model; call step_computed")
        s0, s1 = self.sigmas[state.step], self.sigmas[state.step + 1]
        x = state.latent
        x0 = sp.forecast_x0(self.spectrum, state.spectrum, state.step)     # [C, h, w] f32
        v = (x - x0) / s0
        sp.record_forecast(state.spectrum)
        state.latent = x + v * (s1 - s0)
        state.forecast.append(state.step + 1)
        state.step += 1

    def _require_running(self, state: SamplerState) -> None:
        if self.done(state):
            raise RuntimeError(f"sampling is finished ({self.steps} steps)")

    @staticmethod
    def _velocity(state: SamplerState, v, name: str) -> np.ndarray:
        v = np.asarray(v, dtype=np.float32)
        if v.shape != state.latent.shape:
            raise ValueError(f"{name} has shape {v.shape}, latent is {state.latent.shape}")
        if not np.isfinite(v).all():
            raise FloatingPointError(f"{name} at step {state.step + 1} has non-finite values")
        return v

    # ---- in-process loop -------------------------------------------------------------------------------------------
    def sample(self, model_fn: Callable, latent: Optional[np.ndarray] = None, state: Optional[SamplerState] = None,
               on_step: Optional[Callable[[SamplerState], None]] = None) -> SamplerState:
        """Run to the end: `model_fn(x [C,h,w] f32, sigma float) -> (v_cond, v_uncond)`; starts from `latent` or resumes
        `state` (modified in place); `on_step(state)` after each finished step (e.g. to save it). Returns the state."""
        if (latent is None) == (state is None):
            raise ValueError("give exactly one of latent (new run) or state (resume)")
        if state is None:
            state = self.init_state(latent)
        else:
            self.check_state(state)
        while not self.done(state):
            if self.needs_model(state):
                v_c, v_u = model_fn(state.latent, self.sigma(state))
                self.step_computed(state, v_c, v_u)
            else:
                self.step_forecast(state)
            if on_step is not None:
                on_step(state)
        log.info("sampled %d steps: %d computed, %d forecast", self.steps, len(state.computed), len(state.forecast))
        return state
