"""A LoraPlan applied to one DiT pack for a job: merged FP32 host weights, and every branch's low-rank inputs in the
layout its LoRA-ready graph takes (numpy only: what the scheduler and `anima-models forward` run).

    dl = DitLora(plan, cfg, geometry, pack_dtype, overflow="refuse")
    weights = dl.host_weights(base)            # base {host key: f32} -> a new dict; base is never changed
    feed.update(dl.branch_inputs(block, kind)) # {lora_<kind>_<stem>_a/_b...: io dtype}, zeros where no LoRA

A pack without LoRA inputs (lora_rank 0) takes no branch LoRA: a plan that updates branch layers is refused for it,
naming the way out (a LoRA-ready pack, or baking). Nothing here reloads a pack: a LoRA change between jobs is a
new DitLora over the same base weights and the same graphs.
"""
from __future__ import annotations

import logging
from typing import Optional

from models.dit.branch_layout import lora_inputs
from models.dit.config import DiTConfig
from models.lora.plan import LoraPlan
from models.dit.partition import Geometry, branch_spec

log = logging.getLogger(__name__)

CACHE_MB = 256.0          # a job's branch inputs are kept when they fit (made once, not once per step)


class DitLora:
    """What a job's LoRAs change in the DiT of one pack: host weights and branch inputs."""

    def __init__(self, plan: Optional[LoraPlan], cfg: DiTConfig, geom: Geometry, pack_dtype: str,
                 overflow: str = "refuse", where: str = "", cache_mb: float = CACHE_MB, between=None):
        self.plan, self.cfg, self.geom, self.dtype, self.overflow = plan, cfg, geom, pack_dtype, overflow
        self.between = between                     # called between layers (a cancel check that raises)
        self.svd_errors: dict = {}                 # branch weight key -> relative error of its SVD reduction
        self._zeros: dict = {}                     # kind -> zero inputs (the same for every block)
        self._cache: dict = {}                     # (block, kind) -> inputs, while they fit cache_mb
        self._cache_left = cache_mb * 2**20
        self.over = plan.check_rank(geom.lora_rank, overflow, where) if plan is not None else []
        if self.over:
            log.warning("%d branch layers have a stacked LoRA rank over the pack's %d: reduced by SVD (errors in "
                        "the report)", len(self.over), geom.lora_rank)
        if plan is not None and geom.lora_rank > 0:
            plan.read_all("branch", between)       # a bad branch weight fails the job here, not a step later

    @property
    def empty(self) -> bool:
        return self.plan is None or not self.plan.targets

    def host_weights(self, base: dict) -> dict:
        """base with every host weight a LoRA updates replaced by its merged FP32 copy (base is not changed)."""
        if self.plan is None:
            return base
        out = dict(base)
        for key in self.plan.keys("host"):
            if self.between is not None:
                self.between()
            out[key] = self.plan.merged(key, base[key])
        return out

    def branch_keys(self, block: int, kind: str) -> list:
        """The LoRA-updated weight keys of one branch."""
        if self.plan is None:
            return []
        p = f"blocks.{block}.{branch_spec(kind).module}."
        return [k for k in self.plan.keys("branch") if k.startswith(p)]

    def branch_inputs(self, block: int, kind: str) -> dict:
        """{input name: array} of one branch of a LoRA-ready pack ({} for a plain pack)."""
        if self.geom.lora_rank == 0:
            return {}
        keys = self.branch_keys(block, kind)
        if not keys:
            if kind not in self._zeros:
                self._zeros[kind] = lora_inputs(kind, {}, self.cfg, self.geom, self.dtype)
            return self._zeros[kind]
        hit = self._cache.get((block, kind))
        if hit is not None:
            return hit
        prefix = f"blocks.{block}.{branch_spec(kind).module}."
        factors = {}
        for key in keys:
            B, A, err = self.plan.factors(key, self.geom.lora_rank, self.overflow)
            if err:
                self.svd_errors[key] = err
            factors[key[len(prefix):]] = (B, A)
        out = lora_inputs(kind, factors, self.cfg, self.geom, self.dtype)
        nbytes = sum(a.nbytes for a in out.values())
        if nbytes <= self._cache_left:             # the same arrays every step: made (and an SVD run) once
            self._cache[(block, kind)] = out
            self._cache_left -= nbytes
        return out

    def report(self) -> dict:
        """What was applied where (report.json's lora.dit; `anima-models forward`)."""
        if self.plan is None:
            return {}
        out = {"loras": self.plan.report(), "pack_lora_rank": self.geom.lora_rank,
               "max_branch_rank": self.plan.max_rank("branch")}
        if self.over:
            out["svd_reduced"] = {"layers": len(self.over), "max_rank": max(r for _, r in self.over),
                                  "max_relative_error": max(self.svd_errors.values(), default=None)}
        return out
