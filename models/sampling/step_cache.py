"""Step caches: ComfyUI's EasyCache and LazyCache nodes (comfy_extras/nodes_easycache.py in comfyanonymous/ComfyUI),
reproduced call for call: the same model calls reused, the same picture. docs/samplers.md ("Step caches") has the
rules in words; this module is written from them, not from ComfyUI's code.

Both measure, at each model call inside [start_percent, end_percent), how far the model's input moved since the last
call that ran the model (mean |Δ| over every 8th latent row and column), turn it into an estimated output change with
the output/input change ratio of the last two computed calls, and add that up; while the sum stays below
reuse_threshold the call is not made and its output is the call's input plus the difference output - input the last
computed call left (for easycache, as ComfyUI's in-place add makes it: reused_outputs). A call that runs the model
resets the sum.

    easycache   per CFG pass (ComfyUI's DIFFUSION_MODEL wrapper): the passes' raw outputs (velocities) each get
                their own difference; the input/output figures follow the first pass of ComfyUI's batch, which is the
                unconditional one (the conditional one at cfg 1); the output norm is over the whole batch. Calls
                before start_percent update only the differences.
    lazycache   on the CFG-combined denoised latent (ComfyUI's PREDICT_NOISE wrapper): one difference, and calls
                before start_percent update every figure.

The unit is the model call, not the sampler step: a two-call sampler (heun, dpmpp_sde, ...) may reuse one of its
calls and compute the other, as in ComfyUI. Scalars are float32 as ComfyUI's tensors are; the sigma bounds are
ComfyUI's model_sampling.percent_to_sigma for the flow model (a shifted 1 - percent), compared in float32.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

import numpy as np

from models.base.schema import Float, Record

log = logging.getLogger(__name__)

F32 = np.float32
SUBSAMPLE = 8            # ComfyUI's subsample_factor: every 8th latent row and column enters the change figures
KINDS = ("easycache", "lazycache")
NODE_NAMES = {"easycache": "EasyCache", "lazycache": "LazyCache"}


class CacheSettings(Record, frozen=True):
    """prompt.json's `cache`: ComfyUI's node inputs, names, defaults and bounds (its EasyCache/LazyCache schema)."""

    KEY_NOUN: ClassVar[str] = "setting"

    kind: Literal[KINDS] = "easycache"
    reuse_threshold: Float(0.0, 3.0) = 0.2
    start_percent: Float(0.0, 1.0) = 0.15
    end_percent: Float(0.0, 1.0) = 0.95
    verbose: bool = False

    @property
    def node(self) -> str:
        return NODE_NAMES[self.kind]


def time_snr_shift(shift: float, t: float) -> float:
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def percent_to_sigma(percent: float, shift: float) -> float:
    """ComfyUI's ModelSamplingDiscreteFlow.percent_to_sigma: 1 at 0 %, 0 at 100 %, else the shifted 1 - percent."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return time_snr_shift(shift, 1.0 - percent)


@dataclass
class CacheState:
    """What a cache carries between model calls (saved with the sampler state after every finished step).

    tracking: the first pass has been chosen (ComfyUI's first_cond_uuid; EasyCache only). x_prev / out_prev: the
    subsampled input and output of the last computed call; norm: its mean |output|; rate: output change / input
    change between the last two computed calls; total: the estimated change summed since; diffs: output - input of
    the last computed call, one per output (EasyCache: per pass in the pipeline's order, cond then uncond)."""

    tracking: bool = False
    x_prev: Optional[np.ndarray] = None
    out_prev: Optional[np.ndarray] = None
    norm: Optional[np.float32] = None
    rate: Optional[np.float32] = None
    total: np.float32 = F32(0.0)
    diffs: list = field(default_factory=list)
    run: int = 0                     # model calls made and reused while the cache was on
    reused: int = 0
    pending: Optional[tuple] = None  # the decision for the call at hand: (call key, reuse, input change, tracked)

    SCALARS: ClassVar[tuple] = ("norm", "rate", "total")


def subsample(x: np.ndarray) -> np.ndarray:
    """Every SUBSAMPLE-th row and column of a [C, h, w] latent (a copy)."""
    return np.array(x[..., ::SUBSAMPLE, ::SUBSAMPLE], dtype=F32)


def mean_abs(*arrays: np.ndarray) -> np.float32:
    """mean |a| over all the arrays' elements, as float32 (summed in float64: no order-dependent rounding)."""
    total = sum(float(np.abs(a, dtype=np.float64).sum()) for a in arrays)
    return F32(total / sum(a.size for a in arrays))


class StepCache:
    """One job's cache rule: bounds fixed from the settings and the sampler's shift; every call's state in a
    CacheState. `passes` is the CFG passes of a call (1 at cfg 1)."""

    def __init__(self, settings: CacheSettings, shift: float, passes: int):
        self.settings, self.passes = settings, int(passes)
        self.start_t = F32(percent_to_sigma(settings.start_percent, shift))
        self.end_t = F32(percent_to_sigma(settings.end_percent, shift))
        self.threshold = F32(settings.reuse_threshold)

    @property
    def per_pass(self) -> bool:
        return self.settings.kind == "easycache"

    def decide(self, st: CacheState, key: tuple, x: np.ndarray, sigma: float) -> bool:
        """True when the call at `key` (step, stage) reuses the cached difference instead of running the model.
        Asked again for the same call, the same answer (the figures move once per call)."""
        if st.pending is not None and st.pending[0] == key:
            return st.pending[1]
        s = F32(sigma)
        if not s > self.end_t:                   # past the end: the model runs, nothing is recorded
            st.pending = (key, False, None, None)
            return False
        inside = bool(s <= self.start_t)
        tracked = st.tracking if self.per_pass else True
        change, reuse = None, False
        if inside:
            if self.per_pass and not st.tracking:
                st.tracking = tracked = True
            if tracked and st.x_prev is not None:
                change = mean_abs(subsample(x) - st.x_prev)
                reuse = self._accumulate(st, change)
        st.pending = (key, reuse, change, tracked)
        return reuse

    def _accumulate(self, st: CacheState, change: np.float32) -> bool:
        if st.norm is None or st.rate is None:
            return False
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            st.total = F32(st.total + F32(st.rate * change) / st.norm)
        if st.total < self.threshold and len(st.diffs) == (self.passes if self.per_pass else 1):
            if self.settings.verbose:
                log.info("%s: reusing a call; cumulative change %.6g < %.6g", self.settings.node, st.total,
                         self.threshold)
            return True
        if self.settings.verbose:
            log.info("%s: running the model; cumulative change %.6g", self.settings.node, st.total)
        st.total = F32(0.0)
        return False

    def reused_outputs(self, st: CacheState, x: np.ndarray, sigma: float) -> list:
        """The outputs of a reused call: its input plus each cached difference (lazycache: the denoised latent).

        easycache: the velocities that give ComfyUI's denoised for the call. ComfyUI's EasyCache adds the difference
        to the diffusion model's input tensor in place, and for a flow model (CONST: calculate_input returns its
        input) that tensor is also the model_input calculate_denoised reads, so a reused pass's denoised is
        x' - x'·sigma with x' = x + d, not x - (x + d)·sigma. The velocity returned is the one whose
        x - v·sigma is that denoised (sigma > 0 here: the cache only acts above end_percent's sigma)."""
        st.reused += 1
        st.pending = None
        if not self.per_pass:
            return [x + d for d in st.diffs]
        s = F32(sigma)
        outs = []
        for d in st.diffs:
            aliased = x + d                           # the model input after ComfyUI's in-place add
            den = aliased - aliased * s
            outs.append(((x - den) / s).astype(F32))
        return outs

    def record(self, st: CacheState, x: np.ndarray, outputs: list) -> None:
        """After a computed call at input `x`: `outputs` are, for easycache, the passes' velocities in the
        pipeline's order (cond, uncond), for lazycache the CFG denoised latent alone."""
        pending, st.pending = st.pending, None
        st.run += 1
        if pending is None or pending[2] is None and pending[3] is None:   # past the end: nothing recorded
            return
        change, tracked = pending[2], pending[3]
        batch = list(reversed(outputs)) if self.per_pass else list(outputs)   # ComfyUI's batch order: uncond first
        first = batch[0]
        if tracked and st.norm is not None:
            out_change = mean_abs(subsample(first) - st.out_prev)
            if change is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    st.rate = F32(out_change / change)
        st.diffs = [np.asarray(o, F32) - x for o in outputs]
        if tracked:
            st.x_prev, st.out_prev, st.norm = subsample(x), subsample(first), mean_abs(*batch)


# ---- the sampler state file's part ------------------------------------------------------------------------------------
TENSOR_PREFIX = "cache."


def _scalar_out(v) -> Optional[object]:
    """A float32 scalar for JSON: non-finite ones (a zero input change makes the rate infinite) as text."""
    if v is None:
        return None
    f = float(v)
    return f if np.isfinite(f) else repr(f)


def _scalar_in(v, name: str) -> Optional[np.float32]:
    if v is None:
        return None
    if type(v) in (int, float) or v in ("inf", "-inf", "nan"):
        return F32(float(v))
    raise ValueError(f"cache scalar {name!r} is {str(v)[:40]!r}")


def state_part(st: CacheState) -> tuple:
    """(tensors {name: [C, h, w] f32}, meta {JSON}) of a cache between steps."""
    tensors = {f"{TENSOR_PREFIX}diff.{i}": d for i, d in enumerate(st.diffs)}
    for name in ("x_prev", "out_prev"):
        if getattr(st, name) is not None:
            tensors[TENSOR_PREFIX + name] = getattr(st, name)
    meta = {"tracking": bool(st.tracking), "diffs": len(st.diffs), "run": int(st.run), "reused": int(st.reused),
            **{k: _scalar_out(getattr(st, k)) for k in CacheState.SCALARS}}
    return tensors, meta


def restore_part(meta: dict, tensors: dict) -> CacheState:
    """The CacheState of state_part's (meta, tensors); ValueError naming what is wrong otherwise."""
    if not isinstance(meta, dict) or set(meta) != {"tracking", "diffs", "run", "reused", *CacheState.SCALARS}:
        raise ValueError(f"cache part has fields {sorted(meta) if isinstance(meta, dict) else meta!r}")
    if not isinstance(meta["tracking"], bool) or not all(type(meta[k]) is int and 0 <= meta[k] <= 10**6
                                                        for k in ("diffs", "run", "reused")) or meta["diffs"] > 2:
        raise ValueError("cache part's counts are malformed")
    want = {f"{TENSOR_PREFIX}diff.{i}" for i in range(meta["diffs"])}
    have = set(tensors)
    extra = have - want - {TENSOR_PREFIX + "x_prev", TENSOR_PREFIX + "out_prev"}
    if not want <= have or extra:
        raise ValueError(f"cache tensors {sorted(have)} do not match {meta['diffs']} differences")
    if (TENSOR_PREFIX + "x_prev" in have) != (TENSOR_PREFIX + "out_prev" in have):
        raise ValueError("cache tensors x_prev and out_prev come together")
    st = CacheState(tracking=meta["tracking"], run=meta["run"], reused=meta["reused"],
                    diffs=[tensors[f"{TENSOR_PREFIX}diff.{i}"] for i in range(meta["diffs"])],
                    x_prev=tensors.get(TENSOR_PREFIX + "x_prev"), out_prev=tensors.get(TENSOR_PREFIX + "out_prev"))
    for k in CacheState.SCALARS:
        setattr(st, k, _scalar_in(meta[k], k))
    if st.total is None:
        raise ValueError("cache scalar 'total' is missing")
    return st
