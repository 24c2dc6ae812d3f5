"""Analytic timeline of one computed step on the MODELLED board under a lifecycle policy (the `auto` chooser's
evaluation; bench/overhead.py prints it beside the paced runs). Same figures as the board-sim backend
(cost.BoardModel), same rules as the lifecycle (models/lifecycle.py):

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
  With dual_core a branch has two contexts; the lifecycle loads, inits and releases the pair at once on two CPU
  cores (`DUAL_LIFECYCLE_PARALLEL = True`; False models doing them one after the other).
- transport: `transport_s` per request (measured here), half each way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.board.cost import KINDS, BoardModel
from models.policy import Policy

DUAL_LIFECYCLE_PARALLEL = True      # models/lifecycle.py: a dual_core pair loads/inits/releases at once (_pair)


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


def branch_sequence(model: BoardModel) -> list:
    return [(b, k) for b in range(model.shape.blocks) for k in KINDS]


def simulate_step(model: BoardModel, policy: Policy, pinned: frozenset = frozenset(), warm: bool = True,
                  transport_s: float = 0.0, dual_parallel: bool = DUAL_LIFECYCLE_PARALLEL) -> StepTimeline:
    """The critical path of one computed step. `pinned`: indices (into branch_sequence) of branches whose contexts
    stay loaded; `warm`: they are already loaded (False: this step loads them, and keeps them)."""
    seq = branch_sequence(model)
    fig = [model.kinds[k] for _, k in seq]
    h = model.host_pass_s
    both = model.rate(2)                                       # each of two contexts inferring at once
    per_branch = 1 if policy.interleave else 2                 # passes per request
    lanes = 2 if policy.dual_core and not dual_parallel else 1   # contexts handled one after the other
    prep = [lanes * (f.load_s + f.init_s) for f in fig]
    lifecycle_vis = hidden = npu = io = infer_wall = 0.0
    helper_free = 0.0                                          # the prefetch helper (one per lane; lanes are alike)
    prepared: dict = {}                                        # branch -> time its context is ready
    releases: list = []                                        # background releases queued: (time queued, seconds)
    t_reply = [0.0, 0.0]                                       # replies of the last two requests
    host_end = 0.0
    requests = 0

    def run_helper(until_queue_time: float, jobs: list) -> None:
        nonlocal helper_free, hidden
        for q, secs, branch in jobs:
            start = max(helper_free, q)
            helper_free = start + secs
            hidden += secs
            if branch is not None:
                prepared[branch] = helper_free

    for i, f in enumerate(fig):
        held = i in pinned and warm
        for p in range(2 // per_branch):
            # 1) host ops for this request on the scheduler thread
            if policy.interleave:
                h_start = max(t_reply[0], host_end)            # needs the reply two requests back (same pass)
                host_end = h_start + h
                send = max(host_end, t_reply[1])
            else:
                host_end = t_reply[1] + per_branch * h
                send = host_end
            arrive = send + transport_s / 2
            # 2) the context: held, prepared ahead, or loaded now
            first = p == 0
            if first and not held:
                if policy.prefetch and i in prepared:
                    ready = prepared.pop(i)
                    lifecycle_vis += max(0.0, ready - arrive)
                else:
                    ready = arrive + prep[i]
                    lifecycle_vis += prep[i]
                if policy.prefetch:                            # queue the next branches' preparation
                    jobs = [(q, s, None) for q, s in releases]
                    releases.clear()
                    for j in range(i + 1, min(len(seq), i + 1 + policy.prefetch)):
                        if j not in prepared and not (j in pinned and warm):
                            prepared[j] = float("inf")         # queued
                            jobs.append((arrive, prep[j], j))
                    run_helper(arrive, jobs)
            else:
                ready = arrive
            start = max(arrive, ready)
            # 3) inference: passes in turn on one core, or both at once on two cores
            one = f.io_s + f.npu_s
            dur = f.io_s + f.npu_s / both if policy.dual_core else per_branch * one
            end = start + dur
            npu += per_branch * f.npu_s if not policy.dual_core else 2 * f.npu_s
            io += per_branch * f.io_s if not policy.dual_core else 2 * f.io_s
            infer_wall += dur
            # 4) release: pinned contexts stay; prefetch releases on the helper; on-demand inside the call
            done = end
            last = p == 2 // per_branch - 1
            if last and i not in pinned:
                if policy.prefetch and i < len(fig) - 1:      # more calls follow: released behind them
                    releases.append((end, lanes * f.release_s))
                else:
                    done = end + lanes * f.release_s
                    lifecycle_vis += lanes * f.release_s
            reply = done + transport_s / 2
            t_reply = [t_reply[1], reply]
            requests += 1
    wall = t_reply[1]
    host_vis = max(0.0, wall - infer_wall - lifecycle_vis - requests * transport_s)
    return StepTimeline(wall_s=wall, npu_s=npu, io_s=io, infer_wall_s=infer_wall, lifecycle_s=lifecycle_vis,
                        lifecycle_hidden_s=hidden, host_s=host_vis, transport_s=requests * transport_s,
                        requests=requests)


def pinned_branches(model: BoardModel, policy: Policy, contexts: int) -> frozenset:
    """The branches a resident budget of `contexts` contexts pins: the first ones of the fixed cycle (two contexts
    each with dual_core)."""
    per = 2 if policy.dual_core else 1
    n = min(len(branch_sequence(model)), max(0, contexts) // per)
    return frozenset(range(n))
