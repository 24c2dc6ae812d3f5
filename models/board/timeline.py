"""Analytic timeline of one computed step on the MODELLED board under a lifecycle policy (the `auto` chooser's
evaluation; bench/overhead.py prints it beside the paced runs). Same figures as the board-sim backend
(cost.BoardModel), same rules as the lifecycle (models/runtime/lifecycle.py):

- the scheduler sends one request per branch (both CFG passes), or one per pass with `interleave`; requests are in
  lockstep (one outstanding); before a request it runs that request's host ops (residual of the previous branch and
  LayerNorm of this one: `host_pass_s` per pass). With `interleave` the host ops of a pass may run while the previous
  request (the other pass) is on the NPU.
- the executor gets the branch's context: pinned (`resident`, after the step that loaded it), prepared ahead by the
  prefetch helper, or loaded and initialised now (on demand); then infers (passes one after the other on one core,
  or at once on two cores with `dual_core`, each then at the two-context rate: 1.78x / 2 of its own speed, peer
  figures); then releases it inside the call (on-demand) or hands the release to the helper (prefetch). Tensor I/O
  runs on the CPU beside each inference, at its own speed.
- the prefetch helper is one FIFO thread: at a request's arrival it queues the preparation of the next `prefetch`
  branches of this step (the first branch of a step is never prefetched: no hint crosses a step), at the end of an
  inference the release of that context (the last call of a forward, with nothing ahead, releases inside the call).
  With dual_core a branch has two contexts, a sharded pack's N (2N with dual_core); the lifecycle loads, inits and
  releases them at once on the board's CPU slots (`DUAL_LIFECYCLE_PARALLEL = True`; False models doing them one
  after the other).
- a sharded pack's branch runs its shards: at once (`shards`: one lane per shard, each on an NPU core as one frees)
  or in turn; with dual_core each pass has its lanes. Lanes do their tensor I/O on the CPU, then wait for a core;
  the NPU work of the n lanes on cores progresses at rate(n) each (`infer_span`).
- transport: `transport_s` per request (measured here), half each way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.board.cost import BoardModel
from models.dit.partition import KINDS
from models.board.policy import Policy

DUAL_LIFECYCLE_PARALLEL = True      # models/runtime/lifecycle.py: a dual_core pair loads/inits/releases at once (_pair)


@dataclass
class StepTimeline:
    """One computed step on the modelled board (board seconds)."""
    wall_s: float
    npu_s: float                 # pure NPU inference summed over passes (the overhead ratio's denominator)
    io_s: float                  # tensor I/O summed over passes
    infer_wall_s: float          # inference on the critical path (two passes at once with dual_core)
    lifecycle_s: float           # lifecycle the scheduler waited for
    lifecycle_hidden_s: float    # lifecycle that ran on the helper, out of the way
    host_s: float                # host ops on the critical path
    transport_s: float
    requests: int
    extra: dict = field(default_factory=dict)

    @property
    def overhead_ratio(self) -> float:
        return self.wall_s / self.npu_s


def makespan(times: list, slots: int) -> float:
    """Wall time of independent jobs on `slots` workers, longest first (the lifecycle's contexts of one branch)."""
    free = [0.0] * max(1, min(int(slots), len(times) or 1))
    for t in sorted(times, reverse=True):
        i = free.index(min(free))
        free[i] += t
    return max(free) if times else 0.0


def infer_span(lanes: list, cores: int, rate) -> float:
    """Wall time of lanes running at once, each its jobs (io_s, npu_s) in turn: the tensor I/O on the CPU, then the
    NPU work on a free core (lanes in order take the cores as they free); n lanes on cores each progress at
    rate(n) of one context's speed."""
    jobs = [list(lane) for lane in lanes if lane]
    pos = [0] * len(jobs)
    phase = ["io"] * len(jobs)
    left = [lane[0][0] for lane in jobs]
    t, busy = 0.0, 0
    while True:
        for i, ph in enumerate(phase):
            if ph == "io" and left[i] <= 1e-12:
                phase[i] = "wait"
            if phase[i] == "wait" and busy < cores:
                phase[i], left[i], busy = "npu", jobs[i][pos[i]][1], busy + 1
        on = [i for i, ph in enumerate(phase) if ph == "npu"]
        r = rate(len(on)) if on else 0.0
        steps = [left[i] for i, ph in enumerate(phase) if ph == "io"] + [left[i] / r for i in on]
        if not steps:
            return t
        dt = max(0.0, min(steps))
        t += dt
        for i, ph in enumerate(phase):
            if ph == "io":
                left[i] -= dt
            elif ph == "npu":
                left[i] -= dt * r
                if left[i] <= 1e-12:
                    busy -= 1
                    pos[i] += 1
                    if pos[i] == len(jobs[i]):
                        phase[i] = "done"
                    else:
                        phase[i], left[i] = "io", jobs[i][pos[i]][0]


def request_lanes(parts: list, passes: int, policy: Policy) -> list:
    """The lanes of one request: per pass (dual_core: each pass its own), per shard (`shards`: each its own)."""
    groups = [[p] for p in range(passes)] if policy.dual_core else [list(range(passes))]
    if policy.shards and len(parts) > 1:
        return [[(f.io_s, f.npu_s) for _ in g] for g in groups for f in parts]
    return [[(f.io_s, f.npu_s) for _ in g for f in parts] for g in groups]


def branch_sequence(model: BoardModel) -> list:
    return [(b, k) for b in range(model.shape.blocks) for k in KINDS]


def simulate_step(model: BoardModel, policy: Policy, pinned: frozenset = frozenset(), warm: bool = True,
                  transport_s: float = 0.0, dual_parallel: bool = DUAL_LIFECYCLE_PARALLEL,
                  passes: int = 2) -> StepTimeline:
    """The critical path of one computed step. `pinned`: indices (into branch_sequence) of branches whose contexts
    stay loaded; `warm`: they are already loaded (False: this step loads them, and keeps them). `passes`: CFG passes
    per model call (1 at cfg 1: one request per branch, whatever the policy)."""
    sim = _StepSim(model, policy, pinned, warm, transport_s, dual_parallel, passes)
    for i in range(len(sim.seq)):
        for p in range(sim.passes // sim.per_branch):
            sim.request(i, p)
    wall = sim.t_reply[1]
    requests = sim.requests
    host_vis = max(0.0, wall - sim.infer_wall - sim.lifecycle_vis - requests * transport_s)
    return StepTimeline(wall_s=wall, npu_s=sim.npu, io_s=sim.io, infer_wall_s=sim.infer_wall,
                        lifecycle_s=sim.lifecycle_vis, lifecycle_hidden_s=sim.hidden, host_s=host_vis,
                        transport_s=requests * transport_s, requests=requests)


class _StepSim:
    """The clocks of one simulated step: the scheduler's host ops, the requests' replies, the prefetch helper, and
    what the critical path has summed so far."""

    def __init__(self, model: BoardModel, policy: Policy, pinned: frozenset, warm: bool, transport_s: float,
                 dual_parallel: bool, passes: int = 2):
        self.model, self.policy, self.pinned, self.warm, self.transport_s = model, policy, pinned, warm, transport_s
        self.seq = branch_sequence(model)
        self.passes = passes
        self.interleave = policy.interleave and passes > 1     # one pass: nothing to interleave with
        self.per_branch = 1 if self.interleave else passes     # passes per request
        copies = 2 if policy.dual_core else 1                  # contexts per shard (a dual_core pair)
        slots = model.cpu_slots if dual_parallel else 1        # contexts of one branch handled at once
        by_kind = {k: (makespan([f.load_s + f.init_s for f in fs] * copies, slots),
                       makespan([f.release_s for f in fs] * copies, slots),
                       infer_span(request_lanes(fs, self.per_branch, policy), model.cores, model.rate),
                       sum(f.npu_s for f in fs), sum(f.io_s for f in fs))
                   for k, fs in model.parts.items()}               # every block's branch of a kind is alike
        self.prep = [by_kind[k][0] for _, k in self.seq]
        self.rel = [by_kind[k][1] for _, k in self.seq]
        self.span = [by_kind[k][2] for _, k in self.seq]
        self.npu_io = [by_kind[k][3:] for _, k in self.seq]
        self.lifecycle_vis = self.hidden = self.npu = self.io = self.infer_wall = 0.0
        self.helper_free = 0.0                                 # the prefetch helper (one per lane; lanes are alike)
        self.prepared: dict = {}                               # branch -> time its context is ready
        self.releases: list = []                               # background releases queued: (time queued, seconds)
        self.t_reply = [0.0, 0.0]                              # replies of the last two requests
        self.host_end = 0.0
        self.requests = 0

    def request(self, i: int, p: int) -> None:
        """Request p (a pass with interleave, else both) of branch i, from its host ops to its reply."""
        arrive = self._send(self.model.host_pass_s) + self.transport_s / 2
        held = i in self.pinned and self.warm
        ready = self._context_ready(i, arrive) if p == 0 and not held else arrive
        start = max(arrive, ready)
        # inference: passes (and shards) in turn on one core, or at once on cores as they free
        dur = self.span[i]
        end = start + dur
        self.npu += self.per_branch * self.npu_io[i][0]
        self.io += self.per_branch * self.npu_io[i][1]
        self.infer_wall += dur
        done = self._release(i, end) if p == self.passes // self.per_branch - 1 else end
        reply = done + self.transport_s / 2
        self.t_reply = [self.t_reply[1], reply]
        self.requests += 1

    def _send(self, h: float) -> float:
        """When the request leaves the scheduler: after its host ops on the scheduler thread."""
        if self.interleave:
            h_start = max(self.t_reply[0], self.host_end)      # needs the reply two requests back (same pass)
            self.host_end = h_start + h
            return max(self.host_end, self.t_reply[1])
        self.host_end = self.t_reply[1] + self.per_branch * h
        return self.host_end

    def _context_ready(self, i: int, arrive: float) -> float:
        """When branch i's context is ready: prepared ahead, or loaded now; the next branches queued to prepare."""
        if self.policy.prefetch and i in self.prepared:
            ready = self.prepared.pop(i)
            self.lifecycle_vis += max(0.0, ready - arrive)
        else:
            ready = arrive + self.prep[i]
            self.lifecycle_vis += self.prep[i]
        if self.policy.prefetch:
            self._queue_prefetch(i, arrive)
        return ready

    def _queue_prefetch(self, i: int, arrive: float) -> None:
        """The helper's queue at branch i's arrival: the releases handed to it, then the next branches' preparation."""
        jobs = [(q, s, None) for q, s in self.releases]
        self.releases.clear()
        for j in range(i + 1, min(len(self.seq), i + 1 + self.policy.prefetch)):
            if j not in self.prepared and not (j in self.pinned and self.warm):
                self.prepared[j] = float("inf")                # queued
                jobs.append((arrive, self.prep[j], j))
        for q, secs, branch in jobs:
            start = max(self.helper_free, q)
            self.helper_free = start + secs
            self.hidden += secs
            if branch is not None:
                self.prepared[branch] = self.helper_free

    def _release(self, i: int, end: float) -> float:
        """When branch i's last call is done: pinned contexts stay; prefetch releases on the helper; on-demand inside
        the call."""
        if i in self.pinned:
            return end
        if self.policy.prefetch and i < len(self.seq) - 1:     # more calls follow: released behind them
            self.releases.append((end, self.rel[i]))
            return end
        self.lifecycle_vis += self.rel[i]
        return end + self.rel[i]


def pinned_branches(model: BoardModel, policy: Policy, contexts: int) -> frozenset:
    """The branches a resident budget of `contexts` contexts pins: the first ones of the fixed cycle (two contexts
    each with dual_core, times a sharded pack's shards)."""
    per = (2 if policy.dual_core else 1) * len(model.parts["ffn"])
    n = min(len(branch_sequence(model)), max(0, contexts) // per)
    return frozenset(range(n))
