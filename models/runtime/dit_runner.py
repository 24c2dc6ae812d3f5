"""The in-process DiT forward through a pack: numpy host ops plus every branch, in strict block order, via a backend."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from models.dit import host_ops
from models.quant.smooth import SMOOTH_KEY
from models.runtime.backends.base import BranchBackend
from models.runtime.lifecycle import Lifecycle, context_factory, single_context
from models.lora.apply import DitLora
from models.runtime.phase_times import PhaseSums, PhaseTimes, add_call
from models.packs.pack import Pack, load_pack
from models.packs.sharded import ShardResolver
from models.dit.partition import BRANCHES, KINDS, NUMPY_DTYPES, branch_inputs, context_mask
from models.board.policy import MAX_PREFETCH, Policy, resolve_policy
from models.dit.rope import rope_tables

log = logging.getLogger(__name__)

CONTEXTS_KEPT = 16        # converted contexts a runner keeps (1 MiB each at 512 x 1024 f16): a job's conditionings
AHEAD = MAX_PREFETCH      # branch files named as prefetch hints per call (the deepest prefetch a policy may use)


@dataclass
class ForwardTiming:
    """Seconds of one forward: every branch call's PhaseTimes, summed per kind; host ops measured span by span."""
    per_kind: dict = field(default_factory=lambda: {k: PhaseSums() for k in KINDS})
    branches: list = field(default_factory=list)      # [(block, kind, PhaseTimes)] one per call, in call order
    host_spans: list = field(default_factory=list)    # [(block, kind, pass, t0, t1)] host ops of one pass (monotonic)
    passes: list = field(default_factory=list)        # [(passes of the call,)] parallel to `branches`
    host_s: float = 0.0                               # every host op (embedding, LayerNorm, residual, final layer)
    total_s: float = 0.0

    def add(self, block: int, kind: str, t: PhaseTimes, passes: tuple = ()) -> None:
        add_call(self.per_kind, kind, t)
        self.branches.append((block, kind, t))
        self.passes.append(tuple(passes))

    def merged(self, other: "ForwardTiming") -> "ForwardTiming":
        """Both forwards' figures as one (a sampler step that calls the model twice)."""
        out = ForwardTiming(branches=self.branches + other.branches, host_spans=self.host_spans + other.host_spans,
                            passes=self.passes + other.passes, host_s=self.host_s + other.host_s,
                            total_s=self.total_s + other.total_s)
        for timing in (self, other):
            for k, ps in timing.per_kind.items():
                out.per_kind[k].merge(ps)
        return out

    @property
    def branch_s(self) -> float:
        """Critical-path seconds of the branch calls (visible lifecycle + inference)."""
        return sum(t.total_s for t in self.per_kind.values())

    def overlaps(self) -> list:
        """[(host span, (block, kind, pass, infer start, infer end))]: host ops of one pass that ran while another
        pass was inferring (interleave), found from the calls' own timestamps; empty when nothing overlapped."""
        infers = [(b, k, p, a, a + s) for (b, k, t), ps in zip(self.branches, self.passes)
                  for p, a, s in zip(ps, t.infer_at, t.infer_s)]
        out = []
        for span in self.host_spans:
            for inf in infers:
                if inf[2] != span[2] and span[3] < inf[4] and inf[3] < span[4]:
                    out.append((span, inf))
        return out

    @property
    def host_hidden_s(self) -> float:
        """Host-op seconds that ran while a branch was inferring (the union of inference intervals)."""
        ivs = sorted((a, a + s) for t in (x[2] for x in self.branches) for a, s in zip(t.infer_at, t.infer_s))
        merged: list = []
        for a, e in ivs:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([a, e])
        hidden = 0.0
        for _, _, _, t0, t1 in self.host_spans:
            hidden += sum(max(0.0, min(t1, e) - max(t0, a)) for a, e in merged if a < t1 and t0 < e)
        return hidden

    def to_dict(self) -> dict:
        return {"per_kind": {k: t.to_dict() for k, t in self.per_kind.items()}, "host_s": self.host_s,
                "host_hidden_s": self.host_hidden_s, "branch_s": self.branch_s, "total_s": self.total_s,
                "branches": [{"block": b, "kind": k, **t.to_dict()} for b, k, t in self.branches]}

    def table(self) -> str:
        rows = [f"{'kind':<8}{'load s':>10}{'init s':>10}{'infer s':>10}{'release s':>11}{'visible s':>11}"
                f"{'cached':>8}"]
        tot = PhaseSums()
        for k, t in self.per_kind.items():
            tot.merge(t)
            rows.append(f"{k:<8}{t.load_s:>10.3f}{t.init_s:>10.3f}{t.infer_s:>10.3f}{t.release_s:>11.3f}"
                        f"{t.visible_s:>11.3f}{t.cached:>8d}")
        rows.append(f"{'branches':<8}{tot.load_s:>10.3f}{tot.init_s:>10.3f}{tot.infer_s:>10.3f}"
                    f"{tot.release_s:>11.3f}{tot.visible_s:>11.3f}{tot.cached:>8d}")
        rows.append(f"host ops {self.host_s:.3f} s ({self.host_hidden_s:.3f} s behind inference), forward total "
                    f"{self.total_s:.3f} s")
        return "\n".join(rows)


@dataclass(frozen=True)
class BranchCall:
    """One call the runner makes: a branch and some of its passes (all of them, or one with interleave)."""
    block: int
    kind: str
    path: str
    passes: tuple                    # pass indices this call carries (0 = cond, 1 = uncond, 2+ = probe passes)
    feeds: list                      # one {input name: array} per pass
    ahead: tuple = ()                # branch files that follow, in order (prefetch hints)
    hold: bool = False               # another pass of this branch follows: keep the model loaded


class LocalBranches:
    """The runner's branch side in process: calls go to a Lifecycle (inline, or on its worker thread when the
    runner interleaves, so host ops of one pass run while the other infers)."""

    def __init__(self, lifecycle: Lifecycle):
        self.lifecycle = lifecycle
        self.interleave = lifecycle.policy.interleave

    def submit(self, call: BranchCall):
        if self.interleave:
            return self.lifecycle.submit(call.path, call.feeds, call.ahead, call.hold)
        return _Done(self.lifecycle.run(call.path, call.feeds, call.ahead, call.hold))

    def close(self) -> None:
        self.lifecycle.close()


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class DiTRunner:
    """Host ops + branches in one process, through one Lifecycle (models/runtime/lifecycle.py) under a policy."""

    def __init__(self, pack: Union[Pack, str], backend: Union[str, BranchBackend] = "onnx",
                 threads: Optional[int] = None, check: bool = True, policy: Union[str, Policy] = "on-demand",
                 branches=None, after_release=None, host_pace=None):
        """branches: an object with submit(BranchCall) -> handle with result() -> (outputs per pass, PhaseTimes)
        and an `interleave` flag; replaces the local lifecycle (the scheduler sends each call to the executor this
        way). The host-op sequence around it is the same, so both give bitwise-identical results.
        host_pace(t0): called after each pass's host op that began at monotonic t0 (the scheduler holds it to a
        modelled board's host time in board-sim mode; the span then covers the held time)."""
        self.pack = pack if isinstance(pack, Pack) else load_pack(pack, check=check)
        self.cfg = self.pack.config
        self.geom = self.pack.geometry
        if branches is None:
            if isinstance(backend, str):
                kw = {"threads": threads} if threads is not None else {}
                factory = context_factory(backend, **kw)
                name = backend
            else:
                factory, name = single_context(backend), backend.name
            pol = resolve_policy(policy, name, factory.backend_class, packs=(self.pack.dir,)) \
                if not isinstance(policy, Policy) else policy
            branches = LocalBranches(Lifecycle(factory, pol, after_release=after_release,
                                               shards_of=ShardResolver()))
        self.branches = branches
        self.host_pace = host_pace
        self.io_np = NUMPY_DTYPES[self.pack.io_dtype]
        self.base_weights = self.pack.host_weights()                  # FP32 host tensors, as the pack holds them
        self.weights = self.base_weights                              # ... with the job's LoRAs merged (set_lora)
        self.lora = DitLora(None, self.cfg, self.geom, self.pack.dtype)
        self._lora_feed: tuple = (None, {})                           # ((block, kind), its LoRA inputs)
        cos, sin = rope_tables(self.geom.h_tokens, self.geom.w_tokens, self.cfg.head_dim)  # [L, hd/2] f32
        self.rope = {"rope_cos": cos.astype(self.io_np), "rope_sin": sin.astype(self.io_np)}
        self._contexts: dict = {}      # id(source) -> (source, [S, Dc] io dtype): each context converted once
        self._row_masks: dict = {}     # context rows -> its mask [S]
        self.last_timing: Optional[ForwardTiming] = None

    def set_lora(self, plan=None, overflow: str = "refuse", where: str = "", between=None) -> DitLora:
        """Apply a LoraPlan (models.lora.plan) from the next forward on: host layers merged into FP32 copies of the
        pack's weights, branch layers as a LoRA-ready pack's low-rank inputs; None: back to the plain pack. Nothing
        is reloaded (the branch graphs take the factors as inputs). `between()` runs between layers (a cancel
        check that raises)."""
        lora = DitLora(plan, self.cfg, self.geom, self.pack.dtype, overflow, where, between=between)
        self.weights = lora.host_weights(self.base_weights)
        self.lora, self._lora_feed = lora, (None, {})
        return lora

    def close(self) -> None:
        """Release what the local lifecycle holds (resident, prefetched models) and stop its threads."""
        close = getattr(self.branches, "close", None)
        if close is not None:
            close()

    # -- input checks ---------------------------------------------------------------------------------------------
    def _check_x(self, x, name: str = "x") -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        want = (self.cfg.latent_channels, self.geom.latent_h, self.geom.latent_w)
        if x.shape != want:
            raise ValueError(f"{name} has shape {list(x.shape)}, this pack ({self.geom.width}x{self.geom.height}) "
                             f"wants {list(want)}")
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or Inf")
        return x

    def _check_context(self, c, name: str = "context") -> np.ndarray:
        c = np.asarray(c, dtype=np.float32)
        want = (self.geom.text_tokens, self.cfg.context_dim)
        if c.shape != want:
            raise ValueError(f"{name} has shape {list(c.shape)}, expected {list(want)}")
        if not np.isfinite(c).all():
            raise ValueError(f"{name} contains NaN or Inf")
        return c

    def _context(self, c, name: str) -> np.ndarray:
        """A pass's context as the branches take it, checked and converted once per source array: every call after
        the first hands the branches the same array, so the scheduler's arena slot for it is written once
        (stages/scheduler.BranchClient._input), not every step; several conditionings taking turns in one pass
        (models/sampling/cond_mix.py) each keep theirs. A source must not change in place while the runner uses it
        (a DENOISE's contexts are its own copies; a new DENOISE has a new runner)."""
        kept = self._contexts.get(id(c))
        if kept is not None and kept[0] is c:
            return kept[1]
        out = self._check_context(c, name).astype(self.io_np)                       # [S, Dc] io dtype
        if len(self._contexts) >= CONTEXTS_KEPT:
            self._contexts.pop(next(iter(self._contexts)))                           # the oldest
        self._contexts[id(c)] = (c, out)                                             # (c held: its id stays its own)
        return out

    @staticmethod
    def _check_sigma(sigma) -> float:
        s = float(np.asarray(sigma, dtype=np.float64).reshape(()))  # raises on non-scalars
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"sigma {sigma!r} must be a finite number >= 0")
        return s

    # -- forward ----------------------------------------------------------------------------------------------------
    def forward(self, x, sigma, context) -> np.ndarray:
        """x [C, h, w] f32, sigma, context [S, Dc] f32 -> v [C, h, w] f32."""
        return self.forward_passes([x], sigma, [context])[0]

    def forward_cfg(self, x, sigma, ctx_cond, ctx_uncond, context_rows=None) -> tuple:
        """Both CFG passes, each branch loaded once (cond then uncond) -> (v_cond, v_uncond)."""
        v = self.forward_passes([x, x], sigma, [ctx_cond, ctx_uncond], context_rows=context_rows)
        return v[0], v[1]

    def _masks(self, context_rows, n: int) -> list:
        """Per pass: the context mask [S] of a long-context pack (rows past ComfyUI's context masked), else None."""
        if not self.geom.long_context:
            return [None] * n
        S = self.geom.text_tokens
        rows = list(context_rows) if context_rows else [S] * n
        if len(rows) != n or not all(1 <= int(r) <= S for r in rows):
            raise ValueError(f"context_rows {rows!r}: need {n} row counts in [1, {S}]")
        for r in rows:                       # one array per row count, each call: a "pass" input written once
            if int(r) not in self._row_masks:
                self._row_masks[int(r)] = context_mask(r, S, self.io_np)
        return [self._row_masks[int(r)] for r in rows]

    def forward_passes(self, xs: list, sigma, contexts: list, trace: Optional[list] = None, probe=None,
                       context_rows=None) -> list:
        """Several passes sharing sigma, run branch by branch in lockstep.

        trace: a list that receives per-block records {"self": {"xn", "y"}, "cross": ..., "ffn": ..., "x_out"} of
        pass 0 (all f32). probe: an object with feed(block, kind) -> {name: array} | None and result(block, kind, y);
        a feed it returns runs as one more pass of that branch (inputs it omits are pass 0's), outside the forward
        (verification feeds reference inputs this way without loading a branch twice). context_rows: per pass, the
        rows of ComfyUI's context (partition.context_rows) a long-context pack leaves unmasked; default all."""
        if len(xs) != len(contexts) or not xs:
            raise ValueError("need one context per latent (and at least one pass)")
        t_start = time.perf_counter()
        xs = [self._check_x(x, f"x[{i}]" if len(xs) > 1 else "x") for i, x in enumerate(xs)]
        ctxs = [self._context(c, f"context[{i}]" if len(xs) > 1 else "context") for i, c in enumerate(contexts)]
        masks = self._masks(context_rows, len(xs))
        sigma = self._check_sigma(sigma)
        cfg, W, timing = self.cfg, self.weights, ForwardTiming()
        # 1) tokens, timestep embedding and every block's modulation (once per sigma)
        t0 = time.monotonic()
        hidden, grid = [], None
        for x in xs:
            tok, grid = host_ops.patchify(x)                                        # [L, (C+1)*4]
            hidden.append(host_ops.embed(tok, W["x_embedder.proj.1.weight"]))        # [L, D] f32
        emb, lora = host_ops.t_embedding(W, sigma, cfg)                              # [D], [3D]
        mods = host_ops.block_modulations(W, emb, lora, cfg)                         # [blocks, 3, 3, D]
        if SMOOTH_KEY in W:                        # a W8A8 pack: the branches take xn / s (models/quant/smooth.py)
            mods = host_ops.fold_smoothing(mods, W[SMOOTH_KEY])
        timing.host_s += time.monotonic() - t0
        # 2) blocks in strict order (per pass); per branch: host LayerNorm+modulate, the branch, host gate+residual
        units = [(block, j) for block in range(cfg.blocks) for j in range(len(BRANCHES))]
        paths = [str(self.pack.branch_path(b, BRANCHES[j].kind)) for b, j in units]
        run = self._interleaved if getattr(self.branches, "interleave", False) and probe is None else self._lockstep
        run(units, paths, hidden, list(zip(ctxs, masks)), mods, timing, trace, probe)
        # 3) final layer, unpatchify, crop
        t0 = time.monotonic()
        vs = []
        for h in hidden:
            out = host_ops.final_layer(W, h, emb, lora, cfg)                         # [L, C*4]
            vs.append(host_ops.unpatchify(out, grid[0], grid[1], self.geom.latent_h, self.geom.latent_w,
                                          cfg.latent_channels))                      # [C, h, w]
        timing.host_s += time.monotonic() - t0
        timing.total_s = time.perf_counter() - t_start
        self.last_timing = timing
        log.info("forward (%d pass%s): %.2f s (branches %.2f s, host %.2f s)", len(xs), "es" if len(xs) > 1 else "",
                 timing.total_s, timing.branch_s, timing.host_s)
        return vs

    def _branch_lora(self, block: int, kind: str) -> dict:
        """The LoRA inputs of one branch (a LoRA-ready pack), made once for all the passes of a call."""
        if self._lora_feed[0] != (block, kind):
            self._lora_feed = ((block, kind), self.lora.branch_inputs(block, kind))
        return self._lora_feed[1]

    def _feed(self, spec, block: int, xn: np.ndarray, ctx: tuple) -> dict:
        """One pass's inputs of a branch; ctx = (context [S, Dc], context mask [S] or None) of that pass."""
        avail = {"xn": xn.astype(self.io_np), "context": ctx[0], "context_mask": ctx[1], **self.rope,
                 **self._branch_lora(block, spec.kind)}
        return {i.name: avail[i.name] for i in branch_inputs(spec, self.geom)}

    def _host(self, timing: ForwardTiming, block: int, kind: str, p: int, fn):
        """Run one pass's host op, timed as a span (for host_s and the interleave overlap)."""
        t0 = time.monotonic()
        out = fn()
        if self.host_pace is not None:
            self.host_pace(t0)
        t1 = time.monotonic()
        timing.host_s += t1 - t0
        timing.host_spans.append((block, kind, p, t0, t1))
        return out

    def _lockstep(self, units, paths, hidden, ctxs, mods, timing, trace, probe) -> None:
        """Every pass of a branch in one call (one model load for both CFG passes; dual_core runs them at once)."""
        rec: dict = {}
        for i, (block, j) in enumerate(units):
            spec = BRANCHES[j]
            shift, scale, gate = mods[block, j]                                      # [D] each
            xns = [self._host(timing, block, spec.kind, p, lambda h=h: host_ops.layernorm_modulate(h, shift, scale))
                   for p, h in enumerate(hidden)]                                    # [L, D] f32
            feeds = [self._feed(spec, block, xn, ctx) for xn, ctx in zip(xns, ctxs)]
            extra = probe.feed(block, spec.kind) if probe is not None else None
            if extra is not None:
                feeds.append({**feeds[0], **{k: np.asarray(v).astype(self.io_np) for k, v in extra.items()}})
            call = BranchCall(block, spec.kind, paths[i], tuple(range(len(feeds))), feeds,
                              tuple(paths[i + 1:i + 1 + AHEAD]))
            outs, t = self.branches.submit(call).result()
            timing.add(block, spec.kind, t, call.passes)
            if extra is not None:
                probe.result(block, spec.kind, outs.pop()[spec.outputs[0].name])
            ys = [o[spec.outputs[0].name] for o in outs]                            # [L, D] pack dtype
            for p, (h, y) in enumerate(zip(hidden, ys)):
                self._host(timing, block, spec.kind, p, lambda h=h, y=y: host_ops.gate_residual(h, gate, y))
            if trace is not None:
                rec[spec.kind] = {"xn": xns[0], "y": np.asarray(ys[0], np.float32)}
                if j == len(BRANCHES) - 1:
                    rec["x_out"] = hidden[0].copy()
                    trace.append(rec)
                    rec = {}

    def _interleaved(self, units, paths, hidden, ctxs, mods, timing, trace, probe) -> None:
        """One call per pass, the passes taking turns: pass p's host ops (the gate+residual of its previous branch,
        the LayerNorm+modulate of this one) run while the other pass's call infers. Each pass still goes through
        the blocks in strict order, and the first pass holds the model for the second (hold=True)."""
        n = len(hidden)
        pending: list = [None] * n                      # per pass: (handle, unit index) of its outstanding call
        rec: dict = {}

        def finish(p: int) -> None:
            handle, k = pending[p]
            pending[p] = None
            block, j = units[k]
            spec = BRANCHES[j]
            outs, t = handle.result()
            timing.add(block, spec.kind, t, (p,))
            y = outs[0][spec.outputs[0].name]                                        # [L, D] pack dtype
            gate = mods[block, j][2]
            self._host(timing, block, spec.kind, p, lambda: host_ops.gate_residual(hidden[p], gate, y))
            if trace is not None and p == 0:
                rec.setdefault(block, {})[spec.kind]["y"] = np.asarray(y, np.float32)
                if j == len(BRANCHES) - 1:
                    rec[block]["x_out"] = hidden[0].copy()
                    trace.append(rec.pop(block))
        try:
            for i, (block, j) in enumerate(units):
                spec = BRANCHES[j]
                shift, scale, _ = mods[block, j]
                for p in range(n):
                    if pending[p] is not None:
                        finish(p)
                    xn = self._host(timing, block, spec.kind, p,
                                    lambda: host_ops.layernorm_modulate(hidden[p], shift, scale))
                    if trace is not None and p == 0:
                        rec.setdefault(block, {})[spec.kind] = {"xn": xn}
                    call = BranchCall(block, spec.kind, paths[i], (p,), [self._feed(spec, block, xn, ctxs[p])],
                                      tuple(paths[i + 1:i + 1 + AHEAD]), hold=p < n - 1)
                    pending[p] = (self.branches.submit(call), i)
            for p in range(n):
                finish(p)
        finally:
            for p in range(n):                          # after an error: let outstanding calls end before leaving
                if pending[p] is not None:
                    try:
                        pending[p][0].result()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
