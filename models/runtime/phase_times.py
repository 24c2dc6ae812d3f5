"""What one branch call's lifecycle cost (PhaseTimes) and its sums over calls (PhaseSums): THE timing record.

Produced by models/runtime/lifecycle.py for every call, carried on the wire as BRANCH_DONE.times and DENOISED.branches
(protocol/messages.py validates these classes' fields), summed per branch kind by the runner, the scheduler and the
report. Visible vs hidden: what a policy keeps on the critical path and what it moves behind other work.
"""
from typing import ClassVar, Literal

from models.dit.partition import KINDS
from models.base.schema import Float, Int, Items, Record

SOURCES = ("load", "prefetch", "resident", "held")     # how a call got its model
MAX_RUNS = 4096                                        # model runs of one call (a VAE decodes its tiles in one)
Seconds = Float()                                      # [0, 1e12]: a duration, or a time.monotonic() stamp
Calls = Int(0, 2**40)


class PhaseTimes(Record, frozen=True):
    """Seconds of one branch call (also the wire form of BRANCH_DONE.times).

    load_s, init_s: this call's model, wherever they ran (now, or ahead on the helper thread); 0 when it was already
    loaded. infer_s / infer_at: each pass's inference seconds and its start (time.monotonic(), comparable across
    processes of one host). release_s: this model's release inside the call (visible). prev_release_s: the previous
    call's model, released on the helper thread while this call ran (hidden). wait_s: visible waiting for helper
    work (a prefetch not ready yet, a pending release). source: how the model was obtained (SOURCES).
    context_mb: memory of this call's context(s) as the backend reported it after init (0: unknown).
    The wire requires load_s, init_s, infer_s and release_s (WIRE_DEFAULTS: code may leave them out); BRANCH_DONE
    bounds the passes."""
    WIRE_DEFAULTS: ClassVar[dict] = {"load_s": float, "init_s": float, "infer_s": tuple, "release_s": float}
    load_s: Seconds
    init_s: Seconds
    infer_s: Items(Seconds, MAX_RUNS)
    release_s: Seconds
    wait_s: Seconds = 0.0
    prev_release_s: Seconds = 0.0
    source: Literal[SOURCES] = "load"
    context_mb: Seconds = 0.0
    infer_at: Items(Seconds, MAX_RUNS) = ()

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
        """The fields plus the derived sums (reports)."""
        return {**super().to_dict(), "npu_s": self.npu_s, "visible_s": self.visible_s, "hidden_s": self.hidden_s,
                "total_s": self.total_s}


class PhaseSums(Record):
    """PhaseTimes summed over calls (per branch kind in reports; also the wire form of DENOISED.branches, which
    requires calls, load_s, init_s, infer_s and release_s)."""
    WIRE_DEFAULTS: ClassVar[dict] = {"calls": int, "load_s": float, "init_s": float, "infer_s": float,
                                     "release_s": float}
    calls: Calls
    load_s: Seconds
    init_s: Seconds
    infer_s: Seconds
    release_s: Seconds                 # own releases plus background ones credited to their model's kind
    wait_s: Seconds = 0.0
    visible_s: Seconds = 0.0           # lifecycle on the critical path
    hidden_s: Seconds = 0.0            # lifecycle behind other work (prefetched load+init, background release)
    cached: Calls = 0                  # calls whose model was already loaded (prefetch, resident, held)

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
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(o, name))
        return self

    def add_background_release(self, seconds: float) -> None:
        self.release_s += seconds
        self.hidden_s += seconds

    @property
    def total_s(self) -> float:
        return self.visible_s + self.infer_s

    def to_dict(self) -> dict:
        return {**super().to_dict(), "total_s": self.total_s}


def add_call(sums: dict, kind: str, t: PhaseTimes) -> None:
    """Add one call to per-kind sums; a background release belongs to the previous call's model, which is the
    previous kind in the fixed cycle self → cross → ffn → self (also with interleave: the same branch's first pass
    holds its model, so its release is reported by the next branch's first call)."""
    sums.setdefault(kind, PhaseSums()).add(t)
    if t.prev_release_s:
        prev = KINDS[(KINDS.index(kind) - 1) % len(KINDS)]
        sums.setdefault(prev, PhaseSums()).add_background_release(t.prev_release_s)
