"""The pipeline's sampler (numpy): CFG and Spectrum over the one sampler table (k_sampling.SAMPLERS) and the one scheduler
table (schedules.SCHEDULERS), as a step API a process
drives. The sampler maths is ComfyUI's (models.sampling.k_sampling, models.sampling.schedules; docs/samplers.md).

    sampler = Sampler(steps=20, cfg=4.0, scheduler="sgm_uniform", sampler="er_sde", spectrum=SpectrumSettings())
    state = sampler.init_state(initial_noise(seed, [16, h, w]), seed=seed, noise="comfy")
    while not sampler.done(state):
        if sampler.needs_model(state):                    # 1) a model call (both CFG passes) at point(state)
            x_in, sigma = sampler.point(state)
            sampler.step_computed(state, *model(x_in, sigma))      # True when it finished the step
        else:                                             # 2) Spectrum forecasts the step
            sampler.step_forecast(state)
        if sampler.between_steps(state):
            state.save(job_dir / "state.safetensors")     # 3) resumable after any finished step
    latent = sampler.result(state)
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import numpy as np

from models.sampling import k_sampling as ks
from models.sampling import spectrum as sp
from models.sampling import step_cache as sc
from models.sampling.k_sampling import SAMPLER_NAMES, SAMPLERS, SamplerInfo
from models.sampling.schedules import DEFAULT_SHIFT, SCHEDULER_NAMES, SCHEDULERS
from models.sampling.sampler_state import SamplerState, SamplerStateError
from models.sampling.spectrum import SpectrumSettings
from models.sampling.step_cache import CacheSettings

log = logging.getLogger(__name__)

SIGMA_MIN_T = 0.001            # the smallest timestep of the model's 1000-entry sigma table
DEFAULT_SAMPLER = "euler"
DEFAULT_SCHEDULER = "sgm_uniform"
PROBE_SHAPE = (16, 1, 1)       # a 1-pixel latent: the run structure a saved state is checked against

def check_names(sampler: str, scheduler: str) -> None:
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {list(SAMPLER_NAMES)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {list(SCHEDULER_NAMES)}")


def spectrum_refusal(sampler: str) -> Optional[str]:
    """Why Spectrum cannot run with `sampler` (a sentence naming it), or None when it can."""
    why = SAMPLERS[sampler].spectrum if sampler in SAMPLERS else None
    return None if why is None else f"Spectrum does not apply to sampler {sampler!r}: it makes {why}"


def make_sigmas(scheduler: str, steps: int, shift: float = DEFAULT_SHIFT, sampler: str = DEFAULT_SAMPLER) -> np.ndarray:
    """Sigmas `sampler` runs on for `schedule` and `steps`: [n + 1] f32 descending, normally ending with 0 (ComfyUI's
    KSampler.calculate_sigmas, models.sampling.k_sampling.ksampler_sigmas)."""
    check_names(sampler, scheduler)
    return ks.ksampler_sigmas(sampler, scheduler, steps, shift)


def cfg_passes(cfg: float) -> int:
    """Model passes per call: ComfyUI runs no unconditional pass at cfg 1 (math.isclose(cfg, 1.0),
    comfy/samplers.py sampling_function), so a negative prompt changes nothing there."""
    return 1 if math.isclose(float(cfg), 1.0) else 2


class Sampler:
    """A sampler + CFG over a sigma schedule, optionally with Spectrum; holds settings only, all progress lives in the
    state (models.sampling.sampler_state.SamplerState, its `run` the k_sampling step machine's)."""

    def __init__(self, steps: int = 20, cfg: float = 4.0, scheduler: str = DEFAULT_SCHEDULER,
                 shift: float = DEFAULT_SHIFT, spectrum: Optional[SpectrumSettings] = SpectrumSettings(),
                 sampler: str = DEFAULT_SAMPLER, cache: Optional[CacheSettings] = None):
        if not np.isfinite(cfg):
            raise ValueError(f"cfg must be a finite number, got {cfg!r}")
        if spectrum is not None and not isinstance(spectrum, SpectrumSettings):
            raise ValueError(f"spectrum must be SpectrumSettings or None, got {type(spectrum).__name__}")
        if spectrum is not None and not spectrum.enabled:
            spectrum = None                                                 # off: the plain baseline
        check_names(sampler, scheduler)
        if spectrum is not None and spectrum_refusal(sampler):
            raise ValueError(spectrum_refusal(sampler))
        if cache is not None and not isinstance(cache, CacheSettings):
            raise ValueError(f"cache must be CacheSettings or None, got {type(cache).__name__}")
        if cache is not None and spectrum is not None:
            raise ValueError(f"cache: {cache.node} and Spectrum both decide which model calls to skip; turn one off "
                             "(spectrum.enabled false, or no cache)")
        self.sigmas = make_sigmas(scheduler, steps, shift, sampler)          # [n + 1] f32
        self.requested = int(steps)
        self.steps = len(self.sigmas) - 1       # the steps run (beta drops repeated sigmas for many steps)
        self.cfg, self.scheduler, self.shift, self.spectrum = float(cfg), scheduler, float(shift), spectrum
        self.name = sampler
        self.passes = cfg_passes(self.cfg)
        self.cache = cache
        self._cache = None if cache is None else sc.StepCache(cache, self.shift, self.passes)
        self._machines: dict = {}

    # ---- settings --------------------------------------------------------------------------------------------------
    def settings(self) -> dict:
        return {"sampler": self.name, "steps": self.requested, "cfg": self.cfg, "scheduler": self.scheduler,
                "shift": self.shift, "spectrum": None if self.spectrum is None else self.spectrum.to_dict(),
                "cache": None if self.cache is None else self.cache.to_dict()}

    @classmethod
    def from_settings(cls, d: dict) -> "Sampler":
        """From settings(); files written before the sampler choice have no `sampler` (they ran Euler), before the
        step caches no `cache`."""
        known = {"sampler", "steps", "cfg", "scheduler", "shift", "spectrum", "cache"}
        if isinstance(d, dict) and "sampler" not in d:
            d = {**d, "sampler": DEFAULT_SAMPLER}
        if isinstance(d, dict) and "cache" not in d:
            d = {**d, "cache": None}
        if not isinstance(d, dict) or set(d) != known:
            raise ValueError(f"sampler settings must have exactly the fields {sorted(known)}, got {d!r}")
        spec = None if d["spectrum"] is None else SpectrumSettings.from_dict(d["spectrum"])
        cache = None if d["cache"] is None else CacheSettings.from_data(d["cache"], where="cache")
        return cls(steps=d["steps"], cfg=d["cfg"], scheduler=d["scheduler"], shift=d["shift"], spectrum=spec,
                   sampler=d["sampler"], cache=cache)

    @classmethod
    def from_state(cls, state: SamplerState) -> "Sampler":
        """The sampler a saved state was made by (its settings travel with it)."""
        try:
            return cls.from_settings(state.settings)
        except (TypeError, ValueError) as e:
            raise SamplerStateError(f"sampler state has unusable settings: {e}") from None

    @property
    def entry(self) -> SamplerInfo:
        return SAMPLERS[self.name]

    def nfe(self, step: int) -> int:
        """Model calls step `step` (0-based) makes when computed."""
        return self._machine(0, None).nfe(step)

    def plan(self) -> list:
        """1-based steps in the order their model calls come (a step of two calls twice); forecast steps absent."""
        computed = sp.plan(self.spectrum, self.steps)[0] if self.spectrum else range(1, self.steps + 1)
        return [s for s in computed for _ in range(self.nfe(s - 1))]

    def _machine(self, seed: Optional[int], shape) -> ks.KSampler:
        """The step machine for a seed and latent shape (the noise samplers need both)."""
        key = (seed, None if shape is None else tuple(shape))
        if key not in self._machines:
            if seed is None and self.entry.stochastic:
                raise ValueError(f"sampler {self.name!r} draws noise: it needs the job's seed")
            if shape is None and self.entry.noise == "brownian":
                shape = PROBE_SHAPE                 # nfe() only: the tree is never queried
            self._machines[key] = ks.new_ksampler(self.name, self.sigmas, seed=seed or 0, shape=shape,
                                                  shift=self.shift)
        return self._machines[key]

    def _ks(self, state: SamplerState) -> ks.KSampler:
        return self._machine(state.seed if self.entry.stochastic else None, state.latent.shape)

    # ---- state -----------------------------------------------------------------------------------------------------
    def init_state(self, latent: np.ndarray, seed: Optional[int] = None, noise: Optional[str] = None) -> SamplerState:
        """A fresh run from the job's starting noise (sigma 1): [C, h, w]; the sampler scales it by the first sigma."""
        latent = np.array(latent, dtype=np.float32, copy=True)             # [C, h, w] f32
        if latent.ndim != 3:
            raise ValueError(f"latent must be [C, h, w], got shape {latent.shape}")
        spec = None if self.spectrum is None else sp.new_state(self.spectrum)
        state = SamplerState(settings=self.settings(), step=0, latent=latent, spectrum=spec, seed=seed, noise=noise,
                             cache=None if self.cache is None else sc.CacheState())
        state.run = self._ks(state).start(latent)
        return state

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
        if (state.cache is None) != (self.cache is None):
            raise SamplerStateError("sampler state and settings disagree on the step cache")
        if state.cache is not None and len(state.cache.diffs) not in (0, self.passes if self._cache.per_pass else 1):
            raise SamplerStateError(f"sampler state's cache holds {len(state.cache.diffs)} differences")
        if self.entry.stochastic and state.seed is None:
            raise SamplerStateError(f"sampler state of {self.name!r} has no seed")
        self._check_run(state)

    def _check_run(self, state: SamplerState) -> None:
        """The run carries what this sampler's run carries at that step (names, list lengths, generator, shapes), so
        a resumed job can never fail half-way on a missing piece: compared with a fresh run on a 1-pixel latent
        stepped to the same step."""
        run, shape = state.run, state.latent.shape
        probe = self._machine(state.seed if self.entry.stochastic else None, PROBE_SHAPE)
        ref = probe.start(np.zeros(PROBE_SHAPE, np.float32))
        while ref.step < state.step:
            probe.feed(ref, np.zeros(PROBE_SHAPE, np.float32))
        want = (sorted(ref.arrays), {k: len(v) for k, v in ref.lists.items()}, sorted(ref.scalars),
                ref.gen is not None)
        got = (sorted(run.arrays), {k: len(v) for k, v in run.lists.items()}, sorted(run.scalars), run.gen is not None)
        if want != got:
            raise SamplerStateError(f"sampler state of {self.name!r} at step {state.step} carries {got}, expected "
                                    f"{want}")
        for k, v in ref.scalars.items():
            if isinstance(v, list) != isinstance(run.scalars[k], list) or \
                    (isinstance(v, list) and len(v) != len(run.scalars[k])):
                raise SamplerStateError(f"sampler state scalar {k!r} is {run.scalars[k]!r:.80}")
        for a in list(run.arrays.values()) + [a for v in run.lists.values() for a in v]:
            if a.shape != shape:
                raise SamplerStateError(f"sampler state holds an array of shape {list(a.shape)}, the latent is "
                                        f"{list(shape)}")

    def done(self, state: SamplerState) -> bool:
        return state.step >= self.steps

    def between_steps(self, state: SamplerState) -> bool:
        """True when no step is half done (a state is saved only then)."""
        return state.run.stage == 0

    def point(self, state: SamplerState) -> tuple:
        """(x_in [C, h, w] f32, sigma) where the model is evaluated next."""
        self._require_running(state)
        return self._ks(state).point(state.run)

    def sigma(self, state: SamplerState) -> float:
        """Sigma the model is evaluated at next."""
        return self.point(state)[1]

    def needs_model(self, state: SamplerState) -> bool:
        """True when the next call must run the model (both CFG passes); False when Spectrum forecasts the step."""
        self._require_running(state)
        if self.spectrum is None or state.run.stage > 0:
            return True
        return not sp.should_forecast(self.spectrum, state.spectrum, state.step, self.steps)

    def reuses(self, state: SamplerState) -> bool:
        """True when the step cache reuses the next model call (no model run: call step_reused); the cache's
        figures move once per call, so asking twice gives the same answer."""
        if self._cache is None:
            return False
        self._require_running(state)
        x_in, sigma = self.point(state)
        return self._cache.decide(state.cache, (state.step, state.run.stage), x_in, sigma)

    def step_reused(self, state: SamplerState) -> bool:
        """Feed the next model call from the step cache (reuses(state) was True). Returns True when that call
        finished the step."""
        if not self.reuses(state):
            raise RuntimeError(f"step {state.step + 1}: the step cache does not reuse this call; call step_computed")
        x_in, sigma = self.point(state)
        outs = self._cache.reused_outputs(state.cache, x_in, sigma)
        state.step_reused += 1
        if self._cache.per_pass:                     # the passes' velocities, combined as computed ones are
            return self._fed(state, *self._cfg_pair(outs[0], outs[-1]), reused=True)
        step, calls = state.step, state.run.stage + 1
        self._ks(state).feed(state.run, outs[0])     # lazycache: the CFG denoised latent itself
        return self._finish(state, step, calls)

    def _cfg_pair(self, v_cond, v_uncond):
        """(v_cond, v_uncond) for the step machine: at cfg 1 the one pass stands for both, so the CFG mix
        uncond + (cond - uncond)·1 is the conditional result exactly (ComfyUI's cfg-1 result)."""
        return (v_cond, v_cond) if self.passes == 1 else (v_cond, v_uncond)

    def step_computed(self, state: SamplerState, v_cond: np.ndarray, v_uncond: Optional[np.ndarray] = None) -> bool:
        """One model call's conditional and unconditional velocities at point(state): [C, h, w] each (at cfg 1 the
        conditional one only: a v_uncond given is not used). Returns True when that call finished the step."""
        if not self.needs_model(state):
            raise RuntimeError(f"step {state.step + 1} is a Spectrum forecast; call step_forecast")
        if self.reuses(state):
            raise RuntimeError(f"step {state.step + 1}: the step cache reuses this call; call step_reused")
        v_c = self._velocity(state, v_cond, "v_cond")
        if self.passes == 1:
            v_u = v_c
        elif v_uncond is None:
            raise ValueError(f"cfg {self.cfg} needs the unconditional pass too (v_uncond)")
        else:
            v_u = self._velocity(state, v_uncond, "v_uncond")
        return self._fed(state, v_c, v_u)

    def _fed(self, state: SamplerState, v_c, v_u, reused: bool = False) -> bool:
        step, calls = state.step, state.run.stage + 1
        x_in = None if self._cache is None else self.point(state)[0]
        x0 = self._ks(state).feed_cfg(state.run, v_c, v_u, self.cfg)     # CFG x0: [C, h, w] f32
        if self._cache is not None and not reused:
            outs = [v_c] if self.passes == 1 else [v_c, v_u]
            self._cache.record(state.cache, x_in, outs if self._cache.per_pass else [x0])
        return self._finish(state, step, calls, x0)

    def _finish(self, state: SamplerState, step: int, calls: int, x0=None) -> bool:
        """After a call: when it finished the step, the step's record (computed, its calls run and reused)."""
        if state.step == step:
            return False
        if self.spectrum is not None:
            sp.record_computed(self.spectrum, state.spectrum, step, x0)
        state.computed.append(step + 1)
        state.nfe.append(calls - state.step_reused)
        state.skipped.append(state.step_reused)
        state.step_reused = 0
        return True

    def step_forecast(self, state: SamplerState) -> None:
        """Finish the step from Spectrum's x0 forecast, without the model."""
        if self.needs_model(state):
            raise RuntimeError(f"step {state.step + 1} needs the model; call step_computed")
        x0 = sp.forecast_x0(self.spectrum, state.spectrum, state.step)     # [C, h, w] f32
        step = state.step
        self._ks(state).feed(state.run, x0)
        sp.record_forecast(state.spectrum)
        state.forecast.append(step + 1)
        state.nfe.append(0)
        state.skipped.append(0)

    def result(self, state: SamplerState) -> np.ndarray:
        """The final latent [C, h, w] f32 (for Euler, the state's latent)."""
        return self._ks(state).result(state.run)

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
               on_step: Optional[Callable[[SamplerState], None]] = None, seed: Optional[int] = None) -> SamplerState:
        """Run to the end: `model_fn(x [C,h,w] f32, sigma float) -> (v_cond, v_uncond)`; starts from `latent` (with
        `seed` for the noise samplers) or resumes `state` (modified in place); `on_step(state)` after each finished
        step (e.g. to save it). Returns the state; result(state) is the final latent."""
        if (latent is None) == (state is None):
            raise ValueError("give exactly one of latent (new run) or state (resume)")
        if state is None:
            state = self.init_state(latent, seed=seed)
        else:
            self.check_state(state)
        while not self.done(state):
            if self.reuses(state):
                finished = self.step_reused(state)
            elif self.needs_model(state):
                finished = self.step_computed(state, *model_fn(*self.point(state)))
            else:
                self.step_forecast(state)
                finished = True
            if finished and on_step is not None:
                on_step(state)
        log.info("sampled %d steps with %s: %d computed, %d forecast, %d model calls, %d reused by the step cache",
                 self.steps, self.name, len(state.computed), len(state.forecast), sum(state.nfe), sum(state.skipped))
        return state
