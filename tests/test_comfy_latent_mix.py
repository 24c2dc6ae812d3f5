"""LatentComposite / LatentBlend in ComfyUI graphs: between an img2img KSampler and VAEDecode they are prompt.json's
`latent_mix` (and a job with it is shown as that graph again); every other wiring is refused with ComfyUI's
node_errors on the mix node, naming why; prompt.json's own refusals name the field."""
from __future__ import annotations

import pytest

from bench.comfy_workflows import WORKFLOWS
from orchestrator.http.comfy_graph import GraphError, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import node_table, object_info
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj

FILES = {"dit": "a.safetensors", "text_encoder": "t.safetensors", "vae": "v.safetensors"}


def _graph(name: str) -> dict:
    return WORKFLOWS[name][1](FILES, 7, 256, 256)


def _refused(graph: dict) -> tuple[str, str, str]:
    with pytest.raises(GraphError) as e:
        graph_to_job(graph)
    node, entry = next(iter(e.value.body()["node_errors"].items()))
    err = entry["errors"][0]
    return node, err["extra_info"]["input_name"], err["details"]


@pytest.mark.parametrize("mix", [{"kind": "composite", "onto": "result", "x": 64, "y": 8, "feather": 16},
                                 {"kind": "composite", "onto": "image", "x": 0, "y": 0, "feather": 0},
                                 {"kind": "blend", "onto": "result", "factor": 0.25},
                                 {"kind": "blend", "onto": "image", "factor": 0.5}])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_job_with_latent_mix_is_its_graph_and_back(mix, batch):
    spec = {"prompt": "a", "negative_prompt": "b", "seed": 3, "steps": 6, "cfg": 4.0, "width": 256, "height": 256,
            "init_image": "x.png", "denoise": 0.5, "batch": batch, "latent_mix": mix}
    graph = job_to_graph(spec)
    node = graph["47"]
    assert node["class_type"] == ("LatentComposite" if mix["kind"] == "composite" else "LatentBlend")
    assert graph["8"]["inputs"]["samples"] == ["47", 0]
    job = graph_to_job(graph)
    assert job.spec["latent_mix"] == mix and job.nodes["latent_mix"] == "47"
    assert job.spec.get("batch", 1) == batch


def test_the_nodes_are_offered_with_comfyuis_inputs():
    info = object_info(node_table())
    assert info["LatentComposite"]["input_order"]["required"] == ["samples_to", "samples_from", "x", "y", "feather"]
    assert info["LatentComposite"]["input"]["required"]["feather"] == ["INT", {"min": 0, "max": 16384, "step": 8,
                                                                                "default": 0}]
    assert info["LatentBlend"]["input"]["required"]["blend_factor"] == ["FLOAT", {"min": 0.0, "max": 1.0,
                                                                                   "step": 0.01, "default": 0.5}]


def test_a_mix_before_the_sampler_is_refused_on_its_node():
    """Composite onto the empty latent: ComfyUI's [B, 4, h, w] and a [B, 16, 1, h, w] encoded latent do not
    combine."""
    g = _graph("composite")
    g["6"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}}
    g["25"] = {"class_type": "LatentComposite", "inputs": {"samples_to": ["6", 0], "samples_from": ["21", 0], "x": 0,
                                                           "y": 0, "feather": 0}}
    g["8"]["inputs"]["latent_image"] = ["25", 0]
    g["9"]["inputs"]["samples"] = ["8", 0]
    del g["24"]
    node, name, why = _refused(g)
    assert (node, name) == ("25", "samples_to") and "cannot combine an empty latent" in why and "init_mix" in why
    g["25"]["inputs"].update(samples_to=["21", 0], samples_from=["6", 0])     # the other way round: the same
    assert _refused(g)[:2] == ("25", "samples_from")


@pytest.mark.parametrize("mix", [{"kind": "composite", "onto": "init_image", "x": 64, "y": 0, "feather": 32},
                                 {"kind": "composite", "onto": "image", "x": 8, "y": 8, "feather": 0},
                                 {"kind": "blend", "onto": "image", "factor": 0.35},
                                 {"kind": "blend", "onto": "init_image", "factor": 0.5}])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_job_with_init_mix_is_its_graph_and_back(mix, batch):
    """init_mix: LoadImage -> VAEEncode of each upload, the mix of both (onto first), then the batch, the KSampler."""
    spec = {"prompt": "a", "negative_prompt": "b", "seed": 3, "steps": 6, "cfg": 4.0, "width": 256, "height": 256,
            "init_image": "x.png", "denoise": 0.5, "batch": batch, "init_mix": {"image": "y.png", **mix}}
    graph = job_to_graph(spec)
    node = graph["47"]
    assert node["class_type"] == ("LatentComposite" if mix["kind"] == "composite" else "LatentBlend")
    first = "samples_to" if mix["kind"] == "composite" else "samples1"
    assert node["inputs"][first] == (["41", 0] if mix["onto"] == "init_image" else ["49", 0])
    assert graph["48"]["inputs"]["image"] == "y.png" and graph["49"]["inputs"]["pixels"] == ["48", 0]
    assert graph["7"]["inputs"]["latent_image"] == (["47", 0] if batch == 1 else ["44", 0])
    job = graph_to_job(graph)
    # a graph names no `onto`: samples_to's / samples1's upload is the init_image
    init, other = ("x.png", "y.png") if mix["onto"] == "init_image" else ("y.png", "x.png")
    assert job.spec["init_image"] == init
    assert job.spec["init_mix"] == {"image": other, **{k: v for k, v in mix.items() if k != "onto"}}
    assert job.spec.get("batch", 1) == batch and job.nodes["init_mix"] == "47"
    assert {job.nodes["mix_image"], job.nodes["mix_encode"]} == ({"48", "49"} if mix["onto"] == "init_image" else
                                                                 {"40", "41"})


def test_a_masked_or_batched_latent_into_a_mix_before_the_sampler_is_refused():
    g = _graph("start-composite")
    g["30"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["23", 0], "mask": ["22", 1]}}
    g["24"]["inputs"]["samples_from"] = ["30", 0]
    node, name, why = _refused(g)
    assert (node, name) == ("24", "samples_from") and "noise mask" in why
    g["30"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["21", 0], "amount": 2}}
    g["24"]["inputs"].update(samples_to=["30", 0], samples_from=["23", 0])
    node, name, why = _refused(g)
    assert (node, name) == ("24", "samples_to") and "two VAEEncodes" in why


@pytest.mark.parametrize("mix,field,words", [
    ({"image": "y.png", "kind": "blend", "x": 8}, "init_mix.x", "takes only"),
    ({"image": "y.png", "kind": "composite", "factor": 0.2}, "init_mix.factor", "weighs a blend"),
    ({"image": "y.png", "kind": "composite", "onto": "result"}, "init_mix.onto", "'init_image', 'image'"),
    ({"kind": "blend"}, "init_mix.image", "required"),
    ({"image": "", "kind": "blend"}, "init_mix.image", "")])
def test_bad_init_mix_fields_are_refused_naming_the_field(mix, field, words):
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "a", "init_image": "x.png", "init_mix": mix}, check_output=False)
    assert e.value.field == field and words in str(e.value)
    for extra, words in (({}, "there is no init_image"), ({"init_image": "x.png", "mask": "m.png"}, "mask"),
                         ({"init_image": "x.png", "latent_mix": {"kind": "blend"}}, "latent_mix")):
        with pytest.raises(PromptError, match=words) as e:
            parse_prompt_obj({"prompt": "a", **extra, "init_mix": {"image": "y.png", "kind": "blend"}},
                             check_output=False)
        assert e.value.field == "init_mix"


def test_a_mix_of_two_samplers_or_of_another_latent_is_refused():
    g = _graph("blend")
    g["24"]["inputs"]["samples1"] = ["8", 0]
    node, name, why = _refused(g)
    assert (node, name) == ("24", "samples1") and "must be the KSampler's LATENT" in why
    g = _graph("composite")                     # another upload's VAEEncode: not the latent the KSampler starts from
    g["26"] = {"class_type": "LoadImage", "inputs": {"image": "other.png"}}
    g["27"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["26", 0], "vae": ["3", 0]}}
    g["24"]["inputs"]["samples_from"] = ["27", 0]
    node, name, why = _refused(g)
    assert (node, name) == ("24", "samples_from") and "the VAEEncode the KSampler starts from (node '21')" in why


def test_a_mix_on_a_text_to_image_or_second_pass_is_refused():
    g = _graph("txt2img")
    g["24"] = {"class_type": "LatentBlend", "inputs": {"samples1": ["8", 0], "samples2": ["6", 0],
                                                       "blend_factor": 0.5}}
    g["9"]["inputs"]["samples"] = ["24", 0]
    assert _refused(g)[:2] == ("24", "samples2")
    g = _graph("blend-second")                  # after the second pass
    g["40"] = {"class_type": "LatentBlend", "inputs": {"samples1": ["25", 0], "samples2": ["21", 0],
                                                       "blend_factor": 0.5}}
    g["9"]["inputs"]["samples"] = ["40", 0]
    node, _, why = _refused(g)
    assert node == "40" and "after a second pass" in why


@pytest.mark.parametrize("upscale", [False, True])
def test_a_mix_before_the_second_pass_is_its_start(upscale):
    """blend-second: LatentBlend of the first KSampler's latent and its VAEEncode into a second KSampler (through
    LatentUpscaleBy too): latent_mix with hires, and back."""
    g = _graph("blend-second")
    if upscale:
        g["26"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["24", 0], "upscale_method": "bilinear",
                                                               "scale_by": 1.5}}
        g["25"]["inputs"]["latent_image"] = ["26", 0]
    job = graph_to_job(g)
    assert job.spec["latent_mix"] == {"kind": "blend", "onto": "image", "factor": 0.3}
    assert job.nodes["latent_mix"] == "24" and job.nodes["hires_sampler"] == "25"
    assert job.spec["hires"].get("scale") == (1.5 if upscale else None)
    back = job_to_graph({**job.spec, "width": 256, "height": 256})
    second = back["50" if upscale else "51"]["inputs"]
    assert second["samples" if upscale else "latent_image"] == ["47", 0]
    assert graph_to_job(back).spec["latent_mix"] == job.spec["latent_mix"]
    g["24"]["inputs"]["samples1"] = ["8", 0]    # two KSampler latents: refused on the mix
    assert _refused(g)[:2] == ("24", "samples1")


def test_one_images_latent_blended_with_a_batch_is_refused_as_comfyui_fails():
    g = _graph("blend")
    g["30"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["21", 0], "amount": 2}}
    g["8"]["inputs"]["latent_image"] = ["30", 0]
    node, name, why = _refused(g)
    assert (node, name) == ("24", "samples1") and "batch of 2" in why
    g["24"]["inputs"]["samples1"] = ["30", 0]                # the latent the KSampler takes: the same batch
    assert graph_to_job(g).spec["batch"] == 2


@pytest.mark.parametrize("mix,field,words", [
    ({"kind": "blend", "feather": 8}, "latent_mix.feather", "takes only"),
    ({"kind": "composite", "factor": 0.2}, "latent_mix.factor", "weighs a blend"),
    ({"kind": "composite", "x": 16385}, "latent_mix.x", "0..16384"),
    ({"kind": "paste"}, "latent_mix.kind", "'composite', 'blend'"),
    ({"x": 8}, "latent_mix.kind", "required")])
def test_bad_latent_mix_fields_are_refused_naming_the_field(mix, field, words):
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "a", "init_image": "x.png", "latent_mix": mix}, check_output=False)
    assert e.value.field == field and words in str(e.value)
    with pytest.raises(PromptError, match="there is no init_image") as e:
        parse_prompt_obj({"prompt": "a", "latent_mix": {"kind": "blend"}}, check_output=False)
    with pytest.raises(PromptError, match="pixel"):
        parse_prompt_obj({"prompt": "a", "init_image": "x.png", "hires": {"scale": 1.5, "space": "pixel"},
                          "latent_mix": {"kind": "blend"}}, check_output=False)
