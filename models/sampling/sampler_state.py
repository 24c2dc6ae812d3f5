"""The sampler's resumable state and its file form: one safetensors file (tensors + JSON metadata), written durably."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

import numpy as np

from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile, TensorEntry, write_safetensors
from models.sampling.k_sampling import SamplerRun, SamplerRunError, restore_run, run_state
from models.sampling.noise import TorchCpuGenerator
from models.sampling.spectrum import SpectrumState
from models.sampling import step_cache as sc

log = logging.getLogger(__name__)

STATE_VERSION = 2
READ_VERSIONS = (1, 2)          # version 1: Euler only, no `run` part (an Euler job saved then still resumes)
META_KEY = "anima_sampler_state"
RUN_PREFIX = "run."             # the sampler's own tensors (models.sampling.k_sampling.run_state) carry this prefix


class SamplerStateError(ValueError):
    """A state file that cannot be restored; the message names the file and what is wrong."""


class SamplerState:
    """Everything needed to continue a run after any finished step.

    `step` is the next step to run (0-based; == steps when done); `latent` is the sampler's x at sigma[step].
    `computed` and `forecast` list finished steps, 1-based; `nfe` the model calls of each finished step. `run` is the
    sampler's whole progress (models.sampling.k_sampling.SamplerRun: the latent, multistep history, the noise generator's
    position); `step` and `latent` are its. `seed` and `noise` name the seed and noise mode of the starting latent.
    `cache` is the step cache's (models.sampling.step_cache.CacheState) and `skipped` the calls it reused per finished
    step; `step_reused` counts those of the step under way (always 0 between steps, so never saved).
    """

    def __init__(self, settings: dict, step: int, latent: np.ndarray, spectrum: Optional[SpectrumState] = None,
                 computed=None, forecast=None, seed: Optional[int] = None, noise: Optional[str] = None,
                 run: Optional[SamplerRun] = None, nfe=None, cache: Optional[sc.CacheState] = None, skipped=None):
        self.settings = settings                       # Sampler.settings(): sampler, steps, cfg, schedule, ...
        self.run = run if run is not None else SamplerRun(step=int(step), stage=0, x=latent)
        self.run.step, self.run.x = int(step), latent
        self.spectrum = spectrum
        self.computed = list(computed or [])
        self.forecast = list(forecast or [])
        self.nfe = list(nfe or [])
        self.skipped = list(skipped) if skipped is not None else [0] * len(self.nfe)
        self.cache, self.step_reused = cache, 0
        self.seed, self.noise = seed, noise

    @property
    def step(self) -> int:
        return self.run.step

    @step.setter
    def step(self, v: int) -> None:
        self.run.step = v

    @property
    def latent(self) -> np.ndarray:                    # [C, h, w] f32
        return self.run.x

    @latent.setter
    def latent(self, v: np.ndarray) -> None:
        self.run.x = v

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the state file holds (latent, the sampler's run, Spectrum's history)."""
        r = self.run
        arrays = [r.x, *r.arrays.values(), *(a for v in r.lists.values() for a in v)]
        arrays += self.spectrum.x0s if self.spectrum is not None else []
        arrays += list(sc.state_part(self.cache)[0].values()) if self.cache is not None else []
        return sum(a.nbytes for a in arrays) + (624 * 8 + 8 if r.gen is not None else 0)

    def copy(self) -> "SamplerState":
        sp = None
        if self.spectrum is not None:
            sp = SpectrumState(window=self.spectrum.window, cached=self.spectrum.cached,
                               calls=list(self.spectrum.calls), x0s=[a.copy() for a in self.spectrum.x0s])
        r = self.run
        run = SamplerRun(step=r.step, stage=r.stage, x=r.x.copy(), arrays={k: v.copy() for k, v in r.arrays.items()},
                         lists={k: [a.copy() for a in v] for k, v in r.lists.items()},
                         scalars=json.loads(json.dumps(r.scalars)),
                         gen=None if r.gen is None else TorchCpuGenerator.from_state(r.gen.state()))
        cache = None
        if self.cache is not None:
            tensors, meta = sc.state_part(self.cache)
            cache = sc.restore_part(meta, {k: v.copy() for k, v in tensors.items()})
        return SamplerState(dict(self.settings), self.step, run.x, sp, list(self.computed), list(self.forecast),
                            self.seed, self.noise, run=run, nfe=list(self.nfe), cache=cache, skipped=list(self.skipped))

    # ---- file form -------------------------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write to `path` durably and atomically (write_safetensors goes through models.base.durable.atomic_write): a
        reader, or a resume after a power cut, sees the old state or the new one, never half. Saved between steps."""
        if self.run.stage != 0:
            raise SamplerStateError(f"a sampler state is saved between steps, not inside step {self.step + 1}")
        run_tensors, run_meta = run_state(self.run)
        meta = {
            "version": STATE_VERSION, "settings": self.settings, "step": int(self.step),
            "computed": [int(s) for s in self.computed], "forecast": [int(s) for s in self.forecast],
            "nfe": [int(n) for n in self.nfe],
            "seed": None if self.seed is None else int(self.seed), "noise": self.noise,
            "spectrum": None if self.spectrum is None else {
                "window": float(self.spectrum.window), "cached": int(self.spectrum.cached),
                "calls": [int(c) for c in self.spectrum.calls]},
            "run": {**run_meta, "gen": self.run.gen is not None},
            "skipped": [int(n) for n in self.skipped],
        }
        cache_tensors = {}
        if self.cache is not None:
            cache_tensors, meta["cache"] = sc.state_part(self.cache)
        lat = np.ascontiguousarray(self.latent, dtype=np.float32)
        entries = [TensorEntry("latent", "F32", tuple(lat.shape), lat)]
        for i, x0 in enumerate(self.spectrum.x0s if self.spectrum is not None else []):
            x0 = np.ascontiguousarray(x0, dtype=np.float32)
            entries.append(TensorEntry(f"spectrum.x0.{i}", "F32", tuple(x0.shape), x0))
        for k, v in run_tensors.items():
            dtype = "I64" if v.dtype.kind in "iu" else "F32"
            v = np.ascontiguousarray(v, dtype=np.int64 if dtype == "I64" else np.float32)
            entries.append(TensorEntry(RUN_PREFIX + k, dtype, tuple(v.shape), v))
        for k, v in cache_tensors.items():
            v = np.ascontiguousarray(v, dtype=np.float32)
            entries.append(TensorEntry(k, "F32", tuple(v.shape), v))
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
        version = meta.get("version") if isinstance(meta, dict) else None
        if type(version) is not int or version not in READ_VERSIONS:
            raise SamplerStateError(f"{name}: sampler state version {str(version)[:40]}, expected one of "
                                    f"{list(READ_VERSIONS)}")
        for key, ok in (("settings", isinstance(meta.get("settings"), dict)),
                        ("step", _count(meta.get("step"))),
                        ("computed", _counts(meta.get("computed"))), ("forecast", _counts(meta.get("forecast"))),
                        ("seed", meta.get("seed") is None or _count(meta.get("seed"), 2**64 - 1)),
                        ("noise", meta.get("noise") is None or isinstance(meta.get("noise"), str)),
                        ("nfe", meta.get("nfe") is None or _counts(meta.get("nfe"))),
                        ("skipped", meta.get("skipped") is None or (_counts(meta.get("skipped")) and
                                                                   len(meta["skipped"]) == len(meta.get("nfe") or []))),
                        ("run", meta.get("run") is None or _run_meta(meta.get("run")))):
            if not ok:
                raise SamplerStateError(f"{name}: field {key!r} missing or malformed")
        _check_header(f, meta, name)                                   # names and sizes, before any tensor is read
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
        run = None
        if meta.get("run") is not None:
            tensors = {k[len(RUN_PREFIX):]: _run_tensor(f, k, name) for k in f.keys() if k.startswith(RUN_PREFIX)}
            try:
                run = restore_run(meta["step"], latent, tensors, meta["run"], bool(meta["run"]["gen"]))
            except SamplerRunError as e:
                raise SamplerStateError(f"{name}: {e}") from None
        cache = _cache_part(f, meta, name, latent.shape)
        return cls(settings=meta["settings"], step=meta["step"], latent=latent, spectrum=spectrum,
                   computed=meta["computed"], forecast=meta["forecast"], seed=meta.get("seed"),
                   noise=meta.get("noise"), run=run, nfe=meta.get("nfe"), cache=cache, skipped=meta.get("skipped"))


def _cache_part(f: SafeTensorsFile, meta: dict, name: str, shape) -> Optional[sc.CacheState]:
    """The step cache's part of a state file (None when the job has none): its differences latent-sized, its
    subsampled input and output [C, ceil(h/8), ceil(w/8)]."""
    if meta.get("cache") is None:
        return None
    small = (shape[0], -(-shape[1] // sc.SUBSAMPLE), -(-shape[2] // sc.SUBSAMPLE))
    tensors = {}
    for key in f.keys():
        if key.startswith(sc.TENSOR_PREFIX):
            tensors[key] = _tensor(f, key, name, shape if ".diff." in key else small)
    try:
        return sc.restore_part(meta["cache"], tensors)
    except ValueError as e:
        raise SamplerStateError(f"{name}: {e}") from None


MAX_COUNT = 1_000_000          # steps, step lists, Spectrum call indices: far above any real run
RUN_TENSOR_PREFIXES = ("a.", "l.", "gen.")      # the sampler's arrays, list items, noise generator (k_sampling)
MAX_RUN_ELEMENTS = 4096         # the largest run tensor that is not latent-sized: the generator's state (624 words)


def _check_header(f: SafeTensorsFile, meta: dict, name: str) -> None:
    """What the header says, checked before a byte of tensor data is read: only the names a state holds (the latent,
    one Spectrum x0 per recorded call, the sampler's run tensors), none larger than a latent (or the generator's
    state), so a file padded with a huge tensor is refused at the cost of its header."""
    if "latent" not in f:
        raise SamplerStateError(f"{name}: tensor 'latent' missing")
    latent = math.prod(f.shape("latent"))
    sp = meta.get("spectrum")
    calls = len(sp["calls"]) if isinstance(sp, dict) and isinstance(sp.get("calls"), list) else 0
    x0s = {f"spectrum.x0.{i}" for i in range(calls)}
    for key in f.keys():
        run = key.startswith(RUN_PREFIX) and key[len(RUN_PREFIX):].startswith(RUN_TENSOR_PREFIXES)
        if key != "latent" and key not in x0s and not run and not key.startswith(sc.TENSOR_PREFIX):
            raise SamplerStateError(f"{name}: tensor {key[:80]!r} is not part of a sampler state")
        if math.prod(f.shape(key)) > max(latent, MAX_RUN_ELEMENTS):
            raise SamplerStateError(f"{name}: tensor {key[:80]!r} {list(f.shape(key))} is larger than the latent "
                                    f"{list(f.shape('latent'))}")


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


def _number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _run_meta(v) -> bool:
    """The JSON part of a run (models.sampling.k_sampling.run_state): scalars are numbers, null or lists of numbers."""
    if not (isinstance(v, dict) and set(v) == {"scalars", "lists", "gen"} and isinstance(v["gen"], bool)
            and isinstance(v["scalars"], dict) and isinstance(v["lists"], dict)):
        return False
    if len(v["scalars"]) > 64 or len(v["lists"]) > 64 or not all(_count(n, 64) for n in v["lists"].values()):
        return False
    return all(x is None or _number(x) or (isinstance(x, list) and len(x) <= 64 and all(_number(y) for y in x))
               for x in v["scalars"].values())


def _run_tensor(f: SafeTensorsFile, key: str, name: str) -> np.ndarray:
    """A sampler tensor of a state file: finite F32 (history, points) or I64 (the noise generator's position)."""
    dtype = f.dtype(key)
    if dtype not in ("F32", "I64") or len(f.shape(key)) > 4:
        raise SamplerStateError(f"{name}: tensor {key!r} is {dtype} {list(f.shape(key))}, expected F32 or I64")
    try:
        x = f.get(key, np.float32 if dtype == "F32" else np.int64)
    except (SafeTensorsError, OSError, ValueError) as e:
        raise SamplerStateError(f"{name}: tensor {key!r} cannot be read ({e})") from None
    if dtype == "F32" and not np.isfinite(x).all():
        raise SamplerStateError(f"{name}: tensor {key!r} holds NaN or Inf")
    return x
