"""Spectrum step forecasting: which steps run the model, and the Chebyshev-ridge + Taylor forecast of the CFG x0 (FP32)."""
import logging
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from models.sampling.bounds import STEPS
from models.base.schema import Float, Int, Record, SchemaError

log = logging.getLogger(__name__)

MAX_WARMUP = STEPS.hi           # calls: a job's most steps
# the settings' names in sampler state files of earlier releases: a job folder made by one still resumes
_OLD_NAMES = {"blend": "w", "degree": "m", "ridge": "lam"}


class SpectrumSettings(Record, frozen=True):
    """THE Spectrum settings, from prompt.json through DENOISE to the sampler: prompt.json's names and bounds
    (docs/prompts.md). Defaults as in stable-diffusion.cpp (docs/prompts.md, "Spectrum")."""

    KEY_NOUN: ClassVar[str] = "setting"
    HISTORY: ClassVar[int] = 6      # FIFO length of computed calls kept (at least m + 1)
    TAU_SPAN: ClassVar[int] = 50    # tau(c) = 2c / TAU_SPAN - 1, fixed whatever the number of steps

    enabled: bool = True
    w: Float(0.0, 1.0) = 0.4        # weight of the Chebyshev forecast against the Taylor one
    m: Int(1, 8) = 3                # Chebyshev degree: basis T0..Tm
    lam: Float(0.0, 100.0) = 1.0    # ridge penalty on every basis weight, T0 included
    window: Float(1.0, 50.0) = 2.0  # initial compute window
    flex: Float(0.0, 10.0) = 0.5    # window growth after each computed call past warm-up
    warmup: Int(0, MAX_WARMUP) = 4  # calls 0..warmup-1 are always computed
    stop: Float(hi=1.0, above=0.0) = 0.9   # calls from int(stop * N) on are always computed

    @property
    def fifo(self) -> int:
        return max(self.m + 1, self.HISTORY)

    @classmethod
    def from_dict(cls, d: dict) -> "SpectrumSettings":
        """From to_dict's form, also as earlier releases' sampler state files hold it (blend/degree/ridge, history and
        tau_span at their fixed values); ValueError (a SchemaError) naming the setting otherwise."""
        if not isinstance(d, dict):
            raise SchemaError("", f"expected a map of Spectrum settings, got {type(d).__name__}")
        d = {_OLD_NAMES.get(k, k): v for k, v in d.items()}
        for key, fixed in (("history", cls.HISTORY), ("tau_span", cls.TAU_SPAN)):
            if key in d and d.pop(key) != fixed:
                raise SchemaError(key, f"must be {fixed}")
        return cls(**d)


@dataclass
class SpectrumState:
    """What Spectrum remembers between steps; `x0s` holds FP32 CFG x0 of the last computed calls, oldest first."""
    window: float
    cached: int = 0
    calls: list = field(default_factory=list)     # call index c of each history entry
    x0s: list = field(default_factory=list)       # [C, h, w] f32 each


def tau(c: int, span: int = SpectrumSettings.TAU_SPAN) -> float:
    return 2.0 * c / span - 1.0


def new_state(s: SpectrumSettings) -> SpectrumState:
    return SpectrumState(window=float(s.window))


def should_forecast(s: SpectrumSettings, st: SpectrumState, c: int, n_steps: int) -> bool:
    """The compute/forecast rule for call c (0-based) of an n_steps run."""
    period = max(1, int(np.floor(st.window)))
    return (c >= s.warmup and c < int(s.stop * n_steps) and len(st.x0s) >= 2
            and (st.cached + 1) % period != 0)


def record_computed(s: SpectrumSettings, st: SpectrumState, c: int, x0: np.ndarray) -> None:
    st.calls.append(int(c))
    st.x0s.append(np.array(x0, dtype=np.float32, copy=True))
    if len(st.x0s) > s.fifo:
        del st.calls[0], st.x0s[0]
    if c >= s.warmup:
        st.window += s.flex
    st.cached = 0


def record_forecast(st: SpectrumState) -> None:
    st.cached += 1


def chebyshev_basis(t: np.ndarray, degree: int) -> np.ndarray:
    """T0..T_degree at points t: [K] -> [K, degree+1] f32 (recurrence T_{k+1} = 2t T_k - T_{k-1})."""
    t = np.asarray(t, dtype=np.float32).reshape(-1)
    cols = [np.ones_like(t), t]
    for _ in range(2, degree + 1):
        cols.append(np.float32(2.0) * t * cols[-1] - cols[-2])
    return np.stack(cols[:degree + 1], axis=1)


def _cholesky_solve(a: np.ndarray, b: np.ndarray):
    """Solve a·y = b for a small SPD matrix by Cholesky in float32; None if a pivot is not positive."""
    n = a.shape[0]
    low = np.zeros_like(a)
    for i in range(n):
        for j in range(i + 1):
            acc = a[i, j] - np.dot(low[i, :j], low[j, :j])
            if i == j:
                if not acc > 0.0:
                    return None
                low[i, i] = np.sqrt(acc)
            else:
                low[i, j] = acc / low[j, j]
    y = np.zeros_like(b)
    for i in range(n):                               # forward: low · y = b
        y[i] = (b[i] - np.dot(low[i, :i], y[:i])) / low[i, i]
    x = np.zeros_like(b)
    for i in reversed(range(n)):                     # backward: lowᵀ · x = y
        x[i] = (y[i] - np.dot(low[i + 1:, i], x[i + 1:])) / low[i, i]
    return x


def chebyshev_weights(taus, tau_star: float, degree: int, ridge: float) -> np.ndarray:
    """Ridge weights a = X (XᵀX + λI)⁻¹ x*: [K] f32, one per history entry (oldest first); they sum to < 1 when λ > 0."""
    xmat = chebyshev_basis(np.asarray(taus, dtype=np.float32), degree)           # X: [K, m+1]
    xstar = chebyshev_basis(np.asarray([tau_star], dtype=np.float32), degree)[0]  # x*: [m+1]
    gram = xmat.T @ xmat + np.float32(ridge) * np.eye(degree + 1, dtype=np.float32)  # [m+1, m+1]
    sol = _cholesky_solve(gram, xstar)
    if sol is None:
        jitter = np.float32(1e-4) * np.trace(gram) / np.float32(degree + 1)
        log.warning("Spectrum: Cholesky failed, adding %.3g to the diagonal", float(jitter))
        sol = _cholesky_solve(gram + jitter * np.eye(degree + 1, dtype=np.float32), xstar)
        if sol is None:
            raise FloatingPointError("Spectrum: the ridge system stays singular after the diagonal jitter")
    return (xmat @ sol).astype(np.float32)                                       # a: [K]


def forecast_x0(s: SpectrumSettings, st: SpectrumState, c: int) -> np.ndarray:
    """Forecast the CFG x0 at call c from the history: (1 - w)·taylor + w·cheb, FP32."""
    if len(st.x0s) < 2:
        raise ValueError("Spectrum: a forecast needs at least 2 computed calls in the history")
    taus = [tau(ci) for ci in st.calls]
    a = chebyshev_weights(taus, tau(c), s.m, s.lam)          # [K]
    cheb = np.zeros_like(st.x0s[-1])                                             # [C, h, w] f32
    for ai, x0 in zip(a, st.x0s):
        cheb += ai * x0
    last, prev = st.x0s[-1], st.x0s[-2]
    taylor = last + np.float32(0.5) * (last - prev)
    w = np.float32(s.w)
    return (np.float32(1.0) - w) * taylor + w * cheb


def plan(s: SpectrumSettings, n_steps: int) -> tuple:
    """(computed, forecast) 1-based step lists the rule gives for n_steps (history contents do not affect the rule)."""
    st = new_state(s)
    computed, forecast = [], []
    zero = np.zeros((1,), dtype=np.float32)
    for c in range(n_steps):
        if should_forecast(s, st, c, n_steps):
            record_forecast(st)
            forecast.append(c + 1)
        else:
            record_computed(s, st, c, zero)
            computed.append(c + 1)
    return computed, forecast
