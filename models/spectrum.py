"""Spectrum step forecasting: which steps run the model, and the Chebyshev-ridge + Taylor forecast of the CFG x0 (FP32)."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpectrumSettings:
    """Defaults as in stable-diffusion.cpp (anima-facts.md, "Spectrum")."""
    blend: float = 0.4          # w: weight of the Chebyshev forecast against the Taylor one
    degree: int = 3             # m: Chebyshev basis T0..Tm
    ridge: float = 1.0          # lambda: penalises every basis weight, T0 included
    window: float = 2.0         # initial compute window
    flex: float = 0.5           # window growth after each computed call past warm-up
    warmup: int = 4             # calls 0..warmup-1 are always computed
    stop: float = 0.9           # calls from int(stop * N) on are always computed
    history: int = 6            # FIFO length (at least degree + 1)
    tau_span: int = 50          # tau(c) = 2c / tau_span - 1, fixed whatever N

    def __post_init__(self):
        checks = {
            "blend": 0.0 <= self.blend <= 1.0, "degree": isinstance(self.degree, int) and self.degree >= 0,
            "ridge": self.ridge >= 0.0, "window": self.window >= 1.0, "flex": self.flex >= 0.0,
            "warmup": isinstance(self.warmup, int) and self.warmup >= 0, "stop": 0.0 <= self.stop <= 1.0,
            "history": isinstance(self.history, int) and self.history >= 2,
            "tau_span": isinstance(self.tau_span, int) and self.tau_span > 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid Spectrum setting {bad[0]}={getattr(self, bad[0])!r}")

    @property
    def fifo(self) -> int:
        return max(self.degree + 1, self.history)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SpectrumSettings":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown Spectrum setting(s): {sorted(unknown)}")
        return cls(**d)


@dataclass
class SpectrumState:
    """What Spectrum remembers between steps; `x0s` holds FP32 CFG x0 of the last computed calls, oldest first."""
    window: float
    cached: int = 0
    calls: list = field(default_factory=list)     # call index c of each history entry
    x0s: list = field(default_factory=list)       # [C, h, w] f32 each


def tau(c: int, span: int = 50) -> float:
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
    taus = [tau(ci, s.tau_span) for ci in st.calls]
    a = chebyshev_weights(taus, tau(c, s.tau_span), s.degree, s.ridge)          # [K]
    cheb = np.zeros_like(st.x0s[-1])                                             # [C, h, w] f32
    for ai, x0 in zip(a, st.x0s):
        cheb += ai * x0
    last, prev = st.x0s[-1], st.x0s[-2]
    taylor = last + np.float32(0.5) * (last - prev)
    w = np.float32(s.blend)
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
