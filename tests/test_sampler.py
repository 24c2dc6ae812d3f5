"""Sampler: schedules, Euler + CFG baseline, Spectrum rule and forecast, bitwise resume, seeded noise (vs torch)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from models.sampling import spectrum as sp
from models.sampling.noise import comfy_noise, initial_noise, numpy_noise
from models.sampling.sampler import Sampler, make_sigmas
from models.sampling.sampler_state import SamplerState, SamplerStateError
from models.sampling.spectrum import SpectrumSettings

SHAPE = (16, 4, 6)                      # [C, h, w]: small latent


def toy_model(seed: int = 7):
    """A deterministic stand-in DiT: fixed random linear maps of x plus sigma-dependent offsets."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(SHAPE))
    a_c = (rng.standard_normal((n, n)) / math.sqrt(n)).astype(np.float32) * 0.5
    a_u = (rng.standard_normal((n, n)) / math.sqrt(n)).astype(np.float32) * 0.5
    b_c = rng.standard_normal(n).astype(np.float32)
    b_u = rng.standard_normal(n).astype(np.float32)
    calls = []

    def fn(x, sigma):
        calls.append(float(sigma))
        xf = x.reshape(-1)
        s = np.float32(sigma)
        return (a_c @ xf + s * b_c).reshape(SHAPE), (a_u @ xf + s * b_u).reshape(SHAPE)
    fn.calls = calls
    fn.a_c, fn.a_u = a_c, a_u                 # v_c = a_c x + sigma b_c, v_u = a_u x + sigma b_u
    return fn


def start_latent(seed=3):
    return numpy_noise(seed, SHAPE)


# ---- schedules -------------------------------------------------------------------------------------------------------
def _shift(t, s=3.0):
    return s * t / (1 + (s - 1) * t)


@pytest.mark.parametrize("n", [1, 4, 20, 28])
def test_sgm_uniform_formula(n):
    lo = _shift(0.001)
    want = [_shift(1.0 + (lo - 1.0) * k / n) for k in range(n)] + [0.0]
    got = make_sigmas("sgm_uniform", n)
    assert got.dtype == np.float32 and got.shape == (n + 1,)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[0] == 1.0 and got[-1] == 0.0 and np.all(np.diff(got) < 0)


@pytest.mark.parametrize("n", [1, 7, 20, 30])
def test_simple_schedule_picks_from_table(n):
    # ComfyUI: the flow model's table holds shift(i/1000), i = 1..1000; `simple` takes entry -(1 + int(k * 1000 / n))
    table = [_shift(i / 1000) for i in range(1, 1001)]
    want = [table[-(1 + int(k * (len(table) / n)))] for k in range(n)] + [0.0]
    np.testing.assert_allclose(make_sigmas("simple", n), want, rtol=1e-6, atol=1e-7)


def test_simple_matches_torch_float32_table():
    torch = pytest.importorskip("torch")
    t = torch.arange(1, 1001, 1) / 1000
    table = (3.0 * t / (1 + 2.0 * t)).tolist()
    want = [table[-(1 + int(k * (1000 / 20)))] for k in range(20)] + [0.0]
    np.testing.assert_allclose(make_sigmas("simple", 20), np.array(want, np.float32), rtol=2e-7, atol=0)


@pytest.mark.parametrize("bad", [dict(scheduler="karras_exp"), dict(sampler="Euler a"), dict(steps=0), dict(steps=2.5),
                                 dict(cfg=float("nan"))])
def test_bad_settings_are_named(bad):
    with pytest.raises(ValueError, match="|".join(bad)):
        Sampler(**bad)


# ---- Spectrum rule and weights ---------------------------------------------------------------------------------------
def test_spectrum_schedule_20_and_28():
    computed, forecast = sp.plan(SpectrumSettings(), 20)
    assert computed == [1, 2, 3, 4, 6, 8, 11, 14, 18, 19, 20]
    assert forecast == [5, 7, 9, 10, 12, 13, 15, 16, 17]
    assert len(sp.plan(SpectrumSettings(), 28)[0]) == 13
    for n in (20, 28):                  # the real loop agrees with the plan and counts model calls
        model = toy_model()
        st = Sampler(steps=n, cfg=4.0).sample(model, start_latent())
        assert st.computed == sp.plan(SpectrumSettings(), n)[0]
        assert len(model.calls) == len(st.computed)
        assert sorted(st.computed + st.forecast) == list(range(1, n + 1))


def test_chebyshev_weights_test_vector():
    a = sp.chebyshev_weights([sp.tau(c) for c in range(4)], sp.tau(4), 3, 1.0)
    np.testing.assert_allclose(a, [0.0064, 0.1337, 0.2472, 0.3474], atol=6e-5)
    assert abs(float(a.sum()) - 0.735) < 1e-3


def _ridge64(calls, c, m=3, lam=1.0):
    """Independent float64 closed form: numpy's Chebyshev Vandermonde, a = X (XᵀX + λI)⁻¹ x*."""
    taus = np.array([2 * k / 50 - 1 for k in calls], dtype=np.float64)
    x = np.polynomial.chebyshev.chebvander(taus, m)
    xs = np.polynomial.chebyshev.chebvander(np.array([2 * c / 50 - 1]), m)[0]
    return x @ np.linalg.solve(x.T @ x + lam * np.eye(m + 1), xs)


@pytest.mark.parametrize("calls,c", [([0, 1, 2, 3], 4), ([0, 1, 2, 3, 5, 7], 8), ([3, 5, 7, 10, 13, 17], 19),
                                     ([10, 11], 12)])
def test_weights_equal_closed_form(calls, c):
    a = sp.chebyshev_weights([sp.tau(k) for k in calls], sp.tau(c), 3, 1.0)
    np.testing.assert_allclose(a, _ridge64(calls, c), rtol=1e-4, atol=1e-6)


def test_cholesky_fallback_on_singular_system():
    # λ = 0 and two identical points: XᵀX is singular; the jitter makes it solvable, and weights stay finite
    a = sp.chebyshev_weights([0.1, 0.1], 0.2, 3, 0.0)
    assert np.all(np.isfinite(a)) and a.shape == (2,)


def test_forecasts_equal_closed_form_ridge():
    sampler = Sampler(steps=20, cfg=4.0)
    model = toy_model()
    st = sampler.init_state(start_latent())
    checked = 0
    while not sampler.done(st):
        if sampler.needs_model(st):
            sampler.step_computed(st, *model(st.latent, sampler.sigma(st)))
            continue
        c = st.step
        hist = [x.astype(np.float64) for x in st.spectrum.x0s]
        a = _ridge64(st.spectrum.calls, c)
        cheb = sum(ai * xi for ai, xi in zip(a, hist))
        taylor = hist[-1] + 0.5 * (hist[-1] - hist[-2])
        x0 = 0.6 * taylor + 0.4 * cheb
        s0, s1 = float(sampler.sigmas[c]), float(sampler.sigmas[c + 1])
        x = st.latent.astype(np.float64)
        want = x + (x - x0) / s0 * (s1 - s0)
        sampler.step_forecast(st)
        np.testing.assert_allclose(st.latent, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        checked += 1
    assert checked == 9


def test_history_is_fifo_of_six_cfg_x0():
    sampler = Sampler(steps=20, cfg=3.0)
    model = toy_model()
    st = sampler.init_state(start_latent())
    want = []
    while not sampler.done(st):
        if sampler.needs_model(st):
            x, s = st.latent.copy(), sampler.sigmas[st.step]
            v_c, v_u = model(x, float(s))
            want.append((st.step, x - s * (v_u + np.float32(3.0) * (v_c - v_u))))
            sampler.step_computed(st, v_c, v_u)
        else:
            sampler.step_forecast(st)
    assert st.spectrum.calls == [c for c, _ in want[-6:]]
    for (_, w), got in zip(want[-6:], st.spectrum.x0s):
        np.testing.assert_array_equal(got, w)


# ---- baseline and resume ---------------------------------------------------------------------------------------------
def test_spectrum_off_equals_plain_euler_cfg_bitwise():
    n, cfg = 12, 4.5
    sig = make_sigmas("sgm_uniform", n)
    model = toy_model()
    x = start_latent()
    for k in range(n):                                      # hand-written baseline
        v_c, v_u = model(x, float(sig[k]))
        v = v_u + np.float32(cfg) * (v_c - v_u)
        x = x + v * (sig[k + 1] - sig[k])
    model2 = toy_model()
    st = Sampler(steps=n, cfg=cfg, spectrum=None).sample(model2, start_latent())
    np.testing.assert_array_equal(st.latent, x)
    assert st.computed == list(range(1, n + 1)) and st.forecast == [] and len(model2.calls) == n


def test_spectrum_changes_result_but_stays_close():
    """How far Spectrum lands from plain Euler, from the math. The toy model is linear, v = A x + sigma b with
    A = a_u + cfg (a_c - a_u), so an Euler step is x' = M_k x + c_k with M_k = I + (s_{k+1} - s_k) A. A forecast step
    uses the forecast x0 instead of the model's, which injects e_k = (s_{k+1} - s_k)(v(x_k) - v_used) on top of that
    step; both runs follow the same map otherwise, so off - on = sum_k M_{N-1} ... M_{k+1} e_k exactly (float32
    rounding aside), and |off - on| <= sum_k |M_{N-1} ... M_{k+1}|_2 |e_k|. Each e_k must also be smaller than the
    step's own update (a forecast that does worse than standing still would be useless)."""
    n_steps, cfg = 20, 4.0
    off = Sampler(steps=n_steps, spectrum=None).sample(toy_model(), start_latent()).latent
    sampler = Sampler(steps=n_steps, cfg=cfg)
    sig = sampler.sigmas.astype(np.float64)
    model, probe = toy_model(), toy_model()
    st = sampler.init_state(start_latent())
    injected = {}                                         # forecast step k -> e_k (float64, flattened)
    while not sampler.done(st):
        if sampler.needs_model(st):
            sampler.step_computed(st, *model(st.latent, sampler.sigma(st)))
            continue
        k, x = st.step, st.latent.copy()
        v_c, v_u = probe(x, float(sampler.sigmas[k]))
        v_true = (v_u + np.float32(cfg) * (v_c - v_u)).astype(np.float64)
        sampler.step_forecast(st)
        dx_used = st.latent.astype(np.float64) - x
        update = v_true * (sig[k + 1] - sig[k])
        injected[k] = (update - dx_used).reshape(-1)
        assert np.linalg.norm(injected[k]) < np.linalg.norm(update), k
    on = st.latent
    assert not np.array_equal(on, off)
    assert np.all(np.isfinite(on))
    assert len(injected) >= 5                             # the forecast steps of 20 (see the schedule test)
    a = (probe.a_u + np.float32(cfg) * (probe.a_c - probe.a_u)).astype(np.float64)
    eye = np.eye(a.shape[0])
    carried, bound = np.zeros(a.shape[0]), 0.0
    for k, e in injected.items():
        phi = eye
        for j in range(k + 1, n_steps):
            phi = (eye + (sig[j + 1] - sig[j]) * a) @ phi
        carried += phi @ e
        bound += np.linalg.norm(phi, 2) * np.linalg.norm(e)
    diff = (off.astype(np.float64) - on.astype(np.float64)).reshape(-1)
    assert np.linalg.norm(diff - carried) <= 1e-4 * np.linalg.norm(diff)      # float32 rounding: ~1e-6 here
    assert np.linalg.norm(diff) <= bound


@pytest.mark.parametrize("spectrum", [SpectrumSettings(), None], ids=["spectrum", "baseline"])
def test_resume_after_any_step_is_bitwise(tmp_path, spectrum):
    n = 20
    sampler = Sampler(steps=n, cfg=4.0, scheduler="simple", spectrum=spectrum)
    ref = sampler.sample(toy_model(), start_latent())
    path = tmp_path / "state.safetensors"
    for k in range(0, n + 1):
        model = toy_model()
        st = sampler.init_state(start_latent(), seed=3, noise="numpy")
        while st.step < k:
            if sampler.needs_model(st):
                sampler.step_computed(st, *model(st.latent, sampler.sigma(st)))
            else:
                sampler.step_forecast(st)
        st.save(path)
        assert sorted(q.name for q in tmp_path.iterdir()) == ["state.safetensors"]   # no staging files left
        back = SamplerState.load(path)
        resumed = Sampler.from_state(back)
        assert back.step == k and back.seed == 3 and back.noise == "numpy"
        out = resumed.sample(toy_model(), state=back)
        np.testing.assert_array_equal(out.latent, ref.latent)
        assert out.computed == ref.computed and out.forecast == ref.forecast


def test_state_file_errors(tmp_path):
    with pytest.raises(SamplerStateError, match="nope.safetensors"):
        SamplerState.load(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 4)
    with pytest.raises(SamplerStateError, match="junk.safetensors"):
        SamplerState.load(junk)
    sampler = Sampler(steps=5)
    st = sampler.init_state(start_latent())
    good = tmp_path / "s.safetensors"
    st.save(good)
    # a state whose settings differ is refused by a sampler with other settings
    with pytest.raises(SamplerStateError, match="settings"):
        Sampler(steps=6).sample(toy_model(), state=SamplerState.load(good))
    # tampered metadata: wrong version
    from models.base.safetensors_io import SafeTensorsFile, save_arrays
    meta = json.loads(SafeTensorsFile(good).metadata["anima_sampler_state"])
    meta["version"] = 99
    bad = tmp_path / "bad.safetensors"
    save_arrays(bad, {"latent": st.latent}, metadata={"anima_sampler_state": json.dumps(meta)})
    with pytest.raises(SamplerStateError, match="version"):
        SamplerState.load(bad)


@pytest.mark.parametrize("damage", ["empty", "half", "header-only"])
def test_an_unusable_state_file_restarts_sampling_from_step_0(tmp_path, damage):
    """A truncated sampler state failed every resume although sampling is deterministic: now the job folder's state is
    used when whole, and sampling starts again from step 0 (same result) when not."""
    from models.sampling.denoise import STATE_FILE, save_state, start_or_resume
    sampler = Sampler(steps=6, spectrum=SpectrumSettings(warmup=1))
    ref = sampler.sample(toy_model(), state=start_or_resume(sampler, 11, (16, 4, 6), noise="numpy"))
    st = start_or_resume(sampler, 11, (16, 4, 6), tmp_path, noise="numpy")
    model = toy_model()
    for _ in range(3):
        if sampler.needs_model(st):
            sampler.step_computed(st, *model(st.latent, sampler.sigma(st)))
        else:
            sampler.step_forecast(st)
    save_state(st, tmp_path)
    path = tmp_path / STATE_FILE
    raw = path.read_bytes()
    path.write_bytes({"empty": b"", "half": raw[:len(raw) // 2], "header-only": raw[:200]}[damage])
    again = start_or_resume(sampler, 11, (16, 4, 6), tmp_path, noise="numpy")
    assert again.step == 0
    out = sampler.sample(toy_model(), state=again)
    np.testing.assert_array_equal(out.latent, ref.latent)
    save_state(st, tmp_path)                                   # a whole one is resumed, not restarted
    assert start_or_resume(sampler, 11, (16, 4, 6), tmp_path, noise="numpy").step == 3


def _state_file(path, meta_text: str, tensors: dict) -> None:
    """tensors: name -> array (stored F32) or (safetensors dtype, array)."""
    from models.base.safetensors_io import TensorEntry, write_safetensors
    entries = []
    for k, v in tensors.items():
        dtype, arr = v if isinstance(v, tuple) else ("F32", v)
        entries.append(TensorEntry(k, dtype, arr.shape, arr))
    write_safetensors(path, entries, metadata={"anima_sampler_state": meta_text})


@pytest.fixture
def saved_state(tmp_path):
    """A Spectrum state two computed steps in, saved and read back raw: (its sampler, the file, the file's metadata
    JSON, its tensors by name)."""
    from models.base.safetensors_io import SafeTensorsFile
    sampler = Sampler(steps=6, spectrum=SpectrumSettings(warmup=1))
    st = sampler.init_state(start_latent(), seed=3, noise="numpy")
    model = toy_model()
    for _ in range(2):
        sampler.step_computed(st, *model(st.latent, sampler.sigma(st)))
    good = tmp_path / "good.safetensors"
    st.save(good)
    f = SafeTensorsFile(good)
    return sampler, good, f.metadata["anima_sampler_state"], {k: f.get(k) for k in f.keys()}


@pytest.mark.parametrize("change", [
    lambda m, t: (m.replace('"step":2', '"step":' + "9" * 5000), t),              # int past the digit limit
    lambda m, t: (m.replace('"settings":', '"settings":' + "[" * 50_000 + "]" * 50_000 + ',"x":'), t),
    lambda m, t: (m.replace('"step":2', '"step":true'), t),
    lambda m, t: (m.replace('"step":2', '"step":-1'), t),
    lambda m, t: (m.replace('"step":2', '"step":"2"'), t),
    lambda m, t: (m.replace('"computed":[1,2]', '"computed":["a"]'), t),
    lambda m, t: (m.replace('"seed":3', '"seed":-3'), t),
    lambda m, t: (m.replace('"noise":"numpy"', '"noise":7'), t),
    lambda m, t: (m.replace('"calls":[0,1]', '"calls":[0,1e400]'), t),
    lambda m, t: (m.replace('"calls":[0,1]', '"calls":{"0":1}'), t),
    lambda m, t: (m.replace('"cached":0', '"cached":-1'), t),
    lambda m, t: (m.replace('"window":', '"window":1e999,"w":'), t),
    lambda m, t: (m.replace('"window":', '"window":NaN,"w":'), t),
    lambda m, t: (m, {**t, "latent": t["latent"][0]}),                              # [h, w]: not [C, h, w]
    lambda m, t: (m, {**t, "latent": ("F16", t["latent"])}),
    lambda m, t: (m, {**t, "latent": np.full_like(t["latent"], np.nan)}),
    lambda m, t: (m, {**t, "spectrum.x0.1": t["latent"][:, :2]}),
    lambda m, t: (m, {k: v for k, v in t.items() if k != "spectrum.x0.0"}),
    lambda m, t: ("[" * 100_000, t),
    lambda m, t: ("{}", t),
])
def test_hostile_state_files_are_only_ever_a_sampler_state_error(tmp_path, change, saved_state):
    """Whatever the file holds, SamplerState.load raises SamplerStateError (the scheduler turns it into an ERROR
    reply and keeps serving), never ValueError/TypeError/RecursionError/OverflowError (those killed it)."""
    sampler, good, meta, tensors = saved_state
    assert '"step":2' in meta and '"calls":[0,1]' in meta and '"computed":[1,2]' in meta and '"cached":0' in meta
    bad = tmp_path / "bad.safetensors"
    _state_file(bad, *change(meta, tensors))
    with pytest.raises(SamplerStateError) as e:
        back = SamplerState.load(bad)
        sampler.check_state(back)
    assert type(e.value) is SamplerStateError and "bad.safetensors" in str(e.value)
    assert SamplerState.load(good).step == 2


def test_randomly_damaged_state_files_load_or_raise_sampler_state_error(tmp_path):
    """300 byte-level mutations of a real state file's header: each loads (and resumes) or is a SamplerStateError."""
    import random
    sampler = Sampler(steps=6)
    st = sampler.init_state(start_latent(), seed=3, noise="numpy")
    good = tmp_path / "good.safetensors"
    st.save(good)
    blob = good.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    rng = random.Random(0)
    bad, outcomes = tmp_path / "bad.safetensors", {"loaded": 0, "refused": 0}
    for _ in range(300):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(8, 8 + n)] = rng.choice(b'0123456789[]{}",:-.eE' + bytes([rng.randrange(256)]))
        bad.write_bytes(bytes(b))
        try:
            back = SamplerState.load(bad)
            sampler.check_state(back)
            outcomes["loaded"] += 1
        except SamplerStateError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and sum(outcomes.values()) == 300


def test_step_api_guards():
    sampler = Sampler(steps=20)
    st = sampler.init_state(start_latent())
    with pytest.raises(ValueError, match="v_cond"):
        sampler.step_computed(st, np.zeros((16, 2, 2), np.float32), np.zeros(SHAPE, np.float32))
    with pytest.raises(FloatingPointError, match="v_uncond"):
        sampler.step_computed(st, np.zeros(SHAPE, np.float32), np.full(SHAPE, np.nan, np.float32))
    with pytest.raises(RuntimeError, match="needs the model"):
        sampler.step_forecast(st)
    with pytest.raises(ValueError, match="latent"):
        sampler.init_state(np.zeros((4, 4), np.float32))


# ---- noise -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 42, 123456789, 2**40 + 5])
@pytest.mark.parametrize("shape", [(1, 16, 1, 8, 8), (1, 16, 1, 6, 10), (17,), (3, 7, 5)])
def test_comfy_noise_matches_torch(seed, shape):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    want = torch.randn(*shape).numpy()
    got = comfy_noise(seed, shape)
    assert got.dtype == np.float32 and got.shape == shape
    # torch's vectorised log/sincos are polynomial approximations: agreement to a few float32 ulp
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_comfy_latent_shape_matches_comfy_layout():
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    want = torch.randn(1, 16, 1, 8, 12).numpy().reshape(16, 8, 12)
    np.testing.assert_allclose(initial_noise(5, (16, 8, 12), "comfy"), want, rtol=2e-6, atol=2e-6)


def test_numpy_noise_is_seeded_pcg64():
    a = initial_noise(9, SHAPE, "numpy")
    np.testing.assert_array_equal(a, np.random.Generator(np.random.PCG64(9)).standard_normal(SHAPE, dtype=np.float32))
    assert not np.array_equal(a, initial_noise(10, SHAPE, "numpy"))
    assert abs(float(initial_noise(1, (16, 64, 64), "numpy").std()) - 1.0) < 0.02


@pytest.mark.parametrize("args,match", [((-1, SHAPE, "comfy"), "seed"), ((1.5, SHAPE, "numpy"), "seed"),
                                        ((1, (3, 3), "comfy"), "16 elements"), ((1, SHAPE, "philox"), "noise mode"),
                                        ((1, (0, 4), "numpy"), "shape")])
def test_noise_errors(args, match):
    with pytest.raises(ValueError, match=match):
        initial_noise(*args)


def test_a_state_file_with_the_former_spectrum_names_still_resumes(tmp_path):
    """Earlier releases' state files name the Spectrum settings blend/degree/ridge (plus the fixed history and
    tau_span): they are read as w/m/lam, so such a job resumes instead of starting again."""
    sampler = Sampler(steps=6, spectrum=SpectrumSettings(warmup=1, lam=0.5))
    st = sampler.init_state(start_latent(), seed=3, noise="numpy")
    st.settings["spectrum"] = {"blend": 0.4, "degree": 3, "ridge": 0.5, "window": 2.0, "flex": 0.5, "warmup": 1,
                               "stop": 0.9, "history": 6, "tau_span": 50}
    path = tmp_path / "old.safetensors"
    st.save(path)
    back = SamplerState.load(path)
    sampler.check_state(back)                                           # the same settings, in the former names
    assert Sampler.from_state(back).spectrum == SpectrumSettings(warmup=1, lam=0.5)
    back.settings["spectrum"]["history"] = 7                            # a history this code does not keep
    with pytest.raises(SamplerStateError):
        Sampler.from_state(back)


@pytest.mark.parametrize("extra", ["junk", "run.a.history"])
def test_a_state_padded_with_a_large_tensor_is_refused_from_its_header(tmp_path, monkeypatch, extra, saved_state):
    """A state file with one more, large tensor (reported: 1 GiB, read whole, 2.5 GB RSS, then refused) is refused
    from the header's names and shapes: no tensor data is read at all."""
    from models.base.safetensors_io import SafeTensorsFile
    sampler, good, meta, tensors = saved_state
    big = np.zeros((4, 1024, 1024), np.float32)                          # 16 MB; the latent is far smaller
    bad = tmp_path / "bad.safetensors"
    _state_file(bad, meta, {**tensors, extra: big})
    reads = []
    real_get = SafeTensorsFile.get
    monkeypatch.setattr(SafeTensorsFile, "get", lambda self, k, *a, **kw: reads.append(k) or real_get(self, k, *a, **kw))
    with pytest.raises(SamplerStateError, match=extra.replace(".", r"\.")) as e:
        SamplerState.load(bad)
    assert reads == [], f"tensors read before the refusal: {reads}"
    assert "bad.safetensors" in str(e.value)
    assert SamplerState.load(good).step == 2 and reads                  # a sound state still loads
