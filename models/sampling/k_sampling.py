"""ComfyUI's samplers for Anima's rectified flow (numpy), as resumable step machines.

Each sampler computes what ComfyUI's comfy/k_diffusion/sampling.py (and comfy/extra_samplers/uni_pc.py) computes for
a model whose ModelSampling is ModelSamplingAuraFlow (discrete flow, CONST, shift 3, noise_scale 1): the `_RF` and
flow-matching branches of those functions, their default options (eta 1, s_noise 1, as KSampler runs them), their
order of random draws. The model is a denoiser: `denoised = x - sigma·v` with CFG applied to the denoised values
(cfg_denoised). Driving one:

    ks = new_ksampler("er_sde", sigmas, seed=seed, shape=latent.shape)
    st = ks.start(noise)                          # noise: the job's starting noise (models.sampling.noise.comfy_noise)
    while not ks.done(st):
        x_in, sigma = ks.point(st)                # where the model must be evaluated next
        ks.feed(st, cfg_denoised(x_in, sigma, v_cond, v_uncond, cfg))
        if st.stage == 0: save(ks.state_dict(st)) # a finished step: resumable bit for bit from here
    latent = ks.result(st)

A step may need more than one model call (SAMPLERS[name].nfe); `st.step` advances when its last call is fed.
Everything that changes lives in the SamplerRun (`st`): the latent, the multistep history, the noise generator's
MT19937 position; `state_dict` / `from_state_dict` turn it into arrays and JSON scalars and back, so a run stopped
after any finished step and resumed equals the uninterrupted run bitwise.

Noise: the Gaussian samplers draw ComfyUI's default_noise_sampler on the CPU, a torch generator seeded with seed + 1,
one randn of the latent's shape per draw (models.sampling.noise.TorchCpuGenerator); the DPM++ SDE samplers draw
BrownianTreeNoiseSampler (models.sampling.brownian), entropy = seed. (A CUDA generator would give another stream: ComfyUI's
picture of a stochastic sampler is ComfyUI's on the CPU.) Scalar coefficients are computed in float64 from the
float32 sigmas and applied to float32 latents, except the linear solves of SA-Solver, done in float32 as ComfyUI does
(its Vandermonde systems are ill-conditioned enough for the precision to show).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from models.sampling.brownian import BrownianTreeNoise
from models.sampling.noise import TorchCpuGenerator
from models.sampling.schedules import DEFAULT_SHIFT, make_sigmas, percent_to_sigma

F32 = np.float32


class SamplerRunError(ValueError):
    """A sampler state that does not fit this sampler (other sampler, schedule, seed or shape) or is malformed."""


def cfg_denoised(x: np.ndarray, sigma: float, v_cond: np.ndarray, v_uncond: np.ndarray, cfg: float) -> np.ndarray:
    """ComfyUI's CFG on a flow model's velocities: each turned into denoised = x - v·sigma, then
    uncond + (cond - uncond)·cfg. All [C, h, w] f32."""
    s = F32(sigma)
    d_c = x - v_cond * s
    d_u = x - v_uncond * s
    return d_u + (d_c - d_u) * F32(cfg)


# ---- flow-matching helpers (ComfyUI's sigma_to_half_log_snr etc. for CONST) ------------------------------------------
def half_log_snr(sigma: float) -> float:
    """lambda = log((1 - sigma) / sigma) (+inf at sigma 0)."""
    if sigma <= 0.0:
        return math.inf
    if sigma >= 1.0:
        return -math.inf
    return math.log((1.0 - sigma) / sigma)


def sigma_of_half_log_snr(lam: float) -> float:
    return 1.0 / (1.0 + math.exp(lam))


def ancestral_step(sigma_from: float, sigma_to: float, eta: float = 1.0) -> tuple:
    """(sigma_down, sigma_up) of k-diffusion's get_ancestral_step."""
    if not eta:
        return sigma_to, 0.0
    up = min(sigma_to, eta * math.sqrt(sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2))
    return math.sqrt(sigma_to ** 2 - up ** 2), up


def offset_first_sigma(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """ComfyUI's offset_first_sigma_for_snr for a flow model: a first sigma >= 1 (log-SNR -inf) becomes
    percent_to_sigma(1e-4)."""
    sigmas = sigmas.copy()
    if len(sigmas) > 1 and sigmas[0] >= 1:
        sigmas[0] = F32(percent_to_sigma(1e-4, shift))
    return sigmas


# ---- the run state --------------------------------------------------------------------------------------------------
@dataclass
class SamplerRun:
    """Everything that changes while sampling. `step`: next step (0-based); `stage`: model calls already fed in it;
    `x`: the latent [C, h, w] f32; `arrays`: named f32 arrays (history, points); `lists`: named lists of arrays
    (multistep buffers); `scalars`: JSON-able numbers; `gen`: the Gaussian noise generator (None for samplers that
    draw none)."""
    step: int
    stage: int
    x: np.ndarray
    arrays: dict = field(default_factory=dict)
    lists: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)
    gen: Optional[TorchCpuGenerator] = None


def run_state(st: SamplerRun) -> tuple:
    """A run's arrays, lists, generator position (tensors, named `a.K`, `l.K.i`, `gen.K`) and its JSON part
    (scalars, list lengths), everything but the latent and the step; restore_run inverts it."""
    tensors = {f"a.{k}": v for k, v in st.arrays.items()}
    for k, lst in st.lists.items():
        tensors.update({f"l.{k}.{i}": v for i, v in enumerate(lst)})
    if st.gen is not None:
        tensors.update({f"gen.{k}": v for k, v in st.gen.state().items()})
    return tensors, {"scalars": dict(st.scalars), "lists": {k: len(v) for k, v in st.lists.items()}}


def restore_run(step: int, x: np.ndarray, tensors: dict, meta: dict, gaussian: bool) -> SamplerRun:
    """The run run_state described, at `step` with latent `x`; SamplerRunError for a malformed description."""
    try:
        arrays = {k[2:]: np.asarray(v, dtype=np.float32) for k, v in tensors.items() if k.startswith("a.")}
        lists = {k: [np.asarray(tensors[f"l.{k}.{i}"], dtype=np.float32) for i in range(n)]
                 for k, n in meta["lists"].items()}
        scalars = dict(meta["scalars"])
        gen = None
        if gaussian:
            gen = TorchCpuGenerator.from_state({"mt_key": tensors["gen.mt_key"], "mt_pos": tensors["gen.mt_pos"]})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SamplerRunError(f"sampler state is incomplete or malformed: {type(e).__name__}: {e}") from None
    return SamplerRun(step=step, stage=0, x=x, arrays=arrays, lists=lists, scalars=scalars, gen=gen)


class KSampler:
    """One sampler over one schedule; holds settings only (progress lives in SamplerRun)."""
    name = ""
    discard_penultimate = False  # ComfyUI's KSampler runs it on the schedule for steps + 1 minus its penultimate sigma
    gaussian = False            # draws default_noise_sampler noise
    brownian = False            # draws Brownian-tree noise
    offsets_first_sigma = False

    def __init__(self, sigmas, seed: int = 0, shape=None, shift: float = DEFAULT_SHIFT):
        sig = np.asarray(sigmas, dtype=np.float32).reshape(-1)
        if sig.size < 2 or not np.isfinite(sig).all() or (sig < 0).any() or (np.diff(sig) >= 0).any():
            raise ValueError(f"sigmas must be a strictly descending float32 schedule of >= 2 entries, got {sig}")
        self.noise_sigmas = sig                                   # what the noise scaling and the Brownian tree see
        self.sigmas = offset_first_sigma(sig, shift) if self.offsets_first_sigma else sig
        self.steps = len(sig) - 1
        self.seed, self.shift = int(seed), float(shift)
        self.shape = None if shape is None else tuple(int(s) for s in shape)
        self._bt = None
        if self.brownian:
            if self.shape is None:
                raise ValueError(f"{self.name} needs the latent shape for its Brownian tree")
            pos = sig[sig > 0]
            self._bt = BrownianTreeNoise((1,) + self.shape, float(pos.min()), float(sig.max()), self.seed)
        self._setup()

    # ---- the public step API -----------------------------------------------------------------------------------------
    def start(self, noise: np.ndarray, latent: Optional[np.ndarray] = None) -> SamplerRun:
        """The run from the job's noise: x = sigma_0·noise + (1 - sigma_0)·latent (ComfyUI's CONST noise_scaling;
        latent zeros for text-to-image)."""
        noise = np.asarray(noise, dtype=np.float32)
        if self.shape is not None and noise.shape != self.shape:
            raise ValueError(f"noise has shape {noise.shape}, the sampler was made for {self.shape}")
        s0 = self.noise_sigmas[0]
        lat = np.zeros_like(noise) if latent is None else np.asarray(latent, dtype=np.float32)
        x = s0 * noise + (F32(1.0) - s0) * lat
        st = SamplerRun(step=0, stage=0, x=x, gen=TorchCpuGenerator(self.seed + 1) if self.gaussian else None)
        self._init(st)
        return st

    def done(self, st: SamplerRun) -> bool:
        return st.step >= self.steps

    def point(self, st: SamplerRun) -> tuple:
        """(x_in [C, h, w] f32, sigma float) where the model is to be evaluated next."""
        if self.done(st):
            raise RuntimeError(f"{self.name}: sampling is finished ({self.steps} steps)")
        x_in, sigma = self._point(st)
        return x_in, float(F32(sigma))

    def feed(self, st: SamplerRun, denoised: np.ndarray) -> None:
        """One model result at point(st): the CFG-combined denoised latent [C, h, w] f32."""
        if self.done(st):
            raise RuntimeError(f"{self.name}: sampling is finished ({self.steps} steps)")
        den = np.asarray(denoised, dtype=np.float32)
        if den.shape != st.x.shape:
            raise ValueError(f"denoised has shape {den.shape}, latent is {st.x.shape}")
        if not np.isfinite(den).all():
            raise FloatingPointError(f"{self.name}: the model's output at step {st.step + 1} has non-finite values")
        if self._feed(st, den):
            st.step += 1
            st.stage = 0
        else:
            st.stage += 1

    def nfe(self, step: int) -> int:
        """Model calls step `step` (0-based) makes."""
        return 1

    def result(self, st: SamplerRun) -> np.ndarray:
        """The final latent (ComfyUI's inverse_noise_scaling: x / (1 - last sigma))."""
        if not self.done(st):
            raise RuntimeError(f"{self.name}: not finished (step {st.step} of {self.steps})")
        x = self._final(st)
        last = self.noise_sigmas[-1]
        return x if last == 0 else x / (F32(1.0) - last)

    def sample(self, model: Callable, noise: np.ndarray, on_step: Optional[Callable] = None) -> np.ndarray:
        """Run to the end in-process: `model(x_in, sigma) -> denoised`; `on_step(st)` after each finished step."""
        st = self.start(noise)
        while not self.done(st):
            x_in, sigma = self.point(st)
            self.feed(st, model(x_in, sigma))
            if st.stage == 0 and on_step is not None:
                on_step(st)
        return self.result(st)

    # ---- saving and resuming -------------------------------------------------------------------------------------
    def identity(self) -> dict:
        return {"sampler": self.name, "seed": self.seed, "shift": self.shift,
                "sigmas": [float(s) for s in self.noise_sigmas], "shape": None if self.shape is None else list(self.shape)}

    def state_dict(self, st: SamplerRun) -> tuple:
        """(tensors {name: array}, meta {JSON}) of a run between steps (stage 0)."""
        if st.stage != 0:
            raise SamplerRunError(f"{self.name}: a run is saved between steps, not inside step {st.step + 1}")
        tensors, meta = run_state(st)
        tensors["x"] = st.x
        return tensors, {"identity": self.identity(), "step": st.step, **meta}

    def from_state_dict(self, tensors: dict, meta: dict) -> SamplerRun:
        if meta.get("identity") != self.identity():
            raise SamplerRunError(f"sampler state was made by {meta.get('identity')}, this sampler is {self.identity()}")
        step = meta.get("step")
        if type(step) is not int or not 0 <= step <= self.steps:
            raise SamplerRunError(f"sampler state step {step!r} is outside 0..{self.steps}")
        try:
            x = np.asarray(tensors["x"], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as e:
            raise SamplerRunError(f"sampler state is incomplete or malformed: {type(e).__name__}: {e}") from None
        return restore_run(step, x, tensors, meta, self.gaussian)

    def feed_cfg(self, st: SamplerRun, v_cond: np.ndarray, v_uncond: np.ndarray, cfg: float) -> np.ndarray:
        """One model call's CFG pair of velocities at point(st) ([C, h, w] f32 each) fed as ComfyUI combines them
        (cfg_denoised); returns that denoised (Spectrum's x0 of the call)."""
        x_in, sigma = self.point(st)
        den = cfg_denoised(x_in, sigma, v_cond, v_uncond, cfg)
        self.feed(st, den)
        return den

    # ---- what each sampler defines -------------------------------------------------------------------------------
    def _setup(self) -> None:
        """Constants derived from the settings (not part of a run's state)."""

    def _init(self, st: SamplerRun) -> None:
        """A fresh run's extra state."""

    def _point(self, st: SamplerRun) -> tuple:
        return st.x, self.sigmas[st.step]

    def _feed(self, st: SamplerRun, den: np.ndarray) -> bool:
        """Consume one model result; True when the step is finished."""
        raise NotImplementedError

    def _final(self, st: SamplerRun) -> np.ndarray:
        return st.x

    # ---- shared pieces ---------------------------------------------------------------------------------------------
    def _s(self, i: int) -> float:
        return float(self.sigmas[i])

    def _gauss(self, st: SamplerRun) -> np.ndarray:
        return st.gen.randn(st.x.shape)

    def _brown(self, sigma: float, sigma_next: float) -> np.ndarray:
        return self._bt(sigma, sigma_next).reshape(self.shape)


def _to_d(x, sigma, den):
    return (x - den) / F32(sigma)


# ---- first-order and ancestral ----------------------------------------------------------------------------------------
class Euler(KSampler):
    """sample_euler (s_churn 0); ComfyUI's ddim is this sampler too."""
    name = "euler"

    def feed_cfg(self, st, v_cond, v_uncond, cfg):
        """The pipeline's Euler in velocity form, v = v_u + cfg·(v_c - v_u), x += v·(sigma_next - sigma): the same
        step as ComfyUI's denoised form up to float32 rounding (docs/samplers.md measures both against ComfyUI),
        kept so default jobs stay bitwise what they were. Returns x0 = x - sigma·v."""
        if self.done(st):
            raise RuntimeError(f"{self.name}: sampling is finished ({self.steps} steps)")
        i = st.step
        s0, s1 = self.sigmas[i], self.sigmas[i + 1]                                 # f32 scalars
        x = st.x                                                                     # [C, h, w] f32
        v = np.asarray(v_uncond, np.float32) + F32(cfg) * (np.asarray(v_cond, np.float32) -
                                                           np.asarray(v_uncond, np.float32))
        if v.shape != x.shape:
            raise ValueError(f"velocity has shape {v.shape}, latent is {x.shape}")
        x0 = x - s0 * v
        st.x = x + v * (s1 - s0)
        st.step += 1
        return x0

    def _feed(self, st, den):
        i = st.step
        dt = self.sigmas[i + 1] - self.sigmas[i]                                    # f32
        st.x = st.x + _to_d(st.x, self._s(i), den) * dt
        return True


class Ddim(Euler):
    name = "ddim"


class EulerAncestral(KSampler):
    """sample_euler_ancestral_RF (eta 1): step down to sigma_down, rescale, add noise of renoise_coeff."""
    name = "euler_ancestral"
    gaussian = True

    def _feed(self, st, den, eta: float = 1.0):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        if sn == 0:
            st.x = den
            return True
        sd = sn * (1 + (sn / s - 1) * eta)
        a_n, a_d = 1 - sn, 1 - sd
        renoise = math.sqrt(sn ** 2 - sd ** 2 * a_n ** 2 / a_d ** 2)
        r = sd / s
        x = F32(r) * st.x + F32(1 - r) * den
        st.x = F32(a_n / a_d) * x + self._gauss(st) * F32(renoise)
        return True


class Lcm(KSampler):
    """sample_lcm: x = denoised, then noise back to the next sigma: sigma·noise + (1 - sigma)·x."""
    name = "lcm"
    gaussian = True

    def _feed(self, st, den):
        sn = self.sigmas[st.step + 1]
        st.x = den
        if sn > 0:
            st.x = sn * self._gauss(st) + (F32(1.0) - sn) * den
        return True


class Heun(KSampler):
    """sample_heun: Euler to sigma_next, the model there, the average slope (Euler alone on the last step)."""
    name = "heun"

    def nfe(self, step):
        return 1 if self.sigmas[step + 1] == 0 else 2

    def _point(self, st):
        i = st.step
        if st.stage == 0:
            return st.x, self.sigmas[i]
        return st.arrays["x_2"], self.sigmas[i + 1]

    def _feed(self, st, den):
        i = st.step
        dt = self.sigmas[i + 1] - self.sigmas[i]
        if st.stage == 0:
            d = _to_d(st.x, self._s(i), den)
            if self.sigmas[i + 1] == 0:
                st.x = st.x + d * dt
                return True
            st.arrays["d"] = d
            st.arrays["x_2"] = st.x + d * dt
            return False
        d = st.arrays.pop("d")
        x_2 = st.arrays.pop("x_2")
        d_2 = _to_d(x_2, self._s(i + 1), den)
        st.x = st.x + (d + d_2) / F32(2) * dt
        return True


class Dpm2(KSampler):
    """sample_dpm_2 (s_churn 0): Euler to the log-midpoint sigma, the model there, the full step with its slope
    (Euler alone on the last step). KSampler drops the scheduler's penultimate sigma for it."""
    name = "dpm_2"
    discard_penultimate = True

    def nfe(self, step):
        return 1 if self.sigmas[step + 1] == 0 else 2

    def _mid(self, i: int) -> float:
        return float(F32(math.exp(0.5 * (math.log(self._s(i)) + math.log(self._s(i + 1))))))

    def _point(self, st):
        if st.stage == 0:
            return st.x, self.sigmas[st.step]
        return st.arrays["x_2"], self._mid(st.step)

    def _feed(self, st, den):
        i = st.step
        if st.stage == 0:
            d = _to_d(st.x, self._s(i), den)
            if self.sigmas[i + 1] == 0:
                st.x = st.x + d * (self.sigmas[i + 1] - self.sigmas[i])
                return True
            st.arrays["x_2"] = st.x + d * F32(F32(self._mid(i)) - self.sigmas[i])
            return False
        x_2 = st.arrays.pop("x_2")
        d_2 = _to_d(x_2, self._mid(i), den)
        st.x = st.x + d_2 * (self.sigmas[i + 1] - self.sigmas[i])
        return True


class Dpm2Ancestral(Dpm2):
    """sample_dpm_2_ancestral_RF (eta 1): DPM-Solver-2 down to sigma_down, rescaled and renoised as Euler a."""
    name = "dpm_2_ancestral"
    gaussian = True

    def _down(self, i: int) -> tuple:
        s, sn = self._s(i), self._s(i + 1)
        sd = sn * (1 + (sn / s - 1))
        a_n, a_d = 1 - sn, 1 - sd
        return sd, a_n, a_d, math.sqrt(max(sn ** 2 - sd ** 2 * a_n ** 2 / a_d ** 2, 0.0))

    def _mid(self, i: int) -> float:
        return float(F32(math.exp(0.5 * (math.log(self._s(i)) + math.log(self._down(i)[0])))))

    def _feed(self, st, den):
        i = st.step
        sd, a_n, a_d, renoise = self._down(i)
        if st.stage == 0:
            d = _to_d(st.x, self._s(i), den)
            if sd == 0:
                st.x = st.x + d * F32(F32(sd) - self.sigmas[i])
                return True
            st.arrays["x_2"] = st.x + d * F32(F32(self._mid(i)) - self.sigmas[i])
            return False
        x_2 = st.arrays.pop("x_2")
        x = st.x + _to_d(x_2, self._mid(i), den) * F32(F32(sd) - self.sigmas[i])
        st.x = F32(a_n / a_d) * x + self._gauss(st) * F32(renoise)
        return True


class Dpmpp2SAncestral(KSampler):
    """sample_dpmpp_2s_ancestral_RF (eta 1): a DPM-Solver++(2S) model call at the log-SNR midpoint towards
    sigma_down (0.9999 from sigma 1), then Euler a's rescale and renoise."""
    name = "dpmpp_2s_ancestral"
    gaussian = True

    def nfe(self, step):
        return 1 if self.sigmas[step + 1] == 0 else 2

    def _down(self, i: int) -> tuple:
        s, sn = self._s(i), self._s(i + 1)
        sd = sn * (1 + (sn / s - 1))
        a_n, a_d = 1 - sn, 1 - sd
        return sd, a_n, a_d, math.sqrt(max(sn ** 2 - sd ** 2 * a_n ** 2 / a_d ** 2, 0.0))

    def _sigma_s(self, i: int) -> float:
        s = self._s(i)
        if s == 1.0:
            return float(F32(0.9999))
        lam_i, lam_d = half_log_snr(s), half_log_snr(self._down(i)[0])
        return float(F32(sigma_of_half_log_snr(lam_i + 0.5 * (lam_d - lam_i))))

    def _point(self, st):
        if st.stage == 0:
            return st.x, self.sigmas[st.step]
        return st.arrays["u"], self._sigma_s(st.step)

    def _feed(self, st, den):
        i = st.step
        s = self._s(i)
        sd, a_n, a_d, renoise = self._down(i)
        if st.stage == 0:
            if self.sigmas[i + 1] == 0:
                st.x = st.x + _to_d(st.x, s, den) * F32(F32(sd) - self.sigmas[i])
                return True
            r = self._sigma_s(i) / s
            st.arrays["u"] = F32(r) * st.x + F32(1 - r) * den
            return False
        st.arrays.pop("u")
        r = sd / s
        x = F32(r) * st.x + F32(1 - r) * den
        st.x = F32(a_n / a_d) * x + self._gauss(st) * F32(renoise)
        return True


class Lms(KSampler):
    """sample_lms (order 4): Adams-Bashforth in sigma over the last 4 slopes; the coefficients are integrals of
    Lagrange polynomials (cubic at most), here by 4-point Gauss-Legendre, exact for them as scipy's quad is."""
    name = "lms"
    order = 4
    _GL_X, _GL_W = np.polynomial.legendre.leggauss(4)

    def _coeff(self, order: int, i: int, j: int) -> float:
        t = self.sigmas.astype(np.float64)
        a, b = t[i], t[i + 1]
        taus = 0.5 * (b - a) * self._GL_X + 0.5 * (a + b)
        prod = np.ones_like(taus)
        for k in range(order):
            if k != j:
                prod *= (taus - t[i - k]) / (t[i - j] - t[i - k])
        return float(0.5 * (b - a) * np.sum(self._GL_W * prod))

    def _feed(self, st, den):
        i = st.step
        ds = (st.lists.get("ds", []) + [_to_d(st.x, self._s(i), den)])[-self.order:]
        st.lists["ds"] = ds
        if self.sigmas[i + 1] == 0:
            st.x = den
            return True
        order = min(i + 1, self.order)
        total = F32(0.0)
        for j, d in enumerate(reversed(ds)):
            total = total + F32(self._coeff(order, i, j)) * d
        st.x = st.x + total
        return True


class Ipndm(KSampler):
    """sample_ipndm (max order 4): improved PNDM, Adams-Bashforth weights on the last slopes."""
    name = "ipndm"
    max_order = 4

    def _feed(self, st, den):
        i = st.step
        s, sn = self.sigmas[i], self.sigmas[i + 1]
        buf = st.lists.get("d", [])
        d = _to_d(st.x, float(s), den)
        order = min(self.max_order, i + 1)
        dt = sn - s
        if sn == 0:
            st.x = den
        elif order == 1:
            st.x = st.x + dt * d
        elif order == 2:
            st.x = st.x + dt * (F32(3) * d - buf[-1]) / F32(2)
        elif order == 3:
            st.x = st.x + dt * (F32(23) * d - F32(16) * buf[-1] + F32(5) * buf[-2]) / F32(12)
        else:
            st.x = st.x + dt * (F32(55) * d - F32(59) * buf[-1] + F32(37) * buf[-2] - F32(9) * buf[-3]) / F32(24)
        st.lists["d"] = (buf + [d])[-(self.max_order - 1):]
        return True


class GradientEstimation(KSampler):
    """sample_gradient_estimation (gamma 2): Euler plus (gamma - 1) times the change of the slope."""
    name = "gradient_estimation"
    gamma = 2.0

    def _feed(self, st, den):
        i = st.step
        d = _to_d(st.x, self._s(i), den)
        dt = self.sigmas[i + 1] - self.sigmas[i]
        if self.sigmas[i + 1] == 0:
            st.x = den
        else:
            x = st.x + d * dt
            if i >= 1:
                x = x + F32(self.gamma - 1) * (d - st.arrays["old_d"]) * dt
            st.x = x
        st.arrays["old_d"] = d
        return True


class Ddpm(KSampler):
    """sample_ddpm: ComfyUI's DDPM step in its variance-preserving view of sigma (x / sqrt(1 + sigma^2)), for every
    model; in float32 as there (1 - alpha cancels badly near sigma 0)."""
    name = "ddpm"
    gaussian = True

    def _feed(self, st, den):
        i = st.step
        one = F32(1.0)
        s, sp = self.sigmas[i], self.sigmas[i + 1]                               # f32
        eps = (st.x - den) / s
        x = st.x / np.sqrt(one + s ** F32(2.0))
        acp, acp_prev = one / (s * s + one), one / (sp * sp + one)
        alpha = acp / acp_prev
        mu = np.sqrt(one / alpha) * (x - (one - alpha) * eps / np.sqrt(one - acp))
        if sp > 0:
            mu = mu + np.sqrt((one - alpha) * (one - acp_prev) / (one - acp)) * self._gauss(st)
            mu = mu * np.sqrt(one + sp ** F32(2.0))
        st.x = mu
        return True


# ---- DPM-Solver++ -----------------------------------------------------------------------------------------------------
class Dpmpp2M(KSampler):
    """sample_dpmpp_2m (no flow branch in ComfyUI: t = -log sigma for every model)."""
    name = "dpmpp_2m"

    def _feed(self, st, den):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        old = st.arrays.get("old_denoised")
        if sn == 0:
            st.x = F32(0.0) * st.x + den                  # sigma_fn(inf) / sigma = 0, -expm1(-inf) = 1
        else:
            t, t_next = -math.log(s), -math.log(sn)
            h = t_next - t
            if old is None:
                den_d = den
            else:
                r = (t + math.log(self._s(i - 1))) / h
                den_d = F32(1 + 1 / (2 * r)) * den - F32(1 / (2 * r)) * old
            st.x = F32(sn / s) * st.x - F32(math.expm1(-h)) * den_d
        st.arrays["old_denoised"] = den
        return True


class Dpmpp2MSde(KSampler):
    """sample_dpmpp_2m_sde (midpoint, eta 1) with the Brownian-tree noise; flow log-SNR."""
    name = "dpmpp_2m_sde"
    brownian = True
    offsets_first_sigma = True

    def _feed(self, st, den, eta: float = 1.0):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        old = st.arrays.get("old_denoised")
        h = st.scalars.get("h")
        if sn == 0:
            st.x = den
        else:
            lam_s, lam_t = half_log_snr(s), half_log_snr(sn)
            h = lam_t - lam_s
            h_eta = h * (eta + 1)
            alpha_t = sn * math.exp(lam_t)
            phi = -math.expm1(-h_eta)
            x = F32(sn / s * math.exp(-h * eta)) * st.x + F32(alpha_t * phi) * den
            if old is not None:
                r = st.scalars["h_last"] / h
                x = x + F32(0.5 * alpha_t * phi * (1 / r)) * (den - old)
            x = x + self._brown(s, sn) * F32(sn * math.sqrt(-math.expm1(-2 * h * eta)))
            st.x = x
        st.arrays["old_denoised"] = den
        st.scalars["h_last"] = h
        st.scalars["h"] = h
        return True


class Dpmpp3MSde(KSampler):
    """sample_dpmpp_3m_sde (eta 1) with the Brownian-tree noise; flow log-SNR."""
    name = "dpmpp_3m_sde"
    brownian = True
    offsets_first_sigma = True

    def _feed(self, st, den, eta: float = 1.0):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        d1, d2 = st.arrays.get("denoised_1"), st.arrays.get("denoised_2")
        h, h_1, h_2 = st.scalars.get("h"), st.scalars.get("h_1"), st.scalars.get("h_2")
        if sn == 0:
            st.x = den
        else:
            lam_s, lam_t = half_log_snr(s), half_log_snr(sn)
            h = lam_t - lam_s
            h_eta = h * (eta + 1)
            alpha_t = sn * math.exp(lam_t)
            x = F32(sn / s * math.exp(-h * eta)) * st.x + F32(alpha_t * -math.expm1(-h_eta)) * den
            phi_2 = math.expm1(-h_eta) / h_eta + 1
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                d1_0 = (den - d1) / F32(r0)
                d1_1 = (d1 - d2) / F32(r1)
                dd1 = d1_0 + (d1_0 - d1_1) * F32(r0 / (r0 + r1))
                dd2 = (d1_0 - d1_1) / F32(r0 + r1)
                phi_3 = phi_2 / h_eta - 0.5
                x = x + F32(alpha_t * phi_2) * dd1 - F32(alpha_t * phi_3) * dd2
            elif h_1 is not None:
                x = x + F32(alpha_t * phi_2) * ((den - d1) / F32(h_1 / h))
            x = x + self._brown(s, sn) * F32(sn * math.sqrt(-math.expm1(-2 * h * eta)))
            st.x = x
        if d1 is not None:
            st.arrays["denoised_2"] = d1
        st.arrays["denoised_1"] = den
        st.scalars.update(h=h, h_1=h, h_2=h_1)
        return True


class DpmppSde(KSampler):
    """sample_dpmpp_sde (r 1/2, eta 1): a midpoint model call at sigma_s1, Brownian-tree noise in both halves."""
    name = "dpmpp_sde"
    brownian = True
    offsets_first_sigma = True
    r = 0.5

    def nfe(self, step):
        return 1 if self.sigmas[step + 1] == 0 else 2

    def _mid(self, i: int) -> tuple:
        """(lambda_s, lambda_t, lambda_s1, sigma_s1): the midpoint in float32 as ComfyUI computes it, since sigma_s1
        is a Brownian query time (rounded to 6 decimals there) and a model input."""
        s, sn = self.sigmas[i], self.sigmas[i + 1]
        one = F32(1.0)
        lam_s, lam_t = -np.log(s / (one - s)), -np.log(sn / (one - sn))                      # f32
        lam_s1 = lam_s + F32(self.r) * (lam_t - lam_s)
        s_1 = one / (one + np.exp(lam_s1))                                                   # sigmoid(-lambda)
        return float(lam_s), float(lam_t), float(lam_s1), float(s_1)

    def _point(self, st):
        if st.stage == 0:
            return st.x, self.sigmas[st.step]
        return st.arrays["x_2"], self._mid(st.step)[3]

    def _feed(self, st, den, eta: float = 1.0):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        if sn == 0:
            st.x = den
            return True
        lam_s, lam_t, lam_s1, s_1 = self._mid(i)
        alpha_s = s * math.exp(lam_s)
        if st.stage == 0:
            alpha_s1 = s_1 * math.exp(lam_s1)
            sd, su = ancestral_step(math.exp(-lam_s), math.exp(-lam_s1), eta)
            h_ = -math.log(sd) - lam_s
            x_2 = F32(alpha_s1 / alpha_s * math.exp(-h_)) * st.x - F32(alpha_s1 * math.expm1(-h_)) * den
            x_2 = x_2 + F32(alpha_s1) * self._brown(s, s_1) * F32(su)
            st.arrays["x_2"] = x_2
            st.arrays["denoised"] = den
            return False
        first = st.arrays.pop("denoised")
        st.arrays.pop("x_2")
        fac = 1 / (2 * self.r)
        alpha_t = sn * math.exp(lam_t)
        sd, su = ancestral_step(math.exp(-lam_s), math.exp(-lam_t), eta)
        h_ = -math.log(sd) - lam_s
        den_d = F32(1 - fac) * first + F32(fac) * den
        x = F32(alpha_t / alpha_s * math.exp(-h_)) * st.x - F32(alpha_t * math.expm1(-h_)) * den_d
        st.x = x + F32(alpha_t) * self._brown(s, sn) * F32(su)
        return True


# ---- exponential-integrator multistep ------------------------------------------------------------------------------
class ResMultistep(KSampler):
    """sample_res_multistep (eta 0: deterministic; ComfyUI still draws and adds noise times sigma_up = 0, which
    changes nothing, so no draw is made here)."""
    name = "res_multistep"

    def _feed(self, st, den):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        sd, _ = ancestral_step(s, sn, eta=0.0)
        old = st.arrays.get("old_denoised")
        if sd == 0 or old is None:
            st.x = st.x + _to_d(st.x, s, den) * F32(F32(sd) - F32(s))
        else:
            t, t_old, t_next, t_prev = (-math.log(v) for v in (s, st.scalars["old_sigma_down"], sd, self._s(i - 1)))
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1 = math.expm1(-h) / -h
            phi2 = (phi1 - 1.0) / -h
            b1 = phi1 - phi2 / c2
            b2 = phi2 / c2
            st.x = F32(math.exp(-h)) * st.x + F32(h) * (F32(b1) * den + F32(b2) * old)
        st.arrays["old_denoised"] = den
        st.scalars["old_sigma_down"] = sd
        return True


class ErSde(KSampler):
    """sample_er_sde (VP ER-SDE-Solver-3, max_stage 3, default noise scaler x·(e^(x^0.3) + 10), 200-point integrals)."""
    name = "er_sde"
    gaussian = True
    offsets_first_sigma = True
    points = 200

    @staticmethod
    def _scaler(x):
        return x * (np.exp(x ** 0.3) + 10.0)

    def _er(self, i: int) -> float:
        return math.exp(-half_log_snr(self._s(i)))                     # sigma / alpha; 0 at sigma 0

    def _feed(self, st, den):
        i = st.step
        s, sn = self._s(i), self._s(i + 1)
        old, old_d = st.arrays.get("old_denoised"), st.arrays.get("old_denoised_d")
        stage = min(3, i + 1)
        if sn == 0:
            st.x = den
        else:
            er_s, er_t = self._er(i), self._er(i + 1)
            alpha_s, alpha_t = s / er_s, sn / er_t
            r = float(self._scaler(er_t) / self._scaler(er_s))
            x = F32(alpha_t / alpha_s * r) * st.x + F32(alpha_t * (1 - r)) * den
            if stage >= 2:
                dt = er_t - er_s
                step = -dt / self.points
                pos = er_t + np.arange(self.points, dtype=np.float64) * step
                scaled = self._scaler(pos)
                s_int = float(np.sum(1 / scaled) * step)
                den_d = (den - old) / F32(er_s - self._er(i - 1))
                x = x + F32(alpha_t * (dt + s_int * self._scaler(er_t))) * den_d
                if stage >= 3:
                    s_u = float(np.sum((pos - er_s) / scaled) * step)
                    den_u = (den_d - old_d) / F32((er_s - self._er(i - 2)) / 2)
                    x = x + F32(alpha_t * (dt ** 2 / 2 + s_u * self._scaler(er_t))) * den_u
                st.arrays["old_denoised_d"] = den_d
            var = er_t ** 2 - er_s ** 2 * r ** 2
            amp = math.sqrt(var) if var > 0 else 0.0
            st.x = x + F32(alpha_t) * self._gauss(st) * F32(amp)
        st.arrays["old_denoised"] = den
        return True


# ---- SA-Solver --------------------------------------------------------------------------------------------------------
def _sa_exp_coeffs(s: np.float32, t: np.float32, order: int, tau: float) -> np.ndarray:
    """(1 + tau^2)·∫ exp((1 + tau^2)·x)·x^p dx from s to t, exp((1 + tau^2)·t) factored out, p = 0..order-1, by the
    integration-by-parts recursion; float32 like ComfyUI's sa_solver.compute_exponential_coeffs."""
    tau_mul = F32(1 + tau ** 2)
    h = F32(t - s)
    p = np.arange(order, dtype=np.float32)
    terms = t ** p - s ** p * np.exp(-tau_mul * h)                              # [order] f32
    depth = p[:, None] - p[None, :]
    lf = np.array([math.lgamma(v + 1) for v in p], dtype=np.float32)
    coeff = lf[:, None] - lf[None, :]
    if tau > 0:
        coeff = coeff - depth * F32(math.log(1 + tau ** 2))
    signs = np.where(depth % 2 == 0, F32(1.0), F32(-1.0))
    mat = np.tril(np.exp(coeff) * signs).astype(np.float32)
    return (mat @ terms).astype(np.float32)


def _sa_b_coeffs(sigma_next: float, lambdas: np.ndarray, lam_s: float, lam_t: float, tau: float) -> np.ndarray:
    """SA-Solver's b_i (eqs. 15/18) by Lagrange interpolation over `lambdas` (float32 solve, as ComfyUI)."""
    lams = np.asarray(lambdas, dtype=np.float32)
    n = lams.shape[0]
    rhs = _sa_exp_coeffs(F32(lam_s), F32(lam_t), n, tau)
    vander_t = np.ones((n, n), dtype=np.float32)                                 # row p: lams ** p, in float32
    for p in range(1, n):
        vander_t[p] = vander_t[p - 1] * lams
    integrals = np.linalg.solve(vander_t, rhs).astype(np.float32)
    return (F32(sigma_next) * np.exp(F32(lam_t))) * integrals


class SaSolver(KSampler):
    """sample_sa_solver (predictor order 3, corrector order 4, tau 1 for sigma in [percent 0.8, percent 0.2], lower
    orders at the end). State: x (corrected), x_pred (where the model is next evaluated), the last 4 denoised values,
    the previous predictor's noise."""
    name = "sa_solver"
    gaussian = True
    offsets_first_sigma = True
    pece = False
    predictor_order, corrector_order = 3, 4

    def _setup(self):
        self.lambdas = np.array([half_log_snr(v) for v in self.sigmas.astype(np.float64)], dtype=np.float32)

    def _init(self, st):
        st.arrays["x_pred"] = st.x
        st.lists["pred"] = []
        st.scalars.update(h=0.0, tau=0.0)

    def _lam(self, i):
        return float(self.lambdas[i])

    def _tau(self, sigma: float) -> float:
        hi, lo = percent_to_sigma(0.2, self.shift), percent_to_sigma(0.8, self.shift)
        return 1.0 if hi >= sigma >= lo else 0.0

    def _orders(self, i: int, n_pred: int) -> tuple:
        p = min(self.predictor_order, n_pred)
        c = 0 if i == 0 or (self.sigmas[i + 1] == 0 and not self.pece) else min(self.corrector_order, n_pred)
        if self.sigmas[-1] == 0:
            p = min(p, len(self.sigmas) - 2 - i)
            c = min(c, len(self.sigmas) - 1 - i)
        return p, c

    def nfe(self, step):
        return 2 if self.pece and self._orders(step, min(step + 1, 4))[1] > 0 else 1

    def _point(self, st):
        if st.stage == 0:
            return st.arrays["x_pred"], self.sigmas[st.step]
        return st.x, self.sigmas[st.step]

    def _feed(self, st, den):
        i = st.step
        pred = st.lists["pred"]
        if st.stage == 0:
            pred = (pred + [den])[-max(self.predictor_order, self.corrector_order):]
            st.lists["pred"] = pred
            _, c = self._orders(i, len(pred))
            if c == 0:
                st.x = st.arrays["x_pred"]
            else:
                b = _sa_b_coeffs(self._s(i), self.lambdas[i - c + 1:i + 1], self._lam(i - 1), self._lam(i),
                                 st.scalars["tau"])
                corr = np.tensordot(b, np.stack(pred[-c:], axis=0), axes=([0], [0])).astype(np.float32)
                x = F32(self._s(i) / self._s(i - 1)) * F32(math.exp(-(st.scalars["tau"] ** 2) * st.scalars["h"])) \
                    * st.x + corr
                if st.scalars["tau"] > 0:
                    x = x + st.arrays["noise"]
                st.x = x
                if self.pece:
                    return False                          # evaluate the corrected state before predicting
        else:
            pred[-1] = den
        self._predict(st, den)
        return True

    def _predict(self, st, den):
        i = st.step
        pred = st.lists["pred"]
        if self.sigmas[i + 1] == 0:
            st.arrays["x_pred"] = den
            return
        p, _ = self._orders(i, len(pred))
        tau = self._tau(self._s(i + 1))
        b = _sa_b_coeffs(self._s(i + 1), self.lambdas[i - p + 1:i + 1], self._lam(i), self._lam(i + 1), tau)
        res = np.tensordot(b, np.stack(pred[-p:], axis=0), axes=([0], [0])).astype(np.float32)
        h = float(F32(self.lambdas[i + 1]) - F32(self.lambdas[i]))
        x_pred = F32(self._s(i + 1) / self._s(i)) * F32(math.exp(-(tau ** 2) * h)) * st.x + res
        if tau > 0:
            noise = self._gauss(st) * F32(self._s(i + 1) * math.sqrt(-math.expm1(-2 * tau ** 2 * h)))
            st.arrays["noise"] = noise
            x_pred = x_pred + noise
        st.arrays["x_pred"] = x_pred
        st.scalars.update(h=h, tau=tau)

    def _final(self, st):
        return st.arrays["x_pred"]


class SaSolverPece(SaSolver):
    """sample_sa_solver_pece: SA-Solver that evaluates the model again at every corrected state."""
    name = "sa_solver_pece"
    pece = True


# ---- UniPC (ComfyUI runs it in its variance-exploding view of sigma for every model) ---------------------------------
def _vp(sigma) -> tuple:
    """(alpha, std, lambda) of ComfyUI's uni_pc SigmaConvert, in float32 as there: log alpha = 0.5·log(1/(sigma^2 + 1)).
    float32 on purpose: near sigma 0.001 these cancel badly and ComfyUI's picture carries that."""
    one, half, two = F32(1.0), F32(0.5), F32(2.0)
    s = F32(sigma)
    lmc = half * np.log(one / (s * s + one))
    one_minus = one - np.exp(two * lmc)
    return np.exp(lmc), np.sqrt(one_minus), lmc - half * np.log(one_minus)


class UniPC(KSampler):
    """uni_pc / uni_pc_bh2: UniPC multistep (data prediction, order min(3, steps - 1), lower order at the end) over
    the schedule with its last 0 replaced by 0.001; the model sees x·sqrt(sigma^2 + 1), as ComfyUI's
    predict_eps_sigma scales it (ComfyUI's uni_pc treats every model's sigma as variance-exploding). The caller drops
    the scheduler's penultimate sigma (sampler_sigmas). Coefficients in float32, as ComfyUI computes them. The result
    is divided by 1 - 0.001 at the end, as ComfyUI's is (see _final)."""
    name = "uni_pc"
    variant = "bh1"
    discard_penultimate = True

    def _setup(self):
        self.ts = self.sigmas.copy()                                                     # f32
        if self.ts[-1] == 0:
            self.ts[-1] = F32(0.001)
        self.order = min(3, len(self.ts) - 2)

    def _init(self, st):
        st.x = st.x / np.sqrt(F32(1.0) + self.ts[0] ** F32(2.0))
        st.arrays["x_pred"] = st.x
        st.lists["m"] = []
        st.scalars["t"] = []

    @staticmethod
    def _scale(t) -> np.float32:
        t = F32(t)
        return (t ** F32(2) + F32(1.0)) ** F32(0.5)

    def _point(self, st):
        t = self.ts[st.step]
        return st.arrays["x_pred"] * self._scale(t), float(t)

    def _x0(self, x, t, den):
        """The model's denoised at x·sqrt(t^2 + 1) -> UniPC's data prediction at (x, t)."""
        x_in = x * self._scale(t)
        eps = (x_in - den) / F32(t)
        alpha, std, _ = _vp(t)
        return (x - std * eps) / alpha

    def _update_order(self, j: int) -> int:
        return j if j < self.order else min(self.order, self.steps + 1 - j)

    def _coeffs(self, st, j: int, order: int) -> tuple:
        """Update j's shared pieces: (x_base, D1s, R, b, alpha_t·B(h)), f32."""
        m, ts = st.lists["m"], st.scalars["t"]
        one = F32(1.0)
        alpha_t, std_t, lam_t = _vp(self.ts[j])
        _, std_prev0, lam_prev0 = _vp(ts[-1])
        h = lam_t - lam_prev0
        rks, d1s = [], []
        for k in range(1, order):
            rk = (_vp(ts[-(k + 1)])[2] - lam_prev0) / h
            rks.append(rk)
            d1s.append((m[-(k + 1)] - m[-1]) / rk)
        rks = np.array(rks + [one], dtype=np.float32)
        hh = -h
        h_phi_1 = np.expm1(hh)
        h_phi_k = h_phi_1 / hh - one
        fact = 1
        b_h = hh if self.variant == "bh1" else np.expm1(hh)
        R, b = [], []
        for k in range(1, order + 1):
            R.append(rks ** F32(k - 1))
            b.append(h_phi_k * F32(fact) / b_h)
            fact *= k + 1
            h_phi_k = h_phi_k / hh - F32(1 / fact)
        R, b = np.stack(R).astype(np.float32), np.array(b, dtype=np.float32)
        x_base = (std_t / std_prev0) * st.x - (alpha_t * h_phi_1) * m[-1]
        return x_base, d1s, R, b, alpha_t * b_h

    @staticmethod
    def _combine(rhos, d1s, like):
        out = np.zeros_like(like)
        for r, d in zip(rhos, d1s):
            out = out + d * F32(r)
        return out

    def _feed(self, st, den):
        k = st.step
        t = float(self.ts[k])
        model_t = self._x0(st.arrays["x_pred"], t, den)
        if k == 0:
            st.lists["m"], st.scalars["t"] = [model_t], [t]
        else:
            order = self._update_order(k)
            x_base, d1s, R, b, ab = self._coeffs(st, k, order)
            rhos_c = np.array([0.5], np.float32) if order == 1 else np.linalg.solve(R, b).astype(np.float32)
            corr = self._combine(rhos_c[:-1], d1s, x_base)
            st.x = x_base - ab * (corr + rhos_c[-1] * (model_t - st.lists["m"][-1]))
            m, ts = st.lists["m"], st.scalars["t"]
            if k < self.order:
                st.lists["m"], st.scalars["t"] = m + [model_t], ts + [t]
            else:
                st.lists["m"], st.scalars["t"] = m[1:] + [model_t], ts[1:] + [t]
        if self.steps == 1:
            st.arrays["x_pred"] = st.x                      # ComfyUI makes no update for one step
            return True
        j = k + 1
        order = self._update_order(j)
        x_base, d1s, R, b, ab = self._coeffs(st, j, order)
        if d1s:
            rhos_p = np.array([0.5], np.float32) if order == 2 else \
                np.linalg.solve(R[:-1, :-1], b[:-1]).astype(np.float32)
            st.arrays["x_pred"] = x_base - ab * self._combine(rhos_p, d1s, x_base)
        else:
            st.arrays["x_pred"] = x_base
        if j == self.steps:
            st.x = st.arrays["x_pred"]
        return True

    def _final(self, st):
        x = st.arrays["x_pred"] / _vp(self.ts[-1])[0]
        if self.sigmas[-1] == 0:
            # ComfyUI's sample_unipc writes the 0.001 into the caller's sigmas (a view), so KSAMPLER's
            # inverse_noise_scaling then divides by 1 - 0.001: part of ComfyUI's picture.
            x = x / (F32(1.0) - self.ts[-1])
        return x


class UniPCBh2(UniPC):
    name = "uni_pc_bh2"
    variant = "bh2"


# ---- the table ----------------------------------------------------------------------------------------------------
# Why Spectrum is refused for a sampler: its forecast is indexed by step (one CFG x0 per step, at the step's own
# sigma); these samplers call the model a second time inside the step, at a point that has no place on that axis.
_SECOND_CALL = ("a second model call inside each step ({what}); Spectrum forecasts one x0 per step, so a forecast "
                "step would feed the same x0 to both calls and lose what the second call is for")
_SPECTRUM_REFUSED = {
    "heun": _SECOND_CALL.format(what="the corrector at the next sigma"),
    "dpm_2": _SECOND_CALL.format(what="at the log-midpoint sigma"),
    "dpm_2_ancestral": _SECOND_CALL.format(what="at the log-midpoint sigma"),
    "dpmpp_2s_ancestral": _SECOND_CALL.format(what="at the log-SNR midpoint"),
    "dpmpp_sde": _SECOND_CALL.format(what="at the log-SNR midpoint"),
    "sa_solver_pece": _SECOND_CALL.format(what="the corrected latent, evaluated again"),
}


@dataclass(frozen=True)
class SamplerInfo:
    """One row of THE sampler table (the page, prompt.json, the HTTP APIs and A1111's names read it)."""
    name: str
    cls: type
    nfe: str             # model calls per step, in words (Sampler.nfe(step) gives the number)
    noise: str           # "none", "gaussian" (default_noise_sampler, seed + 1) or "brownian" (BrownianTree, seed)
    state: str           # what the run carries between steps besides the latent
    spectrum: Optional[str] = None   # None: Spectrum applies; else why it is refused

    @property
    def stochastic(self) -> bool:
        return self.noise != "none"


SAMPLERS = {i.name: replace(i, spectrum=_SPECTRUM_REFUSED.get(i.name)) for i in (
    SamplerInfo("euler", Euler, "1", "none", "nothing"),
    SamplerInfo("ddim", Ddim, "1", "none", "nothing (ComfyUI runs euler for ddim)"),
    SamplerInfo("euler_ancestral", EulerAncestral, "1", "gaussian", "noise generator"),
    SamplerInfo("heun", Heun, "2 (1 on the last step)", "none", "nothing"),
    SamplerInfo("lcm", Lcm, "1", "gaussian", "noise generator"),
    SamplerInfo("dpmpp_2m", Dpmpp2M, "1", "none", "previous denoised"),
    SamplerInfo("dpmpp_2m_sde", Dpmpp2MSde, "1", "brownian", "previous denoised, previous h"),
    SamplerInfo("dpmpp_3m_sde", Dpmpp3MSde, "1", "brownian", "two previous denoised, two previous h"),
    SamplerInfo("dpmpp_sde", DpmppSde, "2 (1 on the last step)", "brownian", "nothing"),
    SamplerInfo("res_multistep", ResMultistep, "1", "none", "previous denoised, previous sigma_down"),
    SamplerInfo("er_sde", ErSde, "1", "gaussian", "previous denoised and its difference, noise generator"),
    SamplerInfo("sa_solver", SaSolver, "1", "gaussian",
                "corrected and predicted latents, last 4 denoised, predictor noise, h, tau, noise generator"),
    SamplerInfo("sa_solver_pece", SaSolverPece, "2 (1 on the first step)", "gaussian",
                "as sa_solver"),
    SamplerInfo("uni_pc", UniPC, "1", "none", "predicted latent, last 3 data predictions and their times"),
    SamplerInfo("uni_pc_bh2", UniPCBh2, "1", "none", "as uni_pc"),
    SamplerInfo("dpm_2", Dpm2, "2 (1 on the last step)", "none", "nothing"),
    SamplerInfo("dpm_2_ancestral", Dpm2Ancestral, "2 (1 on the last step)", "gaussian", "noise generator"),
    SamplerInfo("dpmpp_2s_ancestral", Dpmpp2SAncestral, "2 (1 on the last step)", "gaussian", "noise generator"),
    SamplerInfo("lms", Lms, "1", "none", "last 4 slopes"),
    SamplerInfo("ipndm", Ipndm, "1", "none", "last 3 slopes"),
    SamplerInfo("gradient_estimation", GradientEstimation, "1", "none", "previous slope"),
    SamplerInfo("ddpm", Ddpm, "1", "gaussian", "noise generator"),
)}
SAMPLER_NAMES = tuple(SAMPLERS)


def sampler_sigmas(name: str, schedule_sigmas_plus_one: np.ndarray) -> np.ndarray:
    """ComfyUI's KSampler.calculate_sigmas for samplers that discard the penultimate sigma (uni_pc): given the
    schedule for steps + 1, drop its second-to-last entry."""
    s = np.asarray(schedule_sigmas_plus_one, dtype=np.float32)
    return np.concatenate([s[:-2], s[-1:]])


def ksampler_sigmas(name: str, scheduler: str, steps: int, shift: float = DEFAULT_SHIFT) -> np.ndarray:
    """The sigmas ComfyUI's KSampler hands sampler `name` for `scheduler` and `steps` ([n + 1] f32)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {list(SAMPLER_NAMES)}")
    if SAMPLERS[name].cls.discard_penultimate:
        return sampler_sigmas(name, make_sigmas(scheduler, steps + 1, shift))
    return make_sigmas(scheduler, steps, shift)


def new_ksampler(name: str, sigmas, seed: int = 0, shape=None, shift: float = DEFAULT_SHIFT) -> KSampler:
    """The ComfyUI sampler `name` over `sigmas` (the maths alone; models.sampling.denoise.make_sampler gives the
    pipeline's Sampler with CFG and Spectrum)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {list(SAMPLER_NAMES)}")
    return SAMPLERS[name].cls(sigmas, seed=seed, shape=shape, shift=shift)
