"""What one branch call's lifecycle cost (PhaseTimes) and its sums over calls (PhaseSums): THE timing record.

Produced by models/lifecycle.py for every call, carried on the wire as BRANCH_DONE.times and DENOISED.branches
(protocol/messages.py validates these classes' fields), summed per branch kind by the runner, the scheduler and the
report. Visible vs hidden: what a policy keeps on the critical path and what it moves behind other work.
"""
from __future__ import annotations

import dataclasses

from models.partition import KINDS

SOURCES = ("load", "prefetch", "resident", "held")     # how a call got its model


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one branch call (also the wire form of BRANCH_DONE.times).

    load_s, init_s: this call's model, wherever they ran (now, or ahead on the helper thread); 0 when it was already
    loaded. infer_s / infer_at: each pass's inference seconds and its start (time.monotonic(), comparable across
    processes of one host). release_s: this model's release inside the call (visible). prev_release_s: the previous
    call's model, released on the helper thread while this call ran (hidden). wait_s: visible waiting for helper
    work (a prefetch not ready yet, a pending release). source: how the model was obtained (SOURCES).
    context_mb: memory of this call's context(s) as the backend reported it after init (0: unknown)."""
    load_s: float = 0.0
    init_s: float = 0.0
    infer_s: tuple = ()
    release_s: float = 0.0
    wait_s: float = 0.0
    prev_release_s: float = 0.0
    source: str = "load"
    context_mb: float = 0.0
    infer_at: tuple = ()

    @property
    def npu_s(self) -> float:
        """Pure inference seconds (all passes)."""
        return float(sum(self.infer_s))

    @property
    def visible_s(self) -> float:
        """Lifecycle seconds on the call's critical path."""
        own = self.load_s + self.init_s if self.source == "load" else 0.0
        return own + self.wait_s + self.release_s

    @property
    def hidden_s(self) -> float:
        """Lifecycle seconds that ran on the helper thread behind other work."""
        ahead = max(0.0, self.load_s + self.init_s - self.wait_s) if self.source == "prefetch" else 0.0
        return ahead + self.prev_release_s

    @property
    def total_s(self) -> float:
        """The call's critical path in the lifecycle: visible lifecycle plus inference. With dual_core the passes
        overlap, so this is the wall time of the inference part, not the sum of the passes."""
        if len(self.infer_at) == len(self.infer_s) and self.infer_at:
            span = max(a + s for a, s in zip(self.infer_at, self.infer_s)) - min(self.infer_at)
        else:
            span = self.npu_s
        return self.visible_s + span

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(infer_s=list(self.infer_s), infer_at=list(self.infer_at), npu_s=self.npu_s, visible_s=self.visible_s,
                 hidden_s=self.hidden_s, total_s=self.total_s)
        return d


@dataclasses.dataclass
class PhaseSums:
    """PhaseTimes summed over calls (per branch kind in reports; also the wire form of DENOISED.branches)."""
    calls: int = 0
    load_s: float = 0.0
    init_s: float = 0.0
    infer_s: float = 0.0
    release_s: float = 0.0             # own releases plus background ones credited to their model's kind
    wait_s: float = 0.0
    visible_s: float = 0.0             # lifecycle on the critical path
    hidden_s: float = 0.0              # lifecycle behind other work (prefetched load+init, background release)
    cached: int = 0                    # calls whose model was already loaded (prefetch, resident, held)

    def add(self, t: PhaseTimes) -> "PhaseSums":
        self.calls += 1
        self.load_s += t.load_s
        self.init_s += t.init_s
        self.infer_s += t.npu_s
        self.release_s += t.release_s
        self.wait_s += t.wait_s
        self.visible_s += t.visible_s
        self.hidden_s += t.hidden_s - t.prev_release_s
        self.cached += t.source != "load"
        return self

    def merge(self, o: "PhaseSums") -> "PhaseSums":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))
        return self

    def add_background_release(self, seconds: float) -> None:
        self.release_s += seconds
        self.hidden_s += seconds

    @property
    def total_s(self) -> float:
        return self.visible_s + self.infer_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s}


def add_call(sums: dict, kind: str, t: PhaseTimes) -> None:
    """Add one call to per-kind sums; a background release belongs to the previous call's model, which is the
    previous kind in the fixed cycle self → cross → ffn → self (also with interleave: the same branch's first pass
    holds its model, so its release is reported by the next branch's first call)."""
    sums.setdefault(kind, PhaseSums()).add(t)
    if t.prev_release_s:
        prev = KINDS[(KINDS.index(kind) - 1) % len(KINDS)]
        sums.setdefault(prev, PhaseSums()).add_background_release(t.prev_release_s)
