"""Several conditionings per CFG side (models/sampling/cond_mix.py) against a straightforward second computation of
ComfyUI's rule (comfy/samplers.py calc_cond_batch, written out here in float64 on denoised outputs): each active
entry's output weighted by its strength, divided by the summed strengths (+1e-37); windows from
ModelSamplingDiscreteFlow.percent_to_sigma (shift 3: sigma = 3t / (1 + 2t), t = 1 - percent); no active entry gives
a denoised of 0."""
from __future__ import annotations

import numpy as np
import pytest

from models.sampling.cond_mix import CondPass, Conditioning, active_passes, is_active, mix, percent_to_sigma
from models.sampling.sampler import Sampler


def _comfy_sigma(percent: float) -> float:
    """ComfyUI's ModelSamplingDiscreteFlow.percent_to_sigma for shift 3, multiplier 1, written out."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    t = 1.0 - percent
    return 3.0 * t / (1.0 + 2.0 * t)


def _comfy_denoised(x, sigma, outs, strengths):
    """calc_cond_batch's sum: denoised_i = x - sigma v_i, sum(w d) / (1e-37 + sum w), in float64."""
    x = x.astype(np.float64)
    num = sum(w * (x - sigma * v.astype(np.float64)) for v, w in zip(outs, strengths))
    return num / (1e-37 + sum(strengths)) if outs else np.zeros_like(x)


@pytest.mark.parametrize("strengths", [(1.0,), (1.0, 1.0), (0.3, 2.5, 1.0), (0.0, 1.0)])
def test_the_mix_is_comfyuis_weighted_average_of_denoised_outputs(strengths):
    rng = np.random.default_rng(len(strengths))
    x = rng.standard_normal((4, 6, 6)).astype(np.float32)
    outs = [rng.standard_normal(x.shape).astype(np.float32) for _ in strengths]
    sigma = 0.62
    v = mix(outs, strengths, x, sigma)
    got = x.astype(np.float64) - sigma * v.astype(np.float64)
    np.testing.assert_allclose(got, _comfy_denoised(x, sigma, outs, strengths), rtol=0, atol=2e-6)


def test_one_entry_at_strength_1_is_its_own_output_bitwise():
    x = np.random.default_rng(0).standard_normal((4, 5, 5)).astype(np.float32)
    v = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    assert np.array_equal(mix([v], [1.0], x, 0.5), v)


def test_no_active_entry_gives_a_denoised_of_zero():
    x = np.random.default_rng(2).standard_normal((4, 5, 5)).astype(np.float32)
    for outs, strengths in (([], []), ([x + 1], [0.0])):          # nothing active; all weight zero
        v = mix(outs, strengths, x, 0.4)
        np.testing.assert_allclose(x - np.float32(0.4) * v, 0.0, atol=1e-6)


@pytest.mark.parametrize("percent", [0.0, 0.1, 0.25, 0.5, 0.75, 0.999, 1.0])
def test_percent_to_sigma_is_comfyuis(percent):
    assert percent_to_sigma(percent) == pytest.approx(_comfy_sigma(percent), abs=1e-12)


@pytest.mark.parametrize("scheduler,steps", [("simple", 8), ("simple", 6), ("karras", 9), ("sgm_uniform", 7)])
def test_the_windows_follow_comfyuis_test_on_every_step_sigma(scheduler, steps):
    halves = (CondPass(None, start=0.0, end=0.5), CondPass(None, start=0.5, end=1.0))
    middle = (CondPass(None, start=0.2, end=0.6),)
    for sigma in Sampler(steps=steps, scheduler=scheduler, spectrum=None).sigmas[:-1]:
        s32 = np.float32(sigma)
        for entries in (halves, middle):
            want = [i for i, e in enumerate(entries)
                    if not s32 > np.float32(_comfy_sigma(e.start)) and not s32 < np.float32(_comfy_sigma(e.end))]
            assert active_passes(entries, float(sigma)) == want
        assert active_passes(halves, float(sigma))                 # the halves cover every sigma


def test_the_boundary_sigma_runs_both_halves():
    halves = (CondPass(None, start=0.0, end=0.5), CondPass(None, start=0.5, end=1.0))
    assert active_passes(halves, 0.75) == [0, 1]                   # sigma(0.5) = 3 * 0.5 / 2
    assert not is_active(CondPass(None, start=0.6, end=0.5), 0.7)  # start after end: never (ComfyUI's too)


class _Runner:
    """A stand-in DiT runner: each pass's output is a function of its context, the passes of each call recorded."""

    def __init__(self):
        self.calls = []

    def forward_passes(self, xs, sigma, contexts):
        self.calls.append(len(contexts))
        return [x * 0 + c.mean() for x, c in zip(xs, contexts)]


class _Sampler:
    def __init__(self, passes):
        self.passes, self.shift = passes, 3.0


def _ctx(v: float) -> np.ndarray:
    return np.full((4, 3), v, np.float32)


def test_a_call_runs_each_active_entry_two_passes_per_branch_load_and_mixes_each_side():
    pos = (CondPass(_ctx(1.0)), CondPass(_ctx(3.0), strength=3.0), CondPass(_ctx(9.0), start=0.5))
    neg = (CondPass(_ctx(-2.0)),)
    x = np.zeros((2, 2, 2), np.float32)
    runner = _Runner()
    v_c, v_u, ran = Conditioning(pos, neg).call(runner, _Sampler(2), x, 0.9)      # sigma 0.9: the third not yet
    assert ran == 3 and runner.calls == [2, 1]
    np.testing.assert_allclose(v_c, (1.0 * 1 + 3.0 * 3) / 4, rtol=1e-6)
    np.testing.assert_allclose(v_u, -2.0)
    runner = _Runner()
    v_c, v_u, ran = Conditioning(pos, neg).call(runner, _Sampler(1), x, 0.5)      # cfg 1: no negative pass
    assert v_u is None and ran == 3 and runner.calls == [2, 1]
    np.testing.assert_allclose(v_c, (1.0 + 9.0 + 3.0 * 3) / 5, rtol=1e-6)


def test_the_eta_counts_a_branch_sweep_per_two_active_passes():
    s = Sampler(steps=8, cfg=4.0, scheduler="simple", spectrum=None)          # sigma 0.75 at step 5
    halves = Conditioning((CondPass(None, end=0.5), CondPass(None, start=0.5)), (CondPass(None),))
    assert halves.sweep_plan(s) == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    s1 = Sampler(steps=3, cfg=1.0, scheduler="simple", spectrum=None)
    assert Conditioning((CondPass(None),) * 3, (CondPass(None),)).sweep_plan(s1) == [1, 1, 2, 2, 3, 3]


class _Smooth(_Runner):
    """A stand-in whose outputs move with x, so a step cache has changes to measure."""

    def forward_passes(self, xs, sigma, contexts):
        self.calls.append(len(contexts))
        return [np.tanh(x) * 0.3 + c.mean() for x, c in zip(xs, contexts)]


class _Stop(Exception):
    pass


def test_lazycache_with_entries_reuses_calls_and_resumes_bitwise(tmp_path):
    """LazyCache over the entries' mixed prediction (as ComfyUI's PREDICT_NOISE wrapper sees it): some calls reused,
    and a run stopped after a step and resumed from its saved state ends on the same latent bitwise."""
    from models.sampling.sampler_state import SamplerState
    from models.sampling.step_cache import CacheSettings
    cond = Conditioning((CondPass(_ctx(1.0)), CondPass(_ctx(3.0), start=0.3)), (CondPass(_ctx(-2.0)),))

    def run(state=None, stop=None):
        s = Sampler(steps=12, cfg=4.0, scheduler="simple", spectrum=None,
                    cache=CacheSettings(kind="lazycache", reuse_threshold=1.0))
        runner = _Smooth()

        def saved(st):
            if st.step == stop:
                st.save(tmp_path / "state.safetensors")
                raise _Stop
        x0 = np.random.default_rng(3).standard_normal((2, 8, 8)).astype(np.float32)
        start = {"latent": x0, "seed": 3} if state is None else {"state": state}
        return s, s.sample(lambda x, sigma: cond.call(runner, s, x, sigma)[:2], on_step=saved, **start)
    s, whole = run()
    assert sum(whole.skipped) > 0 and sum(whole.nfe) > 0               # the cache reused calls, and ran others
    with pytest.raises(_Stop):
        run(stop=5)
    _, resumed = run(state=SamplerState.load(tmp_path / "state.safetensors"))
    np.testing.assert_array_equal(s.result(resumed), s.result(whole))
