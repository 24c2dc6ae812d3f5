"""`auto`: the lifecycle policy for a board's memory, chosen by evaluating the MODELLED board (cost.toml through
cost.py and timeline.py), analytically, before anything loads.

Memory: contexts may take the board's usable RAM minus the baseline usage minus the 1.5 GiB MemAvailable stop rule
(reference board figures; 8/16/32 GB boards) or, on a real RK3588 (the `rknn` backend passes it), the MemAvailable
it has now minus the stop rule. A policy fits when its contexts in flight (current, prefetched, one being released;
x2 with dual_core; a sharded pack's shards each, priced by `context_units`) fit; `resident` then pins the first
branches of the fixed cycle in what is left, keeping one context of slack. Given the picture size's activation
memory (`memory`: models/packs/memory_fit.for_auto, the one place for that rule), every context beyond the largest
branch call's must also fit beside that call and the arena's growth; the policies it leaves out are named in the
chosen Evaluation's `ruled_out`. Among the policies that fit, the fastest
projected denoise wins; within 0.5 % of it, the one with fewer contexts, then fewer terms (a simpler policy).
`shards` is a candidate when the pack is sharded; `choose_pack` also weighs the packs `pack --shards N` could build
(N shards, a cut per kind) and `choose_cuts` picks a sharded pack's cuts.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Optional

from models.board.cost import BOARD_RAMS_GB, LABEL, BoardModel
from models.board.timeline import StepTimeline, branch_sequence, pinned_branches, simulate_step
from models.dit.partition import KINDS
from models.board.policy import MAX_PREFETCH, Policy
from models.dit.shards import CUTS, MAX_SHARDS

log = logging.getLogger(__name__)

COMPUTED_STEPS = 11          # a 20-step Spectrum job computes 11 steps (R8, docs/board-figures.md)
TIE = 0.005                  # within 0.5 % of the fastest: prefer less memory, then a simpler policy


@dataclass
class Evaluation:
    """One policy on one board (modelled)."""
    policy: Policy               # resident_mb: what the pinned contexts take (modelled)
    contexts_in_flight: int
    resident_contexts: int
    memory_mib: float            # MemAvailable the policy's contexts take at most (modelled)
    cold: StepTimeline           # the first computed step (resident contexts load in it)
    warm: StepTimeline           # every later computed step
    computed_steps: int          # the job's model calls (a step cache's reused calls and forecast steps make none)
    ruled_out: tuple = ()        # (choose) the policies the size's activation memory left out, a line each

    @property
    def contexts(self) -> int:
        return self.contexts_in_flight + self.resident_contexts

    @property
    def denoise_s(self) -> float:
        return self.cold.wall_s + (self.computed_steps - 1) * self.warm.wall_s

    def line(self) -> str:
        return (f"{LABEL} {self.policy.name:<28} step {self.warm.wall_s:7.2f} s (first {self.cold.wall_s:6.2f}), "
                f"overhead_ratio {self.warm.overhead_ratio:.3f}, {self.contexts} contexts "
                f"({self.resident_contexts} resident), {self.memory_mib:.0f} MiB")


def candidates() -> list:
    """Every policy combination the lifecycle accepts (interleave and dual_core do not combine)."""
    out = []
    for shards in (False, True):
        for resident in (False, True):
            for dual in (False, True):
                for inter in (False, True):
                    if dual and inter:
                        continue
                    for pre in range(MAX_PREFETCH + 1):
                        out.append(Policy(prefetch=pre, dual_core=dual, interleave=inter,
                                          resident_mb=1.0 if resident else 0.0, shards=shards))
    return out


def memory_problem(policy: Policy, shards: int, fit, resident: int = 0) -> str:
    """Why a policy's contexts do not fit beside the largest branch call at the size `fit` describes ('' when they
    do). `fit`: models/packs/memory_fit.SizeFit (one call's contexts, the arena's growth and how many further
    contexts of the largest size fit beside them: the rule lives there); every context beyond one call's is counted
    at the largest context's size (conservative)."""
    extra = policy.contexts_in_flight(shards) + resident - max(1, int(shards))
    if extra <= fit.spare_contexts:
        return ""
    return (f"{policy.name}: needs {extra} more context(s) beside its {fit.kind} call at {fit.width}x{fit.height}, "
            f"{fit.spare_contexts} fit ({fit.need_mib:,.0f} MiB for the call and arena, {fit.context_mib:,.0f} MiB "
            f"a context, {fit.budget_mib:,.0f} MiB for contexts; {LABEL})")


def evaluate(model: BoardModel, policy: Policy, budget_mib: float, computed_steps: int = COMPUTED_STEPS,
             transport_s: float = 0.0, resident_contexts: Optional[int] = None,
             passes: int = 2, fit=None) -> Optional[Evaluation]:
    """The policy's projected steps on a board with `budget_mib` for contexts; None when it does not fit (or asks
    for shards of a pack that has none). `passes`: CFG passes per model call (1 at cfg 1). A resident policy pins as many contexts as fit (one of slack) unless
    `resident_contexts` says how many. Memory is counted in whole-branch contexts (a heads shard is less of one);
    with `fit` (the size's activation memory, memory_problem) the policy's contexts must also fit beside its call."""
    n = len(model.parts["ffn"])                           # contexts per branch pass: the shards
    if policy.shards and n < 2:
        return None
    per = (2 if policy.dual_core else 1) * n              # contexts per branch
    per_units = (2 if policy.dual_core else 1) * model.branch_units()
    fly, fly_units = policy.contexts_in_flight(n), policy.branches_in_flight() * per_units
    size_fit, fit = fit, math.floor(model.units_fit(budget_mib) + 1e-9)
    if fly_units > fit + 1e-9 or (size_fit is not None and memory_problem(policy, n, size_fit)):
        return None
    k = 0
    if policy.resident_mb > 0:
        most = min(len(branch_sequence(model)), max(0, math.floor((fit - fly_units - 1) / per_units + 1e-9))) * per
        if size_fit is not None:             # the resident ones beside the call too, in whole branches
            room = size_fit.spare_contexts + n - fly
            most = min(most, max(0, room - room % per))
        k = most if resident_contexts is None else min(most, resident_contexts)
        k -= k % per
        if k == 0:
            return None                                   # nothing to pin: the plain policy covers it
    pinned = pinned_branches(model, policy, k)
    cold = simulate_step(model, policy, pinned, warm=False, transport_s=transport_s, passes=passes)
    warm = simulate_step(model, policy, pinned, warm=True, transport_s=transport_s, passes=passes)
    units = fly_units + k // per * per_units
    resident_mb = model.mem_drop_mib(units) - model.mem_drop_mib(fly_units) if k else 0.0
    pol = policy.replace(resident_mb=round(resident_mb, 1))
    return Evaluation(pol, fly, k, model.mem_drop_mib(units), cold, warm, computed_steps)


def _smallest_resident(model, policy, budget_mib, best: Evaluation, **kw) -> Evaluation:
    """The fewest pinned contexts that keep the policy's denoise time (pinning more than helps only costs memory)."""
    per = (2 if policy.dual_core else 1) * len(model.parts["ffn"])
    lo, hi = per, best.resident_contexts
    while lo < hi:
        mid = (lo + hi) // 2
        mid -= mid % per
        mid = max(mid, per)
        e = evaluate(model, policy, budget_mib, resident_contexts=mid, **kw)
        if e is not None and e.denoise_s <= best.denoise_s * (1 + 1e-4):
            hi = mid
        else:
            lo = mid + per
    return evaluate(model, policy, budget_mib, resident_contexts=hi, **kw) or best


def _memory_ruled_out(model: BoardModel, budget_mib: float, fit) -> tuple:
    """The lines of the policies whose contexts fit by the weights' memory but not beside the size's largest call
    (resident variants say the same as their plain policy, so only the plain ones)."""
    n, units = len(model.parts["ffn"]), math.floor(model.units_fit(budget_mib) + 1e-9)
    out = []
    for pol in candidates():
        if pol.resident or (pol.shards and n < 2):
            continue
        weights_fit = pol.branches_in_flight() * (2 if pol.dual_core else 1) * model.branch_units() <= units + 1e-9
        why = memory_problem(pol, n, fit) if weights_fit else ""
        if why:
            out.append(why)
    return tuple(out)


def choose(model: BoardModel, budget_mib: float, computed_steps: int = COMPUTED_STEPS,
           transport_s: float = 0.0, passes: int = 2, memory=None) -> tuple:
    """-> (the chosen Evaluation, every Evaluation that fits, fastest first). `memory`: (model, budget_mib) -> the
    size's models/packs/memory_fit.SizeFit or None (memory_fit.for_auto); with one a policy must also fit beside
    the size's largest call, and the chosen Evaluation's `ruled_out` says which did not and why."""
    fit = memory(model, budget_mib) if memory is not None else None
    if fit is not None and not fit.fits:
        raise ValueError(f"{LABEL} board: {fit.line()}")
    kw = {"computed_steps": computed_steps, "transport_s": transport_s, "passes": passes, "fit": fit}
    evals = []
    for pol in candidates():
        e = evaluate(model, pol, budget_mib, **kw)
        if e is not None and e.resident_contexts:
            e = _smallest_resident(model, pol, budget_mib, e, **kw)
        if e is not None:
            evals.append(e)
    if not evals:
        raise ValueError(f"{LABEL} board: not even one context fits in {budget_mib:.0f} MiB")
    evals.sort(key=lambda e: e.denoise_s)
    fast = evals[0].denoise_s * (1 + TIE)
    best = min((e for e in evals if e.denoise_s <= fast),
               key=lambda e: (e.contexts, len(e.policy.name.split("+")), e.denoise_s))
    if fit is not None:
        best.ruled_out = _memory_ruled_out(model, budget_mib, fit)
    return best, evals


def job_calls(report: dict) -> tuple:
    """(model calls, CFG passes per call) a finished job's report.json says it ran: what the board model prices a
    job by (its calls, not its steps: a two-call sampler's step is two, a call the step cache reused is none)."""
    calls = report.get("model_calls") or report.get("nfe") or len(report.get("computed_steps", []))
    cfg = float((report.get("prompt") or {}).get("cfg", 4.0))
    return int(calls), 1 if math.isclose(cfg, 1.0) else 2


def sharded_model(model: BoardModel, shards: int, cuts) -> BoardModel:
    """The same board and model as a pack built with `--shards N` and these cuts ({kind: cut})."""
    return BoardModel(model.shape.sharded(shards, cuts), model.cost, model.path)


def choose_cuts(model: BoardModel, shards: int, budget_mib: float, fixed: Optional[dict] = None, **kw) -> tuple:
    """The cut per branch kind for a pack of `shards` shards: every combination (kinds in `fixed` keep theirs)
    evaluated with `choose` (lifecycle, memory and tensor I/O priced) -> ({kind: cut}, the best Evaluation);
    heads before rows on a tie (less memory)."""
    best, fixed = None, dict(fixed or {})
    for combo in itertools.product(CUTS[::-1], repeat=len(KINDS)):        # ("heads", "rows")
        cuts = dict(zip(KINDS, combo))
        if any(cuts[k] != c for k, c in fixed.items()):
            continue
        try:
            e, _ = choose(sharded_model(model, shards, cuts), budget_mib, **kw)
        except ValueError:
            continue
        if best is None or e.denoise_s < best[1].denoise_s * (1 - 1e-9):
            best = (cuts, e)
    if best is None:
        raise ValueError(f"{LABEL} board: no {shards}-shard pack fits in {budget_mib:.0f} MiB")
    return best


def choose_pack(model: BoardModel, budget_mib: float, **kw) -> tuple:
    """Over the packs `pack --shards N` builds (N = 1 .. the NPU's cores, the cuts `choose_cuts` picks) and every
    policy: -> (N, {kind: cut}, the best Evaluation). Within 0.5 % of the fastest, fewer shards."""
    options = [(1, {}, choose(model, budget_mib, **kw)[0])]
    for n in range(2, MAX_SHARDS + 1):             # a W8A8 pack too: its shards carry their branch's INT8 layers
        try:
            options.append((n, *choose_cuts(model, n, budget_mib, **kw)))
        except ValueError:
            continue
    fast = min(o[2].denoise_s for o in options) * (1 + TIE)
    return min((o for o in options if o[2].denoise_s <= fast), key=lambda o: (o[0], o[2].denoise_s))


def fit_table(model: BoardModel) -> dict:
    """How many contexts fit resident on the 8, 16 and 32 GB boards (modelled)."""
    return {ram: model.contexts_fit(model.context_budget_mib(ram)) for ram in BOARD_RAMS_GB}


def budget(model: BoardModel, settings: dict, mem_available_mib: Optional[float] = None) -> tuple:
    """-> (MiB for contexts, what it is based on): a real board's MemAvailable (measured, given by its backend), else
    the modelled `board_ram_gb` board."""
    if mem_available_mib is not None:
        avail = mem_available_mib
        return model.context_budget_mib(mem_available_mib=avail), f"MemAvailable {avail:.0f} MiB (measured)"
    ram = settings.get("board_ram_gb", 8)
    return model.context_budget_mib(ram), f"{ram} GB board ({LABEL})"


def choose_policy(ctx, mem_available_mib: Optional[float] = None, memory=None) -> Policy:
    """`auto` for the board backends (their auto_policy): models.board.policy.AutoContext -> Policy. The real board passes
    its MemAvailable now; without it (board-sim, or a board where it is unreadable) the modelled `board_ram_gb`
    board's memory is the budget. `memory`: the default pack's size's activation memory (`choose`'s; the backends
    pass models/packs/memory_fit.for_pack)."""
    settings = dict(ctx.settings or {})
    packs = tuple(getattr(ctx, "packs", ()) or ())
    # the default pack (the first) sizes the model; without one, the reference configuration (512x512)
    model = BoardModel.for_pack(packs[0] if packs else None, settings.get("board_model", "full"),
                                settings.get("board_cost"))
    mib, basis = budget(model, settings, mem_available_mib)
    best, evals = choose(model, mib, memory=memory)
    fits = ", ".join(f"{r} GB: {n}" for r, n in fit_table(model).items())
    log.info("auto (%s, %s; %s): %s -> %s; contexts that fit resident (%s): %s", LABEL, basis, model.source,
             f"{mib:.0f} MiB for contexts", best.policy.name, LABEL, fits)
    for e in evals[:6]:
        log.info("auto: %s", e.line())
    for why in best.ruled_out:
        log.info("auto: ruled out by memory: %s", why)
    masks = settings.get("dual_masks")
    return best.policy.replace(dual_masks=tuple(masks)) if masks else best.policy
