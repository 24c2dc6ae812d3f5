"""orchestrator.http.comfy_graph: the standard Anima API graph maps onto a job; everything else is refused in ComfyUI's
400 shape with node_errors on the node at fault; a job's graph maps back onto the same job; /object_info's shape."""
from __future__ import annotations

import copy
import json

import pytest

from orchestrator.http.comfy_graph import CANONICAL_IDS, GraphError, graph_links, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from models.sampling.sampler import SAMPLER_NAMES, SCHEDULER_NAMES
from orchestrator.engine.prompt_spec import parse_prompt_obj
from tests.comfy_graphs import TINY_NAMES, edited, standard_graph

NAMES = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
SIZES = [(128, 128), (256, 128)]


def test_standard_graph_maps_onto_a_job():
    job = graph_to_job(standard_graph(), names=NAMES, sizes=SIZES)
    assert job.spec == {"prompt": "1girl, silver hair, (blue eyes:1.2)", "negative_prompt": "worst quality",
                        "seed": 1234, "steps": 2, "cfg": 4.0, "width": 128, "height": 128, "sampler": "euler",
                        "scheduler": "sgm_uniform", "spectrum": False}        # ComfyUI computes every step
    assert job.output == "9"
    assert job.nodes == {"save": "9", "decode": "8", "sampler": "3", "latent": "5", "vae": "13", "positive": "6",
                         "negative": "7", "shift": "15", "unet": "12", "clip": "11"}
    # the spec is a valid prompt.json for those packs
    assert parse_prompt_obj(job.spec, resolution=SIZES).width == 128


def test_variants_accepted_like_comfyui():
    """No ModelSamplingAuraFlow, EmptyLatentImage, numeric strings converted as ComfyUI's int()/float() do, extra
    nodes not linked to the output ignored (ComfyUI validates what the outputs need)."""
    g = standard_graph(shift_node=False, latent="EmptyLatentImage", width=256)
    g = edited(g, "3", steps="3", cfg="5.5", seed=7.0)
    g["99"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "unused", "clip": ["11", 0]}}
    job = graph_to_job(g, names=NAMES, sizes=SIZES)
    assert (job.spec["steps"], job.spec["cfg"], job.spec["seed"], job.spec["width"]) == (3, 5.5, 7, 256)
    assert "shift" not in job.nodes
    # unknown model lists (ModelNames()) are not checked
    assert graph_to_job(edited(standard_graph(), "12", unet_name="other.safetensors"), sizes=SIZES).spec


def _refused(graph, **kw) -> GraphError:
    with pytest.raises(GraphError) as e:
        graph_to_job(graph, **{"names": NAMES, "sizes": SIZES, **kw})
    body = e.value.body()
    assert set(body) == {"error", "node_errors"}
    assert set(body["error"]) == {"type", "message", "details", "extra_info"}
    json.dumps(body)                                  # the answer is JSON as it stands
    return e.value


def _node_error(err: GraphError, node: str, kind: str, detail: str = "") -> dict:
    entry = err.node_errors[node]
    assert set(entry) == {"errors", "dependent_outputs", "class_type"}
    kinds = [e["type"] for e in entry["errors"]]
    assert kind in kinds, (kinds, entry)
    e = entry["errors"][kinds.index(kind)]
    assert detail in e["details"], e
    return e


G = standard_graph()
CASES = [
    # (name, graph, node at fault, ComfyUI error type, text in details)
    ("unknown-node", {**G, "20": {"class_type": "ControlNetApplyAdvanced", "inputs": {}}}, "20", "missing_node_type",
     "#20"),
    ("steps-over-max", edited(G, "3", steps=201), "3", "value_bigger_than_max", "steps"),
    ("steps-zero", edited(G, "3", steps=0), "3", "value_smaller_than_min", "steps"),
    ("cfg-nan", edited(G, "3", cfg="nan"), "3", "invalid_input_type", "cfg"),
    ("seed-text", edited(G, "3", seed="abc"), "3", "invalid_input_type", "seed"),
    ("seed-negative", edited(G, "3", seed=-1), "3", "value_smaller_than_min", "seed"),
    ("sampler", edited(G, "3", sampler_name="deis"), "3", "value_not_in_list", "sampler_name"),
    ("scheduler", edited(G, "3", scheduler="Karras"), "3", "value_not_in_list", "scheduler"),
    ("denoise", edited(G, "3", denoise=-0.5), "3", "value_smaller_than_min", "denoise"),
    ("batch", edited(G, "5", batch_size=9), "5", "value_bigger_than_max", "batch_size"),
    ("no-pack", edited(G, "5", width=512, height=512), "5", "custom_validation_failed", "512x512 has no model pack"),
    ("shift", edited(G, "15", shift=1.73), "15", "value_smaller_than_min", "shift"),
    ("unet-name", edited(G, "12", unet_name="sdxl.safetensors"), "12", "value_not_in_list", "unet_name"),
    # ComfyUI lists every text encoder type; Anima's is its template's "stable_diffusion": another is refused
    ("clip-type", edited(G, "11", type="qwen_image"), "11", "custom_validation_failed",
     "type - 'qwen_image' is not Anima's text encoder type: 'stable_diffusion'"),
    ("clip-type-unknown", edited(G, "11", type="sdxl"), "11", "value_not_in_list", "type"),
    ("missing-input", edited(G, "3", positive=...), "3", "required_input_missing", "positive"),
    ("bad-link", edited(G, "3", positive=["6"]), "3", "bad_linked_input", "positive"),
    ("dangling-link", edited(G, "3", positive=["42", 0]), "3", "bad_linked_input", "positive"),
    ("type-mismatch", edited(G, "3", positive=["11", 0]), "3", "return_type_mismatch", "CLIP != CONDITIONING"),
    ("value-for-link", edited(G, "8", vae="qwen_image_vae.safetensors"), "8", "bad_linked_input", "vae"),
    ("link-for-value", edited(G, "3", steps=["5", 0]), "3", "invalid_input_type", "steps"),
    ("empty-prompt", edited(G, "6", text="  "), "6", "custom_validation_failed", "must not be empty"),
    ("long-prompt", edited(G, "6", text="x" * 4001), "6", "custom_validation_failed", "limit is 4000"),
    ("nul-negative", edited(G, "7", text="a\x00b"), "7", "custom_validation_failed", "NUL"),
    ("three-passes", {**edited(G, "3", latent_image=["30", 0]), "30": edited(G, "3", latent_image=["31", 0])["3"],
                      "31": G["3"]}, "30", "custom_validation_failed", "the first KSampler's LATENT"),
    ("sampler-loop", edited(G, "3", latent_image=["3", 0]), "3", "dependency_cycle", "the graph loops: 3.latent_image"),
    ("decode-latent", edited(G, "8", samples=["5", 0]), "8", "custom_validation_failed", "KSampler's output"),
    ("two-images", {**G, "20": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["13", 0]}},
                    "10": {"class_type": "SaveImage", "inputs": {"images": ["20", 0], "filename_prefix": "b"}}}, "10",
     "custom_validation_failed", "node '20' is neither"),
    ("output-input-missing", {**G, "10": {"class_type": "SaveImage", "inputs": {"images": ["8", 0]}}}, "10",
     "required_input_missing", "filename_prefix"),
]


@pytest.mark.parametrize("name,graph,node,kind,detail", CASES, ids=[c[0] for c in CASES])
def test_refused_with_node_errors(name, graph, node, kind, detail):
    before = copy.deepcopy(graph)
    err = _refused(graph)
    _node_error(err, node, kind, detail)
    assert graph == before                            # the caller's graph is left as it was
    if kind != "missing_node_type":
        assert err.error["type"] == "prompt_outputs_failed_validation"
        assert all(e["dependent_outputs"] for e in err.node_errors.values())


@pytest.mark.parametrize("graph,kind", [
    ([], "invalid_prompt"), ({}, "invalid_prompt"), ("text", "invalid_prompt"),
    ({"1": {"inputs": {}}}, "invalid_prompt"), ({"1": {"class_type": "KSampler", "inputs": []}}, "invalid_prompt"),
    ({str(i): {"class_type": "VAELoader", "inputs": {}} for i in range(65)}, "invalid_prompt"),
    ({"1": {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["vae"]}}}, "prompt_no_outputs"),
])
def test_refused_outright(graph, kind):
    assert _refused(graph).error["type"] == kind


def test_job_graph_round_trip():
    """job -> graph -> job gives the same job; links go where the standard graph's go."""
    spec = parse_prompt_obj({"prompt": "a cat", "negative_prompt": "dog", "seed": 2**64 - 1, "steps": 7, "cfg": 4.5,
                             "width": 256, "height": 128, "scheduler": "simple"}, resolution=SIZES).to_dict()
    g = job_to_graph(spec, names=NAMES)
    assert set(g) == set(CANONICAL_IDS.values())
    assert all("_meta" in n and n["_meta"]["title"] for n in g.values())
    back = graph_to_job(json.loads(json.dumps(g)), names=NAMES, sizes=SIZES)
    assert back.spec == {k: spec[k] for k in back.spec} and back.spec["sampler"] == "euler"
    assert back.output == CANONICAL_IDS["save"]
    links = graph_links(g)
    assert ("7", 0, "8", "samples", "LATENT") in links and ("2", 0, "4", "clip", "CLIP") in links
    assert len(links) == 10                   # the model goes through AnimaSpectrum: prompt.json's default is on
    assert ("1", 0, "30", "model", "MODEL") in links and ("30", 0, "7", "model", "MODEL") in links
    # the client's own node ids can be kept
    g2 = job_to_graph(spec, names=NAMES, ids={"save": "save-node", "sampler": "ks"})
    assert g2["save-node"]["inputs"]["images"] == [CANONICAL_IDS["decode"], 0]
    assert graph_to_job(g2, names=NAMES, sizes=SIZES).output == "save-node"


def test_object_info_shape():
    info = object_info(node_table(NAMES))
    assert set(info) == {"UNETLoader", "CLIPLoader", "VAELoader", "CLIPTextEncode", "EmptyLatentImage",
                         "EmptySD3LatentImage", "ModelSamplingAuraFlow", "KSampler", "KSamplerAdvanced", "VAEDecode",
                         "SaveImage", "LoraLoader", "LoraLoaderModelOnly", "AnimaSpectrum", "EasyCache", "LazyCache",
                         "LoadImage", "LoadImageMask", "VAEEncode", "VAEEncodeForInpaint", "SetLatentNoiseMask",
                         "LatentUpscale", "LatentUpscaleBy", "ImageScale", "ImageScaleBy", "RepeatLatentBatch",
                         "LatentFromBatch", "PreviewImage", "ConditioningZeroOut", "ConditioningAverage",
                         "ImageCrop", "ConditioningCombine", "ConditioningSetTimestepRange",
                         "ConditioningSetAreaStrength", "LatentComposite",
                         "LatentBlend"}                                  # ConditioningConcat: refused, not offered
    ks = info["KSampler"]
    assert ks["input_order"]["required"] == ["model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive",
                                             "negative", "latent_image", "denoise"]
    assert ks["input"]["required"]["sampler_name"][0] == list(SAMPLER_NAMES) and "er_sde" in SAMPLER_NAMES
    assert ks["input"]["required"]["scheduler"][0] == list(SCHEDULER_NAMES) and len(SCHEDULER_NAMES) == 9
    assert ks["input"]["required"]["steps"] == ["INT", {"min": 1, "max": 200, "default": 30}]
    assert ks["input"]["required"]["model"] == ["MODEL"]
    assert ks["output"] == ["LATENT"] and ks["output_node"] is False and info["SaveImage"]["output_node"] is True
    assert info["UNETLoader"]["input"]["required"]["unet_name"][0] == [TINY_NAMES["unet"]]
    assert info["CLIPLoader"]["input_order"] == {"required": ["clip_name", "type"], "optional": ["device"]}
    json.dumps(info)


def test_lora_loaders_map_onto_the_jobs_loras_and_back():
    """LoraLoader (model and CLIP) then LoraLoaderModelOnly, wired as ComfyUI's editor does: the job's `loras` from
    the loaders outward with the strengths of the chains each is in; a job's graph shows them as loaders again, a
    LoRA whose text-encoder strength is omitted (null in job.json: the model's) as a LoraLoader with that strength."""
    names = ModelNames(unet=NAMES.unet, clip=NAMES.clip, vae=NAMES.vae, lora=("a.safetensors", "sub/b.safetensors"))
    g = standard_graph()
    g["20"] = {"inputs": {"lora_name": "a.safetensors", "strength_model": 0.8, "strength_clip": 1.3,
                          "model": ["12", 0], "clip": ["11", 0]}, "class_type": "LoraLoader"}
    g["21"] = {"inputs": {"lora_name": "sub/b.safetensors", "strength_model": -0.5, "model": ["20", 0]},
               "class_type": "LoraLoaderModelOnly"}
    g["15"]["inputs"]["model"] = ["21", 0]
    g["6"]["inputs"]["clip"] = g["7"]["inputs"]["clip"] = ["20", 1]
    job = graph_to_job(g, names=names, sizes=SIZES)
    assert job.spec["loras"] == [{"name": "a.safetensors", "strength": 0.8, "clip_strength": 1.3},
                                 {"name": "sub/b.safetensors", "strength": -0.5, "clip_strength": 0.0}]
    spec = parse_prompt_obj(job.spec, resolution=SIZES)
    assert [c.te_strength for c in spec.loras] == [1.3, 0.0]
    bad = copy.deepcopy(g)
    bad["20"]["inputs"]["lora_name"] = "elsewhere.safetensors"               # not in MODELS/loras/
    with pytest.raises(GraphError):
        graph_to_job(bad, names=names, sizes=SIZES)
    stored = parse_prompt_obj({"prompt": "x", "loras": [{"name": "a.safetensors", "strength": 0.7},
                                                        {"name": "sub/b.safetensors", "strength": 0.4,
                                                         "clip_strength": 0.0}]}).to_dict()
    assert stored["loras"][0]["clip_strength"] is None
    back = job_to_graph({**stored, "width": 128, "height": 128}, names=names)
    loaders = [n for n in back.values() if n["class_type"].startswith("Lora")]
    assert [(n["class_type"], n["inputs"]["lora_name"], n["inputs"]["strength_model"],
             n["inputs"].get("strength_clip")) for n in loaders] == \
        [("LoraLoader", "a.safetensors", 0.7, 0.7), ("LoraLoaderModelOnly", "sub/b.safetensors", 0.4, None)]
    again = graph_to_job(back, names=names, sizes=SIZES).spec["loras"]
    assert again == [{"name": "a.safetensors", "strength": 0.7, "clip_strength": 0.7},
                     {"name": "sub/b.safetensors", "strength": 0.4, "clip_strength": 0.0}]



def test_spectrum_only_where_the_graph_patches_it_in():
    """A ComfyUI graph means what it means in ComfyUI: no Spectrum unless its own node (AnimaSpectrum, a model patch
    listed in /object_info like ComfyUI's EasyCache) sits in the model's chain; its widgets are the job's settings,
    and a job that forecast steps shows as a graph with that node (which maps back onto the same job)."""
    from models.sampling.spectrum import SpectrumSettings
    table = node_table(NAMES)
    info = object_info(table)["AnimaSpectrum"]
    assert info["output"] == ["MODEL"] and info["input"]["required"]["warmup"][1]["default"] == SpectrumSettings().warmup
    g = standard_graph()
    g["30"] = {"class_type": "AnimaSpectrum", "inputs": {"model": g["3"]["inputs"]["model"], "w": 0.4, "m": 3,
                                                         "lam": 1.0, "window": 2.0, "flex": 0.5, "warmup": 1,
                                                         "stop": 0.9}}
    g["3"]["inputs"]["model"] = ["30", 0]
    job = graph_to_job(g, names=NAMES, sizes=SIZES)
    assert job.nodes["spectrum"] == "30"
    want = SpectrumSettings(warmup=1)
    assert SpectrumSettings.from_dict(job.spec["spectrum"]) == want
    spec = parse_prompt_obj(job.spec, resolution=SIZES)
    assert spec.spectrum == want
    back = job_to_graph(json.loads(json.dumps(spec.to_dict())), names=NAMES)
    assert any(n["class_type"] == "AnimaSpectrum" for n in back.values())
    assert graph_to_job(back, names=NAMES, sizes=SIZES).spec["spectrum"] == job.spec["spectrum"]
    plain = parse_prompt_obj(graph_to_job(standard_graph(), names=NAMES, sizes=SIZES).spec, resolution=SIZES)
    assert plain.spectrum.enabled is False
    assert not any(n["class_type"] == "AnimaSpectrum" for n in job_to_graph(plain.to_dict(), names=NAMES).values())


def test_the_setting_nodes_offer_exactly_their_records_bounds():
    """AnimaSpectrum, EasyCache and LazyCache take their inputs' defaults and bounds from SpectrumSettings and
    CacheSettings (they were typed twice): each offered bound is accepted by the record, one step past it refused."""
    from models.sampling.spectrum import SpectrumSettings
    from models.sampling.step_cache import CacheSettings
    from models.base.schema import SchemaError
    from orchestrator.http import comfy_nodes as g
    nodes = [(g._spectrum_node(), SpectrumSettings)] + [(n, CacheSettings) for n in g._cache_nodes()]
    checked = 0
    for node, record in nodes:
        for spec in node.inputs[1:]:
            assert spec.default == getattr(record(), spec.name)
            if spec.type == "BOOLEAN":
                continue
            step = spec.options.get("step", 1)
            for edge, past in ((spec.options["min"], spec.options["min"] - step),
                               (spec.options["max"], spec.options["max"] + step)):
                record(**{spec.name: edge})
                with pytest.raises(SchemaError):
                    record(**{spec.name: past})
                checked += 1
    assert checked == 2 * sum(s.type != "BOOLEAN" for node, _ in nodes for s in node.inputs[1:]) >= 14
