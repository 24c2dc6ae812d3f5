"""One record of the sampling bounds (models/sampling/bounds.py): a value just past each bound is refused at every way
in, in prompt.json's words where the answer is ours (prompt.json, the page's form, an A1111 body), in ComfyUI's
node_errors where a graph breaks what our /object_info declares; the wire and a pack's record hold the same bounds."""
from __future__ import annotations

import pytest

from models.records.manifest import ManifestError, sampling_info
from models.sampling.bounds import CFG, STEPS
from orchestrator.http.comfy_graph import GraphError, graph_to_job
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from orchestrator.http.a1111 import hires_of, to_spec
from orchestrator.http.common import BadRequest
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
from protocol import messages as m
from protocol.fields import ProtocolError
from tests.comfy_graphs import TINY_NAMES, edited, standard_graph

# (prompt.json's field, A1111's field, KSampler's input, value just past the bound, prompt.json's words for it)
PAST = [("steps", "steps", "steps", STEPS.hi + 1, f"must be in {STEPS.lo}..{STEPS.hi}, got {STEPS.hi + 1}"),
        ("steps", "steps", "steps", STEPS.lo - 1, f"must be in {STEPS.lo}..{STEPS.hi}, got {STEPS.lo - 1}"),
        ("cfg", "cfg_scale", "cfg", CFG.hi + 0.5, f"must be in [{CFG.lo}, {CFG.hi}], got {CFG.hi + 0.5}"),
        ("cfg", "cfg_scale", "cfg", CFG.lo - 0.5, f"must be in [{CFG.lo}, {CFG.hi}], got {CFG.lo - 0.5}")]
IDS = ["steps-high", "steps-low", "cfg-high", "cfg-low"]


def test_the_bounds_are_the_ones_documented():
    assert (STEPS, CFG) == ((1, 200), (1.0, 30.0))
    docs = open("docs/prompts.md", encoding="utf-8").read()
    assert "| `steps` | integer in 1..200 |" in docs and "| `cfg` | number in [1, 30] |" in docs


@pytest.mark.parametrize("field, _a, _k, value, words", PAST, ids=IDS)
def test_prompt_json_and_the_page_refuse_past_a_bound(field, _a, _k, value, words):
    """The page's form is a prompt.json object (orchestrator/http/page.py): the daemon checks both the same way."""
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({"prompt": "a", field: value})
    assert (e.value.field, e.value.detail) == (field, words)
    if value > 0:                                   # hires' steps 0 means the job's own
        with pytest.raises(PromptError) as e:
            parse_prompt_obj({"prompt": "a", "hires": {"scale": 1.5, field: value}})
        assert (e.value.field, e.value.detail) == (f"hires.{field}", _hires_words(field, words))


def _hires_words(field: str, words: str) -> str:
    return words.replace(f"{STEPS.lo}..", "0..") if field == "steps" else words


@pytest.mark.parametrize("field, a1111, _k, value, words", PAST, ids=IDS)
def test_a1111_refuses_past_a_bound_in_the_same_words(field, a1111, _k, value, words):
    with pytest.raises(BadRequest) as e:
        to_spec({"prompt": "a", a1111: value})
    assert e.value.status == 422 and (e.value.body["field"], e.value.body["detail"]) == (a1111, words)
    hr_field = {"steps": "hr_second_pass_steps", "cfg": "hr_cfg"}[field]
    if value > 0:
        body = {"prompt": "a", "enable_hr": True, "hr_scale": 1.5, hr_field: value}
        with pytest.raises(BadRequest) as e:
            hires_of(body, to_spec(body))
        assert (e.value.body["field"], e.value.body["detail"]) == (hr_field, _hires_words(field, words))


@pytest.mark.parametrize("_f, _a, node_input, value, _w", PAST, ids=IDS)
def test_a_comfy_graph_past_a_bound_gets_comfyuis_node_errors(_f, _a, node_input, value, _w):
    """ComfyUI refuses a value past what its /object_info declares with value_bigger_than_max/smaller_than_min; ours
    declares our bounds and answers the same way."""
    declared = object_info(node_table())["KSampler"]["input"]["required"][node_input][1]
    assert (declared["min"], declared["max"]) == (STEPS if node_input == "steps" else CFG)
    names = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],))
    with pytest.raises(GraphError) as e:
        graph_to_job(edited(standard_graph(), "3", **{node_input: value}), names=names, sizes=[(128, 128)])
    errors = e.value.node_errors["3"]["errors"]
    kind = "value_bigger_than_max" if value > declared["max"] else "value_smaller_than_min"
    assert [x["type"] for x in errors] == [kind] and node_input in errors[0]["details"]


@pytest.mark.parametrize("field, _a, _k, value, _w", PAST, ids=IDS)
def test_the_wire_and_a_packs_record_hold_the_same_bounds(field, _a, _k, value, _w):
    ok = {"seed": 1, "steps": 20, "cfg": 4.0, "width": 64, "height": 64}
    m.DenoiseParams(**ok)
    with pytest.raises(ProtocolError) as e:
        m.DenoiseParams(**{**ok, field: value})
    assert e.value.field == field
    record = {"steps": 20, "cfg": 4.0, "sampler": "euler", "scheduler": "simple"}
    m.SamplingRef(**record)
    with pytest.raises(ProtocolError):
        m.SamplingRef(**{**record, field: value})
    assert sampling_info({"sampling": record})
    with pytest.raises(ManifestError, match=field):
        sampling_info({"sampling": {**record, field: value}})
