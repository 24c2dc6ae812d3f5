"""The sampler's resumable state and its file form: one safetensors file (tensors + JSON metadata), written durably."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from models.safetensors_io import SafeTensorsError, SafeTensorsFile, TensorEntry, write_safetensors
from models.spectrum import SpectrumState

log = logging.getLogger(__name__)

STATE_VERSION = 1
META_KEY = "anima_sampler_state"


class SamplerStateError(ValueError):
    """A state file that cannot be restored; the message names the file and what is wrong."""


@dataclass
class SamplerState:
    """Everything needed to continue a run after any finished step.

    `step` is the next step to run (0-based; == steps when done); `latent` is x at sigma[step]. `computed` and
    `forecast` list finished steps, 1-based. Euler draws no noise after the start, so the RNG state is the seed and
    noise mode that made the starting latent (kept for the record).
    """
    settings: dict                                     # Sampler.settings(): steps, cfg, schedule, shift, spectrum
    step: int
    latent: np.ndarray                                 # [C, h, w] f32
    spectrum: Optional[SpectrumState] = None
    computed: list = field(default_factory=list)
    forecast: list = field(default_factory=list)
    seed: Optional[int] = None
    noise: Optional[str] = None

    def copy(self) -> "SamplerState":
        sp = None
        if self.spectrum is not None:
            sp = SpectrumState(window=self.spectrum.window, cached=self.spectrum.cached,
                               calls=list(self.spectrum.calls), x0s=[a.copy() for a in self.spectrum.x0s])
        return SamplerState(dict(self.settings), self.step, self.latent.copy(), sp, list(self.computed),
                            list(self.forecast), self.seed, self.noise)

    # ---- file form -------------------------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write to `path` durably and atomically (write_safetensors goes through models.durable.atomic_write): a
        reader, or a resume after a power cut, sees the old state or the new one, never half."""
        meta = {
            "version": STATE_VERSION, "settings": self.settings, "step": int(self.step),
            "computed": [int(s) for s in self.computed], "forecast": [int(s) for s in self.forecast],
            "seed": None if self.seed is None else int(self.seed), "noise": self.noise,
            "spectrum": None if self.spectrum is None else {
                "window": float(self.spectrum.window), "cached": int(self.spectrum.cached),
                "calls": [int(c) for c in self.spectrum.calls]},
        }
        lat = np.ascontiguousarray(self.latent, dtype=np.float32)
        entries = [TensorEntry("latent", "F32", tuple(lat.shape), lat)]
        for i, x0 in enumerate(self.spectrum.x0s if self.spectrum is not None else []):
            x0 = np.ascontiguousarray(x0, dtype=np.float32)
            entries.append(TensorEntry(f"spectrum.x0.{i}", "F32", tuple(x0.shape), x0))
        write_safetensors(path, entries, metadata={META_KEY: json.dumps(meta, separators=(",", ":"))})

    @classmethod
    def load(cls, path) -> "SamplerState":
        """The state in `path`; SamplerStateError (and nothing else) for any file that is not a sound state, so a
        damaged or hostile file can fail a resume but never the process reading it."""
        name = os.fspath(path)
        try:
            f = SafeTensorsFile(path)
        except FileNotFoundError:
            raise SamplerStateError(f"{name}: no sampler state file") from None
        except (SafeTensorsError, OSError) as e:
            raise SamplerStateError(f"{name}: not a readable sampler state ({e})") from None
        if META_KEY not in f.metadata:
            raise SamplerStateError(f"{name}: no {META_KEY!r} metadata; not a sampler state file")
        try:
            meta = json.loads(f.metadata[META_KEY])
        except (ValueError, RecursionError) as e:     # not JSON, an int of > 4300 digits, deep nesting
            raise SamplerStateError(f"{name}: {META_KEY} metadata is not JSON ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
        if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION:
            got = meta.get("version") if isinstance(meta, dict) else None
            raise SamplerStateError(f"{name}: sampler state version {str(got)[:40]}, expected {STATE_VERSION}")
        for key, ok in (("settings", isinstance(meta.get("settings"), dict)),
                        ("step", _count(meta.get("step"))),
                        ("computed", _counts(meta.get("computed"))), ("forecast", _counts(meta.get("forecast"))),
                        ("seed", meta.get("seed") is None or _count(meta.get("seed"), 2**64 - 1)),
                        ("noise", meta.get("noise") is None or isinstance(meta.get("noise"), str))):
            if not ok:
                raise SamplerStateError(f"{name}: field {key!r} missing or malformed")
        latent = _tensor(f, "latent", name, None)                      # [C, h, w] f32
        spectrum = None
        sp = meta.get("spectrum")
        if sp is not None:
            window = sp.get("window") if isinstance(sp, dict) else None
            if not (isinstance(sp, dict) and _counts(sp.get("calls")) and _count(sp.get("cached"))
                    and type(window) in (int, float) and 1.0 <= window <= MAX_COUNT):
                raise SamplerStateError(f"{name}: field 'spectrum' is malformed")
            x0s = [_tensor(f, f"spectrum.x0.{i}", name, latent.shape) for i in range(len(sp["calls"]))]
            spectrum = SpectrumState(window=float(window), cached=sp["cached"], calls=list(sp["calls"]), x0s=x0s)
        return cls(settings=meta["settings"], step=meta["step"], latent=latent, spectrum=spectrum,
                   computed=meta["computed"], forecast=meta["forecast"], seed=meta.get("seed"),
                   noise=meta.get("noise"))


MAX_COUNT = 1_000_000          # steps, step lists, Spectrum call indices: far above any real run


def _count(v, high: int = MAX_COUNT) -> bool:
    return type(v) is int and 0 <= v <= high


def _counts(v) -> bool:
    return isinstance(v, list) and len(v) <= MAX_COUNT and all(_count(x) for x in v)


def _tensor(f: SafeTensorsFile, key: str, name: str, shape) -> np.ndarray:
    """Tensor `key` of a state file as finite f32 [C, h, w] (of `shape` when given); SamplerStateError otherwise."""
    if key not in f:
        raise SamplerStateError(f"{name}: tensor {key!r} missing")
    if f.dtype(key) != "F32" or len(f.shape(key)) != 3 or (shape is not None and f.shape(key) != shape):
        want = "[C, h, w]" if shape is None else list(shape)
        raise SamplerStateError(f"{name}: tensor {key!r} is {f.dtype(key)} {list(f.shape(key))}, expected F32 {want}")
    try:
        x = f.get(key)
    except (SafeTensorsError, OSError, ValueError) as e:
        raise SamplerStateError(f"{name}: tensor {key!r} cannot be read ({e})") from None
    if not np.isfinite(x).all():
        raise SamplerStateError(f"{name}: tensor {key!r} holds NaN or Inf")
    return x
