"""Chained samplers in a ComfyUI graph: a KSampler[Advanced] whose LATENT feeds a second one directly (split
sampling: the first ending early with its leftover noise, the second going on without adding noise, each with its
own cfg, sampler and scheduler) becomes prompt.json's first-pass window plus a `hires` without a size (the second
pass on the first latent as it is, with its own window); the job's graph maps back onto the same job; what a job
cannot say is refused in ComfyUI's node_errors on the node and input at fault. The windows' sigmas are checked
against ComfyUI's KSampler.sample slicing written here in numpy."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from bench.comfy_workflows import split_cfg
from models.sampling import latent_ops as lo
from models.sampling.img2img import LatentPlan, plan_sigmas
from models.sampling.schedules import DEFAULT_SHIFT
from orchestrator.http.comfy_graph import job_to_graph
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
from tests.comfy_graphs import edited, standard_graph
from tests.test_comfy_hires_graph import NAMES, SIZES, _custom, _job, _refused, _resolved, hires_graph


def split_graph(first_end: int = 2, steps: int = 4, cfg2: float = 1.5, **second) -> dict:
    """The standard 64x64 graph as split sampling: KSamplerAdvanced "3" (0 .. first_end, leftover noise) ->
    KSamplerAdvanced "51" (first_end .. end, no noise added, cfg2) -> VAEDecode "8"."""
    g = standard_graph(width=64, height=64)
    ks = {k: v for k, v in g["3"]["inputs"].items() if k not in ("seed", "denoise")}
    g["3"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **ks, "noise_seed": 1234, "steps": steps, "add_noise": "enable", "start_at_step": 0,
        "end_at_step": first_end, "return_with_leftover_noise": "enable"}}
    g["51"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **g["3"]["inputs"], "latent_image": ["3", 0], "add_noise": "disable", "cfg": cfg2,
        "start_at_step": first_end, "end_at_step": 10000, "return_with_leftover_noise": "disable", **second}}
    g["8"]["inputs"]["samples"] = ["51", 0]
    return g


# ---- graph -> job ----------------------------------------------------------------------------------------------------
def test_split_sampling_maps_onto_the_first_window_and_a_chained_second_pass():
    job = _job(split_graph())
    s = job.spec
    assert (s["steps"], s["cfg"], s["end_step"], s["leftover_noise"]) == (4, 4.0, 2, True)
    assert "start_step" not in s and "add_noise" not in s          # the first pass adds its noise from step 0
    assert s["hires"] == {"steps": 4, "denoise": 1.0, "add_noise": False, "start_step": 2, "cfg": 1.5}
    assert job.nodes["sampler"] == "3" and job.nodes["hires_sampler"] == "51" and "upscale" not in job.nodes
    h = parse_prompt_obj(s, resolution=SIZES).hires
    assert not h.upscaled and h.size(64, 64) == (64, 64)           # the second pass on the first pass's pack


def test_the_bench_split_graph_is_the_job_it_means():
    files = {"dit": NAMES.unet[0], "text_encoder": NAMES.clip[0], "vae": NAMES.vae[0]}
    s = _job(split_cfg(files, 7, 64, 64)).spec
    assert (s["steps"], s["cfg"], s["end_step"], s["leftover_noise"], s["seed"]) == (8, 4.0, 4, True, 7)
    assert s["hires"] == {"steps": 8, "denoise": 1.0, "add_noise": False, "start_step": 4, "cfg": 1.5}


@pytest.mark.parametrize("first", [True, False])
def test_saving_both_split_passes_finds_the_final_image_whatever_the_outputs_order(first):
    """A SaveImage on the first window's latent (its VAEDecode) beside the final one: the job's image is the second
    pass's and the first is kept as its base image, whether the extra output comes first in the graph or last (the
    first-listed one was taken as the final image, and the final one refused as neither)."""
    g = split_graph()
    g["60"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": g["8"]["inputs"]["vae"]}}
    save = {"class_type": "SaveImage", "inputs": {"images": ["60", 0], "filename_prefix": "first"}}
    g = {"0": save, **g} if first else {**g, "99": save}
    job = _job(g)
    assert job.nodes["save"] == "9" and job.nodes["base_save"] == ("0" if first else "99")
    assert job.nodes["hires_sampler"] == "51" and job.spec["hires"]["keep_base"] is True


def test_the_second_samplers_own_sampler_scheduler_seed_and_prompt():
    g = split_graph(sampler_name="dpmpp_2m", scheduler="karras", noise_seed=9)
    g["60"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "sharp", "clip": ["11", 0]}}
    g["51"]["inputs"]["positive"] = ["60", 0]
    h = _job(g).spec["hires"]
    assert (h["sampler"], h["scheduler"], h["seed"], h["prompt"]) == ("dpmpp_2m", "karras", 9, "sharp")


def test_a_chained_ksampler_is_a_second_pass_on_the_latent_as_it_is():
    g = standard_graph(width=64, height=64)
    g["51"] = {"class_type": "KSampler", "inputs": {**g["3"]["inputs"], "latent_image": ["3", 0], "steps": 3,
                                                    "denoise": 0.4}}
    g["8"]["inputs"]["samples"] = ["51", 0]
    assert _job(g).spec["hires"] == {"steps": 3, "denoise": 0.4}


def test_a_latent_upscale_between_split_samplers_keeps_its_size_and_the_window():
    g = hires_graph(second="KSamplerAdvanced")
    g = edited(g, "51", add_noise="disable", start_at_step=4)
    h = _job(g).spec["hires"]
    assert (h["scale"], h["method"], h["add_noise"], h["start_step"], h["denoise"]) == (1.5, "nearest-exact", False,
                                                                                          4, 1.0)


def test_a_second_window_ending_early_keeps_its_leftover_noise():
    h = _job(split_graph(steps=6, end_at_step=4, return_with_leftover_noise="enable")).spec["hires"]
    assert (h["start_step"], h["end_step"], h["leftover_noise"]) == (2, 4, True)


# ---- refusals on the node and input ----------------------------------------------------------------------------------
def test_a_second_window_leaving_no_step_is_refused_on_its_start_at_step():
    _custom(_refused(split_graph(start_at_step=4)), "51", "start_at_step", "leaves no step of the 4-step schedule")


def test_the_chained_samplers_must_share_the_model():
    g = split_graph()
    g["51"]["inputs"]["model"] = ["12", 0]                       # past ModelSamplingAuraFlow
    _custom(_refused(g), "51", "model", "the same MODEL")


def test_three_chained_samplers_are_refused_on_the_middle_ones_latent():
    g = split_graph()
    g["52"] = {"class_type": "KSamplerAdvanced", "inputs": {**g["51"]["inputs"], "latent_image": ["51", 0]}}
    g["8"]["inputs"]["samples"] = ["52", 0]
    _custom(_refused(g), "51", "latent_image", "the first KSampler's LATENT")


def test_a_chained_pass_after_an_inpaint_is_refused_on_its_latent_image():
    g = split_graph()
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["22"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["21", 0], "mask": ["20", 1]}}
    g["3"]["inputs"]["latent_image"] = ["22", 0]
    _custom(_refused(g), "51", "latent_image", "carries its noise mask")


@pytest.mark.parametrize("hires,field,words", [
    ({"space": "pixel"}, "hires.space", "give scale, or width and height"),
    ({"scale": 1.5, "width": 96, "height": 96}, "hires", "needs either scale"),
    ({"width": 96}, "hires", "both width and height"),
    ({"start_step": 6, "denoise": 1.0}, "hires.start_step", "leaves no step of the 6-step schedule"),
])
def test_prompt_json_second_passes_a_job_cannot_run_are_refused_naming_the_field(hires, field, words):
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "x", "steps": 6, "hires": hires})
    assert e.value.field == field and words in str(e.value)


# ---- job -> graph ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", [split_graph(), split_graph(steps=6, end_at_step=4,
                                                              return_with_leftover_noise="enable"),
                                   split_graph(sampler_name="dpmpp_2m", scheduler="karras", noise_seed=9)])
def test_a_split_jobs_graph_is_two_chained_advanced_samplers_and_maps_back(graph):
    spec = _resolved(_job(graph).spec)
    g = job_to_graph(spec, names=NAMES)
    kinds = [n["class_type"] for n in g.values()]
    assert kinds.count("KSamplerAdvanced") == 2 and not {"LatentUpscale", "LatentUpscaleBy"} & set(kinds)
    first, second = (k for k, n in g.items() if n["class_type"] == "KSamplerAdvanced")
    assert g[second]["inputs"]["latent_image"] == [first, 0]
    assert (g[first]["inputs"]["return_with_leftover_noise"], g[second]["inputs"]["add_noise"]) == ("enable",
                                                                                                   "disable")
    assert _resolved(_job(g).spec) == spec


def test_a_prompt_json_chain_shows_as_a_chained_ksampler():
    spec = _resolved({"prompt": "x", "seed": 5, "steps": 3, "width": 64, "height": 64, "spectrum": False,
                      "hires": {"steps": 2, "denoise": 0.3, "cfg": 2.0}})
    g = job_to_graph(spec, names=NAMES)
    second = g["51"]
    assert second["class_type"] == "KSampler" and second["inputs"]["latent_image"] == ["7", 0]
    assert (second["inputs"]["denoise"], second["inputs"]["cfg"]) == (0.3, 2.0)
    assert _resolved(_job(g).spec) == spec


# ---- the windows' sigmas are ComfyUI's --------------------------------------------------------------------------------
def _comfy_window(sigmas: np.ndarray, start, last, force_full: bool) -> np.ndarray:
    """comfy/samplers.py KSampler.sample's slicing, as written there."""
    s = sigmas.copy()
    if last is not None and last < len(s) - 1:
        s = s[:last + 1]
        if force_full:
            s[-1] = 0
    if start is not None:
        s = s[start:]
    return s


@pytest.mark.parametrize("sampler,scheduler", [("euler", "simple"), ("dpmpp_2m", "karras")])
def test_the_split_jobs_two_windows_are_comfyuis_sigmas(sampler, scheduler):
    spec = parse_prompt_obj(_job(split_graph(steps=8, first_end=3, sampler_name=sampler,
                                             scheduler=scheduler)).spec, resolution=SIZES)
    full = lo.ksampler_sigmas(sampler, scheduler, 8, DEFAULT_SHIFT)
    h = spec.hires
    first = plan_sigmas(sampler, scheduler, 8, DEFAULT_SHIFT, LatentPlan(
        start_step=spec.start_step, last_step=spec.end_step, force_full_denoise=not spec.leftover_noise))
    second = plan_sigmas(sampler, scheduler, h.steps, DEFAULT_SHIFT, LatentPlan(
        denoise=float(h.denoise), start_step=h.start_step, last_step=h.end_step, add_noise=h.add_noise,
        force_full_denoise=not h.leftover_noise))
    np.testing.assert_array_equal(first, _comfy_window(full, None, 3, False))
    np.testing.assert_array_equal(second, _comfy_window(full, 3, None, True))
    assert first[-1] == second[0] > 0 and second[-1] == 0        # the leftover noise level is where the second starts
    assert msgspec.to_builtins(h)["add_noise"] is False


def test_the_jobs_settings_line_says_the_second_pass_is_chained():
    from orchestrator.terminal.job_view import settings_lines
    line = next(x for x in settings_lines(_resolved(_job(split_graph()).spec)) if x.lstrip().startswith("hires"))
    assert "the first latent as it is" in line and "from step 2" in line and "no noise added" in line


def test_the_estimate_counts_the_second_windows_model_calls():
    """The second pass of an 8-step split at 3 computes steps 3..7: 5 model calls (euler, one per step)."""
    from orchestrator.engine.estimate import hires_calls
    spec = parse_prompt_obj(_job(split_graph(steps=8, first_end=3)).spec, resolution=SIZES)
    assert hires_calls(spec) == (5, 2)


def test_the_split_graph_as_comfyuis_ui_workflow():
    """The PNG's `workflow`: both KSamplerAdvanced with their widgets in INPUT_TYPES order, the second's LATENT
    input linked to the first's output."""
    from orchestrator.http.comfy_workflow import api_to_workflow
    g = job_to_graph(_resolved(_job(split_graph()).spec), names=NAMES)
    wf = api_to_workflow(g)
    advanced = [n for n in wf["nodes"] if n["type"] == "KSamplerAdvanced"]
    assert [n["widgets_values"][0] for n in advanced] == ["enable", "disable"]          # add_noise
    assert [n["widgets_values"][-3:] for n in advanced] == [[0, 2, "enable"], [2, 10000, "disable"]]
    first, second = advanced
    link = next(i["link"] for i in second["inputs"] if i["name"] == "latent_image")
    assert any(x[0] == link and x[1] == first["id"] for x in wf["links"])


def test_the_split_jobs_png_chunks(tmp_path):
    """The PNG of a split job: its ComfyUI graph maps back onto the job (as ComfyUI's front end reads the chunks),
    A1111's labels say the second pass had no upscale, the `anima` chunk keeps its window."""
    import json

    from tests.test_png_chunks import _png
    spec = parse_prompt_obj({**_job(split_graph()).spec, "width": 256, "height": 128}, resolution=[(256, 128)])
    meta, read = _png(tmp_path, spec)
    assert read["dropped"] == "workflow"
    from orchestrator.http.comfy_graph import graph_to_job
    got = _resolved(graph_to_job(read["prompt"], sizes=[(256, 128)]).spec, [(256, 128)])
    assert got == msgspec.to_builtins(spec)
    assert "Hires upscale: 1.0, Hires steps: 4, Hires upscaler: None, Hires CFG Scale: 1.5" in meta["parameters"]
    assert json.loads(meta["anima"])["hires"]["start_step"] == 2
