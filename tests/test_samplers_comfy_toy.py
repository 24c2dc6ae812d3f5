"""The samplers against ComfyUI's own sampler functions, and resumed runs against uninterrupted ones.

Reference: tests/data/samplers/comfy_toy.npz, made by driving an unmodified ComfyUI's comfy/k_diffusion/sampling.py
and comfy/extra_samplers/uni_pc.py (its KSampler's sigmas for Anima: ModelSamplingAuraFlow shift 3) with a fixed
toy denoiser, on the CPU, starting from comfy.sample.prepare_noise(zeros [1, 16, 1, 4, 4], seed): per
sampler/scheduler/steps the final latent, the schedule, the seed and the sigma of every model call (README in that
folder). The toy denoiser below is the same function in numpy.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.sampling.k_sampling import SAMPLER_NAMES, SAMPLERS, SamplerRunError, cfg_denoised, new_ksampler
from models.sampling.noise import comfy_noise
from models.base.safetensors_io import SafeTensorsFile, TensorEntry, write_safetensors

DATA = Path(__file__).parent / "data" / "samplers" / "comfy_toy.npz"
REF = np.load(DATA)
PATTERN = REF["pattern"]                                   # [16, 4, 4] f32
SHAPE = (16, 4, 4)
CASES = sorted(k[:-2] for k in REF.files if k.endswith("/x"))

# Worst relative difference (max |ours - ComfyUI| / max |ComfyUI|) allowed per sampler. Most agree to float32
# rounding; the ones marked amplify float32 rounding of ComfyUI's scalar maths (log/exp of sigmas near 0, big
# exponential-integrator steps), which numpy's libm reproduces only to an ulp.
TOL = {name: 2e-6 for name in SAMPLER_NAMES}
TOL.update(dpmpp_sde=5e-5, uni_pc=5e-5, uni_pc_bh2=5e-5, lms=5e-5)


def toy(calls=None):
    def model(x, sigma):
        if calls is not None:
            calls.append(sigma)
        return (x * np.float32(0.6 * (1 - sigma)) + np.roll(x, 1, 0) * np.float32(0.1)
                + PATTERN * np.float32(0.5 + 0.3 * sigma))
    return model


def _case(key):
    name, sched, steps = key.split("/")
    return name, sched, int(steps), REF[key + "/sigmas"], int(REF[key + "/seed"])


def test_every_sampler_and_scheduler_is_covered():
    names = {k.split("/")[0] for k in CASES}
    scheds = {k.split("/")[1] for k in CASES}
    assert names == set(SAMPLER_NAMES)
    assert len(scheds) == 9 and len(names) == 22


@pytest.mark.parametrize("key", CASES)
def test_final_latent_equals_comfyui(key):
    name, _, _, sigmas, seed = _case(key)
    calls = []
    got = new_ksampler(name, sigmas, seed=seed, shape=SHAPE).sample(toy(calls), comfy_noise(seed, SHAPE))
    ref = REF[key + "/x"]
    np.testing.assert_allclose(calls, REF[key + "/calls"], rtol=2e-6, atol=1e-7)     # the same model calls
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert rel <= TOL[name], f"{key}: relative difference {rel:.2e} > {TOL[name]:.0e}"


@pytest.mark.parametrize("key", [k for k in CASES if k.endswith("/6")])
def test_nfe_table_counts_the_calls(key):
    name, _, _, sigmas, seed = _case(key)
    ks = new_ksampler(name, sigmas, seed=seed, shape=SHAPE)
    assert sum(ks.nfe(i) for i in range(ks.steps)) == len(REF[key + "/calls"])


def _save(path, ks, st):
    tensors, meta = ks.state_dict(st)
    entries = [TensorEntry(k, "I64" if v.dtype.kind in "iu" else "F32", tuple(v.shape),
                           np.ascontiguousarray(v, dtype=np.int64 if v.dtype.kind in "iu" else np.float32))
               for k, v in tensors.items()]
    write_safetensors(path, entries, metadata={"run": json.dumps(meta)})


def _load(path):
    f = SafeTensorsFile(path)
    tensors = {k: f.get(k, dtype=np.int64 if f.dtype(k) == "I64" else np.float32) for k in f.keys()}
    return tensors, json.loads(f.metadata["run"])


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_resumed_run_equals_uninterrupted_bitwise(name, tmp_path):
    """Stop after every step in turn, save to a file, load into a fresh sampler, finish: bitwise the same latent."""
    key = next(k for k in CASES if k.startswith(name + "/") and k.endswith("/11")) if any(
        k.startswith(name + "/") and k.endswith("/11") for k in CASES) else next(k for k in CASES if k.startswith(name + "/"))
    _, _, _, sigmas, seed = _case(key)
    noise = comfy_noise(seed, SHAPE)
    want = new_ksampler(name, sigmas, seed=seed, shape=SHAPE).sample(toy(), noise)
    model = toy()
    for stop in range(1, len(sigmas) - 1):
        ks = new_ksampler(name, sigmas, seed=seed, shape=SHAPE)
        st = ks.start(noise)
        while st.step < stop:
            x_in, sigma = ks.point(st)
            ks.feed(st, model(x_in, sigma))
        _save(tmp_path / "state.safetensors", ks, st)
        ks2 = new_ksampler(name, sigmas, seed=seed, shape=SHAPE)
        st2 = ks2.from_state_dict(*_load(tmp_path / "state.safetensors"))
        while not ks2.done(st2):
            x_in, sigma = ks2.point(st2)
            ks2.feed(st2, model(x_in, sigma))
        got = ks2.result(st2)
        assert got.tobytes() == want.tobytes(), f"{name}: resumed after step {stop} differs"


def test_state_of_another_run_is_refused():
    key = next(k for k in CASES if k.startswith("er_sde/"))
    _, _, _, sigmas, seed = _case(key)
    ks = new_ksampler("er_sde", sigmas, seed=seed, shape=SHAPE)
    st = ks.start(comfy_noise(seed, SHAPE))
    x_in, sigma = ks.point(st)
    ks.feed(st, toy()(x_in, sigma))
    tensors, meta = ks.state_dict(st)
    for other in (new_ksampler("er_sde", sigmas, seed=seed + 1, shape=SHAPE),
                  new_ksampler("sa_solver", sigmas, seed=seed, shape=SHAPE)):
        with pytest.raises(SamplerRunError, match="sampler state was made by"):
            other.from_state_dict(tensors, meta)
    del tensors["gen.mt_key"]
    with pytest.raises(SamplerRunError, match="incomplete or malformed"):
        ks.from_state_dict(tensors, meta)


def test_inside_a_two_call_step_is_not_a_resume_point():
    key = next(k for k in CASES if k.startswith("heun/") and k.endswith("/6"))
    _, _, _, sigmas, seed = _case(key)
    ks = new_ksampler("heun", sigmas, seed=seed, shape=SHAPE)
    st = ks.start(comfy_noise(seed, SHAPE))
    x_in, sigma = ks.point(st)
    ks.feed(st, toy()(x_in, sigma))
    assert st.stage == 1 and st.step == 0
    with pytest.raises(SamplerRunError, match="between steps"):
        ks.state_dict(st)


def test_cfg_denoised_is_comfyuis_combination():
    rng = np.random.default_rng(0)
    x, vc, vu = (rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(3))
    sigma, cfg = 0.7, 4.5
    want = (x - vu * np.float32(sigma)) + ((x - vc * np.float32(sigma)) - (x - vu * np.float32(sigma))) * np.float32(cfg)
    got = cfg_denoised(x, sigma, vc, vu, cfg)
    np.testing.assert_array_equal(got, want)
    # the same as CFG on the velocity, up to rounding
    np.testing.assert_allclose(got, x - np.float32(sigma) * (vu + np.float32(cfg) * (vc - vu)), atol=1e-5)


def test_bad_inputs_are_refused_naming_the_problem():
    sig = np.array([1.0, 0.5, 0.0], np.float32)
    with pytest.raises(ValueError, match="unknown sampler 'Euler a'; choose one of"):
        new_ksampler("Euler a", sig)
    with pytest.raises(ValueError, match="strictly descending"):
        new_ksampler("euler", np.array([0.5, 1.0, 0.0], np.float32))
    ks = new_ksampler("euler", sig, shape=(16, 4, 4))
    st = ks.start(comfy_noise(1, SHAPE))
    with pytest.raises(ValueError, match="denoised has shape"):
        ks.feed(st, np.zeros((16, 4, 5), np.float32))
    with pytest.raises(FloatingPointError, match="non-finite"):
        ks.feed(st, np.full(SHAPE, np.nan, np.float32))
    assert SAMPLERS["dpmpp_2m_sde"].noise == "brownian" and SAMPLERS["er_sde"].noise == "gaussian"
