"""Step caches (models/sampling/step_cache.py) against an independent torch re-implementation of ComfyUI's EasyCache
and LazyCache written here the way ComfyUI wires them (a wrapper round the diffusion model's batched call with one
uuid per conditioning, adding its cached difference in place to that batch; a wrapper round the CFG guider's
predict_noise), on a toy flow model: the same calls reused, the same latent. Also cfg 1's single pass, resuming a
killed job, and bad settings."""
import math

import numpy as np
import pytest
import torch

from models.sampling.denoise import model_call, save_state, start_or_resume
from models.sampling.k_sampling import SAMPLER_NAMES
from models.sampling.sampler import Sampler
from models.sampling.step_cache import CacheSettings
from models.base.schema import SchemaError

SHAPE = (16, 24, 24)
SHIFT = 3.0


def toy_velocity(x: np.ndarray, sigma: float, ctx: float) -> np.ndarray:
    """A smooth, sigma- and context-dependent velocity (the 'diffusion model')."""
    x = np.asarray(x, np.float32)
    return (np.tanh(x * np.float32(0.6 + 0.2 * ctx)) * np.float32(0.8) + np.float32(0.3 * sigma * ctx)
            - np.float32(0.05) * x).astype(np.float32)


COND, UNCOND = 1.0, -0.5          # the two contexts


def ours(steps=14, cfg=4.0, sampler="euler", cache=None, seed=7):
    noise = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    sm = Sampler(steps=steps, cfg=cfg, sampler=sampler, scheduler="simple", spectrum=None, cache=cache)
    passes = []

    def model(x, s):
        passes.append(sm.passes)
        return toy_velocity(x, s, COND), toy_velocity(x, s, UNCOND)
    st = sm.sample(model, latent=noise, seed=seed)
    return sm, st, noise, passes


# ---- the reference: ComfyUI's wiring, re-written here in torch ------------------------------------------------------
def ref_percent_to_sigma(p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    t = 1.0 - p
    return SHIFT * t / (1 + (SHIFT - 1) * t)


class RefCache:
    """Holder of ComfyUI's state; `lazy` selects LazyCache's rules."""

    def __init__(self, thr, start, end, lazy=False):
        self.thr, self.lazy = thr, lazy
        self.start_t, self.end_t = ref_percent_to_sigma(start), ref_percent_to_sigma(end)
        self.first = None
        self.x_prev = self.out_prev = self.norm = self.rate = None
        self.cum = 0.0
        self.diffs = {}
        self.log = []                     # per model call: True when it was reused

    @staticmethod
    def sub(t):
        return t[..., ::8, ::8].clone()

    def forward(self, run, x, sigma, uuids):
        """EasyCache's diffusion-model wrapper: x [B, C, h, w], one uuid per batch entry."""
        if not bool(sigma[0] > self.end_t):
            self.log.append(False)
            return run(x)
        idx = uuids.index(self.first) if self.first in uuids else None
        change = None
        if bool(sigma[0] <= self.start_t):
            ready = all(u in self.diffs for u in uuids)
            if self.first is None:
                self.first, idx = uuids[0], 0
            if idx is not None:
                if self.x_prev is not None:
                    change = (self.sub(x[idx:idx + 1]) - self.x_prev).flatten().abs().mean()
                if self.norm is not None and self.rate is not None:
                    self.cum = self.cum + self.rate * change / self.norm
                    if bool(self.cum < self.thr) and ready:
                        self.log.append(True)
                        for i, u in enumerate(uuids):      # in place, as ComfyUI's apply_cache_diff: x is the
                            x[i:i + 1] += self.diffs[u]    # guider's batch, read again by calculate_denoised
                        return x
                    self.cum = 0.0
        out = run(x)
        self.log.append(False)
        if idx is not None and self.norm is not None:
            oc = (self.sub(out[idx:idx + 1]) - self.out_prev).flatten().abs().mean()
            if change is not None:
                self.rate = oc / change
        for i, u in enumerate(uuids):
            self.diffs[u] = out[i:i + 1] - x[i:i + 1]
        if idx is not None:
            self.x_prev, self.out_prev = self.sub(x[idx:idx + 1]), self.sub(out[idx:idx + 1])
            self.norm = out.flatten().abs().mean()
        return out

    def predict(self, run, x, sigma):
        """LazyCache's predict_noise wrapper: x the latent, run(x) the CFG denoised."""
        if not bool(sigma[0] > self.end_t):
            self.log.append(False)
            return run(x)
        change = None
        if bool(sigma[0] <= self.start_t) and self.x_prev is not None:
            change = (self.sub(x) - self.x_prev).flatten().abs().mean()
            if self.norm is not None and self.rate is not None:
                self.cum = self.cum + self.rate * change / self.norm
                if bool(self.cum < self.thr):
                    self.log.append(True)
                    return x + self.diffs["den"]
                self.cum = 0.0
        out = run(x)
        self.log.append(False)
        if self.norm is not None:
            oc = (self.sub(out) - self.out_prev).flatten().abs().mean()
            if change is not None:
                self.rate = oc / change
        self.diffs["den"] = out - x
        self.x_prev, self.out_prev, self.norm = self.sub(x), self.sub(out), out.flatten().abs().mean()
        return out


def ref_denoised(cache, x, sigma, cfg):
    """ComfyUI's CFG guider: one batch [uncond, cond] (cond alone at cfg 1), denoised = x - v·sigma, then the mix."""
    s = torch.tensor([sigma], dtype=torch.float32)

    def diffusion(xb):
        ctxs = [COND] if xb.shape[0] == 1 else [UNCOND, COND]
        return torch.cat([torch.from_numpy(toy_velocity(xb[i].numpy(), sigma, c))[None] for i, c in enumerate(ctxs)])

    def guided(x1):
        xb = x1.expand(1 if math.isclose(cfg, 1.0) else 2, *x1.shape[1:]).clone()
        uuids = ["c"] if xb.shape[0] == 1 else ["u", "c"]
        v = cache.forward(diffusion, xb, s, uuids) if cache is not None and not cache.lazy else diffusion(xb)
        den = xb - v * sigma
        if xb.shape[0] == 1:
            return torch.zeros_like(den[0:1]) + (den[0:1] - torch.zeros_like(den[0:1])) * cfg
        return den[0:1] + (den[1:2] - den[0:1]) * cfg
    return cache.predict(guided, x, s) if cache is not None and cache.lazy else guided(x)


def ref_sample(sigmas, noise, cfg, cache, sampler="euler"):
    x = torch.from_numpy(noise)[None] * float(sigmas[0])
    for i in range(len(sigmas) - 1):
        s, s1 = float(sigmas[i]), float(sigmas[i + 1])
        d = (x - ref_denoised(cache, x, s, cfg)) / s
        if sampler == "euler" or s1 == 0:
            x = x + d * (s1 - s)
        else:                                           # heun: a second call at the Euler point
            x2 = x + d * (s1 - s)
            d2 = (x2 - ref_denoised(cache, x2, s1, cfg)) / s1
            x = x + (d + d2) / 2 * (s1 - s)
    return x[0].numpy()


@pytest.mark.parametrize("kind", ["easycache", "lazycache"])
@pytest.mark.parametrize("sampler,cfg", [("euler", 4.0), ("euler", 1.0), ("heun", 4.5)])
def test_cache_matches_comfyui_reference(kind, sampler, cfg):
    settings = CacheSettings(kind=kind, reuse_threshold=0.2)
    sm, st, noise, _ = ours(cfg=cfg, sampler=sampler, cache=settings)
    ref = RefCache(0.2, 0.15, 0.95, lazy=kind == "lazycache")
    want = ref_sample(sm.sigmas, noise, cfg, ref, sampler)
    calls = 2 if sampler == "heun" else 1
    per_step = [ref.log[i:i + calls] for i in range(0, len(ref.log), calls)]
    if sampler == "heun":                               # heun's last step (to sigma 0) is one call
        per_step = [ref.log[2 * i:2 * i + 2] for i in range(sm.steps - 1)] + [ref.log[2 * (sm.steps - 1):]]
    assert st.skipped == [sum(c) for c in per_step]
    assert st.nfe == [len(c) - sum(c) for c in per_step]
    assert sum(st.skipped) >= 3                         # the cache did reuse calls here
    np.testing.assert_allclose(sm.result(st), want, rtol=1e-4, atol=1e-5)
    c = st.cache                                        # the figures the decisions came from, as ComfyUI's
    for got, exp in ((c.norm, ref.norm), (c.rate, ref.rate), (c.total, ref.cum)):
        assert float(got) == pytest.approx(float(exp), rel=1e-4, abs=1e-7)
    np.testing.assert_allclose(c.x_prev, ref.x_prev[0].numpy(), rtol=1e-4, atol=1e-5)


def test_no_cache_reference_agrees_and_cache_changes_the_picture():
    """The reference sampler itself matches the pipeline's without a cache (so the cache tests compare caches)."""
    sm, st, noise, _ = ours(cfg=4.0)
    np.testing.assert_allclose(sm.result(st), ref_sample(sm.sigmas, noise, 4.0, None), rtol=1e-4, atol=1e-5)
    _, cst, _, _ = ours(cfg=4.0, cache=CacheSettings())
    assert np.abs(sm.result(st) - Sampler(steps=14, cfg=4.0, scheduler="simple", spectrum=None,
                                          cache=CacheSettings()).result(cst)).max() > 1e-4


def test_start_and_end_bound_the_reused_calls():
    """No call before start_percent or from end_percent on is reused: sigma bounds from the shifted percents."""
    sm, st, _, _ = ours(steps=20, cache=CacheSettings(reuse_threshold=3.0, start_percent=0.4, end_percent=0.6))
    lo, hi = ref_percent_to_sigma(0.6), ref_percent_to_sigma(0.4)
    for i, n in enumerate(st.skipped):
        if n:
            assert lo < float(sm.sigmas[i]) <= hi
    assert sum(st.skipped) > 0


class _Runner:
    """forward_passes / forward_cfg of a DiT runner, counting passes."""

    def __init__(self):
        self.passes = 0

    def forward_passes(self, xs, sigma, ctxs, context_rows=None):
        self.passes += len(xs)
        return [toy_velocity(x, sigma, c) for x, c in zip(xs, ctxs)]

    def forward_cfg(self, x, sigma, c, u, context_rows=None):
        return tuple(self.forward_passes([x, x], sigma, [c, u], context_rows))


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_cfg1_runs_one_pass_per_call_for_every_sampler(name):
    noise = np.random.default_rng(3).standard_normal((16, 8, 8)).astype(np.float32)
    runs = {}
    for cfg in (1.0, 4.0):
        sm = Sampler(steps=4, cfg=cfg, sampler=name, spectrum=None)
        runner = _Runner()
        st = sm.sample(lambda x, s: model_call(runner, sm, x, s, COND, UNCOND), latent=noise, seed=5)
        assert runner.passes == sm.passes * sum(st.nfe)
        assert np.isfinite(sm.result(st)).all()
        runs[cfg] = runner.passes // sm.passes
    assert runs[1.0] == runs[4.0]                       # the same calls, half the passes


def test_cfg1_single_pass_equals_two_pass_result():
    _, st, noise, passes = ours(cfg=1.0)
    sm = Sampler(steps=14, cfg=1.0, scheduler="simple", spectrum=None)
    assert set(passes) == {1}
    two = ref_sample(sm.sigmas, noise, 1.0000001, None)   # two passes (not isclose to 1 only above 1e-9: force it)
    x = torch.from_numpy(noise)[None] * float(sm.sigmas[0])
    for i in range(sm.steps):                             # ComfyUI's two-pass form at exactly cfg 1
        s, s1 = float(sm.sigmas[i]), float(sm.sigmas[i + 1])
        dc = x - torch.from_numpy(toy_velocity(x[0].numpy(), s, COND))[None] * s
        du = x - torch.from_numpy(toy_velocity(x[0].numpy(), s, UNCOND))[None] * s
        x = x + (x - (du + (dc - du) * 1.0)) / s * (s1 - s)
    np.testing.assert_allclose(sm.result(st), x[0].numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(two - sm.result(st)).max() > 0         # the reference above is not a one-pass run


@pytest.mark.parametrize("kind", ["easycache", "lazycache"])
def test_resume_after_a_kill_keeps_the_latent(tmp_path, kind):
    cache = CacheSettings(kind=kind)
    sm, whole, noise, _ = ours(sampler="heun", cfg=4.0, cache=cache)
    shape = noise.shape

    class Killed(Exception):
        pass

    def kill_at_8(state):
        save_state(state, tmp_path)
        if state.step == 8:
            raise Killed

    sampler = Sampler(steps=14, cfg=4.0, sampler="heun", scheduler="simple", spectrum=None, cache=cache)
    state = sampler.init_state(noise, seed=7)
    model = lambda x, s: (toy_velocity(x, s, COND), toy_velocity(x, s, UNCOND))  # noqa: E731
    with pytest.raises(Killed):
        sampler.sample(model, state=state, on_step=kill_at_8)
    again = Sampler(steps=14, cfg=4.0, sampler="heun", scheduler="simple", spectrum=None, cache=cache)
    resumed = start_or_resume(again, 7, shape, tmp_path)
    assert resumed.step == 8 and resumed.cache is not None and resumed.cache.run > 0
    again.sample(model, state=resumed)
    np.testing.assert_array_equal(again.result(resumed), sm.result(whole))
    assert resumed.skipped == whole.skipped and resumed.nfe == whole.nfe


@pytest.mark.parametrize("bad,field", [({"reuse_threshold": 3.5}, "reuse_threshold"),
                                       ({"start_percent": -0.1}, "start_percent"),
                                       ({"end_percent": 1.2}, "end_percent"),
                                       ({"kind": "teacache"}, "kind"),
                                       ({"reuse": 0.1}, "reuse")])
def test_bad_settings_name_the_field(bad, field):
    with pytest.raises(SchemaError) as e:
        CacheSettings.from_data(bad)
    assert e.value.field == field


def test_cache_and_spectrum_together_are_refused():
    from models.sampling.spectrum import SpectrumSettings
    with pytest.raises(ValueError, match="cache: EasyCache and Spectrum"):
        Sampler(steps=10, cfg=4.0, spectrum=SpectrumSettings(), cache=CacheSettings())


# ---- the board model prices a job by its calls (modelled figures) ----------------------------------------------------
def test_board_model_prices_one_pass_calls_and_counts_reused_ones_out():
    from models.board.auto import evaluate, job_calls
    from models.board.cost import BoardModel
    from models.board.timeline import branch_sequence
    from models.board.policy import Policy
    model = BoardModel.for_pack(None, "full", None)
    parts1, parts2 = model.step_parts(passes=1), model.step_parts(passes=2)
    for pol in (Policy(), Policy(prefetch=2), Policy(prefetch=1, interleave=True), Policy(prefetch=1, dual_core=True)):
        two, one = evaluate(model, pol, 6000.0), evaluate(model, pol, 6000.0, passes=1)
        assert one.warm.npu_s == pytest.approx(parts1["npu_s"]) and two.warm.npu_s == pytest.approx(parts2["npu_s"])
        assert one.warm.wall_s < two.warm.wall_s
        assert one.warm.requests == len(branch_sequence(model))       # one request per branch, interleave or not
    report = {"prompt": {"cfg": 1.0}, "model_calls": 9, "reused_calls": 5, "nfe": 9}
    calls, passes = job_calls(report)
    assert (calls, passes) == (9, 1)
    e = evaluate(model, Policy(prefetch=2), 6000.0, computed_steps=calls, passes=passes)
    assert e.denoise_s == pytest.approx(e.cold.wall_s + 8 * e.warm.wall_s)
    assert job_calls({"prompt": {"cfg": 4.5}, "nfe": 14, "computed_steps": list(range(1, 15))}) == (14, 2)


# ---- prompt.json and the ComfyUI graph front ---------------------------------------------------------------------
def _cache_graph(kind="EasyCache", **inputs):
    from tests.comfy_graphs import standard_graph
    g = standard_graph(steps=14)
    g["31"] = {"class_type": kind, "inputs": {"model": g["3"]["inputs"]["model"], "reuse_threshold": 0.2,
                                              "start_percent": 0.15, "end_percent": 0.95, "verbose": False, **inputs}}
    g["3"]["inputs"]["model"] = ["31", 0]
    return g


@pytest.mark.parametrize("node,kind", [("EasyCache", "easycache"), ("LazyCache", "lazycache")])
def test_graph_cache_nodes_become_the_jobs_cache_and_back(node, kind):
    import json as _json
    from orchestrator.http.comfy_graph import graph_to_job, job_to_graph
    from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    from tests.comfy_graphs import TINY_NAMES
    names = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
    info = object_info(node_table(names))[node]["input"]["required"]
    assert info["reuse_threshold"][1] == {"min": 0.0, "max": 3.0, "step": 0.01, "default": 0.2}   # ComfyUI's widget
    assert info["verbose"] == ["BOOLEAN", {"default": False}]
    job = graph_to_job(_cache_graph(node, reuse_threshold=0.3), names=names, sizes=[(128, 128)])
    assert job.nodes["cache"] == "31"
    spec = parse_prompt_obj(job.spec, resolution=[(128, 128)])
    assert spec.cache == CacheSettings(kind=kind, reuse_threshold=0.3) and spec.spectrum.enabled is False
    back = job_to_graph(_json.loads(_json.dumps(spec.to_dict())), names=names)
    assert [n["class_type"] for n in back.values()].count(node) == 1
    assert graph_to_job(back, names=names, sizes=[(128, 128)]).spec["cache"] == job.spec["cache"]


def test_graph_cache_with_spectrum_or_bad_values_is_refused_naming_the_node():
    from orchestrator.http.comfy_graph import GraphError, ModelNames, graph_to_job
    from tests.comfy_graphs import TINY_NAMES
    names = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
    g = _cache_graph()
    g["30"] = {"class_type": "AnimaSpectrum", "inputs": {"model": g["31"]["inputs"]["model"], "w": 0.4, "m": 3,
                                                         "lam": 1.0, "window": 2.0, "flex": 0.5, "warmup": 1,
                                                         "stop": 0.9}}
    g["31"]["inputs"]["model"] = ["30", 0]
    with pytest.raises(GraphError) as e:
        graph_to_job(g, names=names, sizes=[(128, 128)])
    assert "31" in e.value.node_errors and "AnimaSpectrum" in json_text(e.value.node_errors)
    for bad in ({"reuse_threshold": 3.5}, {"verbose": "yes"}, {"end_percent": -1}):
        with pytest.raises(GraphError) as e:
            graph_to_job(_cache_graph(**bad), names=names, sizes=[(128, 128)])
        assert list(e.value.node_errors) == ["31"] and next(iter(bad)) in json_text(e.value.node_errors)


def json_text(obj) -> str:
    import json as _json
    return _json.dumps(obj)


@pytest.mark.parametrize("obj,field", [({"cache": {"kind": "teacache"}}, "cache.kind"),
                                       ({"cache": {"reuse_threshold": -1}}, "cache.reuse_threshold"),
                                       ({"cache": {"kind": "easycache"}, "spectrum": True}, "cache"),
                                       ({"cache": "easycache"}, "cache")])
def test_prompt_json_cache_is_checked_naming_the_field(obj, field):
    from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "x", **obj}, resolution=[(128, 128)])
    assert e.value.field == field
    ok = parse_prompt_obj({"prompt": "x", "cache": {"kind": "lazycache"}}, resolution=[(128, 128)])
    assert ok.cache == CacheSettings(kind="lazycache") and ok.spectrum.enabled is False


def test_generate_cache_options_are_checked_naming_the_option(tmp_path, capsys):
    from orchestrator.terminal import cli
    from orchestrator.engine.runfolder import init_run
    run = init_run(tmp_path / "run")
    for argv, said in ((["--reuse-threshold", "0.3"], "error: --reuse-threshold: needs --cache"),
                       (["--cache", "easycache", "--reuse-threshold", "9"], "error: --reuse-threshold: must be in"),
                       (["--cache", "lazycache", "--cache-end", "1.5"], "error: --cache-end: must be in")):
        assert cli.main(["--run", str(run.root), "generate", "a", *argv]) == 2
        assert said in capsys.readouterr().err


def test_a_job_with_a_cache_at_cfg1_end_to_end(default_pipeline, pipeline_assets):
    """prompt.json's `cache` at cfg 1 through the daemon, supervisord and the real stages: the in-process latent
    bitwise, report.json's model_calls and reused_calls, the job's spec keeping the cache."""
    from models.packs.pack import load_pack
    from models.runtime.dit_runner import DiTRunner
    from models.sampling.denoise import denoise, make_sampler
    pipe = default_pipeline
    cache = {"kind": "easycache", "reuse_threshold": 3.0, "start_percent": 0.0, "end_percent": 1.0}
    prompt = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 99, "steps": 3, "cfg": 1.0,
              "sampler": "euler", "scheduler": "sgm_uniform", "cache": cache}
    job = pipe.submit(prompt)
    info = pipe.wait(job, timeout_s=600.0)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    job_dir = pipe.job_dir(job)
    r = pipe.report(job)
    assert r["prompt"]["cache"] == {**cache, "verbose": False} and r["prompt"]["spectrum"]["enabled"] is False
    pack = load_pack(pipeline_assets[1])
    g, c = pack.geometry, pack.config
    sampler = make_sampler(3, 1.0, "sgm_uniform", None, cache=CacheSettings(**cache))
    state = start_or_resume(sampler, 99, (c.latent_channels, g.latent_h, g.latent_w))
    final = denoise(DiTRunner(pack, threads=1), sampler, state, np.load(job_dir / "cond.npy"),
                    np.load(job_dir / "uncond.npy"))
    np.testing.assert_array_equal(np.load(job_dir / "latent.npy"), sampler.result(final))
    assert (r["model_calls"], r["reused_calls"]) == (sum(final.nfe), sum(final.skipped)) == (2, 1)
    assert r["branch_calls"] == 3 * c.blocks * 2            # one pass per branch call, none for the reused call
    assert [st["calls"] for st in r["steps"]] == [3 * c.blocks, 3 * c.blocks, 0]


def test_timing_table_names_the_cache_and_its_reused_calls():
    from orchestrator.engine.report import format_table
    base = {"job": "j", "prompt": {"cfg": 4.0, "cache": {"kind": "lazycache"}}, "computed_steps": [1, 2, 3],
            "forecast_steps": [], "branch_calls": 168, "nfe": 2, "model_calls": 2, "reused_calls": 1, "stages": {},
            "branches": {}, "steps": []}
    assert "2 model calls (1 reused by LazyCache)" in format_table(base)
    plain = {**base, "prompt": {"cfg": 4.0, "cache": None}, "reused_calls": 0}
    assert "model calls," in format_table(plain) and "reused" not in format_table(plain)


def test_a_cache_job_as_a_comfyui_ui_workflow():
    """The PNG's workflow of a job with a cache: the node with ComfyUI's widget order, links intact."""
    from orchestrator.http.comfy_graph import job_to_graph
    from orchestrator.http.comfy_workflow import api_to_workflow
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    from tests.comfy_png import check_workflow
    spec = parse_prompt_obj({"prompt": "x", "cache": {"kind": "lazycache", "end_percent": 0.8}},
                            resolution=[(128, 128)])
    graph = job_to_graph(spec.to_dict())
    wf = api_to_workflow(graph)
    check_workflow(wf, graph)
    node = next(n for n in wf["nodes"] if n["type"] == "LazyCache")
    assert node["widgets_values"] == [0.2, 0.15, 0.8, False]
