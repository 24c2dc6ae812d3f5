"""Sampling from a latent (models.sampling.img2img): ComfyUI's denoise sigmas, KSamplerAdvanced's window, the start
at the first sigma, the noise mask at every model call, resume. The references are ComfyUI's formulas written again
here (comfy/samplers.py KSampler.set_steps / KSampler.sample / KSamplerX0Inpaint, comfy/k_diffusion/sampling.py
sample_euler / sample_heun / sample_euler_ancestral_RF, ModelSampling CONST noise_scaling) in torch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from models.sampling import latent_ops as lo
from models.sampling.img2img import LatentPlan, LatentSampler, passes_through, plan_sigmas, sampler_from_settings
from models.sampling.k_sampling import SAMPLER_NAMES, ksampler_sigmas
from models.sampling.noise import comfy_noise
from models.sampling.sampler_state import SamplerState
from models.sampling.schedules import SCHEDULER_NAMES

torch = pytest.importorskip("torch")
SHAPE = (16, 4, 6)
CFG = 3.0


def _pattern(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


IMAGE = _pattern(11) * np.float32(0.7)
MASK = np.zeros(SHAPE, np.float32)
MASK[:, 1:3, 2:5] = 1.0
MASK[:, 3, 0] = 0.25                      # a soft edge


def velocities(x, sigma):
    """A toy flow model: (v_cond, v_uncond), smooth in x and sigma."""
    x = np.asarray(x, np.float32)
    s = np.float32(sigma)
    v_c = x * np.float32(0.4) - IMAGE * np.float32(0.3) + np.roll(x, 1, 0) * np.float32(0.1) * s
    v_u = x * np.float32(0.35) + np.float32(0.05) * s
    return v_c, v_u


# ---- sigmas ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
@pytest.mark.parametrize("steps,denoise", [(10, 0.6), (8, 0.5), (7, 0.33), (6, 1.0), (5, 0.99995)])
def test_denoise_sigmas_are_set_steps(scheduler, steps, denoise):
    if scheduler == "kl_optimal" and steps < 2:
        pytest.skip("kl_optimal needs 2 steps")
    # set_steps: above 0.9999 the plain schedule, else the schedule of int(steps / denoise) cut to its last steps + 1
    base = ksampler_sigmas("euler", scheduler, steps if denoise > 0.9999 else int(steps / denoise))
    want = base if denoise > 0.9999 else base[len(base) - min(len(base), steps + 1):]
    got = plan_sigmas("euler", scheduler, steps, 3.0, LatentPlan(denoise=denoise))
    np.testing.assert_array_equal(got, want)
    assert got[-1] == 0 and (denoise > 0.9999 or len(got) <= steps + 1)    # ddim_uniform may run more at 1


def test_denoise_sigmas_of_a_penultimate_discarding_sampler():
    # uni_pc's schedule is that of steps + 1 without its penultimate sigma, at the long step count too
    long = ksampler_sigmas("euler", "karras", int(6 / 0.5) + 1)
    want = np.concatenate([long[:-2], long[-1:]])[-7:]
    np.testing.assert_array_equal(plan_sigmas("uni_pc", "karras", 6, 3.0, LatentPlan(denoise=0.5)), want)


@pytest.mark.parametrize("start,last,full", [(0, 10, True), (2, 6, False), (2, 6, True), (3, None, True),
                                             (None, 4, False), (9, 100, True), (10, 10, True)])
def test_advanced_window(start, last, full):
    sig = ksampler_sigmas("euler", "simple", 10)
    ref = torch.from_numpy(sig.copy())
    # KSampler.sample: the end first (force_full_denoise zeroes the new last), then the start
    if last is not None and last < len(ref) - 1:
        ref = ref[:last + 1]
        if full:
            ref[-1] = 0
    plan = LatentPlan.advanced(True, start if start is not None else 0, last if last is not None else 10000,
                               not full)
    if start is not None and start >= len(ref) - 1:
        assert passes_through("euler", "simple", 10, 3.0, plan)
        with pytest.raises(ValueError, match="start_at_step"):
            LatentSampler(steps=10, scheduler="simple", spectrum=None, plan=plan)
        return
    ref = ref[start or 0:]
    np.testing.assert_array_equal(plan_sigmas("euler", "simple", 10, 3.0, plan), ref.numpy())


@pytest.mark.parametrize("bad,field", [(dict(denoise=0.0), "denoise"), (dict(denoise=1.5), "denoise"),
                                       (dict(denoise=float("nan")), "denoise"), (dict(start_step=-1), "start_at_step"),
                                       (dict(last_step=2.5), "end_at_step"), (dict(add_noise="yes"), "add_noise")])
def test_bad_plans_are_named(bad, field):
    with pytest.raises(ValueError, match=field):
        LatentPlan(**bad)


def test_a_schedule_past_comfyuis_step_limit_is_refused_before_it_is_built(monkeypatch):
    # KSampler.set_steps builds int(steps / denoise) sigmas: 8 steps at 1e-7 built 80,000,000 (1.8 GB); the bound
    # (ComfyUI's KSampler steps maximum) is checked before any schedule exists
    real, built = lo.ksampler_sigmas, []

    def guarded(sampler, scheduler, steps, *rest):
        built.append(steps)
        assert steps <= lo.MAX_SCHEDULE_STEPS, f"a schedule of {steps} steps was built"
        return real(sampler, scheduler, steps, *rest)
    monkeypatch.setattr(lo, "ksampler_sigmas", guarded)
    for steps, denoise in ((8, 1e-7), (8, 1e-300), (8, 5e-324), (200, 0.019), (10, 10 / 10001.5)):
        with pytest.raises(lo.LatentOpError, match=r"^denoise .* the limit is 10000"):
            lo.denoise_sigmas("euler", "simple", steps, denoise)
        with pytest.raises(ValueError, match=r"^denoise "):              # the scheduler's LatentSampler: the same
            LatentSampler(steps=steps, scheduler="simple", spectrum=None, plan=LatentPlan(denoise=denoise))
    assert built == []
    for steps, denoise in ((8, 8 / 10000), (100, 0.01), (200, 0.02), (7, 0.33)):     # at and under the bound
        assert lo.schedule_steps(steps, denoise) == int(steps / denoise) <= 10000
        np.testing.assert_array_equal(lo.denoise_sigmas("euler", "simple", steps, denoise),
                                      real("euler", "simple", int(steps / denoise))[-(steps + 1):])


def test_the_wire_refuses_an_over_long_schedule_naming_params_denoise():
    from protocol import messages as m
    from protocol.fields import ProtocolError
    ok = dict(seed=1, steps=8, cfg=4.0, width=64, height=64, denoise=8 / 10000)
    assert m.DenoiseParams(**ok).denoise == ok["denoise"]
    assert m.DenoiseParams(**{**ok, "denoise": 1e-7, "denoise_steps": "a1111"}).denoise == 1e-7   # steps' schedule
    for d in (1e-7, 1e-300):
        with pytest.raises(ProtocolError, match="limit is 10000") as e:
            m.DenoiseParams(**{**ok, "denoise": d})
        assert e.value.field == "denoise"
    # a DENOISE asking for it is refused where the scheduler decodes it, naming params.denoise
    import msgpack
    from protocol import codec
    from protocol.tensors import TensorDesc
    desc = TensorDesc("f32", (4,), slot="s", offset=0)
    msg = m.Denoise(job="j", job_dir="/tmp/j", pack_dir="/tmp/p", arena="a", params=m.DenoiseParams(**ok), cond=desc,
                    uncond=desc, latent=desc, scratch=m.Region(offset=0, nbytes=64), executor="tcp://127.0.0.1:1")
    head = msgpack.unpackb(codec.encode(msg)[0])
    assert codec.decode([msgpack.packb(head)]).params.denoise == ok["denoise"]
    head["params"]["denoise"] = 1e-7
    with pytest.raises(ProtocolError, match="limit is 10000") as e:
        codec.decode([msgpack.packb(head)])
    assert e.value.field == "params.denoise"


# ---- ComfyUI's sampling, written again --------------------------------------------------------------------------------
def _comfy_sample(name, sigmas, noise, image, mask, seed):
    """comfy/samplers.py KSAMPLER.sample + KSamplerX0Inpaint + the k-diffusion loop, for euler, heun and
    euler_ancestral (RF), CONST model sampling; returns (final latent, model inputs)."""
    sig = torch.from_numpy(np.asarray(sigmas, np.float32))
    noise_t, img = torch.from_numpy(noise), torch.from_numpy(image)
    m = None if mask is None else torch.from_numpy(mask)
    inputs = []

    def noise_scaling(s, n, lat):
        return s * n + (1.0 - s) * lat

    def model(x, s):
        if m is not None:
            x = x * m + noise_scaling(s, noise_t, img) * (1.0 - m)
        inputs.append(x.numpy().copy())
        v_c, v_u = (torch.from_numpy(v) for v in velocities(x.numpy(), float(s)))
        d_c, d_u = x - v_c * s, x - v_u * s
        out = d_u + (d_c - d_u) * CFG
        if m is not None:
            out = out * m + img * (1.0 - m)
        return out

    x = noise_scaling(sig[0], noise_t, img)
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(len(sig) - 1):
        den = model(x, sig[i])
        if name == "euler_ancestral":
            if sig[i + 1] == 0:
                x = den
                continue
            sd = sig[i + 1] * (1 + (sig[i + 1] / sig[i] - 1))
            a1, ad = 1 - sig[i + 1], 1 - sd
            renoise = (sig[i + 1] ** 2 - sd ** 2 * a1 ** 2 / ad ** 2) ** 0.5
            r = sd / sig[i]
            x = r * x + (1 - r) * den
            x = (a1 / ad) * x + torch.randn(x.shape, generator=gen) * renoise
            continue
        d = (x - den) / sig[i]
        dt = sig[i + 1] - sig[i]
        if name == "heun" and sig[i + 1] != 0:
            x2 = x + d * dt
            d2 = (x2 - model(x2, sig[i + 1])) / sig[i + 1]
            x = x + (d + d2) / 2 * dt
        else:
            x = x + d * dt
    last = sig[-1]
    return (x / (1.0 - last)).numpy(), inputs


def _run(sampler, state, inputs=None):
    while not sampler.done(state):
        x_in, sigma = sampler.point(state)
        if inputs is not None:
            inputs.append(x_in.copy())
        sampler.step_computed(state, *velocities(x_in, sigma))
    return sampler.result(state)


CASES = [("euler", "sgm_uniform", 8, LatentPlan(denoise=0.6)),
         ("euler", "simple", 8, LatentPlan(denoise=0.8, masked=True)),
         ("heun", "karras", 6, LatentPlan(denoise=0.5, masked=True)),
         ("euler_ancestral", "karras", 7, LatentPlan(denoise=0.6)),
         ("euler_ancestral", "beta", 7, LatentPlan(denoise=0.8, masked=True)),
         ("euler", "normal", 10, LatentPlan.advanced(True, 3, 7, True)),
         ("heun", "simple", 10, LatentPlan.advanced(False, 4, 10, False, masked=True))]


@pytest.mark.parametrize("name,scheduler,steps,plan", CASES)
def test_sampling_from_a_latent_equals_comfyuis(name, scheduler, steps, plan):
    seed = 5
    mask = MASK if plan.masked else None
    s = LatentSampler(steps=steps, cfg=CFG, scheduler=scheduler, sampler=name, spectrum=None, plan=plan)
    got_inputs = []
    got = _run(s, s.start(seed, image=IMAGE, mask=mask), got_inputs)
    noise = comfy_noise(seed, SHAPE) if plan.add_noise else np.zeros(SHAPE, np.float32)
    want, want_inputs = _comfy_sample(name, s.sigmas, noise, IMAGE, mask, seed)
    assert len(got_inputs) == len(want_inputs)                 # the same model calls (heun: two a step)
    for a, b in zip(got_inputs, want_inputs):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    if plan.masked:                                            # outside the mask the image survives the whole run
        keep = MASK == 0
        np.testing.assert_allclose(got[keep], IMAGE[keep], rtol=0, atol=1e-5)


def test_leftover_noise_then_a_second_pass_without_noise():
    # the classic two-KSamplerAdvanced split: 0..4 with leftover noise, then 4..8 with add_noise disabled equals
    # one run over 0..8 (ComfyUI: inverse_noise_scaling and noise_scaling at the same sigma cancel)
    full = LatentSampler(steps=8, cfg=CFG, spectrum=None, scheduler="simple", plan=LatentPlan())
    want = _run(full, full.start(9, image=np.zeros(SHAPE, np.float32)))
    a = LatentSampler(steps=8, cfg=CFG, spectrum=None, scheduler="simple",
                      plan=LatentPlan.advanced(True, 0, 4, True))
    mid = _run(a, a.start(9, image=np.zeros(SHAPE, np.float32)))
    assert a.sigmas[-1] > 0
    b = LatentSampler(steps=8, cfg=CFG, spectrum=None, scheduler="simple",
                      plan=LatentPlan.advanced(False, 4, 10000, False))
    got = _run(b, b.start(9, image=mid))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_every_sampler_keeps_the_unmasked_latent_and_blends_every_call(name):
    plan = LatentPlan(denoise=0.7, masked=True)
    s = LatentSampler(steps=6, cfg=CFG, scheduler="karras", sampler=name, spectrum=None, plan=plan)
    state = s.start(3, image=IMAGE, mask=MASK)
    noise, keep = comfy_noise(3, SHAPE), MASK == 0
    calls = 0
    while not s.done(state):
        x_in, sigma = s.point(state)
        sg = np.float32(sigma)
        # outside the mask the model sees noise_scaling(sigma, noise, image), whatever call of the step this is
        np.testing.assert_allclose(x_in[keep], (sg * noise + (1 - sg) * IMAGE)[keep], rtol=0, atol=1e-6)
        s.step_computed(state, *velocities(x_in, sigma))
        calls += 1
    assert calls == sum(s.nfe(i) for i in range(s.steps))
    got = s.result(state)
    # UniPC's last update mixes its data predictions at rescaled points (x·sqrt(t^2 + 1)), not the blended denoised
    # alone, so in ComfyUI too the kept area is only close to the image
    tol = 1e-2 if name.startswith("uni_pc") else 2e-4
    np.testing.assert_allclose(got[keep], IMAGE[keep], rtol=0, atol=tol)


@pytest.mark.parametrize("name", ["euler", "heun", "er_sde", "dpmpp_2m_sde", "sa_solver_pece", "uni_pc"])
def test_resume_after_every_step_is_bitwise(name, tmp_path):
    plan = LatentPlan(denoise=0.6, masked=True)

    def make():
        return LatentSampler(steps=5, cfg=CFG, scheduler="beta", sampler=name, spectrum=None, plan=plan)
    s = make()
    want = _run(s, s.start(21, image=IMAGE, mask=MASK))
    for stop in range(1, s.steps):
        s = make()
        st = s.start(21, image=IMAGE, mask=MASK)
        while st.step < stop:
            x_in, sigma = s.point(st)
            s.step_computed(st, *velocities(x_in, sigma))
        st.save(tmp_path / "state.safetensors")
        loaded = SamplerState.load(tmp_path / "state.safetensors")
        s2 = sampler_from_settings(loaded.settings)            # a fresh process knows only the file
        s2.check_state(loaded)
        assert s2.latent_plan == plan
        assert _run(s2, loaded).tobytes() == want.tobytes(), f"{name}: resumed after step {stop} differs"


def test_force_full_denoise_without_an_end_step_is_the_same_plan(tmp_path):
    # the stage spells KSampler's plan with force_full_denoise = not leftover_noise; a state saved by either
    # spelling must resume under the other (it once restarted from step 0)
    a = LatentSampler(steps=4, cfg=CFG, spectrum=None, plan=LatentPlan(denoise=0.5, force_full_denoise=True))
    b = LatentSampler(steps=4, cfg=CFG, spectrum=None, plan=LatentPlan(denoise=0.5))
    st = a.start(3, image=IMAGE)
    b.check_state(st)
    assert a.latent_plan.plain is False and LatentPlan(force_full_denoise=True).plain


def test_a_state_of_another_plan_is_refused(tmp_path):
    s = LatentSampler(steps=5, cfg=CFG, spectrum=None, plan=LatentPlan(denoise=0.6))
    st = s.start(1, image=IMAGE)
    other = LatentSampler(steps=5, cfg=CFG, spectrum=None, plan=LatentPlan(denoise=0.5))
    with pytest.raises(ValueError, match="settings"):
        other.check_state(st)


def test_plain_plan_is_text_to_image():
    from models.sampling.sampler import Sampler
    base = Sampler(steps=6, cfg=CFG, sampler="dpmpp_2m", scheduler="karras", spectrum=None)
    s = LatentSampler(steps=6, cfg=CFG, sampler="dpmpp_2m", scheduler="karras", spectrum=None)
    want = _run(base, base.init_state(comfy_noise(4, SHAPE), seed=4, noise="comfy"))
    got = _run(s, s.start(4, image=np.zeros(SHAPE, np.float32)))
    assert got.tobytes() == want.tobytes()


def test_bad_starts_are_named():
    s = LatentSampler(steps=5, cfg=CFG, spectrum=None, plan=LatentPlan(denoise=0.6, masked=True))
    for kwargs, msg in ((dict(image=IMAGE), "give the mask"), (dict(image=IMAGE, mask=MASK[:8]), "mask has shape"),
                        (dict(image=IMAGE, mask=MASK * 2), "within"),
                        (dict(image=np.full(SHAPE, np.nan, np.float32), mask=MASK), "image holds NaN")):
        with pytest.raises(ValueError, match=msg):
            s.start(1, **kwargs)


# ---- the pipeline: the scheduler stage samples from an init latent and a mask in the job's arena, and resumes -------
from tests.test_stage_processes import THREADS, _contexts, pack128, pipeline  # noqa: E402,F401 - fixtures reused


def _latent_job(config, ctx, pack, job_dir, init, mask, params):
    """Act as the orchestrator: arena with contexts, init latent and mask; DENOISE -> (latent, reply)."""
    from protocol import messages as m
    from protocol.arena import Arena, segment_name
    from protocol.sockets import LazyPirate
    cond, uncond = _contexts(pack)
    job_dir.mkdir(parents=True, exist_ok=True)                  # the orchestrator makes the job folder
    g, c = pack.geometry, pack.config
    L, D, S, Dc = g.tokens, c.width, g.text_tokens, c.context_dim
    size = 2 * S * Dc * 4 + 3 * init.nbytes + (4 * L * D + 2 * S * Dc + L * c.head_dim) * 4
    with Arena.create(segment_name(config.run_dir, job_dir.name), size + 2**20) as arena:
        slots = {}
        for name, a in (("cond", cond), ("uncond", uncond), ("init", init), ("mask", mask)):
            slots[name] = arena.alloc(name, "f32", a.shape)
            arena.write(slots[name], a)
        dl = arena.alloc("latent", "f32", init.shape)
        start = -(-arena.slots.cursor // 64) * 64
        msg = m.Denoise(job=job_dir.name, job_dir=str(job_dir), pack_dir=str(pack.dir), arena=arena.name,
                        params=params, cond=slots["cond"], uncond=slots["uncond"], latent=dl,
                        init_latent=slots["init"], noise_mask=slots["mask"],
                        scratch=m.Region(offset=start, nbytes=arena.size - start), executor=config.endpoint("executor"))
        with LazyPirate(ctx, config.endpoint("scheduler"), timeout_s=300.0, retries=3) as link:
            reply = link.request(msg)
        return arena.read(dl), reply, cond, uncond


def test_pipeline_inpaint_resumes_bitwise(pipeline, pack128, tmp_path):
    from models.packs.pack import load_pack
    from models.runtime.dit_runner import DiTRunner
    from models.sampling.denoise import denoise, save_state
    from models.sampling.img2img import start_or_resume_latent
    from protocol import messages as m
    config, ctx, procs, _ = pipeline
    pack = load_pack(pack128)
    g, c = pack.geometry, pack.config
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    init = np.random.default_rng(2).standard_normal(shape).astype(np.float32) * np.float32(0.5)
    pixel = np.zeros((g.height, g.width), np.float32)
    pixel[:, g.width // 2:] = 1.0                                      # inpaint the right half
    mask = lo.prepare_mask(pixel, (1,) + shape)[0]
    params = m.DenoiseParams(seed=42, steps=2, cfg=4.0, width=g.width, height=g.height, sampler="euler_ancestral",
                             scheduler="karras", spectrum=m.SpectrumSettings(enabled=False), denoise=0.6)
    # the reference: in-process, the same LatentSampler, its state after step 1 kept as a killed job leaves it; the
    # stage resumes from it (init latent and mask from the arena) to the in-process latent bitwise
    runner = DiTRunner(pack, threads=THREADS)
    cond, uncond = _contexts(pack)
    s = LatentSampler(steps=2, cfg=4.0, sampler="euler_ancestral", scheduler="karras", spectrum=None,
                      plan=LatentPlan(denoise=0.6, masked=True))
    killed = tmp_path / "killed"
    saved = []

    def keep_first(state):
        if not saved:
            save_state(state, killed)
            saved.append(state.step)
    ref = s.result(denoise(runner, s, start_or_resume_latent(s, 42, shape, image=init, mask=mask), cond, uncond,
                           on_step=keep_first))
    resumed, reply, _, _ = _latent_job(config, ctx, pack, killed, init, mask, params)
    assert isinstance(reply, m.Denoised), reply
    assert reply.resumed_from == saved[0] == 1
    np.testing.assert_array_equal(resumed, ref)
    keep = mask == 0
    np.testing.assert_allclose(ref[keep], init[keep], atol=1e-4)        # the unmasked half is the init latent
    bad = m.DenoiseParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "start_step": 2})
    _, reply, _, _ = _latent_job(config, ctx, pack, tmp_path / "bad", init, mask, bad)
    assert isinstance(reply, m.Error) and reply.field == "params.start_step", reply


# ---- batches: ComfyUI samples the batch as one tensor; the pipeline runs its images one after another -------------
def _velocities_batch(x, sigma):
    return tuple(np.stack(v) for v in zip(*(velocities(xi, sigma) for xi in x)))


def _whole_batch(name, sigmas, noise, seed):
    """The batch [B, C, h, w] through one k_sampling machine, as ComfyUI's sampler sees it (its noise draws over the
    batch tensor): the reference for the image-by-image runs."""
    from models.sampling.k_sampling import cfg_denoised, new_ksampler
    m = new_ksampler(name, sigmas, seed=seed, shape=noise.shape)
    st = m.start(noise)
    while not m.done(st):
        x_in, sigma = m.point(st)
        m.feed(st, cfg_denoised(x_in, sigma, *_velocities_batch(x_in, sigma), CFG))
    return m.result(st)


@pytest.mark.parametrize("name", ["euler_ancestral", "dpmpp_2m_sde", "er_sde", "dpmpp_2m"])
def test_batch_images_one_by_one_equal_the_batch_tensor(name):
    seed, shape = 31, (3,) + SHAPE
    noise = lo.batch_noise(seed, shape)
    sigmas = ksampler_sigmas(name, "karras", 5)
    want = _whole_batch(name, sigmas, noise, seed)
    for b in range(3):
        s = LatentSampler(steps=5, cfg=CFG, sampler=name, scheduler="karras", spectrum=None,
                          plan=LatentPlan(batch_size=3, batch_pos=b))
        got = _run(s, s.start(seed, image=np.zeros(SHAPE, np.float32), noise=noise[b]))
        np.testing.assert_allclose(got, want[b], rtol=0, atol=2e-5, err_msg=f"{name}: image {b}")
    if name == "euler_ancestral":                 # and the batch tensor is ComfyUI's: the loop written in torch
        g = torch.Generator().manual_seed(seed + 1)
        sig = torch.from_numpy(sigmas)
        x = sig[0] * torch.from_numpy(noise)
        for i in range(len(sig) - 1):
            v_c, v_u = (torch.from_numpy(v) for v in _velocities_batch(x.numpy(), float(sig[i])))
            d_u = x - v_u * sig[i]
            den = d_u + ((x - v_c * sig[i]) - d_u) * CFG
            if sig[i + 1] == 0:
                x = den
                continue
            sd = sig[i + 1] * (1 + (sig[i + 1] / sig[i] - 1))
            a1, ad = 1 - sig[i + 1], 1 - sd
            x = (sd / sig[i]) * x + (1 - sd / sig[i]) * den
            x = (a1 / ad) * x + torch.randn(x.shape, generator=g) * (sig[i + 1] ** 2 - sd ** 2 * a1 ** 2 / ad ** 2) ** 0.5
        np.testing.assert_allclose(want, x.numpy(), rtol=0, atol=2e-5)


def test_a_batch_image_resumes_bitwise(tmp_path):
    plan = LatentPlan(batch_size=2, batch_pos=1, denoise=0.7)
    noise = lo.batch_noise(8, (2,) + SHAPE)[1]

    def make():
        return LatentSampler(steps=4, cfg=CFG, sampler="er_sde", scheduler="simple", spectrum=None, plan=plan)
    s = make()
    want = _run(s, s.start(8, image=IMAGE, noise=noise))
    s = make()
    st = s.start(8, image=IMAGE, noise=noise)
    x_in, sigma = s.point(st)
    s.step_computed(st, *velocities(x_in, sigma))
    st.save(tmp_path / "state.safetensors")
    back = SamplerState.load(tmp_path / "state.safetensors")
    s2 = sampler_from_settings(back.settings)
    s2.check_state(back)
    assert _run(s2, back).tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="batch_pos"):
        LatentPlan(batch_size=2, batch_pos=2)


# ---- the ComfyUI graph front: KSampler denoise and KSamplerAdvanced's window reach the job ---------------------------
def _graph_job(graph):
    from orchestrator.http.comfy_graph import ModelNames, graph_to_job
    from tests.comfy_graphs import TINY_NAMES
    names = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
    return graph_to_job(graph, names=names, sizes=[(128, 128)]), names


def _advanced(graph, **inputs):
    g = dict(graph)
    ks = g["3"]["inputs"]
    g["3"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ks["model"], "add_noise": "enable", "noise_seed": ks["seed"], "steps": 8, "cfg": ks["cfg"],
        "sampler_name": "euler", "scheduler": "simple", "positive": ks["positive"], "negative": ks["negative"],
        "latent_image": ks["latent_image"], "start_at_step": 0, "end_at_step": 10000,
        "return_with_leftover_noise": "disable", **inputs}}
    return g


def test_graph_denoise_and_advanced_window_reach_the_job():
    from orchestrator.http.comfy_graph import GraphError, job_to_graph
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    from tests.comfy_graphs import edited, standard_graph
    g = standard_graph()
    job, names = _graph_job(edited(g, "3", denoise=0.6))
    assert job.spec["denoise"] == 0.6 and "start_step" not in job.spec
    spec = parse_prompt_obj(job.spec, resolution=[(128, 128)])
    assert spec.denoise == 0.6 and spec.add_noise and spec.start_step is None
    # KSamplerAdvanced as nodes.py maps it: add_noise disable, the window, leftover noise kept
    job, _ = _graph_job(_advanced(g, add_noise="disable", start_at_step=2, end_at_step=5,
                                  return_with_leftover_noise="enable"))
    want = {"add_noise": False, "start_step": 2, "end_step": 5, "leftover_noise": True}
    assert {k: job.spec[k] for k in want} == want and "denoise" not in job.spec
    # and back: the job's graph is a KSamplerAdvanced with the same window, which maps onto the same job
    full = parse_prompt_obj(job.spec, resolution=[(128, 128)]).to_dict()
    back, _ = _graph_job(job_to_graph(full, names=names))
    assert {k: back.spec[k] for k in want} == want
    # the whole schedule from noise stays a plain job; nothing left to sample is refused on the sampler node
    job, _ = _graph_job(_advanced(g))
    assert not {"denoise", "start_step", "end_step", "add_noise", "leftover_noise"} & set(job.spec)
    for bad, name in ((edited(g, "3", denoise=0.0), "denoise"), (_advanced(g, start_at_step=8), "start_at_step")):
        with pytest.raises(GraphError) as e:
            _graph_job(bad)
        assert "3" in e.value.node_errors and name in json.dumps(e.value.body()), e.value.body()


@pytest.mark.parametrize("fill", ["noise", "nothing"])
def test_latent_fill_replaces_the_masked_init_latent_and_resumes_bitwise(fill, tmp_path):
    """A1111's inpainting_fill 2 / 3: its init latent becomes init·(1 - mask) + randn(seed)·mask (latent noise) or
    init·(1 - mask) (latent nothing) before the sampler adds its noise; the run starts exactly as a masked run of
    that latent would, and a resume from the job folder takes the same start (the state records it)."""
    from models.sampling.img2img import start_or_resume_latent
    plan = LatentPlan(denoise=0.8, masked=True)

    def make():
        return LatentSampler(steps=4, cfg=CFG, scheduler="karras", sampler="euler", spectrum=None, plan=plan)
    t = torch.manual_seed(5)
    randn = torch.randn((1, *SHAPE), generator=t)[0].numpy()          # A1111's create_random_tensors on the CPU
    m = torch.from_numpy(MASK)
    filled = (torch.from_numpy(IMAGE) * (1 - m) + (torch.from_numpy(randn) * m if fill == "noise" else 0)).numpy()
    s = make()
    want = _run(s, s.start(5, image=filled.astype(np.float32), mask=MASK))
    s = make()
    st = start_or_resume_latent(s, 5, SHAPE, tmp_path, image=IMAGE, mask=MASK, fill=fill)
    x_in, sigma = s.point(st)
    s.step_computed(st, *velocities(x_in, sigma))
    from models.sampling.denoise import STATE_FILE
    st.save(tmp_path / STATE_FILE)
    s2 = make()
    st2 = start_or_resume_latent(s2, 5, SHAPE, tmp_path, image=IMAGE, mask=MASK, fill=fill)
    assert st2.step == 1
    got = _run(s2, st2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    plain = make()
    assert not np.allclose(_run(plain, plain.start(5, image=IMAGE, mask=MASK)), want, atol=1e-3)


@pytest.mark.parametrize("steps, denoise, computed", [(20, 0.5, 11), (20, 0.75, 16), (20, 1.0, 20), (8, 0.3, 3),
                                                      (30, 0.01, 1)])
def test_a1111_denoise_steps_compute_int_denoise_x_steps_plus_one(steps, denoise, computed):
    """A1111's img2img (setup_img2img_steps, img2img_fix_steps off) computes int(min(d, 0.999) * steps) + 1 steps:
    the last ones of the `steps` schedule; ComfyUI's KSampler computes `steps` of the schedule of steps / d. The
    A1111 run equals KSamplerAdvanced started at steps - that - 1 (what the job's ComfyUI graph shows)."""
    a = LatentSampler(steps=steps, cfg=CFG, scheduler="karras", sampler="euler", spectrum=None,
                      plan=LatentPlan(denoise=denoise, denoise_steps="a1111"))
    c = LatentSampler(steps=steps, cfg=CFG, scheduler="karras", sampler="euler", spectrum=None,
                      plan=LatentPlan(denoise=denoise))
    assert a.steps == computed and c.steps == steps
    full = ksampler_sigmas("euler", "karras", steps)
    np.testing.assert_array_equal(a.sigmas, full[len(full) - computed - 1:])
    w = LatentSampler(steps=steps, cfg=CFG, scheduler="karras", sampler="euler", spectrum=None,
                      plan=LatentPlan(start_step=steps - computed))
    assert _run(a, a.start(2, image=IMAGE)).tobytes() == _run(w, w.start(2, image=IMAGE)).tobytes()


def test_a_plan_saved_before_denoise_steps_existed_still_loads():
    d = LatentPlan(denoise=0.6).to_dict()
    del d["denoise_steps"]
    assert LatentPlan.from_dict(d) == LatentPlan(denoise=0.6)
    with pytest.raises(ValueError, match="exactly the fields"):
        LatentPlan.from_dict({**d, "colour": 1})
    with pytest.raises(ValueError, match="denoise_steps"):
        LatentPlan(denoise=0.5, denoise_steps="forge")
