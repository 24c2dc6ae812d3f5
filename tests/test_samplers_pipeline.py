"""Every sampler through the pipeline's Sampler (models/sampling/sampler.py): the same latent as k_sampling driven directly with
ComfyUI's CFG, a run killed after any step and resumed from its state file equal to the uninterrupted one bitwise
(multistep history, noise generator position, Brownian tree, SA-Solver buffers, Spectrum history), state files that
do not fit the sampler refused; Spectrum where it applies; the A1111 names."""
from __future__ import annotations

import math

import numpy as np
import pytest

from models.sampling import k_sampling as ks
from models.sampling.denoise import save_state, start_or_resume, STATE_FILE
from models.sampling.noise import comfy_noise
from models.sampling.sampler import SAMPLER_NAMES, SAMPLERS, SCHEDULER_NAMES, Sampler, spectrum_refusal
from models.sampling.sampler_state import SamplerState, SamplerStateError
from models.sampling.spectrum import SpectrumSettings
from orchestrator.http import a1111_names as an
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj

SHAPE = (16, 2, 3)                      # [C, h, w]: a small latent
SEED = 11
STEPS = 5


def toy_velocity(seed: int = 5):
    """A deterministic stand-in DiT giving (v_cond, v_uncond): linear in x, smooth in sigma."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(SHAPE))
    a_c = (rng.standard_normal((n, n)) / math.sqrt(n)).astype(np.float32) * 0.3
    a_u = (rng.standard_normal((n, n)) / math.sqrt(n)).astype(np.float32) * 0.3
    b_c, b_u = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)

    def fn(x, sigma):
        xf, s = x.reshape(-1), np.float32(sigma)
        return (a_c @ xf + s * b_c).reshape(SHAPE), (a_u @ xf + s * b_u).reshape(SHAPE)
    return fn


def _run_to(sampler: Sampler, state: SamplerState, model, step: int) -> None:
    while state.step < step:
        if sampler.needs_model(state):
            sampler.step_computed(state, *model(*sampler.point(state)))
        else:
            sampler.step_forecast(state)


def _spectrum(name: str):
    return SpectrumSettings(warmup=1) if spectrum_refusal(name) is None else None


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_every_sampler_killed_after_any_step_resumes_bitwise(name, tmp_path):
    sampler = Sampler(steps=STEPS, cfg=4.0, scheduler="karras", sampler=name, spectrum=_spectrum(name))
    noise = comfy_noise(SEED, SHAPE)
    ref = sampler.sample(toy_velocity(), noise, seed=SEED)
    want = sampler.result(ref)
    assert np.isfinite(want).all() and len(ref.nfe) == sampler.steps
    assert sum(ref.nfe) == sum(sampler.nfe(i) for i in range(sampler.steps) if i + 1 in ref.computed)
    for k in range(sampler.steps + 1):
        st = sampler.init_state(noise, seed=SEED, noise="comfy")
        _run_to(sampler, st, toy_velocity(), k)
        save_state(st, tmp_path)
        back = start_or_resume(Sampler.from_state(SamplerState.load(tmp_path / STATE_FILE)), SEED, SHAPE, tmp_path)
        assert back.step == k, f"{name}: the state of step {k} was not resumed"
        out = Sampler.from_state(back).sample(toy_velocity(), state=back)
        np.testing.assert_array_equal(Sampler.from_state(out).result(out), want, err_msg=f"{name} resumed at {k}")
        assert (out.computed, out.forecast, out.nfe) == (ref.computed, ref.forecast, ref.nfe)


@pytest.mark.parametrize("name", ["er_sde", "dpmpp_2m_sde", "sa_solver_pece", "uni_pc", "heun", "dpmpp_2m"])
def test_the_sampler_equals_k_sampling_driven_with_comfy_cfg(name):
    """Nothing between the pipeline's step API and ComfyUI's maths: bitwise the k_sampling run fed cfg_denoised."""
    sampler = Sampler(steps=STEPS, cfg=3.5, scheduler="beta", sampler=name, spectrum=None)
    noise = comfy_noise(SEED, SHAPE)
    got = sampler.result(sampler.sample(toy_velocity(), noise, seed=SEED))
    machine = ks.new_ksampler(name, ks.ksampler_sigmas(name, "beta", STEPS), seed=SEED, shape=SHAPE)
    model = toy_velocity()
    want = machine.sample(lambda x, s: ks.cfg_denoised(x, s, *model(x, s), 3.5), noise)
    np.testing.assert_array_equal(got, want)


def test_euler_keeps_the_velocity_form_and_equals_comfy_form_closely():
    sampler = Sampler(steps=STEPS, cfg=4.0, scheduler="simple", spectrum=None)
    noise = comfy_noise(SEED, SHAPE)
    got = sampler.result(sampler.sample(toy_velocity(), noise))
    machine = ks.new_ksampler("euler", sampler.sigmas, shape=SHAPE)
    model = toy_velocity()
    want = machine.sample(lambda x, s: ks.cfg_denoised(x, s, *model(x, s), 4.0), noise)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_state_that_does_not_fit_the_sampler_restarts_from_step_0(tmp_path):
    sampler = Sampler(steps=STEPS, scheduler="simple", sampler="dpmpp_2m", spectrum=None)
    st = sampler.init_state(comfy_noise(SEED, SHAPE), seed=SEED)
    _run_to(sampler, st, toy_velocity(), 2)
    del st.run.arrays["old_denoised"]                   # the multistep history lost
    save_state(st, tmp_path)
    with pytest.raises(SamplerStateError, match="old_denoised"):
        sampler.check_state(SamplerState.load(tmp_path / STATE_FILE))
    assert start_or_resume(sampler, SEED, SHAPE, tmp_path).step == 0
    # another sampler's state is refused too (its settings name it)
    _run_to(sampler, st := sampler.init_state(comfy_noise(SEED, SHAPE), seed=SEED), toy_velocity(), 2)
    save_state(st, tmp_path)
    other = Sampler(steps=STEPS, scheduler="simple", sampler="dpmpp_2m_sde", spectrum=None)
    assert start_or_resume(other, SEED, SHAPE, tmp_path).step == 0
    assert start_or_resume(sampler, SEED, SHAPE, tmp_path).step == 2


def test_a_generator_state_file_cut_is_refused(tmp_path):
    sampler = Sampler(steps=STEPS, scheduler="simple", sampler="euler_ancestral", spectrum=None)
    st = sampler.init_state(comfy_noise(SEED, SHAPE), seed=SEED)
    _run_to(sampler, st, toy_velocity(), 1)
    st.run.gen = None                                   # as if the generator's tensors were missing
    save_state(st, tmp_path)
    with pytest.raises(SamplerStateError):
        sampler.check_state(SamplerState.load(tmp_path / STATE_FILE))


def test_spectrum_where_it_applies():
    refused = {n for n in SAMPLER_NAMES if spectrum_refusal(n)}
    assert refused == {n for n in SAMPLER_NAMES if SAMPLERS[n].nfe.startswith("2")}
    for n in refused:
        with pytest.raises(ValueError, match=f"sampler '{n}'"):
            Sampler(sampler=n, spectrum=SpectrumSettings())
        assert parse_prompt_obj({"prompt": "a", "sampler": n}).spectrum.enabled is False     # default: off there
        with pytest.raises(PromptError, match=f"field 'spectrum': Spectrum does not apply to sampler '{n}'"):
            parse_prompt_obj({"prompt": "a", "sampler": n, "spectrum": True})
    st = Sampler(steps=10, sampler="er_sde", spectrum=SpectrumSettings(warmup=1)).sample(
        toy_velocity(), comfy_noise(SEED, SHAPE), seed=SEED)
    assert st.forecast and 0 in st.nfe and sum(st.nfe) == len(st.computed)
    assert parse_prompt_obj({"prompt": "a", "sampler": "er_sde"}).spectrum.enabled is True


def test_plan_counts_each_model_call():
    s = Sampler(steps=4, sampler="heun", scheduler="simple", spectrum=None)
    assert s.plan() == [1, 1, 2, 2, 3, 3, 4]             # heun's last step is Euler alone
    s = Sampler(steps=4, sampler="sa_solver_pece", scheduler="simple", spectrum=None)
    assert s.plan() == [1, 2, 2, 3, 3, 4, 4]


def test_a1111_names():
    assert {s.name for s in an.A1111_SAMPLERS} == set(SAMPLER_NAMES)
    assert {s.name for s in an.A1111_SCHEDULERS} == set(SCHEDULER_NAMES)
    assert an.resolve("Euler a", None) == ("euler_ancestral", "sgm_uniform")
    assert an.resolve("k_euler_a", "automatic") == ("euler_ancestral", "sgm_uniform")
    assert an.resolve("DPM++ 2M", "Karras") == ("dpmpp_2m", "karras")
    assert an.resolve("DPM++ 2M Karras", "automatic") == ("dpmpp_2m", "karras")
    assert an.resolve("DPM++ 2M SDE Exponential", None) == ("dpmpp_2m_sde", "exponential")
    assert an.resolve("DPM++ 2M Karras", "karras") == ("dpmpp_2m", "karras")
    assert an.resolve("er_sde", "Beta") == ("er_sde", "beta")
    assert an.resolve("UniPC", "Uniform") == ("uni_pc", "normal")
    assert an.resolve("Heun", "SGM Uniform") == ("heun", "sgm_uniform")
    for sampler, scheduler, field, words in (("Restart", None, "sampler_name", r"Restart \(A1111's restart sampler\)"),
                                             ("DPM++ 2M Karras", "Exponential", "scheduler", "contradicts"),
                                             ("Euler", "Align Your Steps", "scheduler", "Align Your Steps"),
                                             ("Euler b", None, "sampler_name", r"samplers: DPM\+\+ 2M, ")):
        with pytest.raises(an.A1111NameError, match=words) as e:
            an.resolve(sampler, scheduler)
        assert e.value.field == field
    names = [s["name"] for s in an.samplers_list()]
    assert "Euler a" in names and "DPM++ 2M SDE" in names and "Restart" not in names
    assert [s["name"] for s in an.schedulers_list()][:3] == ["automatic", "uniform", "karras"]
    assert an.sampler_label("euler_ancestral") == "Euler a" and an.scheduler_label("normal") == "Normal"
