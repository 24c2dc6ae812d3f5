"""The PNG's text chunks as other tools read them: ComfyUI's `prompt` (API graph) and `workflow` (editor graph), parsed
here as ComfyUI's front end parses them (tests/comfy_png.py); A1111's `parameters`; the project's own `anima`."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from models.vae.png import write_png
from orchestrator.http.comfy_graph import ModelNames, graph_to_job
from orchestrator.http.comfy_workflow import api_to_workflow
from orchestrator.engine.prompt_spec import parse_prompt_obj
from orchestrator.http.png_formats import png_metadata
from protocol import codec
from protocol import messages as m
from protocol.tensors import TensorDesc
from tests.comfy_graphs import standard_graph
from tests.comfy_png import check_workflow, read_comfy_png

PACK = SimpleNamespace(width=256, height=128, source_name="anima-preview.safetensors", source_sha256="ab" * 32)
NAMES = ModelNames(unet=("anima-preview.safetensors",), clip=("qwen_3_06b_base.safetensors",),
                   vae=("qwen_image_vae.safetensors",))


def _png(tmp_path, spec, names=NAMES, job="20260101-000000-abcdef"):
    meta = png_metadata(spec, PACK, job, names)
    path = tmp_path / "image.png"
    write_png(path, np.zeros((PACK.height, PACK.width, 3), np.uint8), meta)
    return meta, read_comfy_png(path.read_bytes())


def test_comfyui_loads_this_job_from_the_png(tmp_path):
    spec = parse_prompt_obj({"prompt": "1girl, (silver hair:1.2), \"quoted\" \\ back", "negative_prompt": "worst",
                             "seed": 2**63 + 5, "steps": 28, "cfg": 4.5, "scheduler": "simple"},
                            resolution=(256, 128))
    meta, png = _png(tmp_path, spec)
    assert set(png["texts"]) == {"parameters", "prompt", "workflow", "anima"}
    assert png["dropped"] == "workflow"                           # ComfyUI takes the editor graph first
    assert {png["kinds"][k] for k in ("prompt", "workflow", "anima")} == {"tEXt"}   # ASCII JSON, as SaveImage writes
    # the API graph is this job: ComfyUI's graph -> our job gives every field back
    job = graph_to_job(png["prompt"], names=NAMES, sizes=[(256, 128)])
    assert job.spec == {"prompt": spec.prompt, "negative_prompt": "worst", "seed": 2**63 + 5, "steps": 28,
                        "cfg": 4.5, "width": 256, "height": 128, "sampler": "euler", "scheduler": "simple",
                        "spectrum": spec.spectrum.to_dict()}       # prompt.json's default: on, as its own node
    loaders = {n["class_type"]: n["inputs"] for n in png["prompt"].values()}
    assert loaders["UNETLoader"]["unet_name"] == "anima-preview.safetensors"
    assert loaders["CLIPLoader"]["clip_name"] == "qwen_3_06b_base.safetensors"
    assert loaders["VAELoader"]["vae_name"] == "qwen_image_vae.safetensors"
    # the editor graph: KSampler's widgets as the editor saves them, the seed control right after the seed
    ks = next(n for n in png["workflow"]["nodes"] if n["type"] == "KSampler")
    assert ks["widgets_values"] == [2**63 + 5, "fixed", 28, 4.5, "euler", "simple", 1.0]
    assert [i["name"] for i in ks["inputs"]] == ["model", "positive", "negative", "latent_image"]
    # A1111's line and the project's own fields
    assert png["texts"]["parameters"].startswith(spec.prompt + "\nNegative prompt: worst\nSteps: 28, ")
    assert f"Seed: {2**63 + 5}" in png["texts"]["parameters"] and "Size: 256x128" in png["texts"]["parameters"]
    own = json.loads(png["texts"]["anima"])
    assert (own["job"], own["seed"], own["model_sha256"], own["latent_space"]) == (
        "20260101-000000-abcdef", 2**63 + 5, "ab" * 32, "model")
    assert "SaveLatent" in own["latent_note"] and own["spectrum"]["enabled"] is True


def test_unknown_loader_names_stay_empty(tmp_path):
    spec = parse_prompt_obj({"prompt": "a", "seed": 1}, resolution=(256, 128))
    _, png = _png(tmp_path, spec, names=None)
    loaders = {n["class_type"]: n["inputs"] for n in png["prompt"].values()}
    assert loaders["UNETLoader"]["unet_name"] == "anima-preview.safetensors"    # the pack's checkpoint
    assert loaders["VAELoader"]["vae_name"] == ""


def test_longest_prompts_fit_the_decode_message(tmp_path):
    """4000 astral characters (12 ASCII characters each in JSON) in both prompts: the chunks still travel in DECODE
    and come back whole."""
    text = "\U0001F338" * 4000
    spec = parse_prompt_obj({"prompt": text, "negative_prompt": text, "seed": 3}, resolution=(256, 128))
    meta = png_metadata(spec, PACK, "j", NAMES)
    assert len(meta["workflow"]) > 96_000
    msg = m.Decode(job="j", latent=TensorDesc("f32", (16, 16, 32), slot="latent"), arena="a", output="/tmp/x.png",
                   metadata=meta)
    back = codec.decode(codec.encode(msg))
    assert back.metadata == meta
    _, png = _png(tmp_path, spec)
    assert graph_to_job(png["prompt"], names=NAMES).spec["prompt"] == text


@pytest.mark.parametrize("shift_node,latent", [(True, "EmptySD3LatentImage"), (False, "EmptyLatentImage")])
def test_a_clients_graph_as_a_workflow(shift_node, latent):
    """Graphs as ComfyUI clients send them (their node ids, ModelSamplingAuraFlow, the SD3 latent) convert too."""
    graph = standard_graph(shift_node=shift_node, latent=latent)
    wf = api_to_workflow(graph)
    check_workflow(json.loads(json.dumps(wf)), graph)
    assert wf["last_node_id"] == max(int(k) for k in graph)
    orders = {n["id"]: n["order"] for n in wf["nodes"]}
    for _, src, _, dst, _, _ in wf["links"]:
        assert orders[src] < orders[dst]                          # sources run first


def test_the_checker_catches_a_broken_workflow():
    graph = standard_graph()
    wf = api_to_workflow(graph)
    wf["links"][0][2] = 1                                          # an output slot the source does not have
    with pytest.raises((AssertionError, IndexError)):
        check_workflow(wf, graph)
    wf = api_to_workflow(graph)
    next(n for n in wf["nodes"] if n["type"] == "KSampler")["widgets_values"][2] = 99    # steps differ
    with pytest.raises(AssertionError):
        check_workflow(wf, graph)


def test_a_comfyui_clients_graph_is_kept_as_sent(tmp_path):
    """A job from ComfyUI's API: the PNG holds the client's own graph (its ids, titles, ModelSamplingAuraFlow), as
    ComfyUI would; its workflow matches it."""
    graph = standard_graph(prompt="a fox", seed=99, steps=3, width=256, height=128)
    job = graph_to_job(graph, sizes=[(256, 128)])
    spec = parse_prompt_obj(job.spec, resolution=(256, 128))
    meta = png_metadata(spec, PACK, "j", NAMES, graph=graph)
    path = tmp_path / "c.png"
    write_png(path, np.zeros((128, 256, 3), np.uint8), meta)
    png = read_comfy_png(path.read_bytes())
    assert png["prompt"] == graph
    assert {n["type"] for n in png["workflow"]["nodes"]} >= {"ModelSamplingAuraFlow", "EmptySD3LatentImage"}
    # an extra node no output needs, with a link to nowhere (ComfyUI does not check it): kept in the prompt, its
    # dangling link left out of the editor graph, nothing raised
    odd = dict(graph, **{"50": {"class_type": "VAEDecode", "inputs": {"samples": ["77", 0], "vae": ["13", 0]},
                                "_meta": {"title": "spare"}}})
    meta = png_metadata(spec, PACK, "j", NAMES, graph=odd)
    wf = json.loads(meta["workflow"])
    assert json.loads(meta["prompt"]) == odd and len(wf["links"]) == len(api_to_workflow(graph)["links"]) + 1
    # a sent graph too large for a DECODE text value: the job's own graph instead
    huge = dict(graph, **{str(1000 + i): {"class_type": "CLIPTextEncode", "inputs": {"text": "x" * 4000,
                                                                                   "clip": ["11", 0]},
                                          "_meta": {"title": "t"}} for i in range(80)})
    meta = png_metadata(spec, PACK, "j", NAMES, graph=huge)
    assert len(json.loads(meta["prompt"])) == 9 and len(meta["prompt"]) < m.MAX_PNG_TEXT_CHARS


def test_a_jobs_loras_in_every_chunk(tmp_path):
    """A1111's tags after the prompt and `Lora hashes` (the stem and its short hash, as A1111 writes them, in the
    job's order), ComfyUI's loaders in the graph (a ComfyUI client loads the job with them), the project's record."""
    spec = parse_prompt_obj({"prompt": "1girl", "seed": 3, "loras": [
        {"name": "styles/ink.safetensors", "strength": 0.8, "clip_strength": 1.2},
        {"name": "body.safetensors", "strength": -0.5, "clip_strength": 0.0}]}, resolution=(256, 128))
    hashes = {"styles/ink.safetensors": "0123456789ab", "body.safetensors": "ba9876543210"}
    meta = png_metadata(spec, PACK, "j", NAMES, lora_hashes=hashes)
    lines = meta["parameters"].split("\n")
    assert lines[0] == "1girl <lora:ink:1.2:0.8> <lora:body:0:-0.5>"
    assert ', Lora hashes: "ink: 0123456789ab, body: ba9876543210", ' in lines[2]
    names = ModelNames(unet=NAMES.unet, clip=NAMES.clip, vae=NAMES.vae,
                       lora=("body.safetensors", "styles/ink.safetensors"))
    back = graph_to_job(json.loads(meta["prompt"]), names=names, sizes=[(256, 128)])
    assert back.spec["loras"] == [{"name": "styles/ink.safetensors", "strength": 0.8, "clip_strength": 1.2},
                                  {"name": "body.safetensors", "strength": -0.5, "clip_strength": 0.0}]
    own = json.loads(meta["anima"])["loras"]
    assert [(x["name"], x["clip_strength"], x["short_hash"]) for x in own] == \
        [("styles/ink.safetensors", 1.2, "0123456789ab"), ("body.safetensors", 0.0, "ba9876543210")]
    plain = png_metadata(parse_prompt_obj({"prompt": "1girl", "seed": 3}, resolution=(256, 128)), PACK, "j", NAMES)
    assert "Lora hashes" not in plain["parameters"] and json.loads(plain["anima"])["loras"] == []


# A1111's reading of `parameters` (stable-diffusion-webui, modules/infotext_utils.py, parse_generation_parameters;
# written here from its documented behaviour): the text is stripped and split at "\n"; the last line is the
# parameters when it holds at least 3 `Key: value` pairs; every other line is stripped, and from the first one that
# then begins with "Negative prompt:" (that prefix cut off) on, lines belong to the negative prompt; a value in
# double quotes is JSON.
A1111_PAIR = __import__("re").compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def a1111_parse(text: str) -> dict:
    *lines, last = text.strip().split("\n")
    if len(A1111_PAIR.findall(last)) < 3:
        lines, last = lines + [last], ""
    prompt, negative, in_negative = [], [], False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for k, v in A1111_PAIR.findall(last):
        out[k] = json.loads(v) if len(v) > 1 and v[0] == v[-1] == '"' else v
    return out


def test_a1111_reads_the_prompts_and_settings_back_whole():
    """A prompt holding "\\nNegative prompt: ...\\nSteps: 99, ..." made A1111's parser report another prompt and
    negative split (and other steps). Each text keeps its lines; a line A1111 would take for the start of the
    negative prompt has its first letter lowered, the only change; a model name with commas or colons is quoted as
    A1111 quotes values."""
    prompt = "1girl, silver hair\nNegative prompt: a trap\n  Negative prompt:also\nSteps: 99, Sampler: x, Seed: 1"
    negative = "worst quality\nNegative prompt: twice\n\nlowres"
    spec = parse_prompt_obj({"prompt": prompt, "negative_prompt": negative, "seed": 42, "steps": 7, "cfg": 4.5},
                            resolution=(256, 128))
    pack = SimpleNamespace(**{**vars(PACK), "source_name": "my, model: v2.safetensors"})
    got = a1111_parse(png_metadata(spec, pack, "j", NAMES)["parameters"])
    lowered = lambda t: "\n".join(("n" + ln.strip()[1:]) if ln.strip().startswith("Negative prompt:") else ln.strip()
                                  for ln in t.split("\n"))  # noqa: E731
    assert got["Prompt"] == lowered(prompt) and got["Negative prompt"] == lowered(negative)
    assert (got["Steps"], got["Seed"], got["CFG scale"], got["Size"]) == ("7", "42", "4.5", "256x128")
    assert got["Model"] == "my, model: v2.safetensors" and got["Model hash"] == "ab" * 5
    for p, n in (("Negative prompt: first line", ""), ("x", ""), ("plain", "Negative prompt: x")):
        spec = parse_prompt_obj({"prompt": p, "negative_prompt": n, "seed": 1}, resolution=(256, 128))
        got = a1111_parse(png_metadata(spec, PACK, "j", NAMES)["parameters"])
        assert (got["Prompt"], got["Negative prompt"], got["Seed"]) == (lowered(p), lowered(n), "1"), (p, n)


def test_the_engine_writes_its_own_chunk_and_the_formats_it_is_handed(monkeypatch, tmp_path):
    """The engine (orchestrator.engine.png_text) knows no front's vocabulary: with no formats a PNG has only `anima`; the
    formats come in the order handed; and `orchestrator serve` hands the daemon the fronts' PNG_FORMATS."""
    from orchestrator.terminal import cli
    from orchestrator.engine import daemon
    from orchestrator.http.png_formats import PNG_FORMATS
    from orchestrator.engine.png_text import ImageText, png_text
    spec = parse_prompt_obj({"prompt": "a", "seed": 1}, resolution=(256, 128))
    image = ImageText(spec, PACK, "j")
    assert list(png_text((), image)) == ["anima"]
    assert png_text(PNG_FORMATS, image) == png_metadata(spec, PACK, "j")
    assert list(png_text(PNG_FORMATS, image)) == ["parameters", "prompt", "workflow", "anima"]
    handed = []
    monkeypatch.setattr(daemon, "serve", lambda rf, config, formats=(): handed.append(formats) or 0)
    assert cli.main(["--run", str(tmp_path), "serve", "--config", str(tmp_path / "pipeline.toml")]) == 0
    assert handed == [PNG_FORMATS]
