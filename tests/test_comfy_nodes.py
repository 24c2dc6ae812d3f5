"""The node table (orchestrator/http/comfy_nodes.py) drives `/object_info`, validation with ComfyUI's node_errors, and
both directions of the graph <-> job mapping; its inputs are ComfyUI's (nodes.py INPUT_TYPES) where it claims so."""
from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.http import comfy_nodes
from orchestrator.http.comfy_graph import GraphError, field_error, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import node_table, object_info
from tests.comfy_graphs import edited, standard_graph

SPEC = {"prompt": "a", "negative_prompt": "b", "seed": 1, "steps": 10, "cfg": 4.0, "width": 64, "height": 64}


def _with_steps_bound(monkeypatch, hi: int, default: int) -> None:
    """The table's KSampler and KSamplerAdvanced declare steps up to `hi` (default `default`): one edit of the
    declaration, nothing else."""
    declared = comfy_nodes._sampler_nodes

    def edited_nodes():
        return tuple(replace(n, inputs=tuple(replace(i, default=default, options={**i.options, "max": hi})
                                             if i.name == "steps" else i for i in n.inputs)) for n in declared())
    monkeypatch.setattr(comfy_nodes, "_sampler_nodes", edited_nodes)


def test_a_bound_changed_in_the_table_shows_in_object_info_and_in_validation(monkeypatch):
    graph = standard_graph(steps=13)
    assert graph_to_job(graph).spec["steps"] == 13
    _with_steps_bound(monkeypatch, 12, 7)
    info = object_info(node_table())
    for node in ("KSampler", "KSamplerAdvanced"):
        assert info[node]["input"]["required"]["steps"] == ["INT", {"min": 1, "max": 12, "default": 7}]
    with pytest.raises(GraphError) as e:
        graph_to_job(graph)
    (err,) = e.value.node_errors["3"]["errors"]
    assert (err["type"], err["message"]) == ("value_bigger_than_max", "Value 13 bigger than max of 12")
    assert graph_to_job(edited(graph, "3", steps=12)).spec["steps"] == 12


def test_every_job_field_names_an_input_of_its_node():
    for node in node_table().values():
        for name in {**node.job, **node.refusals}.values():
            assert node.input(name) is not None and node.input(name).is_widget, (node.class_type, name)


def test_graph_and_job_fields_go_both_ways_through_the_table():
    """job -> graph -> job keeps every field the table maps, KSamplerAdvanced's step window included."""
    for extra in ({}, {"start_step": 2, "end_step": 8, "leftover_noise": True, "add_noise": False},
                  {"denoise": 0.5, "sampler": "dpmpp_2m", "scheduler": "karras"}):
        spec = {**SPEC, **extra}
        job = graph_to_job(job_to_graph(spec))
        assert {k: job.spec[k] for k in spec} == spec
    graph = job_to_graph({**SPEC, "end_step": 8})
    assert graph["7"]["class_type"] == "KSamplerAdvanced"
    assert list(graph["7"]["inputs"]) == [i.name for i in node_table()["KSamplerAdvanced"].inputs]


@pytest.mark.parametrize("extra, field, node, name", [
    ({"end_step": 8, "leftover_noise": True}, "end_step", "7", "end_at_step"),
    ({"start_step": 2}, "start_step", "7", "start_at_step"),
    ({"cache": {"kind": "easycache"}}, "cache.reuse_threshold", "31", "reuse_threshold"),
    ({"spectrum": {"enabled": True, "w": 0.5, "m": 3, "lam": 0.1, "window": 2.0, "flex": 0.5, "warmup": 4,
                   "stop": 0.9}}, "spectrum.w", "30", "w"),
])
def test_a_refused_field_lands_on_the_input_the_table_names(extra, field, node, name):
    """A daemon's refusal of a field lands on the input that carries it (before the table, on a name no input has)."""
    graph = job_to_graph({**SPEC, **extra})
    err = field_error(graph, graph_to_job(graph), field, "stand-in refusal")
    assert list(err.node_errors) == [node]
    assert err.node_errors[node]["errors"][0]["extra_info"]["input_name"] == name


# ComfyUI's INPUT_TYPES (nodes.py, comfy_extras/nodes_sd3.py) for the inputs the table keeps as ComfyUI has them:
# node -> input -> (default, min, max)
COMFYUI = {"KSampler": {"seed": (0, 0, 0xffffffffffffffff), "denoise": (1.0, 0.0, 1.0)},
           "KSamplerAdvanced": {"noise_seed": (0, 0, 0xffffffffffffffff), "start_at_step": (0, 0, 10000),
                                "end_at_step": (10000, 0, 10000)},
           "VAEEncodeForInpaint": {"grow_mask_by": (6, 0, 64)},
           "LatentUpscale": {"width": (512, 0, 16384), "height": (512, 0, 16384)},
           "LatentUpscaleBy": {"scale_by": (1.5, 0.01, 8.0)},
           "ImageScale": {"width": (512, 0, 16384), "height": (512, 0, 16384)},
           "ImageScaleBy": {"scale_by": (1.0, 0.01, 8.0)},
           "RepeatLatentBatch": {"amount": (1, 1, 64)},
           "LatentFromBatch": {"length": (1, 1, 64)}}
# where this pipeline supports less than ComfyUI: within ComfyUI's (min, max)
NARROWER = {"KSampler": {"steps": (1, 10000), "cfg": (0.0, 100.0)},
            "KSamplerAdvanced": {"steps": (1, 10000), "cfg": (0.0, 100.0)},
            "LoraLoader": {"strength_model": (-100.0, 100.0), "strength_clip": (-100.0, 100.0)},
            "ModelSamplingAuraFlow": {"shift": (0.0, 100.0)},
            "EmptySD3LatentImage": {"width": (16, 16384), "height": (16, 16384), "batch_size": (1, 4096)}}


def test_the_tables_inputs_are_comfyuis():
    table = node_table()
    for node, inputs in COMFYUI.items():
        for name, (default, lo_, hi) in inputs.items():
            i = table[node].input(name)
            assert (i.default, i.options["min"], i.options["max"]) == (default, lo_, hi), (node, name)
    for node, inputs in NARROWER.items():
        for name, (lo_, hi) in inputs.items():
            i = table[node].input(name)
            assert lo_ <= i.options["min"] <= i.options["max"] <= hi, (node, name)
    assert [i.name for i in table["KSamplerAdvanced"].inputs] == [
        "model", "add_noise", "noise_seed", "steps", "cfg", "sampler_name", "scheduler", "positive", "negative",
        "latent_image", "start_at_step", "end_at_step", "return_with_leftover_noise"]
    assert table["SaveImage"].input("filename_prefix").default == "ComfyUI"
    assert "mage" in table["CLIPLoader"].input("type").choices       # the newest of ComfyUI's CLIP types


def _done_view(graph: dict, job):
    """The front's view of a finished ComfyUI job (what /history and the WebSocket are built from)."""
    import json
    from orchestrator.http.views import JobView
    from protocol import messages as m
    origin = {"api": "comfyui", "graph": graph, "nodes": job.nodes}
    return JobView.of(m.JobInfo(job="j1", state="done", created=1.0, updated=2.0, spec_json=json.dumps(job.spec),
                                origin=json.dumps(origin)))


def test_several_save_and_preview_nodes_on_the_final_image_are_one_job():
    """SaveImage and PreviewImage on the same VAEDecode: the same job as one SaveImage; each output node gets the
    job's images in /history and an `executed` message, as ComfyUI reports each output node."""
    from orchestrator.http.comfy_nodes import ModelNames
    from orchestrator.http import comfy_shapes as shapes
    from orchestrator.http.comfy_prompt import PromptView
    one = standard_graph()
    g = {**one, "21": {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}},
         "22": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "copy"}}}
    job = graph_to_job(g)
    assert job.spec == graph_to_job(one).spec and job.output == "9"
    assert (job.nodes["save"], job.nodes["save1"], job.nodes["save2"]) == ("9", "21", "22")
    view = _done_view(g, job)
    entry = shapes.history_entry(PromptView((view,)), ModelNames())
    assert list(entry["outputs"]) == ["9", "21", "22"] == list(entry["meta"]) == entry["prompt"][4]
    assert all(o["images"][0] == {"filename": "image.png", "subfolder": "j1", "type": "output"}
               for o in entry["outputs"].values())
    executed = [msg["node"] for kind, msg in shapes.end(view, ModelNames()) if kind == "executed"]
    assert executed == ["9", "21", "22"]


def test_an_output_of_another_image_is_refused_on_it():
    g = {**standard_graph(), "20": {"class_type": "LoadImage", "inputs": {"image": "t/a.png [input]"}},
         "21": {"class_type": "PreviewImage", "inputs": {"images": ["20", 0]}}}
    with pytest.raises(GraphError) as e:
        graph_to_job(g)
    (err,) = e.value.node_errors["21"]["errors"]
    assert err["type"] == "custom_validation_failed" and "every SaveImage and PreviewImage" in err["details"]


COMFY_SOURCE = '''
MAX_RESOLUTION = 16384
class KSampler:
    @classmethod
    def INPUT_TYPES(s):
        return {"required": {"model": ("MODEL",),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff}),
                             "steps": ("INT", {"default": 20, "min": 1, "max": 10000}),
                             "sampler_name": (comfy.samplers.KSampler.SAMPLERS, ),
                             "latent_image": ("LATENT", ), "extra": ("FLOAT", {"default": 0.5})}}
class LatentUpscale:
    @classmethod
    def INPUT_TYPES(s):
        return {"required": {"samples": ("LATENT",), "upscale_method": (["nearest-exact", "bilinear"],),
                             "width": ("INT", {"default": 512, "min": 0, "max": MAX_RESOLUTION, "step": 8})}}
'''
SCHEMA_SOURCE = '''
class EasyCacheNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="EasyCache", inputs=[io.Model.Input("model"),
                         io.Float.Input("reuse_threshold", min=0.0, default=0.3, max=3.0, step=0.01)])
'''


def test_the_spec_check_reads_comfyuis_declarations(tmp_path):
    """bench/comfy_node_specs.py on a stand-in ComfyUI source: each kind of difference found, nothing else."""
    from bench.comfy_node_specs import comfy_nodes, differences
    (tmp_path / "comfy_extras").mkdir()
    (tmp_path / "nodes.py").write_text(COMFY_SOURCE)
    (tmp_path / "comfy_extras" / "nodes_easycache.py").write_text(SCHEMA_SOURCE)
    theirs = comfy_nodes(tmp_path)
    table = node_table()
    rows = {(r["input"], r["what"]): (r.get("ours"), r.get("comfyui")) for r in differences(table["KSampler"],
                                                                                          theirs["KSampler"])}
    assert rows[("steps", "default")] == (30, 20) and rows[("steps", "max")] == (200, 10000)
    assert ("extra", "not in the table") in rows and ("cfg", "not in ComfyUI") in rows
    assert not any(name in ("seed", "model", "latent_image", "sampler_name") for name, _ in rows)
    up = {(r["input"], r["what"]): r.get("comfyui") for r in differences(table["LatentUpscale"],
                                                                         theirs["LatentUpscale"])}
    assert up[("upscale_method", "choices")] == ["nearest-exact", "bilinear"] and ("width", "max") not in up
    ec = {(r["input"], r["what"]): r.get("comfyui") for r in differences(table["EasyCache"], theirs["EasyCache"])}
    assert ec == {("reuse_threshold", "default"): 0.3, ("start_percent", "not in ComfyUI"): None,
                  ("end_percent", "not in ComfyUI"): None, ("verbose", "not in ComfyUI"): None}
