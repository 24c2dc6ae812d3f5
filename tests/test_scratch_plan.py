"""One scratch plan for two processes: the region the orchestrator sizes is exactly the one the scheduler carves."""
import secrets
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from models.dit.config import PRESETS
from models.packs.pack import Pack
from models.dit.partition import Geometry
from models.packs.scratch import scratch_plan
from orchestrator.engine.job_arena import arena_plan, create_job_arena
from protocol.arena import ALIGN_BYTES, ArenaError
from protocol.messages import Region
from stages.scheduler import BranchClient

# (config, width, height, text_tokens, dtype, LoRA rank): square and odd token grids, default and long-context
# packs, both dtypes, plain and LoRA-ready
PACKS = [(preset, w, h, s, dt, 0) for preset, w, h in (("tiny", 64, 64), ("tiny", 264, 200), ("full", 64, 48))
         for s in (512, 1024) for dt in ("fp16", "fp32")] + \
    [("tiny", 64, 64, 512, "fp16", 8), ("full", 64, 48, 1024, "fp32", 32)]


def _pack(preset, w, h, s, dt, r=0) -> Pack:
    return Pack(dir=Path("/nonexistent"), manifest={}, config=PRESETS[preset]["dit"],
                geometry=Geometry.from_resolution(w, h, text_tokens=s, lora_rank=r), dtype=dt)


def _by_hand(pack) -> dict:
    """The slots written out from the branch graphs' inputs and outputs: {name: (dtype, shape)}."""
    c, g = pack.config, pack.geometry
    io = {"fp16": "f16", "fp32": "f32"}[pack.dtype]
    L, S, D, Dc, hd2 = g.tokens, g.text_tokens, c.width, c.context_dim, c.head_dim // 2
    slots = {"rope_cos": (io, (L, hd2)), "rope_sin": (io, (L, hd2))}
    R, F = g.lora_rank, c.ffn_width
    if R:                       # one slot per LoRA factor of each kind, shared by the passes, rewritten per branch
        for kind, dims in (("self", {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D)}),
                           ("cross", {"q": (D, D), "k": (Dc, D), "v": (Dc, D), "o": (D, D)}),
                           ("ffn", {"fc1": (D, F), "fc2": (F, D)})):
            for stem, (n_in, n_out) in dims.items():
                slots[f"lora_{kind}_{stem}_a"] = (io, (n_in, R))
                if kind == "self" and stem in ("q", "k"):
                    slots[f"lora_{kind}_{stem}_b1"] = slots[f"lora_{kind}_{stem}_b2"] = (io, (R, n_out // 2))
                else:
                    slots[f"lora_{kind}_{stem}_b"] = (io, (R, n_out))
    for p in (0, 1):
        slots |= {f"xn.{p}": (io, (L, D)), f"y.{p}": (io, (L, D)), f"context.{p}": (io, (S, Dc))}
        if S > 512:
            slots[f"context_mask.{p}"] = (io, (S,))
    return slots


def _aligned(n):
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@pytest.mark.parametrize("spec", PACKS)
def test_the_plan_holds_every_branch_input_and_output(spec):
    pack = _pack(*spec)
    plan = scratch_plan(pack.config, pack.geometry, pack.dtype, 2)
    want = _by_hand(pack)
    assert {s.name: (s.dtype, s.shape) for s in plan.slots} == want
    itemsize = {"f16": 2, "f32": 4}
    assert plan.nbytes(ALIGN_BYTES) == sum(_aligned(itemsize[d] * int(np.prod(sh))) for d, sh in want.values())
    shared = {s.name for s in plan.slots if s.cfg_pass is None}
    assert shared == {"rope_cos", "rope_sin"} | {n for n in want if n.startswith("lora_")}
    assert plan.slot("rope_cos", 1).name == "rope_cos" and plan.slot("context", 1).name == "context.1"
    with pytest.raises(ValueError, match="no scratch slot for 'hidden'"):
        plan.slot("hidden", 0)


def _client(arena, scratch, pack):
    msg = SimpleNamespace(executor="ipc:///tmp/anima-test-executor.sock", scratch=scratch, job="j")
    return BranchClient(None, msg, pack, None, None, arena, [1], max_lost=0, steps=1)


@pytest.mark.parametrize("spec", PACKS)
def test_the_scheduler_carves_exactly_the_region_the_orchestrator_made(spec):
    pack = _pack(*spec)
    plan = arena_plan(pack)
    job = create_job_arena(f"anima_test_{secrets.token_hex(4)}", pack)
    try:
        assert job.arena.size == plan.total and job.scratch.nbytes == plan.scratch_bytes
        assert job.scratch.offset % ALIGN_BYTES == 0
        client = _client(job.arena, job.scratch, pack)
        assert {n: (d.dtype, d.shape) for n, d in client.slots.items()} == _by_hand(pack)
        end = max(d.offset + d.nbytes for d in client.slots.values())
        assert _aligned(end) == job.scratch.offset + job.scratch.nbytes == job.arena.size     # nothing left over
        short = Region(offset=job.scratch.offset, nbytes=job.scratch.nbytes - ALIGN_BYTES)
        with pytest.raises(ArenaError, match="does not fit"):
            _client(job.arena, short, pack)                                                # nothing to spare
    finally:
        job.arena.close()


def test_inputs_that_stay_a_while_are_written_only_when_another_array_comes():
    """A "pass" input (the context) is written when the runner hands an array other than the one its slot holds
    (several conditionings take turns in one pass's slot: models/sampling/cond_mix.py), not again for the same one
    (every branch of a model call hands the same context); a "call" input (xn) every call."""
    pack = _pack("tiny", 64, 64, 512, "fp32")
    job = create_job_arena(f"anima_test_{secrets.token_hex(4)}", pack)
    try:
        client = _client(job.arena, job.scratch, pack)
        g, c = pack.geometry, pack.config
        ctx = np.ones((g.text_tokens, c.context_dim), np.float32)
        xn = np.ones((g.tokens, c.width), np.float32)
        first = client._input(1, "context", ctx)
        job.arena.write(first, 5 * ctx)                                         # a mark: a write would undo it
        assert client._input(1, "context", ctx) == first                        # the same array: not written again
        assert (job.arena.read(first) == 5).all()
        other = 2 * ctx
        assert client._input(1, "context", other) == first                      # another: written into the slot
        assert (job.arena.read(first) == 2).all()
        assert client._input(0, "context", 3 * ctx) != first                   # the other pass has its own
        client._input(1, "xn", xn)
        desc = client._input(1, "xn", 2 * xn)                                  # "call": written every call
        assert (job.arena.read(desc) == 2).all() and desc == client.xn[1]
    finally:
        job.arena.close()


def test_lora_factors_are_written_when_the_branch_brings_other_arrays():
    pack = _pack("tiny", 64, 64, 512, "fp32", 4)
    job = create_job_arena(f"anima_test_{secrets.token_hex(4)}", pack)
    try:
        client = _client(job.arena, job.scratch, pack)
        a = np.ones((pack.config.width, 4), np.float32)
        first = client._input(0, "lora_ffn_fc1_a", a)
        assert client._input(1, "lora_ffn_fc1_a", a) == first              # one slot for both passes
        job.arena.write(first, np.zeros_like(a))                          # (to see whether it is written again)
        client._input(1, "lora_ffn_fc1_a", a)
        assert not job.arena.read(first).any()                            # the same array: not written again
        client._input(0, "lora_ffn_fc1_a", 2 * a)                         # the next branch's factors
        assert (job.arena.read(first) == 2).all()
    finally:
        job.arena.close()


def test_a_sharded_packs_outputs_are_fp32_in_both_plans():
    """The executor combines a sharded branch's shard outputs in FP32 and hands them on so: y's slots are FP32 in
    the plan the orchestrator sizes and the one the scheduler carves; inputs keep the pack's dtype."""
    pack = _pack("tiny", 64, 64, 512, "fp16")
    sharded = Pack(dir=pack.dir, manifest={"shards": {"n": 3}}, config=pack.config, geometry=pack.geometry,
                   dtype="fp16")
    plan = scratch_plan(pack.config, pack.geometry, "fp16", 2, shards=3)
    want = _by_hand(pack) | {f"y.{p}": ("f32", (pack.geometry.tokens, pack.config.width)) for p in (0, 1)}
    assert {s.name: (s.dtype, s.shape) for s in plan.slots} == want
    assert arena_plan(sharded).scratch_bytes == plan.nbytes(ALIGN_BYTES) > arena_plan(pack).scratch_bytes


def test_the_arenas_pack_is_read_again_only_when_its_manifest_changed(tmp_path, monkeypatch):
    """The daemon reads a job's pack for its arena's sizes (the manifest only); the same manifest is not read again
    for every job, a changed one is, and a pack gone fails as load_pack does (the job's error names it)."""
    import shutil

    from models.packs.pack import PackError
    from orchestrator.engine import job_arena
    from tests.doubles_harness import fake_pack
    pack = fake_pack(tmp_path / "p", 64, 64)
    reads = []
    real = job_arena.load_pack
    monkeypatch.setattr(job_arena, "load_pack", lambda d, check=True: reads.append(check) or real(d, check=check))
    first = job_arena.arena_pack(pack)
    assert job_arena.arena_pack(pack) is first and reads == [False]
    manifest = pack / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")             # changed (its size): read again
    assert job_arena.arena_plan(job_arena.arena_pack(pack)) == job_arena.arena_plan(first) and len(reads) == 2
    shutil.rmtree(pack)
    with pytest.raises(PackError):
        job_arena.arena_pack(pack)
