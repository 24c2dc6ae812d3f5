"""ConditioningZeroOut and ConditioningAverage in a ComfyUI graph (orchestrator/http/comfy_nodes.py, comfy_graph.py): the
prompt.json entries they map to, the graph a job with entries is shown as, and ComfyUI's node_errors for the wirings
a job cannot say."""
from __future__ import annotations

import copy

import pytest

from bench.comfy_workflows import AVERAGE_WITH, NEGATIVE, PROMPT, WORKFLOWS
from orchestrator.http.comfy_graph import GraphError, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import node_table, object_info
from orchestrator.engine.prompt_spec import parse_prompt_obj

FILES = {"dit": "anima-small.safetensors", "text_encoder": "qwen.safetensors", "vae": "vae.safetensors"}


def _graph(name: str) -> dict:
    return WORKFLOWS[name][1](FILES, 7, 256, 256)


def _errors(graph: dict) -> dict:
    with pytest.raises(GraphError) as e:
        graph_to_job(graph)
    return e.value.body()["node_errors"]


def test_the_bench_graphs_are_the_entries_they_mean():
    zero = graph_to_job(_graph("zero-negative")).spec
    assert zero["negative"] == [{"text": NEGATIVE, "zero_out": True}] and "positive" not in zero
    avg = graph_to_job(_graph("average")).spec
    assert avg["positive"] == [{"text": PROMPT, "zero_out": False, "average": {"text": AVERAGE_WITH, "weight": 0.6}}]
    assert "negative" not in avg and avg["prompt"] == PROMPT
    plain = graph_to_job(_graph("txt2img")).spec
    assert "positive" not in plain and "negative" not in plain          # a plain graph's job is as before


def test_a_zero_out_after_an_average_zeroes_the_blend_and_before_it_is_kept():
    g = _graph("average")
    g["63"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["62", 0]}}
    g["8"]["inputs"]["positive"] = ["63", 0]
    assert graph_to_job(g).spec["positive"] == [{"text": PROMPT, "zero_out": True}]
    g = _graph("average")
    g["63"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}}
    g["62"]["inputs"]["conditioning_to"] = ["63", 0]
    entry = graph_to_job(g).spec["positive"][0]
    assert entry["zero_out"] and entry["average"] == {"text": AVERAGE_WITH, "weight": 0.6}


@pytest.mark.parametrize("name", ["zero-negative", "average"])
def test_a_job_with_entries_is_shown_as_the_graph_it_came_from(name):
    job = graph_to_job(_graph(name))
    spec = parse_prompt_obj(job.spec).to_dict()
    shown = job_to_graph(spec, ids=job.nodes)
    assert graph_to_job(shown).spec == job.spec
    kinds = {n["class_type"] for n in shown.values()}
    assert ("ConditioningZeroOut" if name == "zero-negative" else "ConditioningAverage") in kinds


def test_a_prompt_json_entry_becomes_comfyuis_nodes_in_the_encoders_order():
    spec = parse_prompt_obj({"positive": [{"text": "a cat", "zero_out": True,
                                           "average": {"text": "a dog", "weight": 0.3}}],
                             "negative_prompt": "blurry", "seed": 1, "width": 256, "height": 256}).to_dict()
    g = job_to_graph(spec)
    sampler = next(n for n in g.values() if n["class_type"] == "KSampler")
    avg = g[sampler["inputs"]["positive"][0]]
    assert avg["class_type"] == "ConditioningAverage" and avg["inputs"]["conditioning_to_strength"] == 0.3
    zero = g[avg["inputs"]["conditioning_to"][0]]
    assert zero["class_type"] == "ConditioningZeroOut"
    assert g[zero["inputs"]["conditioning"][0]]["inputs"]["text"] == "a cat"
    assert g[avg["inputs"]["conditioning_from"][0]]["inputs"]["text"] == "a dog"
    assert g[sampler["inputs"]["negative"][0]]["class_type"] == "CLIPTextEncode"
    defaults = {"strength": 1.0, "start": 0.0, "end": 1.0}            # a whole entry's pass settings, left out
    assert graph_to_job(g).spec["positive"] == [{k: v for k, v in e.items() if defaults.get(k, ...) != v}
                                                for e in spec["positive"]]


def test_wirings_a_job_cannot_say_are_comfyuis_node_errors():
    g = _graph("average")
    g["63"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["61", 0]}}
    g["62"]["inputs"]["conditioning_from"] = ["63", 0]
    errs = _errors(g)
    assert errs["62"]["errors"][0]["type"] == "custom_validation_failed"
    assert "conditioning_from must be a CLIPTextEncode" in errs["62"]["errors"][0]["details"]
    g = _graph("average")
    g["64"] = {"class_type": "ConditioningAverage", "inputs": {"conditioning_to": ["62", 0],
                                                               "conditioning_from": ["5", 0],
                                                               "conditioning_to_strength": 0.5}}
    g["8"]["inputs"]["positive"] = ["64", 0]
    assert "one ConditioningAverage per sampler input" in _errors(g)["64"]["errors"][0]["details"]


def test_bad_values_land_on_the_node_that_carries_them():
    g = _graph("average")
    g["62"]["inputs"]["conditioning_to_strength"] = 1.5
    assert _errors(g)["62"]["errors"][0]["type"] == "value_bigger_than_max"
    g = _graph("average")
    g["61"]["inputs"]["text"] = "a\x00b"
    assert "NUL" in _errors(g)["61"]["errors"][0]["details"]
    g = _graph("zero-negative")
    g["60"]["inputs"]["conditioning"] = ["6", 0]                      # a LATENT into a CONDITIONING input
    assert _errors(g)["60"]["errors"][0]["type"] == "return_type_mismatch"


def test_a_second_pass_whose_prompt_is_zeroed_on_its_own_is_refused_not_a_crash():
    g = _graph("hires-latent")
    g["60"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["5", 0]}}
    g["25"]["inputs"]["negative"] = ["60", 0]
    assert "plain CLIPTextEncode" in _errors(g)["25"]["errors"][0]["details"]
    g = _graph("hires-latent")                                        # both passes on the same zeroed negative
    g["60"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["5", 0]}}
    g["8"]["inputs"]["negative"] = g["25"]["inputs"]["negative"] = ["60", 0]
    spec = graph_to_job(g).spec
    assert spec["negative"][0]["zero_out"] and "negative_prompt" not in spec["hires"]
    g["26"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a sharper picture", "clip": ["2", 0]}}
    g["25"]["inputs"]["positive"] = ["26", 0]                        # its own prompt, the zeroed negative shared
    job = graph_to_job(g)
    assert job.spec["hires"]["prompt"] == "a sharper picture"
    from orchestrator.engine.plan.build import build_plan
    resolved = parse_prompt_obj(job.spec, resolution=[(256, 256), (384, 384)])
    hires_step = next(s for s in build_plan(resolved).steps if getattr(s, "hires", False))
    assert hires_step.entries[0] is None and hires_step.entries[1].zero_out       # the second pass's negative: zeroed
    shown = job_to_graph(resolved.to_dict(), ids=job.nodes)
    assert graph_to_job(shown).spec == job.spec


def test_object_info_declares_them_as_comfyui():
    info = object_info(node_table())
    z, a = info["ConditioningZeroOut"], info["ConditioningAverage"]
    assert z["input"]["required"] == {"conditioning": ["CONDITIONING"]} and z["output"] == ["CONDITIONING"]
    assert a["input_order"]["required"] == ["conditioning_to", "conditioning_from", "conditioning_to_strength"]
    assert a["input"]["required"]["conditioning_to_strength"] == ["FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0,
                                                                            "step": 0.01}]
    assert a["category"] == z["category"] == "model/conditioning/transform"
