"""prompt.json's conditioning entries (protocol/prompt.py CondEntry: ConditioningZeroOut, ConditioningAverage): what
is refused naming the field, how the resolved job reads, the plan's encode step and ENCODE carrying them."""
from __future__ import annotations

import pytest

from orchestrator.engine.plan.build import build_plan, cond_entries
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
from protocol import codec, messages as m

BASE = {"seed": 1, "width": 64, "height": 64}


@pytest.mark.parametrize("obj,field,words", [
    ({}, "prompt", "is required"),
    ({"positive": []}, "positive", "at least 1"),
    ({"positive": [{"text": str(k)} for k in range(9)]}, "positive", "at most 8"),
    # a second pass samples with the first pass's conditionings: its own prompt beside them is refused
    ({"positive": [{"text": "a"}, {"text": "b"}], "hires": {"prompt": "c"}}, "hires.prompt", "the first pass's"),
    ({"negative": [{"text": "n", "end": 0.5}], "prompt": "a", "hires": {"negative_prompt": "m"}},
     "hires.negative_prompt", "leave hires.prompt and hires.negative_prompt out"),
    # EasyCache keeps a difference per conditioning of ComfyUI's batch: refused with entries (LazyCache runs)
    ({"positive": [{"text": "a"}, {"text": "b"}], "cache": {"kind": "easycache"}}, "cache", "use LazyCache"),
    ({"positive": [{"text": "  "}]}, "positive[0].text", "must not be empty"),
    ({"prompt": "a", "positive": [{"text": "b"}]}, "prompt", "differs from positive[0].text"),
    ({"prompt": "a", "negative_prompt": "x", "negative": [{"text": "y", "zero_out": True}]}, "negative_prompt",
     "differs from negative[0].text"),
    ({"positive": [{"text": "a", "average": {"text": "b", "weight": 1.5}}]}, "positive[0].average.weight", "[0.0, 1.0]"),
    ({"positive": [{"text": "a", "average": {"weight": 0.5}}]}, "positive[0].average.text", "is required"),
    ({"positive": [{"text": "a", "average": {"text": "b\x00", "weight": 0.5}}]}, "positive[0].average.text", "NUL"),
    ({"positive": [{"text": "a", "zero": True}]}, "positive[0].zero", "unknown setting"),
    ({"prompt": "a", "negative": [{"text": "b", "zero_out": "yes"}]}, "negative[0].zero_out", "true or false"),
])
def test_a_bad_entry_is_refused_naming_its_field(obj, field, words):
    with pytest.raises(PromptError) as e:
        parse_prompt_obj({**BASE, **obj})
    assert e.value.field == field and words in str(e.value)


def test_the_job_reads_each_sides_text_from_its_entry():
    spec = parse_prompt_obj({**BASE, "positive": [{"text": "a cat", "average": {"text": "a dog", "weight": 0.3}}],
                             "negative": [{"text": "blurry", "zero_out": True}]})
    assert (spec.prompt, spec.negative_prompt) == ("a cat", "blurry")
    pos, neg = cond_entries(spec)
    assert pos.average.text == "a dog" and pos.average.weight == 0.3 and not pos.zero_out
    assert neg.zero_out and neg.average is None
    assert cond_entries(parse_prompt_obj({**BASE, "prompt": "a cat", "negative_prompt": "blurry"})) == (None, None)
    assert type(spec).from_dict(spec.to_dict()) == spec                 # job.json keeps them


def test_the_plans_encode_step_carries_them():
    spec = parse_prompt_obj({**BASE, "prompt": "a cat", "negative": [{"text": "blurry", "zero_out": True}]})
    step = build_plan(spec).steps[0]
    assert step.entries == cond_entries(spec) and step.name == "EncodeText[negative:zero_out]"
    assert build_plan(parse_prompt_obj({**BASE, "prompt": "a cat"})).steps[0].name == "EncodeText"


def test_encode_carries_the_entries_over_the_wire():
    spec = parse_prompt_obj({**BASE, "positive": [{"text": "a cat", "zero_out": True,
                                                   "average": {"text": "a dog", "weight": 0.25}}]})
    msg = m.Encode(job="j", prompt="a cat", prompt_entry=spec.positive[0])
    back = codec.decode(codec.encode(msg))
    assert back.prompt_entry == spec.positive[0] and back.negative_entry is None


def test_entries_that_each_take_a_pass_encode_each_distinct_conditioning_once():
    """A ZeroOut / Average inside several entries: each distinct (text, zero_out, average) is one ENCODE of its own
    (the text as the prompt, the entry with it; an empty negative), whatever its strength or window; the same text
    plain and zeroed out is two conditionings."""
    from orchestrator.engine.plan.build import entry_conds, entry_pair, prompt_pairs
    avg = {"text": "a dog", "weight": 0.25}
    spec = parse_prompt_obj({**BASE, "cfg": 4.0, "positive": [
        {"text": "a cat", "end": 0.5}, {"text": "a cat", "average": avg, "start": 0.5},
        {"text": "a cat", "average": avg, "strength": 2.0}], "negative": [
        {"text": "blurry", "zero_out": True}, {"text": "a cat"}]})
    conds = entry_conds(spec)
    assert [(c.text, c.zero_out, c.average and c.average.weight) for c in conds] == [
        ("a cat", False, None), ("a cat", False, 0.25), ("blurry", True, None)]
    assert all((c.strength, c.start, c.end) == (1.0, 0.0, 1.0) for c in conds)
    assert [entry_pair(c) for c in conds] == [(None, None), (conds[1], None), (conds[2], None)]
    plan = build_plan(spec)
    assert plan.steps[0].name == "EncodeText[entries]" and plan.steps[0].outputs[:3] == (
        "cond_entry.npy", "cond_entry_1.npy", "cond_entry_2.npy")
    size = (64, 64)
    assert [(p, n, e) for p, n, _, e in prompt_pairs(spec, {size: object()})] == [
        ("a cat", "", (None, None)), ("a cat", "", (conds[1], None)), ("blurry", "", (conds[2], None))]


def test_a_second_pass_reads_the_first_pass_entries():
    """hires with entries: no context of its own; its HiresDenoise reads the entries' files, as the first pass does."""
    spec = parse_prompt_obj({**BASE, "cfg": 4.0, "positive": [{"text": "a cat"}, {"text": "a dog", "start": 0.5}],
                             "hires": {"denoise": 0.5}})
    plan = build_plan(spec)
    files = ("cond_entry.npy", "cond_entry_1.npy", "cond_entry_2.npy", "cond_entries.json")
    assert [s.name for s in plan.steps] == ["EncodeText[entries]", "Denoise[0]", "HiresDenoise[0]", "Decode[0]",
                                            "Deliver", "Report"]
    assert plan.steps[0].outputs == files and plan.steps[2].inputs == (*files, "latent.npy")


def test_entries_on_a_long_context_pack_are_refused_at_the_way_in_naming_the_side():
    """The daemon's submit refuses them (orchestrator.engine.daemon._check_vae_size): the first pass's pack or the second
    pass's with more than 512 text rows; a job without entries, or on 512-row packs, is not refused."""
    from types import SimpleNamespace
    from orchestrator.engine.plan.build import entries_pack_refusal
    short, long = SimpleNamespace(text_tokens=512), SimpleNamespace(text_tokens=1024)
    mixed = parse_prompt_obj({**BASE, "negative": [{"text": "n", "end": 0.5}], "prompt": "a"})
    field, why = entries_pack_refusal(mixed, {(64, 64): long})
    assert field == "negative" and "the 64x64 pack has 1024" in why and "512 text rows" in why
    assert entries_pack_refusal(mixed, {(64, 64): short}) is None
    plain = parse_prompt_obj({**BASE, "prompt": "a"})
    assert entries_pack_refusal(plain, {(64, 64): long}) is None
    hires = parse_prompt_obj({**BASE, "positive": [{"text": "a"}, {"text": "b"}], "hires": {"scale": 1.5}})
    assert entries_pack_refusal(hires, {(64, 64): short, (96, 96): long})[0] == "positive"


def test_lazycache_runs_with_entries():
    spec = parse_prompt_obj({**BASE, "positive": [{"text": "a"}, {"text": "b", "start": 0.3}],
                             "cache": {"kind": "lazycache"}})
    assert spec.cache.kind == "lazycache" and build_plan(spec).steps[0].name == "EncodeText[entries]"
