"""The scheduler's ETA (stages/eta.py): calls still to come after each branch call, checked against the whole call
sequence written out; exact at a constant rate; and steady over a recorded Spectrum run, where forecast steps cost a
thousandth of a computed one (the old estimate swung at each of them)."""
import json
from pathlib import Path

import pytest

from models.dit.partition import KINDS
from models.sampling.spectrum import SpectrumSettings, plan
from orchestrator.engine.progress_text import eta_text
from stages.eta import EtaClock, calls_left

RECORDED = Path(__file__).parent / "data" / "progress" / "board_sim_spectrum_20_steps.json"


@pytest.mark.parametrize("blocks,computed", [(3, [1, 2, 3]), (28, plan(SpectrumSettings(), 20)[0]),
                                             (2, [1, 4, 7])])
def test_calls_left_counts_the_rest_of_the_sequence(blocks, computed):
    seq = [(s, b, k) for s in computed for b in range(blocks) for k in KINDS]     # what the executor will serve
    for i, (s, b, k) in enumerate(seq):
        assert calls_left(s, b, k, blocks, computed) == len(seq) - i - 1


def test_eta_is_exact_at_a_constant_rate():
    computed, blocks, per_call, per_forecast = [1, 2, 4], 4, 0.25, 0.01
    clock, t = EtaClock(5, blocks, computed), 0.0
    total = len(computed) * blocks * len(KINDS) * per_call + 2 * per_forecast       # steps 3 and 5 are forecast
    for step in range(1, 6):
        if step not in computed:
            t += per_forecast
            clock.cheap_step(per_forecast)
            assert clock.eta(t, step) == pytest.approx(total - t)
            continue
        for b in range(blocks):
            for k in KINDS:
                t += per_call
                clock.call_done()
                # a forecast step is priced once one has been timed (until then at nothing: 0.01 s each here)
                unpriced = 0.0 if clock.cheap_done else clock.cheap_left(step) * per_forecast
                assert clock.eta(t, step, b, k) == pytest.approx(total - t - unpriced)


def _replay(rec: dict, estimate) -> list:
    """(seconds so far, ETA, true seconds left) after every branch call and every forecast step of the recording (a
    computed step's calls spread evenly over its measured wall time)."""
    steps, blocks = rec["steps"], rec["blocks"]
    total, t, out = sum(s["wall_s"] for s in steps), 0.0, []
    for s in steps:
        if not s["computed"]:
            t += s["wall_s"]
            out.append((t, estimate("forecast", s, t, None), total - t))
            continue
        assert s["calls"] == blocks * len(KINDS)
        for i in range(s["calls"]):
            t += s["wall_s"] / s["calls"]
            out.append((t, estimate("call", s, t, (i // len(KINDS), KINDS[i % len(KINDS)])), total - t))
    return out


def _jumps(seq: list) -> list:
    """Every rise of the ETA from one report to the next, in seconds, with where."""
    return [(b[1] - a[1], b[0]) for a, b in zip(seq, seq[1:]) if a[1] is not None and b[1] is not None]


def test_the_eta_is_steady_over_a_recorded_spectrum_run():
    rec = json.loads(RECORDED.read_text())
    steps, blocks = rec["steps"], rec["blocks"]
    clock = EtaClock(len(steps), blocks, [s["step"] for s in steps if s["computed"]])

    def new(kind, s, t, where):
        if kind == "forecast":
            clock.cheap_step(s["wall_s"])
            return clock.eta(t, s["step"])
        clock.call_done()
        return clock.eta(t, s["step"], *where)
    seq = _replay(rec, new)
    first_step = steps[0]["wall_s"]
    settled = [(t, eta, left) for t, eta, left in seq if t > first_step]
    # within 12% of the time really left (the first step's cold start makes the early ETA high, then it settles)
    assert all(abs(eta - left) <= 0.12 * left + 1.0 for _, eta, left in settled), max(
        (abs(eta - left) / left, t) for t, eta, left in settled if left)
    # and monotone-ish: it never rises by more than a second and a half from one report to the next (a call's time
    # on this board is ~0.34 s), where a forecast step made it swing
    assert max(j for j, _ in _jumps(seq)) <= 1.5, max(_jumps(seq))

    # the estimate this replaces, on the same recording: per call at the mean over all time so far, and at a forecast
    # step (no ETA from the stage) the time per step so far times the steps left, as the CLI scaled it
    done = {"calls": 0}
    computed = [s["step"] for s in steps if s["computed"]]

    def old(kind, s, t, where):
        if kind == "forecast":
            return t / (s["step"] - 1) * (len(steps) - s["step"] + 1)
        done["calls"] += 1
        return t / done["calls"] * calls_left(s["step"], *where, blocks, computed)
    swings = [j for j, _ in _jumps(_replay(rec, old))]
    assert max(swings) > 60 and min(swings) < -60         # minutes up and down around the forecast steps


def test_eta_text_is_minutes_and_seconds():
    assert [eta_text(v) for v in (None, 0, 59.6, 91, 3600)] == ["?", "0m00s", "1m00s", "1m31s", "60m00s"]
