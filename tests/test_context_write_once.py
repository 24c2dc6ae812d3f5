"""The conditioning context is a "pass" input (models/dit/partition.py): the scheduler writes it into its arena slot
when the runner hands another array (stages/scheduler.BranchClient._input). The runner converts each context to the
pack's io dtype once (models/runtime/dit_runner.DiTRunner._context), so a job's context slots are written once, not
at every model call; conditionings taking turns in one pass (cond_mix) still land as each call needs."""
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from models.packs.pack import load_pack
from models.runtime.dit_runner import DiTRunner, _Done
from models.runtime.phase_times import PhaseTimes
from orchestrator.engine.job_arena import create_job_arena
from stages.scheduler import BranchClient

CALLS = 4


class ArenaBranches:
    """The branch side as the scheduler runs it, without an executor: every feed goes into the job arena through the
    real BranchClient rule (what it writes is counted per slot), each branch answering zeros."""
    interleave = False

    def __init__(self, pack, job):
        msg = SimpleNamespace(executor="ipc:///tmp/anima-test-executor.sock", scratch=job.scratch, job="j")
        self.client = BranchClient(None, msg, pack, None, None, job.arena, [1], max_lost=0, steps=1)
        self.pack, self.writes = pack, {}
        write = job.arena.write

        def counted(desc, array):
            name = next(n for n, d in self.client.slots.items() if d == desc)
            self.writes[name] = self.writes.get(name, 0) + 1
            return write(desc, array)
        job.arena.write = counted
        self.arena = job.arena

    def submit(self, call):
        for p, feed in zip(call.passes, call.feeds):
            for name, array in feed.items():
                self.client._input(p, name, array)
        out = self.pack.branch(call.block, call.kind)["outputs"][0]
        y = np.zeros(out["shape"], np.float16 if out["dtype"] == "f16" else np.float32)
        return _Done(([{out["name"]: y} for _ in call.passes], PhaseTimes()))

    def context_writes(self) -> int:
        return sum(n for name, n in self.writes.items() if name.startswith("context"))


@pytest.fixture
def arena_runner(pipeline_assets):
    pack = load_pack(pipeline_assets[1])
    job = create_job_arena(f"anima_test_{secrets.token_hex(4)}", pack)
    try:
        branches = ArenaBranches(pack, job)
        yield DiTRunner(pack, branches=branches), branches, job
    finally:
        job.arena.close()


def _inputs(pack, k: int = 2):
    g, c = pack.geometry, pack.config
    rng = np.random.default_rng(0)
    x = rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w)).astype(np.float32)
    return x, [rng.standard_normal((g.text_tokens, c.context_dim)).astype(np.float32) for _ in range(k)]


def test_a_jobs_contexts_are_written_into_the_arena_once(arena_runner):
    runner, branches, job = arena_runner
    x, (cond, uncond) = _inputs(runner.pack)
    for step in range(CALLS):                              # one model call per step, both CFG passes
        runner.forward_cfg(x, 1.0 - step / CALLS, cond, uncond)
    assert branches.context_writes() == 2                  # one per pass (was 2 per call: 2 x CALLS)
    for p, ctx in enumerate((cond, uncond)):               # what the slots hold: each pass's context, as the pack takes it
        desc = branches.client._input(p, "context", runner._context(ctx, "context"))
        np.testing.assert_array_equal(job.arena.read(desc), ctx.astype(runner.io_np))


def test_conditionings_taking_turns_in_a_pass_each_land_when_their_call_comes(arena_runner):
    """cond_mix's several positive entries share pass 0's slot: a call with another entry writes it, the same entry
    again does not; the arena then holds the entry the call ran with."""
    runner, branches, job = arena_runner
    x, (a, b) = _inputs(runner.pack)
    order = [a, a, b, b, a]
    held = []
    for ctx in order:
        runner.forward_passes([x], 0.5, [ctx])
        desc = branches.client.slots[branches.client.plan.slot("context", 0).name]
        held.append(job.arena.read(desc).copy())
    assert branches.context_writes() == 3                  # a, then b, then a again
    for ctx, got in zip(order, held):
        np.testing.assert_array_equal(got, ctx.astype(runner.io_np))


def test_a_context_changed_is_a_new_array_and_a_bad_one_is_still_refused(arena_runner):
    runner, _, _ = arena_runner
    x, (cond,) = _inputs(runner.pack, 1)
    first = runner._context(cond, "context")
    assert runner._context(cond, "context") is first       # converted once
    assert runner._context(cond.copy(), "context") is not first
    bad = cond.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="context contains NaN"):
        runner.forward_passes([x], 0.5, [bad])
