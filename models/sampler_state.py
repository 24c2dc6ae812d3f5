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
        except json.JSONDecodeError as e:
            raise SamplerStateError(f"{name}: {META_KEY} metadata is not JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION:
            got = meta.get("version") if isinstance(meta, dict) else None
            raise SamplerStateError(f"{name}: sampler state version {got!r}, expected {STATE_VERSION}")
        for key, typ in (("settings", dict), ("step", int), ("computed", list), ("forecast", list)):
            if not isinstance(meta.get(key), typ):
                raise SamplerStateError(f"{name}: field {key!r} missing or not {typ.__name__}")
        if "latent" not in f:
            raise SamplerStateError(f"{name}: tensor 'latent' missing")
        latent = f.get("latent")                                 # [C, h, w] f32
        spectrum = None
        sp = meta.get("spectrum")
        if sp is not None:
            if not (isinstance(sp, dict) and isinstance(sp.get("calls"), list)
                    and isinstance(sp.get("cached"), int) and isinstance(sp.get("window"), (int, float))):
                raise SamplerStateError(f"{name}: field 'spectrum' is malformed")
            x0s = []
            for i in range(len(sp["calls"])):
                key = f"spectrum.x0.{i}"
                if key not in f:
                    raise SamplerStateError(f"{name}: tensor {key!r} missing")
                x0 = f.get(key)
                if x0.shape != latent.shape:
                    raise SamplerStateError(f"{name}: tensor {key!r} has shape {x0.shape}, latent {latent.shape}")
                x0s.append(x0)
            spectrum = SpectrumState(window=float(sp["window"]), cached=sp["cached"], calls=list(sp["calls"]), x0s=x0s)
        return cls(settings=meta["settings"], step=meta["step"], latent=latent, spectrum=spectrum,
                   computed=meta["computed"], forecast=meta["forecast"], seed=meta.get("seed"),
                   noise=meta.get("noise"))
