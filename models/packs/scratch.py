"""The scratch region of a job's arena, planned from the partition table: one slot per branch input and output that
the scheduler hands the executor, with its resolved shape and dtype.

Two processes use one plan: the orchestrator sizes the region when it creates the arena (`nbytes`), the scheduler
carves exactly these slots from the region DENOISE hands it. An input's `lifetime` says how many slots it needs:
"call" and "pass" inputs (and every output) one per CFG pass, "job" and "branch" inputs one shared by the passes
(a "branch" input, a LoRA-ready pack's low-rank factors, is written again when the branch's values differ).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.dit.config import DiTConfig
from models.dit.partition import BRANCHES, NUMPY_DTYPES, Geometry, branch_inputs, resolve_io


SHARED_LIFETIMES = ("job", "branch")        # one slot for every CFG pass


@dataclass(frozen=True)
class ScratchSlot:
    name: str                 # the arena slot: "xn.0" (one per CFG pass) or "rope_cos" (shared by the passes)
    tensor: str               # the branch input or output it holds (an IOSpec name)
    cfg_pass: int | None      # 0, 1, …; None: shared by every pass
    dtype: str                # descriptor dtype "f16" | "f32"
    shape: tuple              # resolved, e.g. (L, D)
    lifetime: str             # "call": written for every call; "pass" | "job": once per job; "branch": per branch

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(NUMPY_DTYPES[self.dtype]).itemsize


@dataclass(frozen=True)
class ScratchPlan:
    slots: tuple              # ScratchSlot, in carving order

    def slot(self, tensor: str, cfg_pass: int) -> ScratchSlot:
        """The slot holding `tensor` for CFG pass `cfg_pass` (the shared one for a "job" or "branch" input)."""
        for s in self.slots:
            if s.tensor == tensor and s.cfg_pass in (cfg_pass, None):
                return s
        raise ValueError(f"no scratch slot for {tensor!r} of pass {cfg_pass}: the partition table has no such "
                         f"branch input or output for this pack")

    def nbytes(self, align: int) -> int:
        """Bytes of a region that starts `align`-aligned and holds every slot, each at an `align`-aligned offset
        (protocol.arena.SlotAllocator carves so)."""
        return sum(-(-s.nbytes // align) * align for s in self.slots)


def scratch_plan(cfg: DiTConfig, geom: Geometry, pack_dtype: str, passes: int, shards: int = 1) -> ScratchPlan:
    """The slots for a pack of this config, geometry and dtype ("fp16" | "fp32") with `passes` CFG passes: every
    input a branch graph of this geometry takes (a long-context pack's mask too), then every output. A sharded pack's
    (`shards` > 1) outputs are FP32: the executor combines the shards' outputs in FP32 (models/runtime/lifecycle.py) and they
    go to the host's FP32 residual add as they are."""
    tensors: dict = {}                     # name -> (IOSpec, resolved {"shape", "dtype"}); one per name
    for spec in BRANCHES:
        for io_specs in (branch_inputs(spec, geom), spec.outputs):
            for io, res in zip(io_specs, resolve_io(io_specs, cfg, geom, pack_dtype)):
                seen = tensors.setdefault(io.name, (io, res))
                if (seen[0].lifetime, seen[1]) != (io.lifetime, res):
                    raise ValueError(f"partition table: {io.name!r} of the {spec.kind} branch is {res} "
                                     f"({io.lifetime}), elsewhere {seen[1]} ({seen[0].lifetime})")
    slots = []
    outputs = {o.name for spec in BRANCHES for o in spec.outputs}
    for name, (io, res) in tensors.items():
        shape = tuple(res["shape"])
        if shards > 1 and name in outputs:
            res = dict(res, dtype="f32")
        if io.lifetime in SHARED_LIFETIMES:
            slots.append(ScratchSlot(name, name, None, res["dtype"], shape, io.lifetime))
        else:
            slots += [ScratchSlot(f"{name}.{p}", name, p, res["dtype"], shape, io.lifetime) for p in range(passes)]
    return ScratchPlan(tuple(slots))
