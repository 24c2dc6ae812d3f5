"""The scheduler's ETA for one DENOISE: the time its sampling pass has left, sent with every PROGRESS.

Two kinds of step cost very different times: a computed step makes blocks x 3 branch calls to the executor, while a
forecast step (Spectrum) or a step the step cache answers whole (EasyCache, LazyCache) makes none and takes a small
part of that. They are priced apart: the calls still to come at the mean wall time per finished branch call measured
over the computed steps only (host ops, transport and state saves included), plus the cheap steps still to come at
their own mean. One mean per kind keeps the ETA steady across a forecast step, where a rate over all steps (or the
time per step so far) would swing it down and back up (1m31s -> 0m54s -> 1m25s).
"""
from __future__ import annotations

from models.dit.partition import KINDS


def calls_left(step: int, block: int, kind: str, blocks: int, computed_steps) -> int:
    """Branch calls still to come after (step, block, kind): the rest of this step, then every later computed step's
    (forecast steps make none; a step of two model calls is listed twice)."""
    rest = (blocks - 1 - block) * len(KINDS) + (len(KINDS) - 1 - KINDS.index(kind))
    return rest + len(KINDS) * blocks * sum(1 for s in computed_steps if s > step)


class EtaClock:
    """One DENOISE's clock: `call_done()` after each finished branch (all its passes), `cheap_step(seconds)` after
    each step that made no branch call; `eta(...)` at any point. Times are seconds since the DENOISE started."""

    def __init__(self, steps: int, blocks: int, computed_steps):
        self.steps, self.blocks = steps, blocks
        self.computed = sorted(computed_steps)        # 1-based, a two-call step twice (Sampler.plan())
        self.calls_done = 0
        self.cheap_done, self.cheap_s = 0, 0.0

    def call_done(self) -> None:
        self.calls_done += 1

    def cheap_step(self, seconds: float) -> None:
        self.cheap_done += 1
        self.cheap_s += max(0.0, seconds)

    def cheap_left(self, step: int) -> int:
        """Steps after `step` that run no model call by the plan (forecast steps)."""
        return (self.steps - step) - len({s for s in self.computed if s > step})

    def eta(self, elapsed_s: float, step: int, block: int | None = None, kind: str | None = None) -> float | None:
        """Seconds left after (step, block, kind) has finished (block None: after the whole step); None before any
        branch call finished when calls are still to come (nothing to price them by yet)."""
        if block is None:
            calls = len(KINDS) * self.blocks * sum(1 for s in self.computed if s > step)
        else:
            calls = calls_left(step, block, kind, self.blocks, self.computed)
        cheap = self.cheap_left(step)
        if calls and not self.calls_done:
            return None
        per_call = max(0.0, elapsed_s - self.cheap_s) / self.calls_done if self.calls_done else 0.0
        per_cheap = self.cheap_s / self.cheap_done if self.cheap_done else 0.0
        return calls * per_call + cheap * per_cheap
