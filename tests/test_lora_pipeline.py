"""LoRA through the real pipeline (supervisord, the REAL stages, the tiny bundle, a rank-12 LoRA-ready FP32 pack at
128x128): a job naming two LoRAs in prompt.json (kohya alpha != rank over the blocks, the host layers, the LLM adapter
and Qwen3; ComfyUI layout without alpha over the blocks and the adapter) gives the final latent of the same job
computed in process on a pack with those LoRAs baked in and the text encoder built from files with them merged; the
same LoRAs through A1111's txt2img `<lora:...>` tags and a ComfyUI graph with LoraLoader + LoraLoaderModelOnly give
that job again; the report and the PNG name them (A1111's `Lora hashes`, ComfyUI's loaders); a LoRA for a plain pack,
a malformed file and a name outside loras/ are refused at submit (naming the field, the pack and the fix) and the
daemon keeps serving."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from models.sampling.denoise import denoise, make_sampler, start_or_resume
from models.lora import LoraUse, TargetTable, plan_loras
from models.lora.merged_file import write_merged
from models.lora.synth import write_lora
from models.setup.models_dir import resolve_models
from models.packs.pack import build_pack, load_pack
from models.sampling.spectrum import SpectrumSettings
from orchestrator.terminal.cli import CliError
from protocol import messages as m
from protocol.prompt import PromptError, PromptFile
from tests.comfy_graphs import standard_graph
from tests.pipeline_harness import RESIDENT_EXECUTOR, Pipeline, reference_runner

THREADS = 1
RANK = 12                       # the pack's: the two LoRAs stack to 8 + 4 in the blocks both update
STYLE, EXTRA = "style.safetensors", "sub/extra.safetensors"
# strength_model, strength_clip of each (ComfyUI's LoraLoader; LoraLoaderModelOnly leaves the text encoder alone)
STRENGTHS = {STYLE: (0.8, 1.3), EXTRA: (-0.5, 0.0)}
PROMPT = {"prompt": "1girl, silver hair, (blue eyes:1.2)", "negative_prompt": "worst quality", "seed": 77,
          "steps": 3, "cfg": 4.0, "sampler": "euler", "scheduler": "simple", "spectrum": False}
LORAS = [{"name": n, "strength": s, "clip_strength": c} for n, (s, c) in STRENGTHS.items()]
JOB_TIMEOUT_S = 900.0


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def assets(tiny_bundle):
    """The tiny models folder with two LoRAs under loras/, a LoRA-ready FP32 pack (128x128), a plain one (128x96),
    and the reference: a pack with the LoRAs baked in and the text encoder's files with them merged. The models are
    the session's (hard links: the LoRAs go in this copy only)."""
    root = Path(tempfile.mkdtemp(prefix="anima-lora-e2e-"))
    try:
        models = root / "models"
        shutil.copytree(tiny_bundle, models, copy_function=os.link)
        paths = resolve_models(models, {}, need=("dit", "text_encoder", "qwen_tokenizer", "t5_tokenizer"))
        (models / "loras" / "sub").mkdir(parents=True)
        write_lora("tiny", 31, models / "loras" / STYLE, "kohya", rank=8, alpha=3.0,
                   groups=("blocks", "host", "adapter", "te"))
        write_lora("tiny", 32, models / "loras" / EXTRA, "comfy", rank=4, alpha=None, groups=("blocks", "adapter"))
        pack = build_pack(paths.dit, root / "pack-lora", (128, 128), "fp32", lora_rank=RANK)
        plain = build_pack(paths.dit, root / "pack-plain", (128, 96), "fp32")
        uses = [LoraUse(str(models / "loras" / n), s, c) for n, (s, c) in STRENGTHS.items()]
        baked = build_pack(paths.dit, root / "pack-baked", (128, 128), "fp32", loras=uses)
        from models.dit.checkpoint import DiTCheckpoint
        from models.base.safetensors_io import SafeTensorsFile
        ck, te = DiTCheckpoint.open(paths.dit), SafeTensorsFile(paths.text_encoder)
        plan = plan_loras(uses, TargetTable({k: ck.shape(k) for k in ck.keys()}, {k: te.shape(k) for k in te.keys()}))
        merged = {"dit": root / "dit+lora.safetensors", "te": root / "te+lora.safetensors"}
        write_merged(paths.dit, plan, merged["dit"])
        write_merged(paths.text_encoder, plan, merged["te"])
        layers = [r["layers"] for r in plan.report()]                    # {place: layers} per LoRA, in order
        yield {"models": models, "paths": paths, "pack": pack, "plain": plain, "baked": baked, "merged": merged,
               "layers": layers}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def pipe(assets):
    p = Pipeline.start(assets["models"], assets["pack"], threads=THREADS, packs=(assets["plain"],),
                       executor_toml=RESIDENT_EXECUTOR)       # the jobs' nine forwards
    try:
        yield p
    finally:
        p.stop_clean()


@pytest.fixture(scope="module")
def reference(assets):
    """The job in process on the merged models: contexts from the text encoder built from the merged files, the
    sampler over the baked pack (same seed, steps, CFG, schedule and threads as the pipeline's)."""
    from models.text.conditioning import TextEncoder
    p, mf = assets["paths"], assets["merged"]
    enc = TextEncoder.from_files(str(mf["te"]), str(mf["dit"]), str(p.qwen_tokenizer), str(p.t5_tokenizer),
                                 threads=THREADS)
    try:
        cond, uncond = enc.encode(PROMPT["prompt"]), enc.encode(PROMPT["negative_prompt"])      # [512, Dc] f32
    finally:
        enc.close()
    pack = load_pack(assets["baked"])
    g, c = pack.geometry, pack.config
    sampler = make_sampler(PROMPT["steps"], PROMPT["cfg"], PROMPT["scheduler"], SpectrumSettings(enabled=False))
    state = start_or_resume(sampler, PROMPT["seed"], (c.latent_channels, g.latent_h, g.latent_w))
    runner = reference_runner(pack, threads=THREADS)
    try:
        final = denoise(runner, sampler, state, cond, uncond)
    finally:
        runner.close()
    return {"cond": cond, "uncond": uncond, "latent": final.latent}


@pytest.fixture(scope="module")
def lora_job(pipe):
    job = pipe.submit({**PROMPT, "loras": LORAS})
    info = pipe.wait(job, ("done", "failed"), timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", (info.error_stage, info.error, pipe.logs())
    return job


def _short_hash(path: Path) -> str:
    """sha256 of a safetensors file's bytes after its header (u64 length + JSON), first 12 hex digits."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(data[8 + n:]).hexdigest()[:12]


def test_lora_job_equals_the_job_on_the_baked_pack_and_merged_encoder(pipe, assets, reference, lora_job):
    d = pipe.job_dir(lora_job)
    for name in ("cond", "uncond"):
        got, want = np.load(d / f"{name}.npy"), reference[name]
        assert _cos(got, want) >= 0.99999, name
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name
    latent = np.load(d / "latent.npy")                                  # [C, H/8, W/8] f32
    assert latent.shape == reference["latent"].shape
    cos = _cos(latent, reference["latent"])
    print(f"LoRA job vs the baked pack and merged encoder: final latent cos {cos:.9f}, max abs diff "
          f"{np.abs(latent - reference['latent']).max():.2e}")
    assert cos >= 0.99999
    # the LoRAs matter: the plain pack's job in process is far from it
    plain = load_pack(assets["pack"])
    g, c = plain.geometry, plain.config
    sampler = make_sampler(PROMPT["steps"], PROMPT["cfg"], PROMPT["scheduler"], SpectrumSettings(enabled=False))
    state = start_or_resume(sampler, PROMPT["seed"], (c.latent_channels, g.latent_h, g.latent_w))
    runner = reference_runner(plain, threads=THREADS)
    try:
        without = denoise(runner, sampler, state, reference["cond"], reference["uncond"]).latent
    finally:
        runner.close()
    assert _cos(without, reference["latent"]) < 0.9999


def test_lora_job_report_and_png_name_the_loras(pipe, assets, lora_job):
    rep = pipe.report(lora_job)
    by = {r["name"]: r for r in rep["loras"]}
    assert list(by) == [STYLE, EXTRA]
    assert [by[n]["layers"] for n in (STYLE, EXTRA)] == assets["layers"]
    assert set(by[STYLE]["layers"]) == {"branch", "host", "adapter", "te"} and set(by[EXTRA]["layers"]) == \
        {"branch", "adapter"}
    assert (by[STYLE]["strength"], by[STYLE]["clip_strength"]) == STRENGTHS[STYLE]
    assert by[STYLE]["applied_in"]["branch"].startswith("executor") and "rank 12" in by[STYLE]["applied_in"]["branch"]
    assert by[STYLE]["applied_in"]["host"].startswith("scheduler")
    assert by[STYLE]["applied_in"]["te"].startswith("encoder")
    assert "lora_s" in rep["encoder_timings"]
    hashes = {n: _short_hash(assets["models"] / "loras" / n) for n in STRENGTHS}
    assert by[STYLE]["short_hash"] == hashes[STYLE]
    im = Image.open(pipe.job_dir(lora_job) / "image.png")
    params = im.text["parameters"]
    first = params.split("\n")[0]
    assert first == PROMPT["prompt"] + " <lora:style:1.3:0.8> <lora:extra:0:-0.5>"
    assert f'Lora hashes: "style: {hashes[STYLE]}, extra: {hashes[EXTRA]}"' in params
    graph = json.loads(im.text["prompt"])
    loaders = {n["class_type"]: n["inputs"] for n in graph.values() if n["class_type"].startswith("LoraLoader")}
    assert loaders["LoraLoader"]["lora_name"] == STYLE and loaders["LoraLoader"]["strength_clip"] == 1.3
    assert loaders["LoraLoaderModelOnly"]["lora_name"] == EXTRA
    assert loaders["LoraLoaderModelOnly"]["strength_model"] == -0.5
    own = json.loads(im.text["anima"])
    assert [x["name"] for x in own["loras"]] == [STYLE, EXTRA]


def _lora_graph(url: str) -> dict:
    """The standard API graph with LoraLoader (model + CLIP) then LoraLoaderModelOnly between the loaders and the
    sampler, as ComfyUI's editor wires them."""
    names = requests.get(url + "object_info", timeout=30).json()
    assert names["LoraLoader"]["input"]["required"]["lora_name"][0] == [STYLE, EXTRA]    # /object_info lists them
    g = standard_graph(prompt=PROMPT["prompt"], negative=PROMPT["negative_prompt"], seed=PROMPT["seed"],
                       steps=PROMPT["steps"], cfg=PROMPT["cfg"], width=128, height=128,
                       names={"unet": names["UNETLoader"]["input"]["required"]["unet_name"][0][0],
                              "clip": names["CLIPLoader"]["input"]["required"]["clip_name"][0][0],
                              "vae": names["VAELoader"]["input"]["required"]["vae_name"][0][0]})
    g["3"]["inputs"]["scheduler"] = PROMPT["scheduler"]
    s, c = STRENGTHS[STYLE]
    g["20"] = {"inputs": {"lora_name": STYLE, "strength_model": s, "strength_clip": c, "model": ["12", 0],
                          "clip": ["11", 0]}, "class_type": "LoraLoader", "_meta": {"title": "Load LoRA"}}
    g["21"] = {"inputs": {"lora_name": EXTRA, "strength_model": STRENGTHS[EXTRA][0], "model": ["20", 0]},
               "class_type": "LoraLoaderModelOnly", "_meta": {"title": "LoraLoaderModelOnly"}}
    g["15"]["inputs"]["model"] = ["21", 0]
    for node in ("6", "7"):
        g[node]["inputs"]["clip"] = ["20", 1]
    return g


def test_comfy_graph_and_a1111_tags_give_the_same_job(pipe, lora_job):
    """ComfyUI's loaders and A1111's tags are two more ways to the same job: the same final latent."""
    want = np.load(pipe.job_dir(lora_job) / "latent.npy")
    url = pipe.http_url()
    page = requests.get(url + "anima/info", timeout=30).json()                # the web page's LoRA picker
    assert page["loras"] == [STYLE, EXTRA] and page["lora_ranks"] == {"128x128": RANK, "128x96": 0}
    r = requests.post(url + "prompt", json={"prompt": _lora_graph(url)}, timeout=60)
    assert r.status_code == 200, r.text
    comfy = r.json()["prompt_id"]
    s, c = STRENGTHS[STYLE]
    body = {"prompt": PROMPT["prompt"] + f"<lora:style:{c}:{s}><lora:extra:te=0:unet={STRENGTHS[EXTRA][0]}>",
            "negative_prompt": PROMPT["negative_prompt"], "seed": PROMPT["seed"], "steps": PROMPT["steps"],
            "cfg_scale": PROMPT["cfg"], "width": 128, "height": 128, "sampler_name": "Euler",
            "scheduler": PROMPT["scheduler"], "spectrum": False}
    r = requests.post(url + "sdapi/v1/txt2img", json=body, timeout=JOB_TIMEOUT_S)
    assert r.status_code == 200, r.text
    a1111 = json.loads(r.json()["info"])["extra_generation_params"]["Job"]
    info = pipe.wait(comfy, ("done", "failed"), timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", (info.error_stage, info.error)
    for job in (comfy, a1111):
        spec = json.loads((pipe.job_dir(job) / "job.json").read_text())["spec"]
        assert spec["prompt"] == PROMPT["prompt"]                               # A1111's tags left the text
        assert [(x["name"].split("/")[-1].split(".")[0], x["strength"], x["clip_strength"]) for x in spec["loras"]] \
            == [("style", s, c), ("extra", STRENGTHS[EXTRA][0], 0.0)]
        got = np.load(pipe.job_dir(job) / "latent.npy")
        assert _cos(got, want) >= 0.99999, job
    png = Image.open(io.BytesIO(__import__("base64").b64decode(r.json()["images"][0])))
    assert "Lora hashes: " in png.text["parameters"]


def _refused(pipe, prompt: dict) -> str:
    with pytest.raises((CliError, PromptError)) as e:           # the daemon's refusal, or the record's own
        pipe.client().call(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(pipe.root)), m.Submitted)
    return str(e.value)


def test_bad_loras_are_refused_at_submit_and_the_daemon_keeps_serving(pipe, assets, lora_job):
    plain = _refused(pipe, {**PROMPT, "height": 96, "loras": LORAS[:1]})
    assert "field 'loras'" in plain and str(assets["plain"].resolve()) in plain
    assert "--lora-rank" in plain and "--lora FILE:STRENGTH" in plain           # the two ways out
    loras = assets["models"] / "loras"
    cut = loras / "cut.safetensors"
    cut.write_bytes((loras / STYLE).read_bytes()[:1000])
    assert "loras[1]" in _refused(pipe, {**PROMPT, "loras": [LORAS[0], {"name": "cut.safetensors"}]})
    outside = _refused(pipe, {**PROMPT, "loras": [{"name": "../anima-tiny.safetensors"}]})
    assert "loras[0].name" in outside and "outside loras/" in outside
    assert "loras[0].name" in _refused(pipe, {**PROMPT, "loras": [{"name": "nothing-here"}]})
    assert "loras[0].strength" in _refused(pipe, {**PROMPT, "loras": [{"name": STYLE, "strength": 101}]})
    over = _refused(pipe, {**PROMPT, "loras": LORAS + [{"name": STYLE}]})      # 8 + 4 + 8 > 12 in the blocks
    assert "exceeds the pack's LoRA rank 12" in over
    cut.unlink()
    jobs = pipe.client().call(m.Status(), m.Jobs).jobs
    assert [j.job for j in jobs if j.state not in ("done",)] == []              # nothing was queued
    assert pipe.client().call(m.Info(), m.Pipeline).loras == (STYLE, EXTRA)
