"""Seeded starting noise for the sampler: a numpy PCG64 mode and a ComfyUI-compatible mode (torch CPU randn, no torch)."""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

NOISE_MODES = ("comfy", "numpy")
DEFAULT_NOISE_MODE = "comfy"
SEED_MAX = 2**64 - 1


def _check(seed, shape) -> tuple:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= int(seed) <= SEED_MAX:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    shape = tuple(int(s) for s in shape)
    if any(s <= 0 for s in shape):
        raise ValueError(f"noise shape must be positive, got {shape}")
    return int(seed), shape


def numpy_noise(seed: int, shape) -> np.ndarray:
    """Standard normal float32 from numpy's PCG64 seeded with `seed` (numpy's own stream; stable across numpy versions)."""
    seed, shape = _check(seed, shape)
    return np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, dtype=np.float32)


def _mt19937_u32(seed32: int, n: int) -> np.ndarray:
    """The first n 32-bit outputs of MT19937 initialised with the classic 32-bit seeding (init_genrand).

    numpy's legacy RandomState uses that seeding for integer seeds, and a full-range uint32 draw returns the raw
    outputs in order, which is exactly the stream torch's CPU generator draws from after manual_seed.
    """
    return np.random.RandomState(seed32).randint(0, 2**32, size=n, dtype=np.uint32)


def _box_muller_16(u: np.ndarray) -> np.ndarray:
    """Blocks of 16 uniforms -> 16 normals: element j pairs with j+8 (radius from the first half, angle from the second).

    u: [k, 16] f32 in [0, 1). Same float32 steps as torch's CPU fill: u1 = 1 - u[:, :8], r = sqrt(-2 log u1),
    theta = 2π u[:, 8:]; out[:, :8] = r cos theta, out[:, 8:] = r sin theta. The transcendental functions are evaluated
    in float64 and rounded, so values agree with torch's vectorised approximations to a few float32 ulp.
    """
    f32 = np.float32
    u1 = f32(1.0) - u[:, :8]                                         # [k, 8] f32 in (0, 1]
    log_u1 = np.log(u1.astype(np.float64)).astype(f32)              # [k, 8]
    radius = np.sqrt(f32(-2.0) * log_u1)                             # [k, 8] f32
    theta = f32(2.0 * np.pi) * u[:, 8:]                              # [k, 8] f32
    cos_t = np.cos(theta.astype(np.float64)).astype(f32)
    sin_t = np.sin(theta.astype(np.float64)).astype(f32)
    return np.concatenate([radius * cos_t, radius * sin_t], axis=1)  # [k, 16] f32


def _randn_from_bits(bits: np.ndarray, n: int) -> np.ndarray:
    """torch's CPU randn of n >= 16 elements from its 32-bit draws: [n (+16 when n % 16)] u32 -> [n] f32.

    One uniform per element, (bits & 0xFFFFFF) * 2^-24; consecutive blocks of 16 through Box-Muller; when n is not a
    multiple of 16, 16 more draws recompute the last 16 elements."""
    tail = n % 16
    uni = (bits & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24)
    out = np.empty(n, dtype=np.float32)
    k = n // 16
    out[:16 * k] = _box_muller_16(uni[:16 * k].reshape(k, 16)).reshape(-1)
    if tail:
        out[n - 16:] = _box_muller_16(uni[n:n + 16].reshape(1, 16)).reshape(-1)
    return out


def _randn_draws(shape) -> tuple:
    """(elements, 32-bit draws) one torch CPU randn of `shape` takes; below 16 elements torch uses another path."""
    n = int(np.prod(shape, dtype=np.int64))
    if n < 16:
        raise ValueError(f"comfy noise needs at least 16 elements (torch uses another algorithm below that), got {shape}")
    return n, n + (16 if n % 16 else 0)


def comfy_noise(seed: int, shape) -> np.ndarray:
    """What `torch.manual_seed(seed); torch.randn(shape)` returns on CPU (float32), computed with numpy only.

    ComfyUI's starting latent is this with shape (1, 16, 1, h, w); reshaping to [16, h, w] keeps the order.
    The seed is taken modulo 2^32, as torch's mt19937 does.
    """
    seed, shape = _check(seed, shape)
    n, draws = _randn_draws(shape)
    return _randn_from_bits(_mt19937_u32(seed & 0xFFFFFFFF, draws), n).reshape(shape)


class TorchCpuGenerator:
    """A torch CPU generator after `manual_seed(seed)`, drawing `randn` calls one after another (numpy only).

    Each `randn(shape)` continues the MT19937 stream where the last one stopped, as successive
    `torch.randn(shape, generator=g)` calls do; ComfyUI's default_noise_sampler is such a generator. Its whole
    position is the MT19937 state (624 words + index): `state()` gives it as arrays, `from_state()` resumes it, so a
    sampler saved after any step continues the same noise bit for bit.
    """

    def __init__(self, seed: int):
        seed, _ = _check(seed, (1,))
        self._rs = np.random.RandomState(seed & 0xFFFFFFFF)

    def randn(self, shape) -> np.ndarray:
        _, shape = _check(0, shape)
        n, draws = _randn_draws(shape)
        bits = self._rs.randint(0, 2**32, size=draws, dtype=np.uint32)          # [draws] u32, raw outputs in order
        return _randn_from_bits(bits, n).reshape(shape)

    def state(self) -> dict:
        """{"mt_key": [624] i64 (32-bit words), "mt_pos": [1] i64}: the generator's position, as int64 arrays so any
        tensor file can hold them."""
        _, key, pos, _, _ = self._rs.get_state(legacy=True)
        return {"mt_key": np.array(key, dtype=np.int64), "mt_pos": np.array([pos], dtype=np.int64)}

    @classmethod
    def from_state(cls, state: dict) -> "TorchCpuGenerator":
        key = np.asarray(state["mt_key"]).reshape(-1)
        pos = np.asarray(state["mt_pos"]).reshape(-1)
        if (key.shape != (624,) or pos.shape != (1,) or not 0 <= int(pos[0]) <= 624
                or key.dtype.kind not in "iu" or key.min() < 0 or key.max() > 0xFFFFFFFF):
            raise ValueError(f"generator state needs mt_key: 624 words in 0..2**32-1 and mt_pos in 0..624, got "
                             f"{key.dtype} {key.shape} / {pos}")
        g = cls.__new__(cls)
        g._rs = np.random.RandomState()
        g._rs.set_state(("MT19937", key.astype(np.uint32), int(pos[0]), 0, 0.0))
        return g


def initial_noise(seed: int, shape, mode: str = DEFAULT_NOISE_MODE) -> np.ndarray:
    """The starting latent (sigma 1) for `seed`: shape e.g. [16, h, w], float32; mode 'comfy' or 'numpy'."""
    if mode == "comfy":
        return comfy_noise(seed, shape)
    if mode == "numpy":
        return numpy_noise(seed, shape)
    raise ValueError(f"unknown noise mode {mode!r}; choose one of {list(NOISE_MODES)}")
