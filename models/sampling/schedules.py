"""Sigma schedules for Anima's rectified flow (numpy): the schedulers ComfyUI offers, as ComfyUI computes them.

The model's noise levels are a 1000-entry table, sigma_i = shift(i/1000) for i = 1..1000 with the flow time shift
shift(t) = s·t / (1 + (s - 1)·t), s = 3 (ComfyUI's ModelSamplingAuraFlow for Anima). Every schedule is descending,
[steps + 1] float32 (ComfyUI hands the samplers a float32 tensor), and ends with 0 unless noted. Facts from ComfyUI's
comfy/samplers.py (SCHEDULER_HANDLERS) and comfy/k_diffusion/sampling.py (get_sigmas_karras, get_sigmas_exponential);
quirks kept on purpose, since the point is ComfyUI's picture:
- sgm_uniform and normal space *table sigmas* linearly and shift them again (ComfyUI's timestep of a flow sigma is the
  sigma itself, multiplier 1), so their first sigma is shift(1) = 1 and the last non-zero one shift(shift(0.001)).
- karras, exponential and kl_optimal run between the table's ends sigma_min = shift(0.001) and sigma_max = 1.
- ddim_uniform starts below 1 (table entries 1 + k·(1000 // steps), reversed).
- beta uses the Beta(0.6, 0.6) quantiles of 1 - k/steps, rounded to table indices; repeated indices are dropped, so
  it can have fewer than steps + 1 entries for many steps.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

DEFAULT_SHIFT = 3.0
TABLE_SIZE = 1000


def shift_sigma(t, shift: float = DEFAULT_SHIFT):
    """Flow time shift: sigma = shift·t / (1 + (shift - 1)·t) (float64)."""
    t = np.asarray(t, dtype=np.float64)
    return shift * t / (1.0 + (shift - 1.0) * t)


def sigma_table(shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """The model's discrete sigma table, ascending: shift(i/1000) for i = 1..1000 -> [1000] f64."""
    return shift_sigma(np.arange(1, TABLE_SIZE + 1, dtype=np.float64) / TABLE_SIZE, shift)


def percent_to_sigma(percent: float, shift: float = DEFAULT_SHIFT) -> float:
    """ComfyUI's ModelSamplingDiscreteFlow.percent_to_sigma: 1 at 0 %, 0 at 100 %, else shift(1 - percent)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return float(shift_sigma(1.0 - percent, shift))


def _table_ends(shift: float) -> tuple:
    """(sigma_min, sigma_max) as ComfyUI reads them from its float32 table."""
    table = sigma_table(shift).astype(np.float32)
    return float(table[0]), float(table[-1])


def _with_zero(sig) -> np.ndarray:
    return np.concatenate([np.asarray(sig, dtype=np.float64), [0.0]])


def simple(steps: int, shift: float) -> np.ndarray:
    """Equal strides of 1000/steps down the table from its top: table[-(1 + int(k·1000/steps))], then 0."""
    table = sigma_table(shift)
    stride = TABLE_SIZE / steps
    return _with_zero([table[-(1 + int(k * stride))] for k in range(steps)])


def sgm_uniform(steps: int, shift: float) -> np.ndarray:
    """shift(linspace(table[-1], table[0], steps + 1)[:-1]), then 0."""
    table = sigma_table(shift)
    return _with_zero(shift_sigma(np.linspace(table[-1], table[0], steps + 1)[:-1], shift))


def normal(steps: int, shift: float) -> np.ndarray:
    """shift(linspace(table[-1], table[0], steps)) (the last point kept), then 0."""
    table = sigma_table(shift)
    return _with_zero(shift_sigma(np.linspace(table[-1], table[0], steps), shift))


def karras(steps: int, shift: float, rho: float = 7.0) -> np.ndarray:
    """Karras et al. (2022): (max^(1/rho) + ramp·(min^(1/rho) - max^(1/rho)))^rho over ramp = linspace(0, 1, steps)."""
    lo, hi = _table_ends(shift)
    ramp = np.linspace(0.0, 1.0, steps)
    return _with_zero((hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho)


def exponential(steps: int, shift: float) -> np.ndarray:
    """exp(linspace(log max, log min, steps)), then 0."""
    lo, hi = _table_ends(shift)
    return _with_zero(np.exp(np.linspace(math.log(hi), math.log(lo), steps)))


def ddim_uniform(steps: int, shift: float) -> np.ndarray:
    """Table entries 1, 1 + s, 1 + 2s, ... (s = max(1000 // steps, 1)) with 0 in front, reversed."""
    table = sigma_table(shift)
    sigs = [0.0] + [table[i] for i in range(1, TABLE_SIZE, max(TABLE_SIZE // steps, 1))]
    return np.asarray(sigs[::-1], dtype=np.float64)


def beta(steps: int, shift: float, alpha: float = 0.6, beta_: float = 0.6) -> np.ndarray:
    """Table entries at rint(BetaQuantile(1 - k/steps)·999), repeats dropped, then 0 (arXiv 2407.12173)."""
    table = sigma_table(shift)
    ts = np.rint(np.array([beta_ppf(1.0 - k / steps, alpha, beta_) for k in range(steps)]) * (TABLE_SIZE - 1))
    sigs, last = [], None
    for t in ts:
        if t != last:
            sigs.append(table[int(t)])
        last = t
    return _with_zero(sigs)


def linear_quadratic(steps: int, shift: float, threshold_noise: float = 0.025) -> np.ndarray:
    """Mochi's schedule: linear to threshold_noise over steps // 2, then quadratic to 1; as 1 - that, times sigma_max."""
    if steps == 1:
        return np.array([1.0, 0.0])
    linear_steps = steps // 2
    lin = [i * threshold_noise / linear_steps for i in range(linear_steps)]
    diff = linear_steps - threshold_noise * steps
    quad_steps = steps - linear_steps
    qc = diff / (linear_steps * quad_steps ** 2)
    lc = threshold_noise / linear_steps - 2 * diff / (quad_steps ** 2)
    const = qc * linear_steps ** 2
    quad = [qc * i ** 2 + lc * i + const for i in range(linear_steps, steps)]
    _, hi = _table_ends(shift)
    return np.array([1.0 - x for x in lin + quad + [1.0]]) * hi


def kl_optimal(steps: int, shift: float) -> np.ndarray:
    """tan(w·atan(min) + (1 - w)·atan(max)) over w = k/(steps - 1), then 0 (A1111 PR 15608)."""
    if steps < 2:
        raise ValueError("kl_optimal needs at least 2 steps (ComfyUI divides by steps - 1 and gets NaN for 1)")
    lo, hi = _table_ends(shift)
    w = np.arange(steps, dtype=np.float64) / (steps - 1)
    return _with_zero(np.tan(w * math.atan(lo) + (1 - w) * math.atan(hi)))


class Scheduler(NamedTuple):
    name: str
    fn: Callable[[int, float], np.ndarray]
    summary: str


SCHEDULERS = {s.name: s for s in (
    Scheduler("simple", simple, "equal strides down the model's sigma table"),
    Scheduler("sgm_uniform", sgm_uniform, "uniform in time, then the flow shift"),
    Scheduler("karras", karras, "Karras rho = 7 between the table's ends"),
    Scheduler("exponential", exponential, "uniform in log sigma"),
    Scheduler("ddim_uniform", ddim_uniform, "every (1000 // steps)-th table entry"),
    Scheduler("beta", beta, "Beta(0.6, 0.6) quantiles of the table"),
    Scheduler("normal", normal, "uniform in time including the last, then the flow shift"),
    Scheduler("linear_quadratic", linear_quadratic, "Mochi's linear then quadratic"),
    Scheduler("kl_optimal", kl_optimal, "KL-optimal (tan of linear atan)"),
)}
SCHEDULER_NAMES = tuple(SCHEDULERS)


def make_sigmas(scheduler: str, steps: int, shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """The `schedule`'s sigmas for `steps` steps: [n + 1] f32, descending, normally ending with 0 (n = steps except
    for beta, see above)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {list(SCHEDULER_NAMES)}")
    return SCHEDULERS[scheduler].fn(int(steps), float(shift)).astype(np.float32)


# ---- Beta(a, b) quantile without scipy (the board has no scipy) ------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), float64."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln_front) * _betacf(b, a, 1.0 - x) / b


def beta_ppf(q: float, a: float, b: float) -> float:
    """Inverse of beta_cdf by bisection to float64 resolution (monotone, so exact up to the last bits)."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    if a == b and q == 0.5:
        return 0.5              # the symmetric median exactly: beta's steps land on rint(0.5 * 999) = 500 there
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
