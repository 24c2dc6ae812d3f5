"""The ComfyUI graph front's hires fix and batch nodes: KSampler -> LatentUpscale[By] (or VAEDecode -> ImageScale[By]
-> VAEEncode) -> a second KSampler[Advanced] becomes prompt.json's `hires`; RepeatLatentBatch / LatentFromBatch
between the latent source and the sampler become `batch`; what a job cannot say is refused in ComfyUI's node_errors
on the node at fault; a hires (or image batch) job's graph maps back onto the same job. The sampler inputs a graph's
job gets (sigmas, starting noise, the upscaled latent) are checked against ComfyUI's formulas written here in
numpy / torch."""
from __future__ import annotations

import copy
import json

import msgspec
import numpy as np
import pytest

from models.sampling import latent_ops as lo
from models.sampling.img2img import job_noise
from orchestrator.http.comfy_graph import GraphError, field_error, graph_to_job, job_to_graph, sized_to_image
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from orchestrator.engine.prompt_spec import parse_prompt_obj
from tests.comfy_graphs import TINY_NAMES, edited, standard_graph

NAMES = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
SIZES = [(64, 64), (96, 96), (128, 128), (96, 64)]


def hires_graph(up: str = "LatentUpscaleBy", *, second: str = "KSampler", **up_inputs) -> dict:
    """The standard 64x64 graph with KSampler "3" -> `up` "50" -> `second` "51" -> VAEDecode "8". The pixel path
    (ImageScale / ImageScaleBy): "3" -> VAEDecode "54" -> "50" -> VAEEncode "55" -> "51"."""
    g = standard_graph(width=64, height=64)
    defaults = {"LatentUpscaleBy": dict(upscale_method="nearest-exact", scale_by=1.5),
                "LatentUpscale": dict(upscale_method="bilinear", width=96, height=96, crop="disabled"),
                "ImageScaleBy": dict(upscale_method="lanczos", scale_by=1.5),
                "ImageScale": dict(upscale_method="bicubic", width=96, height=96, crop="disabled")}[up]
    if up.startswith("Image"):
        g["54"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["13", 0]}}
        g["50"] = {"class_type": up, "inputs": {"image": ["54", 0], **defaults, **up_inputs}}
        g["55"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["50", 0], "vae": ["13", 0]}}
        latent = ["55", 0]
    else:
        g["50"] = {"class_type": up, "inputs": {"samples": ["3", 0], **defaults, **up_inputs}}
        latent = ["50", 0]
    ks = {k: v for k, v in g["3"]["inputs"].items() if k not in ("seed", "denoise")}
    if second == "KSampler":
        ks.update(seed=g["3"]["inputs"]["seed"], steps=4, denoise=0.5)
    else:
        ks.update(noise_seed=g["3"]["inputs"]["seed"], steps=10, add_noise="enable", start_at_step=4,
                  end_at_step=10000, return_with_leftover_noise="disable")
    g["51"] = {"class_type": second, "inputs": {**ks, "latent_image": latent}}
    g["8"]["inputs"]["samples"] = ["51", 0]
    return g


def batch_graph(*nodes: tuple[str, dict], batch_size: int = 1) -> dict:
    """The standard 64x64 graph with `nodes` (class_type, inputs) chained from EmptyLatentImage "5" to KSampler."""
    g = edited(standard_graph(width=64, height=64), "5", batch_size=batch_size)
    src = ["5", 0]
    for i, (ct, inputs) in enumerate(nodes):
        g[f"6{i}"] = {"class_type": ct, "inputs": {"samples": src, **inputs}}
        src = [f"6{i}", 0]
    g["3"]["inputs"]["latent_image"] = src
    return g


def _job(graph, sizes=SIZES):
    return graph_to_job(graph, names=NAMES, sizes=sizes)


def _refused(graph, sizes=SIZES) -> GraphError:
    with pytest.raises(GraphError) as e:
        _job(graph, sizes)
    body = e.value.body()
    json.dumps(body)
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    return e.value


def _custom(err: GraphError, node: str, name: str, words: str) -> None:
    """ComfyUI's node_errors entry on `node`: a custom_validation_failed error on input `name` saying `words`."""
    entry = err.node_errors[node]
    assert set(entry) == {"errors", "dependent_outputs", "class_type"} and entry["dependent_outputs"] == ["9"]
    found = [e for e in entry["errors"] if e["type"] == "custom_validation_failed"
             and e["details"].startswith(f"{name} - ") and e["extra_info"]["input_name"] == name]
    assert any(words in e["details"] for e in found), entry["errors"]


def _resolved(spec: dict, sizes=SIZES) -> dict:
    return msgspec.to_builtins(parse_prompt_obj(spec, resolution=sizes))


# ---- graph -> job: the hires fix -------------------------------------------------------------------------------------
def test_a_latent_hires_fix_maps_onto_prompt_json_hires():
    job = _job(hires_graph())
    assert job.spec["hires"] == {"method": "nearest-exact", "scale": 1.5, "steps": 4, "denoise": 0.5}
    assert (job.spec["steps"], job.spec["width"], job.spec["height"]) == (2, 64, 64)      # the first pass's
    assert {r: job.nodes[r] for r in ("sampler", "upscale", "hires_sampler", "decode")} == \
        {"sampler": "3", "upscale": "50", "hires_sampler": "51", "decode": "8"}
    assert "hires_positive" not in job.nodes                   # the second pass takes the first's prompts
    spec = parse_prompt_obj(job.spec, resolution=SIZES)
    assert spec.hires.size(64, 64) == (96, 96)
    job = _job(hires_graph("LatentUpscale", width=96, height=64))
    assert job.spec["hires"] == {"method": "bilinear", "width": 96, "height": 64, "steps": 4, "denoise": 0.5}


@pytest.mark.parametrize("method", lo.UPSCALE_METHODS)
def test_every_latent_method_is_the_jobs(method):
    assert _job(hires_graph(upscale_method=method)).spec["hires"]["method"] == method


def test_the_second_ksamplers_own_settings_only_where_they_differ():
    g = hires_graph()
    g["51"]["inputs"].update(seed=77, cfg=5.5, sampler_name="dpmpp_2m", scheduler="karras")
    g["52"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "detailed, sharp", "clip": ["11", 0]}}
    g["53"] = {"class_type": "CLIPTextEncode", "inputs": {"text": g["7"]["inputs"]["text"], "clip": ["11", 0]}}
    g["51"]["inputs"].update(positive=["52", 0], negative=["53", 0])
    job = _job(g)
    assert job.spec["hires"] == {"method": "nearest-exact", "scale": 1.5, "steps": 4, "denoise": 0.5, "seed": 77,
                                 "cfg": 5.5, "sampler": "dpmpp_2m", "scheduler": "karras",
                                 "prompt": "detailed, sharp"}        # the negative's text is the first's: not set
    assert (job.nodes["hires_positive"], job.nodes["hires_negative"]) == ("52", "53")
    # the graph the job keeps (the front keeps the nodes its roles name) holds every node the job used
    assert {"50", "51", "52", "53"} <= set(job.nodes.values())


def _comfy_simple_sigmas(steps: int, shift: float = 3.0) -> np.ndarray:
    """ComfyUI's `simple` scheduler on Anima's ModelSamplingDiscreteFlow (shift 3, multiplier 1000), written out:
    sigmas(t) = shift t / (1 + (shift - 1) t) at t = 1..1000 / 1000 (float32), every len/steps-th from the top, 0."""
    t = np.arange(1, 1001, dtype=np.float32) / np.float32(1000)
    sig = (np.float32(shift) * t / (1 + (np.float32(shift) - 1) * t)).astype(np.float32)
    ss = len(sig) / steps
    return np.array([sig[-(1 + int(x * ss))] for x in range(steps)] + [0.0], np.float32)


@pytest.mark.parametrize("steps,start", [(10, 4), (30, 12), (7, 3), (20, 0)])
def test_ksampler_advanced_as_second_pass_samples_comfyuis_sigmas(steps, start):
    g = hires_graph(second="KSamplerAdvanced")
    g["51"]["inputs"].update(steps=steps, start_at_step=start, scheduler="simple")
    h = _job(g).spec["hires"]
    # ComfyUI: KSamplerAdvanced samples sigmas[start_at_step:] of the `steps` schedule, its noise added at the first
    want = _comfy_simple_sigmas(steps)[start:]
    got = lo.denoise_sigmas("euler", "simple", h["steps"], h["denoise"])
    assert h["steps"] == steps - start
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_ksampler_as_second_pass_samples_comfyuis_denoise_sigmas():
    g = hires_graph()
    g["51"]["inputs"].update(steps=6, denoise=0.4, scheduler="simple")
    h = _job(g).spec["hires"]
    # ComfyUI's KSampler.set_steps: denoise d builds int(steps / d) = 15 steps and keeps the last 7 sigmas
    np.testing.assert_allclose(lo.denoise_sigmas("euler", "simple", h["steps"], h["denoise"]),
                               _comfy_simple_sigmas(15)[-7:], rtol=0, atol=1e-6)


def test_the_jobs_upscale_is_comfyuis_latent_upscale_by():
    torch = pytest.importorskip("torch")
    spec = parse_prompt_obj(_job(hires_graph(scale_by=1.5)).spec, resolution=SIZES)
    w, h = spec.hires.size(spec.width, spec.height)
    first = np.random.default_rng(3).standard_normal((1, 16, 8, 8)).astype(np.float32)
    got = lo.common_upscale(first, w // 8, h // 8, spec.hires.method)     # what the flow does with the job's hires
    # nodes.py LatentUpscaleBy: round(side * scale_by), torch's interpolate
    want = torch.nn.functional.interpolate(torch.from_numpy(first), size=(round(8 * 1.5), round(8 * 1.5)),
                                           mode="nearest-exact").numpy()
    np.testing.assert_array_equal(got, want)


def test_a_pixel_hires_fix_maps_onto_space_pixel():
    job = _job(hires_graph("ImageScaleBy"))
    assert job.spec["hires"] == {"method": "lanczos", "space": "pixel", "scale": 1.5, "steps": 4, "denoise": 0.5}
    assert {r: job.nodes[r] for r in ("hires_decode", "upscale", "hires_encode")} == \
        {"hires_decode": "54", "upscale": "50", "hires_encode": "55"}
    job = _job(hires_graph("ImageScale", width=96, height=64))
    assert job.spec["hires"] == {"method": "bicubic", "space": "pixel", "width": 96, "height": 64, "steps": 4,
                                 "denoise": 0.5}
    assert parse_prompt_obj(job.spec, resolution=SIZES).hires.space == "pixel"


# ---- graph -> job: what a hires job cannot say, refused on the node --------------------------------------------------
def test_a_scale_outside_1_to_4_is_refused_on_scale_by():
    _custom(_refused(hires_graph(scale_by=0.5)), "50", "scale_by", "upscales by 1..4")
    _custom(_refused(hires_graph(scale_by=4.5)), "50", "scale_by", "upscales by 1..4")
    e = _refused(hires_graph(scale_by=8.5))                     # outside the node's own range: ComfyUI's error
    assert e.node_errors["50"]["errors"][0]["type"] == "value_bigger_than_max"


def test_a_second_size_without_a_pack_is_refused_naming_the_sizes():
    assert _job(hires_graph(scale_by=2.0)).spec["hires"]["scale"] == 2.0          # 128x128 has a pack
    e = _refused(hires_graph(scale_by=1.25))                                      # 80x80 has none
    _custom(e, "50", "scale_by", "80x80 has no model pack; the sizes with a pack: 64x64, 96x96, 128x128, 96x64")
    _custom(_refused(hires_graph("LatentUpscale", width=112, height=96)), "50", "width", "112x96 has no model pack")
    # the daemon's refusal at submit (its packs may differ from the front's) lands on the same node
    job = _job(hires_graph())
    e = field_error(hires_graph(), job, "hires", "prompt.json: field 'hires': the second pass at 96x96 has no "
                                                 "model pack; the sizes with a pack: 64x64")
    _custom(e, "50", "scale_by", "the second pass at 96x96 has no model pack")
    _custom(field_error(hires_graph(), job, "hires.steps", "must be in 0..200"), "51", "steps", "0..200")
    g = hires_graph(second="KSamplerAdvanced")                 # its inputs by KSamplerAdvanced's names
    _custom(field_error(g, _job(g), "hires.seed", "must be in 0..7"), "51", "noise_seed", "0..7")
    _custom(field_error(g, _job(g), "hires.denoise", "must be in (0, 1]"), "51", "start_at_step", "(0, 1]")


def test_a_denoise_past_the_schedule_bound_is_refused_on_its_ksampler():
    # int(steps / denoise) sigmas: denoise 1e-300 was accepted and failed after the whole first pass (1e-7 at 8 steps
    # took 1.8 GB); refused at submit on the node and input that carry it, as ComfyUI's 400
    g = hires_graph()
    g["51"]["inputs"]["denoise"] = 1e-300
    _custom(_refused(g), "51", "denoise", "the limit is 10000 (ComfyUI's KSampler steps maximum)")
    g = hires_graph()
    g["3"]["inputs"]["denoise"] = 1e-7
    _custom(_refused(g), "3", "denoise", "use a denoise of at least steps / 10000")
    g["3"]["inputs"]["denoise"] = g["3"]["inputs"]["steps"] / 10000               # at the bound: accepted
    assert _job(g).spec["denoise"] == g["3"]["inputs"]["denoise"]


def test_the_second_pass_must_take_the_first_passs_model_clip_and_vae():
    g = hires_graph()
    g["16"] = {"class_type": "ModelSamplingAuraFlow", "inputs": {"shift": 3.0, "model": ["12", 0]}}
    g["51"]["inputs"]["model"] = ["16", 0]
    _custom(_refused(g), "51", "model", "the same MODEL")
    g = hires_graph()
    g["14"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_NAMES["clip"], "type": "stable_diffusion"}}
    g["52"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "more", "clip": ["14", 0]}}
    g["51"]["inputs"]["positive"] = ["52", 0]
    _custom(_refused(g), "52", "clip", "the first's CLIP")
    for node in ("54", "55"):
        g = hires_graph("ImageScaleBy")
        g["17"] = {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["vae"]}}
        g[node]["inputs"]["vae"] = ["17", 0]
        _custom(_refused(g), node, "vae", "the same VAE")


def test_ksampler_advanced_second_passes_keep_their_window_and_an_empty_one_is_refused_on_the_input():
    g = hires_graph(second="KSamplerAdvanced")
    h = _job(edited(g, "51", add_noise="disable")).spec["hires"]          # split sampling over an upscale
    assert (h["steps"], h["denoise"], h["start_step"], h["add_noise"]) == (10, 1.0, 4, False)
    h = _job(edited(g, "51", end_at_step=8)).spec["hires"]
    assert (h["start_step"], h["end_step"], h["leftover_noise"]) == (4, 8, False)
    _custom(_refused(edited(g, "51", start_at_step=10)), "51", "start_at_step", "no step")
    _custom(_refused(edited(g, "51", start_at_step=10, add_noise="disable")), "51", "start_at_step", "no step")


def test_crop_center_only_where_it_cuts_nothing():
    job = _job(hires_graph("LatentUpscale", width=128, height=128, crop="center"))   # the same aspect: no crop
    assert job.spec["hires"]["width"] == 128 and "crop" not in job.spec["hires"]
    _custom(_refused(hires_graph("LatentUpscale", width=96, height=64, crop="center")), "50", "crop",
            "does not crop")
    _custom(_refused(hires_graph("ImageScale", width=96, height=64, crop="center")), "50", "crop", "does not crop")
    assert _job(hires_graph("ImageScale", width=96, height=96, crop="center")).spec["hires"]["space"] == "pixel"


def test_pixel_sizes_vae_encode_would_crop_are_refused():
    # ComfyUI scales 64 pixels by 1.3 to 83, which VAEEncode crops to 80; a job's pixel pass scales to whole cells
    _custom(_refused(hires_graph("ImageScaleBy", scale_by=1.3), [(64, 64), (80, 80)]), "50", "scale_by",
            "scales the 64x64 image to 83x83")
    _custom(_refused(hires_graph("ImageScale", width=100, height=96)), "50", "width", "multiples of 8")
    _custom(_refused(hires_graph("ImageScale", width=0, height=100)), "50", "width", "100x100: VAEEncode would crop")


@pytest.mark.parametrize("up,width,height,want", [
    ("LatentUpscale", 0, 96, (96, 96)),          # 0 keeps the aspect (nodes.py: round(w * height / h), at least 64)
    ("LatentUpscale", 128, 0, (128, 128)),
    ("LatentUpscale", 0, 0, (64, 64)),           # both 0: the latent as it is
    ("ImageScale", 0, 96, (96, 96)),             # ImageScale: round(w * height / h) pixels
    ("ImageScale", 0, 0, (64, 64)),
])
def test_a_zero_side_keeps_the_first_passs_aspect(up, width, height, want):
    h = _job(hires_graph(up, width=width, height=height)).spec["hires"]
    assert (h["width"], h["height"]) == want


def test_sides_past_any_latent_are_node_errors_not_tracebacks():
    _custom(_refused(hires_graph("LatentUpscale", width=10000, height=0)), "50", "width",
            "must be an integer in 0..8192")
    _custom(_refused(hires_graph("LatentUpscale", width=16000, height=96, crop="center")), "50", "width",
            "must be an integer in 0..8192")
    e = _refused(hires_graph("LatentUpscale", width=8000, height=96))          # prompt.json's bound: on the node
    _custom(e, "50", "width", "16..4096")
    g = hires_graph("LatentUpscale", width=0, height=96)                       # from an init image: no size yet
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["3"]["inputs"].update(latent_image=["21", 0], denoise=0.6)
    _custom(_refused(g), "50", "width", "give both width and height")


def test_other_hires_shapes_are_refused_on_the_node():
    g = hires_graph()
    g["50"]["inputs"]["samples"] = ["5", 0]                     # an empty latent upscaled: no first pass
    _custom(_refused(g), "50", "samples", "the first KSampler's latent")
    g = hires_graph("ImageScaleBy")
    g["50"]["inputs"]["image"] = ["20", 0]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    _custom(_refused(g), "50", "image", "the first KSampler's VAEDecode")
    g = hires_graph()                                            # three passes
    g["56"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["51", 0], "upscale_method": "area",
                                                           "scale_by": 1.5}}
    g["57"] = {**copy.deepcopy(g["51"])}
    g["57"]["inputs"]["latent_image"] = ["56", 0]
    g["8"]["inputs"]["samples"] = ["57", 0]
    _custom(_refused(g), "51", "latent_image", "for a second pass")
    g = hires_graph()
    g["3"]["inputs"]["latent_image"] = ["60", 0]                 # a batch with a hires fix: each image its second pass
    g["60"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["5", 0], "amount": 2}}
    job = _job(g)
    assert job.spec["batch"] == 2 and job.spec["hires"]["scale"] == 1.5


def test_a_hires_fix_from_an_init_image_is_sized_to_the_image():
    g = hires_graph()
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["3"]["inputs"].update(latent_image=["21", 0], denoise=0.6)
    job = sized_to_image(g, _job(g), (64, 64), SIZES)
    assert (job.spec["init_image"], job.spec["denoise"], job.spec["width"]) == ("a.png", 0.6, 64)
    assert job.spec["hires"]["scale"] == 1.5
    g["50"] = {"class_type": "LatentUpscale", "inputs": {"samples": ["3", 0], "upscale_method": "bislerp",
                                                         "width": 96, "height": 96, "crop": "center"}}
    _custom(pytest.raises(GraphError, sized_to_image, g, _job(g), (96, 64), SIZES).value, "50", "crop",
            "center would crop the 96x64 first pass")


def test_a_latent_hires_fix_of_an_inpaint_is_refused_the_pixel_path_taken():
    """ComfyUI's KSampler and LatentUpscale copy the LATENT dict, noise_mask included: its second KSampler samples
    under the first pass's mask, a job's second pass does not. VAEEncode makes a latent without one."""
    def inpaint(g):
        del g["5"]
        g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
        g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
        g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["21", 0], "mask": ["20", 1]}}
        g["3"]["inputs"].update(latent_image=["23", 0], denoise=0.8)
        return g
    _custom(_refused(inpaint(hires_graph())), "50", "samples", "carries its noise mask")
    job = _job(inpaint(hires_graph("ImageScaleBy")))
    assert (job.spec["mask"], job.spec["hires"]["space"]) == ("a.png", "pixel")


# ---- graph -> job: batches -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes,batch_size,want", [
    ((("RepeatLatentBatch", {"amount": 3}),), 1, 3),
    ((("RepeatLatentBatch", {"amount": 3}),), 2, 6),
    ((("LatentFromBatch", {"batch_index": 0, "length": 2}),), 4, 2),
    ((("LatentFromBatch", {"batch_index": 0, "length": 9}),), 3, 3),            # clamped to the batch, as ComfyUI
    ((("LatentFromBatch", {"batch_index": 0, "length": 2}), ("RepeatLatentBatch", {"amount": 2})), 4, 4),
    ((("RepeatLatentBatch", {"amount": 1}),), 1, 1),
    # past the first image, a negative index from the end, either end clamped: nodes.py's LatentFromBatch
    ((("LatentFromBatch", {"batch_index": 1, "length": 2}),), 4, (2, 1)),
    ((("LatentFromBatch", {"batch_index": -1, "length": 2}),), 4, (1, 3)),
    ((("LatentFromBatch", {"batch_index": -3, "length": 2}),), 4, (2, 1)),
    ((("LatentFromBatch", {"batch_index": 7, "length": 1}),), 4, (1, 3)),
    ((("LatentFromBatch", {"batch_index": -9, "length": 2}),), 4, (2, 0)),
    ((("RepeatLatentBatch", {"amount": 3}), ("LatentFromBatch", {"batch_index": 4, "length": 3})), 2, (2, 4)),
])
def test_batch_nodes_map_onto_the_jobs_batch(nodes, batch_size, want):
    job = _job(batch_graph(*nodes, batch_size=batch_size))
    want, first = want if isinstance(want, tuple) else (want, 0)
    assert job.spec.get("batch", 1) == want and job.spec.get("batch_index", 0) == first
    assert [job.nodes[f"batch{i}"] for i in range(len(nodes))] == [f"6{i}" for i in reversed(range(len(nodes)))]


def _comfy_prepare_noise(torch, seed: int, shape: tuple, batch_index=None) -> np.ndarray:
    """comfy/sample.py prepare_noise, as published: one randn over the batch, or one [1, ...] draw per index."""
    gen = torch.manual_seed(seed)
    if batch_index is None:
        return torch.randn(shape, dtype=torch.float32, layout=torch.strided, generator=gen, device="cpu").numpy()
    draws = [torch.randn((1,) + shape[1:], dtype=torch.float32, generator=gen) for _ in range(max(batch_index) + 1)]
    return torch.cat([draws[i] for i in batch_index]).numpy()


@pytest.mark.parametrize("nodes,batch_size,batch_index", [
    ((("RepeatLatentBatch", {"amount": 3}),), 1, None),
    ((("LatentFromBatch", {"batch_index": 0, "length": 2}),), 4, [0, 1]),
    ((("LatentFromBatch", {"batch_index": 1, "length": 2}),), 4, [1, 2]),
    ((("LatentFromBatch", {"batch_index": -1, "length": 1}),), 4, [3]),
    ((("RepeatLatentBatch", {"amount": 4}), ("LatentFromBatch", {"batch_index": 5, "length": 2})), 2, [5, 6]),
])
def test_a_batch_graphs_images_start_from_comfyuis_noise(nodes, batch_size, batch_index):
    from types import SimpleNamespace
    from orchestrator.engine.plan.denoise import DenoiseSteps
    torch = pytest.importorskip("torch")
    spec = parse_prompt_obj(_job(batch_graph(*nodes, batch_size=batch_size)).spec, resolution=SIZES)
    shape = (16, spec.height // 8, spec.width // 8)
    want = _comfy_prepare_noise(torch, spec.seed, (spec.batch,) + shape, batch_index)
    # the plan's DENOISE for image i: its noise_index (orchestrator/engine/plan/denoise.py _batch_params)
    runner = SimpleNamespace(batch=spec.batch)
    index = [DenoiseSteps._batch_params(runner, i, spec.batch_index).get("noise_index", 0) for i in range(spec.batch)]
    got = np.stack([job_noise(spec.seed, shape, i) for i in index])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_a_masked_batch_takes_its_batch_nodes_after_the_mask():
    g = batch_graph(("RepeatLatentBatch", {"amount": 2}))
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["21", 0], "mask": ["20", 1]}}
    g["60"]["inputs"]["samples"] = ["23", 0]
    job = _job(g)
    assert (job.spec["batch"], job.spec["mask"], job.spec["mask_channel"]) == (2, "a.png", "alpha")
    g["60"]["inputs"]["samples"], g["23"]["inputs"]["samples"] = ["21", 0], ["60", 0]
    g["3"]["inputs"]["latent_image"] = ["23", 0]
    _custom(_refused(g), "23", "samples", "go after SetLatentNoiseMask")


def test_batches_a_job_cannot_say_are_refused_on_the_node():
    e = _refused(batch_graph(("RepeatLatentBatch", {"amount": 9}), ("LatentFromBatch", {"batch_index": 66,
                                                                                           "length": 1}), batch_size=8))
    _custom(e, "61", "batch_index", "a job's come from its first 64")
    e = _refused(batch_graph(("RepeatLatentBatch", {"amount": 5}), batch_size=2))
    _custom(e, "60", "amount", "a batch of 10 images; at most 8")
    e = _refused(batch_graph(("RepeatLatentBatch", {"amount": 65})))
    assert e.node_errors["60"]["errors"][0]["type"] == "value_bigger_than_max"
    e = _refused(batch_graph(("LatentFromBatch", {"batch_index": 16385, "length": 1})))
    assert e.node_errors["60"]["errors"][0]["type"] == "value_bigger_than_max"


def test_a_batch_from_an_init_image():
    g = batch_graph(("RepeatLatentBatch", {"amount": 3}))
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["60"]["inputs"]["samples"] = ["21", 0]
    g["3"]["inputs"]["denoise"] = 0.7
    job = _job(g)
    assert (job.spec["init_image"], job.spec["batch"], job.spec["denoise"]) == ("a.png", 3, 0.7)
    back = _job(job_to_graph(_resolved(job.spec), names=NAMES))
    assert (back.spec["init_image"], back.spec["batch"], back.spec["denoise"]) == ("a.png", 3, 0.7)


# ---- job -> graph -> job ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hires", [
    {"scale": 1.5},
    {"scale": 2, "method": "bislerp", "steps": 5, "denoise": 0.35},
    {"width": 96, "height": 64, "method": "area"},
    {"scale": 1.5, "space": "pixel", "method": "lanczos"},
    {"width": 96, "height": 96, "space": "pixel", "method": "bilinear"},
    {"scale": 1.5, "prompt": "sharp", "negative_prompt": "blurry", "sampler": "dpmpp_2m", "scheduler": "karras",
     "cfg": 6.0, "seed": 9},
])
def test_a_hires_jobs_graph_is_the_two_pass_graph_and_maps_back(hires):
    spec = _resolved({"prompt": "x", "negative_prompt": "y", "seed": 5, "steps": 3, "width": 64, "height": 64,
                      "sampler": "euler", "spectrum": False, "hires": hires})
    g = job_to_graph(spec, names=NAMES)
    kinds = {n["class_type"] for n in g.values()}
    ups = {"ImageScaleBy", "ImageScale"} if hires.get("space") == "pixel" else {"LatentUpscaleBy", "LatentUpscale"}
    assert ups & kinds
    assert [n["class_type"] for n in g.values()].count("KSampler") == 2
    back = _resolved(_job(g).spec)
    # the same job: a second KSampler always has its steps (hires.steps 0, "the job's", shows as that number)
    spec["hires"]["steps"] = spec["hires"]["steps"] or spec["steps"]
    assert back == spec, {k: (back[k], spec[k]) for k in spec if back.get(k) != spec[k]}


def test_the_hires_graph_as_comfyuis_ui_workflow():
    from orchestrator.http.comfy_workflow import api_to_workflow
    spec = _resolved({"prompt": "x", "width": 64, "height": 64, "spectrum": False,
                      "hires": {"scale": 1.5, "method": "bicubic"}})
    wf = api_to_workflow(job_to_graph(spec, names=NAMES))
    up = next(n for n in wf["nodes"] if n["type"] == "LatentUpscaleBy")
    assert up["widgets_values"] == ["bicubic", 1.5]


# ---- /object_info ----------------------------------------------------------------------------------------------------
def test_object_info_has_comfyuis_upscale_and_batch_nodes():
    info = object_info(node_table(NAMES))
    side = lambda step: ["INT", {"min": 0, "max": 16384, "step": step, "default": 512}]   # noqa: E731
    latent_methods = ["nearest-exact", "bilinear", "area", "bicubic", "bislerp"]
    pixel_methods = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]
    crop = [["disabled", "center"], {"default": "disabled"}]
    want = {
        "LatentUpscale": {"samples": ["LATENT"], "upscale_method": [latent_methods, {"default": "nearest-exact"}],
                          "width": side(8), "height": side(8), "crop": crop},
        "LatentUpscaleBy": {"samples": ["LATENT"], "upscale_method": [latent_methods, {"default": "nearest-exact"}],
                            "scale_by": ["FLOAT", {"min": 0.01, "max": 8.0, "step": 0.01, "default": 1.5}]},
        "ImageScale": {"image": ["IMAGE"], "upscale_method": [pixel_methods, {"default": "nearest-exact"}],
                       "width": side(1), "height": side(1), "crop": crop},
        "ImageScaleBy": {"image": ["IMAGE"], "upscale_method": [pixel_methods, {"default": "nearest-exact"}],
                         "scale_by": ["FLOAT", {"min": 0.01, "max": 8.0, "step": 0.01, "default": 1.0}]},
        "RepeatLatentBatch": {"samples": ["LATENT"], "amount": ["INT", {"min": 1, "max": 64, "default": 1}]},
        "LatentFromBatch": {"samples": ["LATENT"], "batch_index": ["INT", {"min": -16384, "max": 16384,
                                                                           "default": 0}],
                            "length": ["INT", {"min": 1, "max": 64, "default": 1}]},
    }
    for name, inputs in want.items():
        assert info[name]["input"] == {"required": inputs}, name
        assert info[name]["input_order"] == {"required": list(inputs)}
        assert info[name]["output"] == ["IMAGE" if name.startswith("Image") else "LATENT"]


# ---- POST /prompt over the stand-in daemon (one 128x128 pack) --------------------------------------------------------
def _front_graph(g: dict) -> dict:
    """A 64x64 test graph at the stand-in daemon's one size, 128x128, its loaders naming no file."""
    g = copy.deepcopy(g)
    for node in g.values():
        if node["class_type"] in ("EmptyLatentImage", "EmptySD3LatentImage"):
            node["inputs"].update(width=128, height=128)
    return g


def test_post_prompt_submits_the_hires_fix_and_the_batch(tmp_path):
    from tests.test_graph_front_hardening import Front
    f = Front(tmp_path)
    same = hires_graph(scale_by=1.0)                             # a second pass at the first's size: the one pack
    bigger = hires_graph(scale_by=1.5)                           # 192x192: no pack
    batch = batch_graph(("RepeatLatentBatch", {"amount": 3}))
    try:
        calls = f.requests([("POST", "/prompt", {"prompt": _front_graph(g)}) for g in (same, bigger, batch)])
    finally:
        f.front.link = None
    (ok, _), (refused, body), (ok2, _) = calls
    assert (ok, refused, ok2) == (200, 400, 200), body
    first, second = f.link.submitted
    assert (first.prompt.hires.scale, first.prompt.hires.steps, first.prompt.hires.denoise) == (1.0, 4, 0.5)
    assert second.prompt.batch == 3 and second.prompt.hires is None
    details = [e["details"] for e in body["node_errors"]["50"]["errors"]]
    assert any("192x192 has no model pack" in d and "128x128" in d for d in details), details


def test_a_hires_jobs_png_shows_the_two_pass_graph():
    """A job of prompt.json / A1111's enable_hr / the page (no client graph): the PNG's `prompt` chunk is the two-pass
    graph (orchestrator/http/png_formats.py png_metadata: what /history and /queue show too, views.JobView.graph), and
    `workflow` draws it; the graph maps back onto the job."""
    from types import SimpleNamespace

    from orchestrator.http.png_formats import png_metadata
    pack = SimpleNamespace(width=64, height=64, source_name=TINY_NAMES["unet"], source_sha256="ab" * 32)
    spec = parse_prompt_obj({"prompt": "a cat", "seed": 1, "steps": 3, "spectrum": False,
                             "hires": {"scale": 1.5, "denoise": 0.4, "prompt": "a sharp cat"}}, resolution=SIZES)
    meta = png_metadata(spec, pack, "j", names=NAMES)
    graph = json.loads(meta["prompt"])
    assert graph["8"]["inputs"]["samples"] == ["51", 0] and graph["51"]["inputs"]["latent_image"] == ["50", 0]
    assert graph["52"]["inputs"]["text"] == "a sharp cat"
    assert {n["type"] for n in json.loads(meta["workflow"])["nodes"]} >= {"LatentUpscaleBy", "KSampler"}
    back = parse_prompt_obj(_job(graph).spec, resolution=SIZES)
    assert back.hires == spec.hires.replace(steps=3) and back.seed == spec.seed


def test_save_image_of_an_image_that_is_no_decode_is_a_node_error():
    """SaveImage of LoadImage's (or ImageScale's) IMAGE passed ComfyUI's type check and then raised KeyError in the
    mapping (a 500 from POST /prompt); now a node error on SaveImage."""
    for src in ("20", "50"):
        g = hires_graph("ImageScaleBy")
        g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
        g["9"]["inputs"]["images"] = [src, 0]
        _custom(_refused(g), "9", "images", "must save VAEDecode's image")


def test_random_edits_of_hires_and_batch_graphs_are_graph_errors_or_jobs():
    """Inputs of the new nodes' graphs set to values and links of every kind: graph_to_job (and sized_to_image for
    an image's job) gives a job or ComfyUI's 400, never another exception (a 500)."""
    import random
    pool = [0, 1, -1, 8, 63, 65, 4096, 16384, 99999, 0.5, 1.0, 1.5, 4.0, 8.0, "x", "", None, [], {}, True, "center",
            "bislerp", "lanczos", "disable", float("nan"), ["3", 0], ["50", 0], ["5", 0], ["54", 0], ["55", 0],
            ["51", 0], ["99", 0], ["20", 0], ["20", 1], ["21", 0]]
    bases = [hires_graph(u) for u in ("LatentUpscaleBy", "LatentUpscale", "ImageScaleBy", "ImageScale")]
    bases += [hires_graph(second="KSamplerAdvanced"), batch_graph(("RepeatLatentBatch", {"amount": 3})),
              batch_graph(("LatentFromBatch", {"batch_index": 0, "length": 2}), batch_size=3)]
    for g in list(bases):
        g = copy.deepcopy(g)
        g["20"] = {"class_type": "LoadImage", "inputs": {"image": "a.png"}}
        g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
        bases.append(g)
    rng = random.Random(27)
    for _ in range(600):
        g = copy.deepcopy(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            node = g[rng.choice(list(g))]
            node["inputs"][rng.choice(list(node["inputs"]))] = rng.choice(pool)
        try:
            job = _job(g)
            if "init_image" in job.spec:
                sized_to_image(g, job, rng.choice([(64, 64), (96, 64), (80, 80)]), SIZES)
        except GraphError as e:
            json.dumps(e.body())


@pytest.mark.parametrize("extra", [{"mask": "a.png", "mask_channel": "alpha"},
                                   {"mask": "m.png", "mask_channel": "red", "grow_mask_by": 6}, {"mask": "m.png"}])
def test_an_image_batch_jobs_graph_with_a_mask_maps_back(extra):
    spec = _resolved({"prompt": "x", "width": 64, "height": 64, "spectrum": False, "init_image": "a.png",
                      "denoise": 0.6, "batch": 3, **extra})
    g = job_to_graph(spec, names=NAMES)
    assert g["44"]["class_type"] == "RepeatLatentBatch" and g["44"]["inputs"]["amount"] == 3
    back = _resolved(_job(g).spec)
    keys = ("init_image", "mask", "grow_mask_by", "denoise", "batch")
    assert {k: back[k] for k in keys} == {k: spec[k] for k in keys}
    assert back["mask_channel"] == (spec["mask_channel"] or "red")     # A1111's rule shows as LoadImageMask red


@pytest.mark.parametrize("extra", [{"cache": {"kind": "easycache"}}, {"spectrum": True},
                                   {"loras": [{"name": "a.safetensors", "strength": 0.5, "clip_strength": 0.25}]},
                                   {"init_image": "a.png", "denoise": 0.5}])
def test_both_passes_share_the_model_chain_back_and_forth(extra):
    spec = _resolved({"prompt": "x", "seed": 2, "width": 64, "height": 64, "spectrum": False,
                      "hires": {"scale": 1.5, "seed": 3}, **extra})
    g = job_to_graph(spec, names=NAMES)
    assert g["51"]["inputs"]["model"] == g["7"]["inputs"]["model"]
    back = _resolved(_job(g).spec)
    spec["hires"]["steps"] = spec["steps"]
    assert back == spec, {k: (back[k], spec[k]) for k in spec if back.get(k) != spec[k]}


# ---- the base image and the hires image each saved (hires.keep_base) ---------------------------------------------
def _base_saved(up: str) -> dict:
    """hires_graph(up) with SaveImage "57" of the first pass's image listed before the final SaveImage "9": the pixel
    path's VAEDecode "54", or a VAEDecode "56" of KSampler "3"'s latent."""
    g = hires_graph(up)
    image = "54"
    if not up.startswith("Image"):
        g["56"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["13", 0]}}
        image = "56"
    return {"57": {"class_type": "SaveImage", "inputs": {"images": [image, 0], "filename_prefix": "base"}}, **g}


@pytest.mark.parametrize("up", ["LatentUpscaleBy", "ImageScaleBy"])
def test_the_base_and_the_hires_image_each_saved_is_one_job_that_keeps_its_base(up):
    from orchestrator.http import comfy_shapes as shapes
    from orchestrator.http.comfy_prompt import PromptView
    from tests.test_comfy_nodes import _done_view
    g = _base_saved(up)
    job = _job(g)
    plain = _job(hires_graph(up))
    assert job.output == "9" and job.nodes["save"] == "9" and job.nodes["base_save"] == "57"
    assert job.spec == {**plain.spec, "hires": {**plain.spec["hires"], "keep_base": True}}
    assert job.nodes.get("base_decode") == (None if up.startswith("Image") else "56")
    assert parse_prompt_obj(job.spec, resolution=SIZES).hires.keep_base
    view = _done_view(g, job)
    entry = shapes.history_entry(PromptView((view,)), NAMES)
    files = {node: [i["filename"] for i in out["images"]] for node, out in entry["outputs"].items()}
    assert files == {"9": ["image.png"], "57": ["base.png"]} and entry["prompt"][4] == ["9", "57"]
    executed = {msg["node"]: [i["filename"] for i in msg["output"]["images"]]
                for kind, msg in shapes.end(view, NAMES) if kind == "executed"}
    assert executed == files


def test_a_batchs_base_images_are_each_saved_and_another_image_is_refused():
    from orchestrator.http import comfy_shapes as shapes
    from orchestrator.http.comfy_prompt import PromptView
    from tests.test_comfy_nodes import _done_view
    g = edited(_base_saved("LatentUpscaleBy"), "5", batch_size=2)
    job = _job(g)
    entry = shapes.history_entry(PromptView((_done_view(g, job),)), NAMES)
    assert [i["filename"] for i in entry["outputs"]["57"]["images"]] == ["base.png", "base_1.png"]
    assert [i["filename"] for i in entry["outputs"]["9"]["images"]] == ["image.png", "image_1.png"]
    # a VAEDecode of the upscaled latent is no image the job makes: refused on the SaveImage that asks for it
    wrong = edited(_base_saved("LatentUpscaleBy"), "56", samples=["50", 0])
    _custom(_refused(wrong), "57", "images", "node '56' is neither")
    # without a hires fix there is no first pass's image to keep
    lone = {**standard_graph(width=64, height=64),
            "57": {"class_type": "SaveImage", "inputs": {"images": ["58", 0], "filename_prefix": "b"}},
            "58": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["13", 0]}}}
    _custom(_refused(lone), "57", "images", "is neither")


@pytest.mark.parametrize("space", ["latent", "pixel"])
def test_a_keep_base_jobs_graph_saves_both_images_and_maps_back(space):
    from orchestrator.http.comfy_graph import job_nodes
    hires = {"scale": 1.5, "keep_base": True, **({"space": "pixel", "method": "lanczos"} if space == "pixel" else {})}
    spec = _resolved({"prompt": "x", "seed": 5, "steps": 3, "width": 64, "height": 64, "spectrum": False,
                      "hires": hires})
    g = job_to_graph(spec, names=NAMES)
    saves = {k: n["inputs"]["images"][0] for k, n in g.items() if n["class_type"] == "SaveImage"}
    assert saves == {"9": "8", "57": "54" if space == "pixel" else "56"}
    assert job_nodes(spec)["base_save"] == "57" and "base_save" not in job_nodes({**spec, "hires": None})
    back = _resolved(_job(g).spec)
    assert back["hires"]["keep_base"] is True and back == {**spec, "hires": {**spec["hires"], "steps": 3}}
