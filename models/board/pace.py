"""Pacing to the modelled board: a phase does its real work here, then sleeps until it has taken its modelled board
time x time_scale (on the caller's own clock). Used by the `board-sim` backend and by the scheduler's host ops.

A phase never ends before its target less the credit it was given (`wall_s + credit_s >= target_s`). Credit is what
the phases just before it, back to back on the same context, took beyond their targets (a late wake-up from sleep,
real work here that overran on a busy machine): a chain of phases (load, init, inference, release of one call) then
takes its modelled time in all, as on the board, instead of adding this machine's hiccups. A phase whose real work
alone takes longer than its (credited) target overruns (`overrun_s > 0`); overruns are reported, never hidden.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass

from models.board.cost import LABEL

clock = time.perf_counter


def check_time_scale(value) -> float:
    """time_scale must be a number in (0, 1]: 1 = the board's pace, 0.1 = ten times faster (quick runs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= 1:
        raise ValueError(f"time_scale {value!r} must be a number in (0, 1] (1 = the modelled board's pace)")
    return float(value)


def scale_note(time_scale: float) -> str:
    """What every printed line of a paced run says about its time scale."""
    return f"time_scale={time_scale:g}" + ("" if time_scale == 1 else " (paced phases shrunk; board s = paced s / scale)")


@dataclass
class Paced:
    """One paced phase: the modelled board seconds, its target here (x time_scale), the credit it used, the real
    work, the wall."""
    modelled_s: float
    target_s: float
    real_s: float
    wall_s: float
    credit_s: float = 0.0

    @property
    def overrun_s(self) -> float:
        return max(0.0, self.real_s - (self.target_s - self.credit_s))

    @property
    def excess_s(self) -> float:
        """What this phase took beyond its credited target: the credit it hands to the next phase of its chain."""
        return max(0.0, self.wall_s - (self.target_s - self.credit_s))

    def to_dict(self) -> dict:
        return {**asdict(self), "overrun_s": self.overrun_s}


def pace(t0: float, modelled_s: float, time_scale: float, credit_s: float = 0.0, now_fn=None) -> Paced:
    """Sleep until `modelled_s * time_scale - credit_s` has passed since `t0` (on `now_fn`'s clock, perf_counter by
    default); the real work is what had passed."""
    now_fn = now_fn or clock
    target = modelled_s * time_scale
    credit = min(max(0.0, credit_s), target)
    now = now_fn()
    real = now - t0
    deadline = t0 + target - credit
    while now < deadline:                  # a sleep may end a little early on some systems: never end a phase early
        time.sleep(deadline - now)
        now = now_fn()
    return Paced(modelled_s, target, real, now - t0, credit)


class Chain:
    """Credit between the phases of one context's model (load, init, inferences, release) that run back to back
    (started within CHAIN_GAP_S of the previous one's end): a waiting gap (the next request, an NPU core, a
    prefetched model waiting for its call) breaks the chain and drops the credit."""
    CHAIN_GAP_S = 0.005

    def __init__(self):
        self.credit, self.last_end = 0.0, None
        self._linked = False

    def start(self, t0: float) -> float:
        """The credit a phase that began at `t0` may use (0 when the chain was broken)."""
        self._linked = self.last_end is not None and t0 - self.last_end <= self.CHAIN_GAP_S
        return self.credit if self._linked else 0.0

    def end(self, p: Paced) -> Paced:
        """Hand what the phase took beyond its credited target to the next one."""
        self.credit = (self.credit - p.credit_s if self._linked else 0.0) + p.excess_s
        self.last_end = clock()
        return p

    def pace(self, t0: float, modelled_s: float, time_scale: float) -> Paced:
        return self.end(pace(t0, modelled_s, time_scale, self.start(t0)))


@dataclass
class PaceTotals:
    """Sums over paced phases (thread-safe through `add`)."""
    modelled_s: float = 0.0
    target_s: float = 0.0
    real_s: float = 0.0
    wall_s: float = 0.0
    credit_s: float = 0.0
    overrun_s: float = 0.0
    overruns: int = 0
    phases: int = 0

    def add(self, p: Paced) -> None:
        self.modelled_s += p.modelled_s
        self.target_s += p.target_s
        self.real_s += p.real_s
        self.wall_s += p.wall_s
        self.credit_s += p.credit_s
        self.overrun_s += p.overrun_s
        self.overruns += p.overrun_s > 0
        self.phases += 1

    def to_dict(self) -> dict:
        return asdict(self)


class HostPacer:
    """The scheduler's host ops at the modelled board's pace: each pass's host op (models.runtime.dit_runner's `host_pace`
    hook) takes at least half the board's host time per branch pass x time_scale. The reference's 0.1658 s per block
    covers both passes of its three branches (R3, docs/board-figures.md). An op that runs while the executor infers the
    other pass (interleave) is held there too, so what a policy hides stays hidden in wall time.

    The ops of one job form one chain (the scheduler's thread runs them in turn): what an op took beyond its target
    (a late wake-up on a busy machine, real work that overran) is credited to the next ones, so the job's host time
    stays at the board's while this machine's own work fits in it; real overruns are still counted in `totals`."""

    def __init__(self, pass_s: float, time_scale: float):
        self.pass_s = float(pass_s)
        self.time_scale = check_time_scale(time_scale)
        self.totals = PaceTotals()
        self._lock = threading.Lock()
        self._credit = 0.0

    @classmethod
    def for_pack(cls, pack_dir, time_scale: float, board_model: str = "full", board_cost=None) -> "HostPacer":
        from models.board.cost import BoardModel
        model = BoardModel.for_pack(pack_dir, board_model, board_cost)
        return cls(model.host_pass_s, time_scale)

    def op(self, t0: float) -> Paced:
        """One pass's host op that began at `t0` (time.monotonic): a branch pass has two (LayerNorm + modulation
        before the branch, gate + residual after), each held to half the pass's modelled host time x time_scale."""
        with self._lock:
            credit = self._credit
        p = pace(t0, self.pass_s / 2, self.time_scale, credit, now_fn=time.monotonic)
        with self._lock:
            self._credit += p.excess_s - p.credit_s
            self.totals.add(p)
        return p

    def describe(self) -> str:
        return (f"{LABEL} board host ops: {self.pass_s * 6:.4f} s per block (both passes), {scale_note(self.time_scale)}")
