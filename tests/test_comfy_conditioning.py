"""ComfyUI's conditioning nodes (orchestrator/http/comfy_conditioning.py): ConditioningCombine, ConditioningSetTimestepRange
and ConditioningSetAreaStrength map onto prompt.json's positive/negative entries in ComfyUI's list order with the
setter nearest the sampler winning (node_helpers.conditioning_set_values overwrites), and back; ConditioningConcat and
other nodes in a conditioning chain are refused on their node; /object_info lists them as nodes.py declares them."""
from __future__ import annotations

import pytest

from orchestrator.http.comfy_graph import GraphError, graph_to_job, job_to_graph
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from orchestrator.engine.prompt_spec import parse_prompt_obj
from tests.comfy_graphs import TINY_NAMES, standard_graph

NAMES = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
SIZES = [(128, 128)]


def _text(text: str) -> dict:
    return {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["11", 0]}}


def _combine(a: str, b: str) -> dict:
    return {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": [a, 0], "conditioning_2": [b, 0]}}


def _range(src: str, start: float, end: float) -> dict:
    return {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": [src, 0], "start": start,
                                                                     "end": end}}


def _graph(nodes: dict, positive: str = "6", negative: str = "7") -> dict:
    g = standard_graph()
    g.update(nodes)
    g["3"]["inputs"]["positive"], g["3"]["inputs"]["negative"] = [positive, 0], [negative, 0]
    return g


def _job(graph: dict):
    return graph_to_job(graph, names=NAMES, sizes=SIZES)


def test_combine_and_ranges_map_onto_entries_in_comfyuis_order():
    g = _graph({"20": _text("a car"), "21": _text("a dog"), "22": _range("6", 0.0, 0.5), "23": _range("20", 0.5, 1.0),
                "24": _combine("22", "23"), "25": _combine("24", "21"),
                "26": {"class_type": "ConditioningSetAreaStrength", "inputs": {"conditioning": ["21", 0],
                                                                               "strength": 2.5}},
                "27": _combine("7", "26")}, positive="25", negative="27")
    job = _job(g)
    assert job.spec["positive"] == [{"text": "1girl, silver hair, (blue eyes:1.2)", "start": 0.0, "end": 0.5},
                                    {"text": "a car", "start": 0.5, "end": 1.0}, {"text": "a dog"}]
    assert job.spec["negative"] == [{"text": "worst quality"}, {"text": "a dog", "strength": 2.5}]
    assert job.spec["prompt"] == "1girl, silver hair, (blue eyes:1.2)" and job.spec["negative_prompt"] == \
        "worst quality"
    spec = parse_prompt_obj(job.spec, resolution=SIZES).to_dict()
    back = job_to_graph(spec, names=NAMES)
    assert _job(back).spec["positive"] == job.spec["positive"]
    assert _job(back).spec["negative"] == job.spec["negative"]
    # with the graph's own node ids too
    assert _job(job_to_graph(spec, names=NAMES, ids=job.nodes)).spec["negative"] == job.spec["negative"]


def test_the_setter_nearest_the_sampler_wins_over_every_entry_below_it():
    g = _graph({"20": _text("a car"), "22": _range("6", 0.1, 0.2), "24": _combine("22", "20"),
                "25": _range("24", 0.3, 0.9)}, positive="25")
    assert _job(g).spec["positive"] == [{"text": "1girl, silver hair, (blue eyes:1.2)", "start": 0.3, "end": 0.9},
                                        {"text": "a car", "start": 0.3, "end": 0.9}]
    one = _job(job_to_graph(parse_prompt_obj(_job(g).spec, resolution=SIZES).to_dict(), names=NAMES, ids=_job(g).nodes))
    assert one.spec["positive"] == _job(g).spec["positive"]       # one window node per entry when built back


def _refused(graph) -> dict:
    with pytest.raises(GraphError) as e:
        _job(graph)
    return e.value.body()["node_errors"]


def test_concat_is_refused_on_its_node_naming_the_512_token_packs():
    errs = _refused(_graph({"20": _text("a car"),
                            "21": {"class_type": "ConditioningConcat",
                                   "inputs": {"conditioning_to": ["6", 0], "conditioning_from": ["20", 0]}}},
                           positive="21"))
    assert list(errs) == ["21"]
    assert "built for 512 text tokens" in errs["21"]["errors"][0]["details"]


def test_an_entry_field_refused_lands_on_the_node_that_carries_it():
    errs = _refused(_graph({"20": _text("a \x00 car"), "24": _combine("6", "20")}, positive="24"))
    assert list(errs) == ["20"] and "NUL" in errs["20"]["errors"][0]["details"]
    many = {str(30 + i): _text(f"t{i}") for i in range(9)}
    chain = {str(50 + i): _combine(str(49 + i) if i else "30", str(31 + i)) for i in range(8)}
    errs = _refused(_graph({**many, **chain}, positive="57"))
    assert "at most 8" in str(errs) or "holds 9" in str(errs)


def test_a_combine_at_cfg_1_encodes_no_negative():
    g = _graph({"20": _text("a car"), "24": _combine("6", "20")}, positive="24")
    g["3"]["inputs"]["cfg"] = 1.0
    spec = parse_prompt_obj(_job(g).spec, resolution=SIZES)
    from orchestrator.engine.plan.build import entry_texts
    assert entry_texts(spec) == ("1girl, silver hair, (blue eyes:1.2)", "a car")


def test_object_info_lists_the_nodes_as_comfyui_declares_them():
    info = object_info(node_table())
    assert info["ConditioningCombine"]["input"]["required"] == {"conditioning_1": ["CONDITIONING"],
                                                                "conditioning_2": ["CONDITIONING"]}
    rng = info["ConditioningSetTimestepRange"]["input"]["required"]
    assert rng["start"] == ["FLOAT", {"min": 0.0, "max": 1.0, "step": 0.001, "default": 0.0}]
    assert rng["end"] == ["FLOAT", {"min": 0.0, "max": 1.0, "step": 0.001, "default": 1.0}]
    strength = info["ConditioningSetAreaStrength"]["input"]["required"]["strength"]
    assert strength == ["FLOAT", {"min": 0.0, "max": 10.0, "step": 0.01, "default": 1.0}]
    assert info["ConditioningCombine"]["output"] == ["CONDITIONING"] and "ConditioningConcat" not in info


def _hires_graph(first: str, second: str) -> dict:
    g = _graph({"20": _text("a car"), "24": _combine("6", "20"), "25": _combine("20", "6")})
    g["30"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["3", 0], "upscale_method": "nearest-exact",
                                                           "scale_by": 1.5}}
    g["31"] = {"class_type": "KSampler", "inputs": {**g["3"]["inputs"], "latent_image": ["30", 0], "denoise": 0.5}}
    g["8"]["inputs"]["samples"] = ["31", 0]
    g["3"]["inputs"]["positive"], g["31"]["inputs"]["positive"] = [first, 0], [second, 0]
    return g


def test_a_hires_graph_samples_both_passes_with_the_first_samplers_combined_conditioning():
    job = graph_to_job(_hires_graph("24", "24"), names=NAMES, sizes=[(128, 128), (192, 192)])
    assert [e["text"] for e in job.spec["positive"]] == ["1girl, silver hair, (blue eyes:1.2)", "a car"]
    assert "prompt" not in job.spec["hires"] and job.spec["hires"]["scale"] == 1.5
    spec = parse_prompt_obj(job.spec, resolution=[(128, 128), (192, 192)]).to_dict()
    for ids in (None, job.nodes):
        back = job_to_graph(spec, names=NAMES, ids=ids)
        first = next(k for k, n in back.items() if n["class_type"] == "KSampler" and n["inputs"]["denoise"] == 1.0)
        second = next(k for k, n in back.items() if n["class_type"] == "KSampler" and n["inputs"]["denoise"] == 0.5)
        assert back[second]["inputs"]["positive"] == back[first]["inputs"]["positive"]
        assert back[back[first]["inputs"]["positive"][0]]["class_type"] == "ConditioningCombine"
        assert graph_to_job(back, names=NAMES, sizes=[(128, 128), (192, 192)]).spec["positive"] == \
            job.spec["positive"]


@pytest.mark.parametrize("first,second,where,words", [
    ("24", "25", "31", "must be the first KSampler's"),          # its own combined conditioning
    ("6", "24", "31", "must be the first KSampler's"),
    ("24", "20", "20", "takes the first pass's"),               # a plain prompt of its own: hires.prompt refused
])
def test_a_hires_graph_with_its_own_conditioning_beside_a_combined_one_is_refused(first, second, where, words):
    with pytest.raises(GraphError) as e:
        graph_to_job(_hires_graph(first, second), names=NAMES, sizes=[(128, 128), (192, 192)])
    errs = e.value.body()["node_errors"]
    assert where in errs and words in str(errs[where]), errs


def test_a_zero_out_and_an_average_inside_a_combine_are_their_entries_and_built_back():
    """ConditioningZeroOut / ConditioningAverage under a Combine: the entry's zero_out / average (its own
    CLIPTextEncode as conditioning_from), each entry still its own pass; job -> graph gives the same entries."""
    g = _graph({"20": _text("a car"), "21": _text("a dog"),
                "22": {"class_type": "ConditioningAverage", "inputs": {"conditioning_to": ["20", 0],
                                                                       "conditioning_from": ["21", 0],
                                                                       "conditioning_to_strength": 0.6}},
                "23": _range("22", 0.5, 1.0), "24": _combine("6", "23"),
                "25": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["7", 0]}},
                "26": _combine("25", "21")}, positive="24", negative="26")
    job = _job(g)
    assert job.spec["positive"] == [{"text": "1girl, silver hair, (blue eyes:1.2)"},
                                    {"text": "a car", "zero_out": False, "average": {"text": "a dog", "weight": 0.6},
                                     "start": 0.5, "end": 1.0}]
    assert job.spec["negative"] == [{"text": "worst quality", "zero_out": True}, {"text": "a dog"}]
    assert job.nodes["positive_average1"] == "22" and job.nodes["positive_from1"] == "21"
    assert job.nodes["negative_zero0"] == "25" and job.nodes["negative_text1"] == "21"
    spec = parse_prompt_obj(job.spec, resolution=SIZES).to_dict()
    for ids in (None, job.nodes):
        back = _job(job_to_graph(spec, names=NAMES, ids=ids))
        assert (back.spec["positive"], back.spec["negative"]) == (job.spec["positive"], job.spec["negative"])
    from orchestrator.http.comfy_conditioning import entry_field_node
    assert entry_field_node(job.nodes, "positive[1].average.weight") == ("22", "conditioning_to_strength")
    assert entry_field_node(job.nodes, "positive[1].average.text") == ("21", "text")
    assert entry_field_node(job.nodes, "negative[0].zero_out") == ("25", "conditioning")


def test_a_zero_out_of_a_combined_conditioning_is_refused_on_its_node():
    errs = _refused(_graph({"20": _text("a car"), "24": _combine("6", "20"),
                            "25": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["24", 0]}}},
                           positive="25"))
    assert list(errs) == ["25"] and "takes a CLIPTextEncode" in str(errs["25"])
