"""Several conditionings of one CFG side, each its own model pass, mixed as ComfyUI mixes them.

ComfyUI's ConditioningCombine makes a list of conditionings; its sampler (comfy/samplers.py, calc_cond_batch) runs the
model once per entry that is active at the call's sigma and mixes the outputs weighted by each entry's strength (and
area or mask; here always the whole latent), divided by the summed weights plus 1e-37. An entry is active when
sigma_end <= sigma <= sigma_start, its window's percents turned into sigmas by the model's sampling
(percent_to_sigma; ConditioningSetTimestepRange sets them). A side with no active entry gives a denoised of zero.

ComfyUI mixes denoised outputs; the pipeline's model gives velocities (denoised = x - sigma*v, linear in v with
weights that sum to one), so the same mix of velocities gives the same denoised. The one exception is the empty mix:
denoised 0 is the velocity x / sigma.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.sampling.schedules import DEFAULT_SHIFT, shift_sigma

F32 = np.float32
COUNT_FLOOR = F32(1e-37)        # ComfyUI's out_counts start: a side with no weight divides by this, not by zero


@dataclass(frozen=True)
class CondPass:
    """One conditioning of a CFG side: its context [S, Dc] f32, its strength, its window in percent of the schedule
    (0: the start, sigma max; 1: the end, sigma 0)."""

    context: np.ndarray
    strength: float = 1.0
    start: float = 0.0
    end: float = 1.0


def percent_to_sigma(percent: float, shift: float = DEFAULT_SHIFT) -> float:
    """ComfyUI's ModelSamplingDiscreteFlow.percent_to_sigma (the Anima model's sampling, shift 3): 1 at or below 0,
    0 at or above 1, else the shifted time of 1 - percent."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return float(shift_sigma(1.0 - percent, shift))


def is_active(entry: CondPass, sigma: float, shift: float = DEFAULT_SHIFT) -> bool:
    """True when `entry` conditions a model call at `sigma` (compared in float32, as ComfyUI compares its float32
    sigma tensor with the window's Python floats). The default window [0, 1] is always active (ComfyUI sets no
    window then)."""
    s = F32(sigma)
    if entry.start > 0.0 and s > F32(percent_to_sigma(entry.start, shift)):
        return False
    if entry.end < 1.0 and s < F32(percent_to_sigma(entry.end, shift)):
        return False
    return True


def active_passes(entries, sigma: float, shift: float = DEFAULT_SHIFT) -> list[int]:
    """The indices of `entries` active at `sigma`, in order."""
    return [i for i, e in enumerate(entries) if is_active(e, sigma, shift)]


def mix(outputs, strengths, x: np.ndarray, sigma: float) -> np.ndarray:
    """The side's velocity from its active entries' velocities `outputs` and their `strengths`: sum(w v) / (sum(w) +
    1e-37), accumulated in float32 in the entries' order as ComfyUI adds them; no entry, or no weight: x / sigma
    (denoised 0)."""
    x = np.asarray(x, F32)
    acc = np.zeros_like(x)
    count = np.full_like(x, COUNT_FLOOR)
    for v, w in zip(outputs, strengths):
        mult = np.full_like(x, F32(w))
        acc += np.asarray(v, F32) * mult
        count += mult
    v = acc / count
    kept = float(count.flat[0] - COUNT_FLOOR) / float(count.flat[0])     # sum(w) / count: 1 unless ~no weight
    if kept != 1.0:               # ComfyUI divides x's share too: denoised = x * kept - sigma * v
        v = v + x * F32((1.0 - kept) / sigma)
    return v


PASSES_PER_LOAD = 2     # passes of one branch call: the job arena's scratch holds two (the CFG pair's slots)


@dataclass(frozen=True)
class Conditioning:
    """Both CFG sides as entry lists (`negative` unused by a one-pass sampler, cfg 1)."""

    positive: tuple
    negative: tuple

    def passes_at(self, sigma: float, shift: float, cfg_passes: int) -> tuple[list[int], list[int]]:
        """(positive, negative) entry indices a model call at `sigma` runs."""
        neg = active_passes(self.negative, sigma, shift) if cfg_passes > 1 else []
        return active_passes(self.positive, sigma, shift), neg

    def sweep_plan(self, sampler) -> list:
        """sampler.plan() with each call listed once per branch sweep it makes (two passes a sweep, at least one:
        the ETA's count of branch calls), each call's entries taken at its step's sigma."""
        out = []
        for step in sampler.plan():
            pos, neg = self.passes_at(float(sampler.sigmas[step - 1]), sampler.shift, sampler.passes)
            out += [step] * max(1, -(-(len(pos) + len(neg)) // PASSES_PER_LOAD))
        return out

    def call(self, runner, sampler, x: np.ndarray, sigma: float) -> tuple:
        """One model call at (x, sigma): each active entry's DiT pass (two per branch load), each side mixed ->
        (v_cond, v_uncond or None at cfg 1, passes run)."""
        pos, neg = self.passes_at(sigma, sampler.shift, sampler.passes)
        contexts = [self.positive[i].context for i in pos] + [self.negative[i].context for i in neg]
        outs = []
        for k in range(0, len(contexts), PASSES_PER_LOAD):
            chunk = contexts[k:k + PASSES_PER_LOAD]
            outs += runner.forward_passes([x] * len(chunk), sigma, chunk)
        v_c = mix(outs[:len(pos)], [self.positive[i].strength for i in pos], x, sigma)
        if sampler.passes == 1:
            return v_c, None, len(contexts)
        v_u = mix(outs[len(pos):], [self.negative[i].strength for i in neg], x, sigma)
        return v_c, v_u, len(contexts)
