"""The in-process DiT forward through a pack: numpy host ops plus every branch, in strict block order, via a backend."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from models import host_ops
from models.branch_runtime import BranchBackend, PhaseTimes, make_backend, run_branch
from models.pack import Pack, load_pack
from models.partition import BRANCHES, KINDS, NUMPY_DTYPES, branch_inputs, context_mask
from models.rope import rope_tables

log = logging.getLogger(__name__)


@dataclass
class ForwardTiming:
    """Seconds of one forward: branch phases summed per kind, per-branch detail, host ops, total."""
    per_kind: dict = field(default_factory=lambda: {k: PhaseTimes() for k in KINDS})
    branches: list = field(default_factory=list)      # [(block, kind, PhaseTimes)] in execution order
    host_s: float = 0.0
    total_s: float = 0.0

    def add(self, block: int, kind: str, t: PhaseTimes) -> None:
        self.per_kind[kind] = self.per_kind[kind] + t
        self.branches.append((block, kind, t))

    @property
    def branch_s(self) -> float:
        return sum(t.total_s for t in self.per_kind.values())

    def to_dict(self) -> dict:
        return {"per_kind": {k: t.to_dict() for k, t in self.per_kind.items()}, "host_s": self.host_s,
                "branch_s": self.branch_s, "total_s": self.total_s,
                "branches": [{"block": b, "kind": k, **t.to_dict()} for b, k, t in self.branches]}

    def table(self) -> str:
        rows = [f"{'kind':<8}{'load s':>10}{'init s':>10}{'infer s':>10}{'release s':>11}{'total s':>10}"]
        tot = PhaseTimes()
        for k, t in self.per_kind.items():
            tot = tot + t
            rows.append(f"{k:<8}{t.load_s:>10.3f}{t.init_s:>10.3f}{t.infer_s:>10.3f}{t.release_s:>11.3f}"
                        f"{t.total_s:>10.3f}")
        rows.append(f"{'branches':<8}{tot.load_s:>10.3f}{tot.init_s:>10.3f}{tot.infer_s:>10.3f}"
                    f"{tot.release_s:>11.3f}{tot.total_s:>10.3f}")
        rows.append(f"host ops {self.host_s:.3f} s, forward total {self.total_s:.3f} s")
        return "\n".join(rows)


class DiTRunner:
    """Host ops + branches in one process. Each branch: load, init, infer every pass, release (on-demand policy)."""

    def __init__(self, pack: Union[Pack, str], backend: Union[str, BranchBackend] = "onnx",
                 threads: Optional[int] = None, check: bool = True, branch_fn=None):
        """branch_fn(block, kind, path, feeds, next_path) -> (outputs per feed, PhaseTimes) replaces the local
        on-demand lifecycle (the scheduler sends each branch to the executor process this way); the host-op
        sequence around it stays the same, so both give bitwise-identical results for the same branch outputs."""
        self.branch_fn = branch_fn
        self.pack = pack if isinstance(pack, Pack) else load_pack(pack, check=check)
        self.cfg = self.pack.config
        self.geom = self.pack.geometry
        if isinstance(backend, str) and branch_fn is None:
            backend = make_backend(backend, **({"threads": threads} if threads is not None else {}))
        self.backend = backend
        self.io_np = NUMPY_DTYPES[self.pack.io_dtype]
        self.weights = self.pack.host_weights()                       # FP32 host tensors
        cos, sin = rope_tables(self.geom.h_tokens, self.geom.w_tokens, self.cfg.head_dim)  # [L, hd/2] f32
        self.rope = {"rope_cos": cos.astype(self.io_np), "rope_sin": sin.astype(self.io_np)}
        self.last_timing: Optional[ForwardTiming] = None

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
        return [context_mask(r, S, self.io_np) for r in rows]

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
        ctxs = [self._check_context(c, f"context[{i}]" if len(xs) > 1 else "context").astype(self.io_np)
                for i, c in enumerate(contexts)]
        masks = self._masks(context_rows, len(xs))
        sigma = self._check_sigma(sigma)
        cfg, W, timing = self.cfg, self.weights, ForwardTiming()
        # 1) tokens, timestep embedding and every block's modulation (once per sigma)
        hidden, grid = [], None
        for x in xs:
            tok, grid = host_ops.patchify(x)                                        # [L, (C+1)*4]
            hidden.append(host_ops.embed(tok, W["x_embedder.proj.1.weight"]))        # [L, D] f32
        emb, lora = host_ops.t_embedding(W, sigma, cfg)                              # [D], [3D]
        mods = host_ops.block_modulations(W, emb, lora, cfg)                         # [blocks, 3, 3, D]
        # 2) blocks in strict order; per branch: host LayerNorm+modulate, backend (all passes), host gate+residual
        for block in range(cfg.blocks):
            rec = {}
            for j, spec in enumerate(BRANCHES):
                shift, scale, gate = mods[block, j]                                  # [D] each
                xns = [host_ops.layernorm_modulate(h, shift, scale) for h in hidden]  # [L, D] f32
                feeds = []
                for xn, ctx, mask in zip(xns, ctxs, masks):
                    avail = {"xn": xn.astype(self.io_np), "context": ctx, "context_mask": mask, **self.rope}
                    feeds.append({i.name: avail[i.name] for i in branch_inputs(spec, self.geom)})
                extra = probe.feed(block, spec.kind) if probe is not None else None
                if extra is not None:
                    feeds.append({**feeds[0], **{k: np.asarray(v).astype(self.io_np) for k, v in extra.items()}})
                nxt = self._next_path(block, j)
                path = self.pack.branch_path(block, spec.kind)
                if self.branch_fn is not None:
                    outs, t = self.branch_fn(block, spec.kind, path, feeds, nxt)
                else:
                    outs, t = run_branch(self.backend, path, feeds, next_path=nxt)
                timing.add(block, spec.kind, t)
                if extra is not None:
                    probe.result(block, spec.kind, outs.pop()[spec.outputs[0].name])
                ys = [o[spec.outputs[0].name] for o in outs]                        # [L, D] pack dtype
                for h, y in zip(hidden, ys):
                    host_ops.gate_residual(h, gate, y)                               # x += gate * y, f32
                if trace is not None:
                    rec[spec.kind] = {"xn": xns[0], "y": np.asarray(ys[0], np.float32)}
            if trace is not None:
                rec["x_out"] = hidden[0].copy()
                trace.append(rec)
        # 3) final layer, unpatchify, crop
        vs = []
        for h in hidden:
            out = host_ops.final_layer(W, h, emb, lora, cfg)                         # [L, C*4]
            vs.append(host_ops.unpatchify(out, grid[0], grid[1], self.geom.latent_h, self.geom.latent_w,
                                          cfg.latent_channels))                      # [C, h, w]
        timing.total_s = time.perf_counter() - t_start
        timing.host_s = timing.total_s - timing.branch_s
        self.last_timing = timing
        log.info("forward (%d pass%s): %.2f s (branches %.2f s, host %.2f s)", len(xs), "es" if len(xs) > 1 else "",
                 timing.total_s, timing.branch_s, timing.host_s)
        return vs

    def _next_path(self, block: int, j: int):
        """The branch that runs after (block, j): what a prefetch policy would prepare now."""
        if j + 1 < len(BRANCHES):
            return self.pack.branch_path(block, BRANCHES[j + 1].kind)
        if block + 1 < self.cfg.blocks:
            return self.pack.branch_path(block + 1, BRANCHES[0].kind)
        return None
