"""The samplers on a real DiT against ComfyUI's own job: issue 22's six sampler/scheduler combos.

tests/data/samplers/comfy_small_6step.npz was made by bench/comfy_reference.py --record against an unmodified
ComfyUI (CPU, float32) running the synthetic "small" bundle (seed 0; the smallest DiT ComfyUI's Anima support loads:
10 blocks, width 256) through its standard text-to-image graph: 256x256, 6 steps, CFG 4, seed 7, ModelSamplingAuraFlow
shift 3. It holds ComfyUI's final latent per combo (model space) and the conditioning rows this project's text
encoder made for the prompt pair (the bench checked them against ComfyUI by the same final latents), so this test
needs only the DiT: it rebuilds the same synthetic checkpoint, packs it for 256x256 in FP32 and samples through
DiTRunner (ONNX Runtime), as the pipeline's scheduler does.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.sampling.k_sampling import cfg_denoised, new_ksampler
from models.sampling.noise import comfy_noise
from models.sampling.schedules import make_sigmas

REC = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_small_6step.npz")
JOB = json.loads(str(REC["job"]))
COMBOS = sorted(tuple(k.split("/")[1:]) for k in REC.files if k.startswith("comfyui/"))
CONTEXT_ROWS = 512


@pytest.fixture(scope="module")
def small_dit(tmp_path_factory) -> Path:
    """The bundle's DiT without its LLM adapter (not needed with the recorded conditioning; each tensor's values
    depend only on the seed and its name, so the blocks are the bundle's), written once for both packs."""
    from models.base.safetensors_io import write_safetensors
    from models.dit.synth import dit_entries
    path = tmp_path_factory.mktemp("small_dit") / "anima-small.safetensors"
    write_safetensors(path, [e for e in dit_entries("small", 0, prefix="net.")
                             if not e.name.startswith("net.llm_adapter.")])
    return path


def _small_runner(dit: Path, size: tuple):
    """The small DiT packed for `size` in FP32 on ONNX Runtime with one thread: `make test` runs two workers on two
    cores, where ONNX Runtime's default (a spinning thread per core) costs ~1.5x the CPU of one thread for the same
    numbers. Every branch resident: the module's ~400 forwards would otherwise make an ONNX Runtime session per
    branch per forward (measured: 0.82 CPU-s per CFG forward on demand, 0.49 resident, the outputs bitwise equal)."""
    from models.packs.pack import build_pack
    from tests.pipeline_harness import reference_runner
    return reference_runner(build_pack(dit, dit.parent / f"pack-{size[0]}x{size[1]}", size, "fp32"), threads=1)


@pytest.fixture(scope="module")
def runner(small_dit):
    r = _small_runner(small_dit, tuple(JOB["size"]))
    yield r
    r.close()


def _context(rows: np.ndarray) -> np.ndarray:
    ctx = np.zeros((CONTEXT_ROWS, rows.shape[1]), np.float32)              # [512, 1024] f32, zero rows after the tokens
    ctx[:rows.shape[0]] = rows
    return ctx


def test_the_record_holds_issue_22s_six_combos():
    assert set(COMBOS) == {("euler_ancestral", "karras"), ("er_sde", "beta"), ("dpmpp_2m", "simple"),
                           ("dpmpp_2m_sde", "karras"), ("sa_solver_pece", "sgm_uniform"),
                           ("res_multistep", "exponential")}


@pytest.mark.parametrize("sampler,scheduler", COMBOS)
def test_six_step_job_equals_comfyui(runner, sampler, scheduler):
    cond, uncond = _context(REC["cond"]), _context(REC["uncond"])
    w, h = JOB["size"]
    shape = (16, h // 8, w // 8)
    ks = new_ksampler(sampler, make_sigmas(scheduler, JOB["steps"]), seed=JOB["seed"], shape=shape)

    def model(x, sigma):
        v_c, v_u = runner.forward_cfg(x, sigma, cond, uncond)
        return cfg_denoised(x, sigma, v_c, v_u, JOB["cfg"])
    got = ks.sample(model, comfy_noise(JOB["seed"], shape)).astype(np.float64).ravel()
    want = REC[f"comfyui/{sampler}/{scheduler}"].astype(np.float64).ravel()
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos >= 0.99999, f"{sampler}/{scheduler}: cosine {cos:.9f} with ComfyUI's final latent"


# tests/data/samplers/comfy_small_easycache.npz: the same bundle, prompt pair and seed through ComfyUI's graph with its
# EasyCache node (reuse 0.2, start 0.15, end 0.95) before the KSampler, 14 steps (ComfyUI's log: 6 of 14 steps skipped
# for euler/simple, 2 of 14 for dpmpp_2m/karras). A reused call is where ComfyUI's in-place add shows
# (models/sampling/step_cache.py reused_outputs): without it euler's latent has cosine -0.58 with ComfyUI's.
EASY = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_small_easycache.npz")
EASY_JOB = json.loads(str(EASY["job"]))


@pytest.mark.parametrize("sampler,scheduler", [("euler", "simple"), ("dpmpp_2m", "karras")])
def test_easycache_job_equals_comfyui(runner, sampler, scheduler):
    from models.sampling.denoise import model_call
    from models.sampling.sampler import Sampler
    from models.sampling.step_cache import CacheSettings
    assert EASY_JOB["size"] == JOB["size"] and EASY_JOB["cache"]["kind"] == "easycache"
    cond, uncond = _context(EASY["cond"]), _context(EASY["uncond"])
    w, h = EASY_JOB["size"]
    shape = (16, h // 8, w // 8)
    s = Sampler(steps=EASY_JOB["steps"], cfg=EASY_JOB["cfg"], scheduler=scheduler, sampler=sampler, spectrum=None,
                cache=CacheSettings(**EASY_JOB["cache"]))
    st = s.sample(lambda x, sigma: model_call(runner, s, x, sigma, cond, uncond),
                  latent=comfy_noise(EASY_JOB["seed"], shape), seed=EASY_JOB["seed"])
    assert sum(st.skipped) == {"euler": 6, "dpmpp_2m": 2}[sampler]          # ComfyUI's "skipped N/14 steps"
    got = s.result(st).astype(np.float64).ravel()
    want = EASY[f"comfyui/{sampler}/{scheduler}"].astype(np.float64).ravel()
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos >= 0.99999, f"easycache {sampler}/{scheduler}: cosine {cos:.9f} with ComfyUI's final latent"


# tests/data/samplers/comfy_small_split.npz: bench/comfy_workflows.py's split-cfg graph (two KSamplerAdvanced: steps
# 0..4 of 8 at cfg 4 with the leftover noise, then 4..end at cfg 1.5 adding no noise; euler/simple) on the same bundle,
# prompt pair, seed and size, its final latent saved by ComfyUI (bench/comfy_reference.py --workflow split-cfg
# --record). The job is what the graph front makes of that graph; both passes run as the daemon runs them.
SPLIT = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_small_split.npz")
SPLIT_JOB = json.loads(str(SPLIT["job"]))


def _pass(runner, sampler, seed: int, shape: tuple, cond, uncond, image=None) -> np.ndarray:
    from models.sampling.denoise import denoise
    from models.sampling.img2img import start_or_resume_latent
    state = start_or_resume_latent(sampler, seed, shape, image=image)
    return sampler.result(denoise(runner, sampler, state, cond, uncond))


def test_split_sampling_over_two_advanced_samplers_equals_comfyui(runner):
    from bench.comfy_workflows import split_cfg
    from models.sampling.img2img import LatentPlan, LatentSampler
    from models.vae.latent import denormalize, normalize
    from orchestrator.http.comfy_graph import graph_to_job
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    assert (SPLIT_JOB["seed"], SPLIT_JOB["size"]) == (JOB["seed"], JOB["size"])
    w, h = SPLIT_JOB["size"]
    spec = parse_prompt_obj(graph_to_job(split_cfg(SPLIT_JOB["files"], SPLIT_JOB["seed"], w, h)).spec,
                            check_output=False)
    second = spec.hires
    assert (spec.end_step, spec.leftover_noise, second.start_step, second.add_noise, second.cfg) == (4, True, 4,
                                                                                                     False, 1.5)
    cond, uncond = _context(REC["cond"]), _context(REC["uncond"])
    shape = (16, h // 8, w // 8)
    s1 = LatentSampler(steps=spec.steps, cfg=spec.cfg, sampler=spec.sampler, scheduler=spec.scheduler, spectrum=None,
                       plan=LatentPlan(last_step=spec.end_step, force_full_denoise=not spec.leftover_noise))
    first = _pass(runner, s1, spec.seed, shape, cond, uncond)
    s2 = LatentSampler(steps=second.steps, cfg=second.cfg, sampler=spec.sampler, scheduler=spec.scheduler,
                       spectrum=None, plan=LatentPlan(denoise=float(second.denoise), start_step=second.start_step,
                                                      add_noise=second.add_noise))
    got = _pass(runner, s2, spec.seed, shape, cond, uncond, image=normalize(denormalize(first)))
    want = SPLIT["comfyui_workflow/split-cfg"]
    g, r = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    cos = g @ r / (np.linalg.norm(g) * np.linalg.norm(r))
    assert cos >= 0.99999, f"split sampling: cosine {cos:.9f} with ComfyUI's final latent"
    # measured: cosine 1.000000000, max |difference| 2.6e-6; the noise added again at step 4 gives 0.959 and 3.4
    assert np.abs(g - r).max() < 1e-3
    # the second pass matters: the first window's latent alone (its leftover noise rescaled) is far from it
    f = first.astype(np.float64).ravel()
    assert f @ r / (np.linalg.norm(f) * np.linalg.norm(r)) < 0.999


# tests/data/samplers/comfy_small_entries.npz (bench/comfy_cond_record.py entries --record): the same bundle and seed through
# bench/comfy_workflows.py's conditioning graphs in ComfyUI (ConditioningCombine of two prompts at cfg 4 and at cfg 1;
# ConditioningSetTimestepRange halves combined, 8 steps; a Combine with a ConditioningAverage entry and a
# ConditioningZeroOut negative; a latent hires fix whose two KSamplers take one Combine of two windowed prompts),
# ComfyUI's final latents and this project's context rows of each entry (bench's context_label). The graph maps onto
# its job as the front maps it; each active entry a pass of its own, mixed by models/sampling/cond_mix.py, as
# bench/comfy_cond_record.py entries computes it (without the feature the latent is far from ComfyUI's: the test can fail).
ENTRIES = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_small_entries.npz")


@pytest.fixture(scope="module")
def hires_runner(small_dit):
    """The small DiT packed for the hires graph's second pass (1.5 x the record's size)."""
    w, h = JOB["size"]
    r = _small_runner(small_dit, (w * 3 // 2, h * 3 // 2))
    yield r
    r.close()


def _entries_latent(runners, name: str, contexts: dict | None = None, hires_mixed: bool = True) -> tuple:
    from bench.comfy_cond_record import project_latent
    ctx = {k.split("/", 1)[1]: _context(ENTRIES[k]) for k in ENTRIES.files if k.startswith("context/")}
    return project_latent(runners, {**ctx, **(contexts or {})}, json.loads(str(ENTRIES[f"graph/{name}"])),
                          hires_mixed=hires_mixed)


def _cos(a, b) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# DiT passes per model call: the average entry from 0.3 on (sigma <= 0.875); the hires graph's first pass 6 calls,
# then the second pass's 6, both windows open between sigma 0.667 and 0.346; LazyCache's 5 computed calls of 12
# (ComfyUI logged 7 of 12 skipped)
PASSES_ZERO_AVERAGE = [2, 2, 3, 3, 3, 3]
PASSES_HIRES_WINDOWS = [2, 2, 2, 2, 3, 3] + [2, 2, 3, 3, 3, 2]
PASSES_LAZYCACHE = [2, 2, 2, 3, 3]


@pytest.mark.parametrize("name,passes", [("combine", [3] * 6), ("combine-cfg1", [2] * 6),
                                         ("timestep-halves", [2, 2, 2, 2, 3, 2, 2, 2]),
                                         ("combine-zero-average", PASSES_ZERO_AVERAGE),
                                         ("hires-windows", PASSES_HIRES_WINDOWS),
                                         ("combine-lazycache", PASSES_LAZYCACHE)])
def test_conditioning_graphs_equal_comfyui(request, runner, name, passes):
    runners = (runner, request.getfixturevalue("hires_runner") if name == "hires-windows" else None)
    got, ran = _entries_latent(runners, name)
    assert ran == passes                                    # DiT passes per step (sigma 0.75: both halves)
    want = ENTRIES[f"comfyui/{name}"]
    off = float(np.abs(got - want).max())                   # measured when recorded: 1.4e-6 .. 1.3e-5
    assert _cos(got, want) >= 0.99999 and off <= 1e-4, f"{name}: cosine {_cos(got, want):.9f}, max {off:.2e}"
    without = {"combine": {"second": _context(ENTRIES["context/prompt"])},           # the first prompt alone
               "combine-cfg1": {"second": _context(ENTRIES["context/prompt"])},
               # the entries' texts plain: no ConditioningAverage, no ConditioningZeroOut
               "combine-zero-average": {"second+avg_with_0.6": _context(ENTRIES["context/second"]),
                                        "negative+zero": _context(ENTRIES["context/negative"])}}.get(name)
    if without is not None:
        alone, _ = _entries_latent(runners, name, without)
        assert float(np.abs(alone - want).max()) > 50 * off


# tests/data/samplers/comfy_small_start_mix.npz (bench/comfy_start_mix_record.py): bench/comfy_workflows.py's mixes
# before the first KSampler on ComfyUI (the same bundle, prompt pair, seed and size): both uploads' VAEEncode latents,
# the LatentComposite / LatentBlend the KSampler takes and its output, in model space. The graph maps onto its job's
# init_mix as the front maps it; the plan's MixStart (models/sampling/latent_mix.mix_image) on ComfyUI's two encoded
# latents gives ComfyUI's start, and the img2img pass from it ComfyUI's final latent.
START = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_small_start_mix.npz")
START_JOB = json.loads(str(START["job"]))
START_SAVED = {"21": "init", "23": "other"}          # the graphs' VAEEncode nodes -> the recorded latents


def _start_mix(name: str) -> tuple:
    """(the job of graph `name`, MixStart on ComfyUI's encoded latents [16, h, w], ComfyUI's mix, the onto latent)."""
    from bench.comfy_workflows import WORKFLOWS
    from models.sampling.latent_mix import mix_image
    from orchestrator.http.comfy_graph import MIX_INPUTS, graph_to_job
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    graph = json.loads(str(START[f"graph/{name}"]))
    w, h = START_JOB["size"]
    assert graph == WORKFLOWS[name][1](START_JOB["files"], START_JOB["seed"], w, h)     # the bench's graph as it is
    spec = parse_prompt_obj(graph_to_job(graph).spec, check_output=False)
    mix = graph["24"]
    onto_node, other_node = (mix["inputs"][k][0] for k in MIX_INPUTS[mix["class_type"]])
    onto, other = START[f"{name}/{START_SAVED[onto_node]}"][0], START[f"{name}/{START_SAVED[other_node]}"][0]
    m = spec.init_mix
    got = mix_image(m.kind, onto, other, x=m.x, y=m.y, feather=m.feather, factor=m.factor)
    return spec, got, START[f"{name}/start"][0], onto


@pytest.mark.parametrize("name", ["start-composite", "start-blend"])
def test_a_mix_before_the_first_ksampler_is_comfyuis_start_latent(name):
    spec, got, want, onto = _start_mix(name)
    assert spec.init_image is not None and spec.init_mix is not None
    assert got.shape == want.shape == onto.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)       # ComfyUI mixes in VAE space, this in model space
    assert np.abs(want - onto).max() > 0.1                         # the node changes the start latent


def test_img2img_from_a_composite_of_two_uploads_equals_comfyui(runner):
    """start-composite: the KSampler (euler / simple, denoise 0.6) from MixStart's latent gives ComfyUI's final
    latent; from the first upload's latent alone (the graph without the node) it is far from it."""
    from models.sampling.img2img import LatentPlan, LatentSampler
    assert (START_JOB["seed"], START_JOB["size"]) == (JOB["seed"], JOB["size"])
    spec, start, _, onto = _start_mix("start-composite")
    cond, uncond = _context(REC["cond"]), _context(REC["uncond"])

    def img2img(image):
        s = LatentSampler(steps=spec.steps, cfg=spec.cfg, sampler=spec.sampler, scheduler=spec.scheduler,
                          spectrum=None, plan=LatentPlan(denoise=float(spec.denoise)))
        return _pass(runner, s, spec.seed, start.shape, cond, uncond, image=image)
    got, want = img2img(start), START["start-composite/final"][0]
    off = float(np.abs(got - want).max())
    assert _cos(got, want) >= 0.99999 and off < 1e-3, f"cosine {_cos(got, want):.9f}, max {off:.2e}"
    alone = img2img(onto)
    assert float(np.abs(alone - want).max()) > 0.1 and _cos(alone, want) < 0.9999
