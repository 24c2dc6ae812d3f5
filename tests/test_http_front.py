"""The HTTP front on the real pipeline (supervisord, the real stages, the tiny bundle at 128x128), driven by third-party
clients from the package index, unchanged: comfy-api-simplified (ComfyUI's API: POST /prompt, /ws, /history, /view)
and webuiapi (A1111's: /sdapi/v1/txt2img). Malformed requests to both APIs while a job runs all get a 4xx with a
message, queue nothing, and the job ends with the latent an undisturbed job of the same prompt gave."""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import requests
from PIL import Image

from protocol import messages as m
from tests.comfy_graphs import edited, standard_graph
from tests.pipeline_harness import Pipeline

JOB_S = 600.0
PROMPT, NEGATIVE, SEED, STEPS, CFG = "1girl, silver hair, (blue eyes:1.2)", "worst quality", 4321, 3, 4.0


@pytest.fixture(scope="module")
def pipe(board_pipeline):
    """The session's pipeline with the board's encoder and VAE: the front is the subject here, not the torch stages."""
    return board_pipeline


def url_of(p: Pipeline) -> str:
    return p.http_url()


def _names(url: str) -> dict:
    """The loader file names, read from /object_info as a ComfyUI client would."""
    deadline = time.monotonic() + 90
    while (r := requests.get(url + "object_info", timeout=30)).status_code == 503:   # the daemon not answering yet:
        assert time.monotonic() < deadline, r.text                                   # poll, as SwarmUI's liveness does
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    info = r.json()
    first = lambda cls, name: info[cls]["input"]["required"][name][0][0]  # noqa: E731
    return {"unet": first("UNETLoader", "unet_name"), "clip": first("CLIPLoader", "clip_name"),
            "vae": first("VAELoader", "vae_name")}


@pytest.fixture(scope="module")
def reference_job(pipe):
    """Job A: the standard Anima API graph through comfy-api-simplified, undisturbed. -> (job id, PNG bytes)."""
    from comfy_api_simplified import ComfyApiWrapper, ComfyWorkflowWrapper
    url = url_of(pipe)
    api = ComfyApiWrapper(url.rstrip("/"))
    graph = standard_graph(prompt=PROMPT, negative=NEGATIVE, seed=SEED, steps=STEPS, cfg=CFG, names=_names(url))
    wf = ComfyWorkflowWrapper(graph)
    wf.set_node_param("KSampler", "steps", STEPS)              # the client's own editing API works on our graph
    images = api.queue_and_wait_images(wf, "Save Image")
    assert list(images) == ["image.png"]
    job = pipe.client().call(m.Status(limit=1), m.Jobs).jobs[-1]
    assert job.state == "done"
    return job.job, images["image.png"]


def test_comfy_client_gets_the_image(pipe, reference_job):
    job, png = reference_job
    url = url_of(pipe)
    assert png == (pipe.job_dir(job) / "image.png").read_bytes()
    im = Image.open(io.BytesIO(png))
    assert im.size == (128, 128) and "parameters" in im.text and f"Seed: {SEED}" in im.text["parameters"]
    from comfy_api_simplified import ComfyApiWrapper
    api = ComfyApiWrapper(url.rstrip("/"))
    h = api.get_history(job)[job]
    assert h["status"]["status_str"] == "success" and h["outputs"]["9"]["images"][0]["subfolder"] == job
    assert api.get_image("image.png", job, "output") == png
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}
    assert set(api.get_object_info("KSampler")["KSampler"]["input"]["required"]) >= {"seed", "steps", "cfg"}
    device = api.get_system_stats()["devices"][0]
    assert device["name"].startswith("onnx") and device["type"] == "cpu"        # the backend says what it runs on
    assert api.get_embeddings() == []


def _malformed(url: str, job_dir_name: str) -> list[tuple[str, str, str, dict, tuple]]:
    """(name, method, path, request kwargs, accepted statuses): >= 30 bad requests over both APIs and the page's."""
    g = standard_graph(prompt=PROMPT, names=_names(url))
    big = {"prompt": "x", "pad": "y" * 300_000}
    deep = "[" * 200 + "]" * 200
    return [
        ("comfy not json", "POST", "prompt", {"data": b"{not json"}, (400,)),
        ("comfy empty body", "POST", "prompt", {"data": b""}, (400,)),
        ("comfy array", "POST", "prompt", {"json": [1, 2]}, (400,)),
        ("comfy no prompt", "POST", "prompt", {"json": {"client_id": "x"}}, (400,)),
        ("comfy prompt is text", "POST", "prompt", {"json": {"prompt": "a cat"}}, (400,)),
        ("comfy unknown node", "POST", "prompt", {"json": {"prompt": {**g, "20": {"class_type":
                                                                               "ControlNetApplyAdvanced",
                                                                               "inputs": {}}}}}, (400,)),
        ("comfy steps 0", "POST", "prompt", {"json": {"prompt": edited(g, "3", steps=0)}}, (400,)),
        ("comfy steps 10000", "POST", "prompt", {"json": {"prompt": edited(g, "3", steps=10000)}}, (400,)),
        ("comfy sampler", "POST", "prompt", {"json": {"prompt": edited(g, "3", sampler_name="deis")}}, (400,)),
        ("comfy size without pack", "POST", "prompt", {"json": {"prompt": edited(g, "5", width=512, height=512)}},
         (400,)),
        ("comfy denoise", "POST", "prompt", {"json": {"prompt": edited(g, "3", denoise=1.5)}}, (400,)),
        ("comfy batch", "POST", "prompt", {"json": {"prompt": edited(g, "5", batch_size=9)}}, (400,)),
        ("comfy missing input", "POST", "prompt", {"json": {"prompt": edited(g, "3", positive=...)}}, (400,)),
        ("comfy dangling link", "POST", "prompt", {"json": {"prompt": edited(g, "8", vae=["77", 0])}}, (400,)),
        ("comfy NaN", "POST", "prompt", {"data": json.dumps({"prompt": g}).replace('"cfg": 4.0', '"cfg": NaN')},
         (400,)),
        ("comfy long text", "POST", "prompt", {"json": {"prompt": edited(g, "6", text="x" * 5000)}}, (400,)),
        ("comfy client_id type", "POST", "prompt", {"json": {"prompt": g, "client_id": 12}}, (400,)),
        ("comfy too large", "POST", "prompt", {"json": big}, (413,)),
        ("comfy too deep", "POST", "prompt", {"data": deep}, (400,)),
        ("comfy bad utf-8", "POST", "prompt", {"data": b'{"prompt": "\xff\xfe"}'}, (400,)),
        ("view dotdot", "GET", "view", {"params": {"filename": "../../etc/passwd", "type": "output"}}, (400,)),
        ("view subfolder dotdot", "GET", "view", {"params": {"filename": "image.png", "subfolder": "../..",
                                                             "type": "output"}}, (400,)),
        ("view absolute", "GET", "view", {"params": {"filename": "/etc/passwd"}}, (400,)),
        ("view type input", "GET", "view", {"params": {"filename": "image.png", "subfolder": job_dir_name,
                                                       "type": "input"}}, (404,)),     # no such upload
        ("view type bogus", "GET", "view", {"params": {"filename": "image.png", "type": "models"}}, (400,)),
        ("upload not multipart", "POST", "upload/image", {"json": {"image": "x"}}, (400,)),
        ("view job.json", "GET", "view", {"params": {"filename": "job.json", "subfolder": job_dir_name}}, (404,)),
        ("view no filename", "GET", "view", {}, (404,)),
        ("history max_items", "GET", "history", {"params": {"max_items": "many"}}, (400,)),
        ("interrupt array", "POST", "interrupt", {"json": [1]}, (400,)),
        ("interrupt prompt_id type", "POST", "interrupt", {"json": {"prompt_id": 5}}, (400,)),
        ("ws long client id", "GET", "ws", {"params": {"clientId": "c" * 300}}, (400,)),
        ("cross origin", "POST", "prompt", {"json": {"prompt": g}, "headers": {"Origin": "http://evil.example"}},
         (403,)),
        ("queue delete not a list", "POST", "queue", {"json": {"delete": 5}}, (400,)),
        ("no such route", "GET", "nothing/here", {}, (404,)),
        ("a1111 not json", "POST", "sdapi/v1/txt2img", {"data": b"prompt=cat"}, (422,)),
        ("a1111 array", "POST", "sdapi/v1/txt2img", {"json": ["cat"]}, (422,)),
        ("a1111 batch", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "batch_size": 9}}, (422,)),
        ("a1111 hires", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "enable_hr": True}}, (422,)),
        ("a1111 sampler", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "sampler_name": "Restart"}},
         (422,)),
        ("a1111 scheduler", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "scheduler": "Polyexponential"}}, (422,)),
        ("a1111 steps text", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "steps": "many"}}, (422,)),
        ("a1111 steps 0", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "steps": 0}}, (422,)),
        ("a1111 seed -5", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "seed": -5}}, (422,)),
        ("a1111 cfg huge", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "cfg_scale": 1e9}}, (422,)),
        ("a1111 prompt number", "POST", "sdapi/v1/txt2img", {"json": {"prompt": 123}}, (422,)),
        ("a1111 empty prompt", "POST", "sdapi/v1/txt2img", {"json": {"prompt": " ", "width": 128, "height": 128}},
         (422,)),
        ("a1111 size without pack", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "width": 512,
                                                                           "height": 512}}, (422,)),
        ("a1111 sampler list", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "sampler_name": []}}, (422,)),
        ("a1111 send_images word", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "send_images": "maybe"}},
         (422,)),
        ("a1111 scripts", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "alwayson_scripts":
                                                                {"ControlNet": {"args": []}}}}, (422,)),
        ("a1111 styles", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "styles": ["anime"]}}, (422,)),
        ("a1111 override", "POST", "sdapi/v1/txt2img", {"json": {"prompt": "x", "override_settings":
                                                                 {"CLIP_stop_at_last_layers": 2}}}, (422,)),
        ("a1111 too large", "POST", "sdapi/v1/txt2img", {"json": big}, (413,)),
        ("page unknown field", "POST", "anima/jobs", {"json": {"prompt": "x", "bogus": 1}}, (400,)),
        ("page steps", "POST", "anima/jobs", {"json": {"prompt": "x", "steps": 0}}, (400,)),
        ("page cancel not an id", "POST", "anima/jobs/not-a-job/cancel", {}, (400,)),
        ("page cancel unknown", "POST", "anima/jobs/20000101-000000-abcdef/cancel", {}, (404,)),
        ("page jobs limit", "GET", "anima/jobs", {"params": {"limit": "0"}}, (400,)),
    ]


def test_a1111_client_and_malformed_requests_leave_the_job_alone(pipe, reference_job):
    import webuiapi
    url = url_of(pipe)
    ref_job, ref_png = reference_job
    sup_pids = {n: pipe.sup.info(n).pid for n in ("orchestrator", "scheduler", "executor", "http")}
    jobs_before = {j.job for j in pipe.client().call(m.Status(), m.Jobs).jobs}
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", scheduler="sgm_uniform")
    assert [m["name"] for m in api.get_samplers()][:7] == ["DPM++ 2M", "DPM++ SDE", "DPM++ 2M SDE", "DPM++ 2S a",
                                                           "DPM++ 3M SDE", "Euler a", "Euler"]
    assert api.util_get_model_names()[0].startswith("anima-tiny.safetensors")
    result = {}

    def run():
        try:
            result["r"] = api.txt2img(prompt=PROMPT, negative_prompt=NEGATIVE, seed=SEED, steps=STEPS, cfg_scale=CFG,
                                      width=128, height=128)
        except Exception as e:  # noqa: BLE001 - reported below
            result["e"] = e
    t = threading.Thread(target=run)
    t.start()
    # wait until job B runs, then send every malformed request while it does
    deadline = time.monotonic() + JOB_S
    while True:
        prog = api.get_progress()
        if prog["state"]["job"]:                     # running: encoding, denoising or decoding
            break
        assert time.monotonic() < deadline and t.is_alive(), result
        time.sleep(0.1)
    job = prog["state"]["job"]
    cases = _malformed(url, job)
    assert len(cases) >= 30
    failures = []
    for name, method, path, kw, ok in cases:
        r = requests.request(method, url + path, timeout=60, **kw)
        try:
            body = r.json()
            message = body.get("error") if isinstance(body, dict) else None
        except ValueError:
            body, message = r.text, None
        if r.status_code not in ok or not message:
            failures.append((name, r.status_code, str(body)[:200]))
    still = requests.get(url + "sdapi/v1/progress", timeout=30).json()["state"]["job"]
    t.join(JOB_S)
    assert not failures, failures
    assert still == job, "the job ended before every malformed request was sent: not a test of a running job"
    assert "e" not in result, result.get("e")
    r = result["r"]
    # webuiapi decoded our answer: a PNG of the pack's size, A1111's parameters and info
    assert r.image.size == (128, 128) and r.info["seed"] == SEED and r.info["all_seeds"] == [SEED]
    assert r.parameters["seed"] == SEED and r.parameters["steps"] == STEPS and r.info["infotexts"][0]
    raw = base64.b64decode(r.json["images"][0])
    assert raw == (pipe.job_dir(job) / "image.png").read_bytes()
    # job B ran to the end with the same latent (and image) as the undisturbed job A of the same prompt
    assert np.array_equal(np.load(pipe.job_dir(job) / "latent.npy"), np.load(pipe.job_dir(ref_job) / "latent.npy"))
    assert np.array_equal(np.asarray(r.image), np.asarray(Image.open(io.BytesIO(ref_png))))
    # nothing else was queued, no program was restarted
    jobs_after = {j.job for j in pipe.client().call(m.Status(), m.Jobs).jobs}
    assert jobs_after - jobs_before == {job}
    assert {n: pipe.sup.info(n).pid for n in sup_pids} == sup_pids


def test_a_comfy_hires_graph_runs_both_passes(pipe, reference_job):
    """KSampler -> LatentUpscaleBy 1.0 -> KSampler (denoise 0.5) through comfy-api-simplified: the graph front maps it
    onto prompt.json's hires, the real flow samples the second pass on the one (128x128) pack, and /history and the
    PNG keep the two-pass graph as sent (a second pack size would need a pipeline of its own: not here)."""
    from comfy_api_simplified import ComfyApiWrapper, ComfyWorkflowWrapper
    from tests.test_comfy_hires_graph import hires_graph
    url = url_of(pipe)
    names = _names(url)
    graph = hires_graph(scale_by=1.0)
    graph["5"]["inputs"].update(width=128, height=128)
    graph["3"]["inputs"]["steps"] = 1
    graph["51"]["inputs"]["steps"] = 2
    for node, key in (("12", "unet"), ("11", "clip"), ("13", "vae")):
        graph[node]["inputs"][f"{key}_name"] = names[key]
    api = ComfyApiWrapper(url.rstrip("/"))
    images = api.queue_and_wait_images(ComfyWorkflowWrapper(graph), "Save Image")
    job = pipe.client().call(m.Status(limit=1), m.Jobs).jobs[-1]
    assert job.state == "done", job
    jd = pipe.job_dir(job.job)
    assert images["image.png"] == (jd / "image.png").read_bytes()
    first, second = np.load(jd / "latent.npy"), np.load(jd / "hires_latent.npy")
    assert first.shape == second.shape and not np.array_equal(first, second)     # sampled again from the first
    report = json.loads((jd / "report.json").read_text())
    # both passes reported, one after the other: the first pass's one step, then the second pass's two
    assert [(p["pass"], p["computed_steps"]) for p in report["passes"]] == [("first", [1]), ("hires", [1, 2])]
    assert report["computed_steps"] == [1, 1, 2]
    im = Image.open(io.BytesIO(images["image.png"]))
    assert im.size == (128, 128) and "Hires upscale: 1.0, Hires steps: 2," in im.text["parameters"]
    sent = json.loads(im.text["prompt"])
    assert sent["51"]["inputs"]["latent_image"] == ["50", 0] and sent["50"]["class_type"] == "LatentUpscaleBy"
    assert api.get_history(job.job)[job.job]["prompt"][2]["51"]["class_type"] == "KSampler"


def test_swarm_protocol_client_gets_the_reference_image(pipe, reference_job):
    """The one real-pipeline check of the SwarmUI backend (the dispatch itself: tests/test_swarm_backend.py on
    stand-in stages): what SwarmUI's ComfyUI backend sends gets, for the same graph and seed, the pixels the
    reference job made on this front (the image a job gets does not depend on which client or backend sent it)."""
    from tests.swarm_client import SwarmComfy
    c = SwarmComfy(url_of(pipe).rstrip("/"), timeout_s=JOB_S)
    try:
        c.load_value_set()
        names = {"unet": c.models["Stable-Diffusion"][0], "clip": c.models["CLIP"][0], "vae": c.models["VAE"][0]}
        graph = standard_graph(prompt=PROMPT, negative=NEGATIVE, seed=SEED, steps=STEPS, cfg=CFG, names=names)
        [png] = c.generate(graph)
    finally:
        c.close()
    kinds = [k for k, _ in c.messages]
    assert kinds[0] == "execution_start" and "progress" in kinds and kinds[-2:] == ["execution_success", "executing"]
    pixels = lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))  # noqa: E731
    assert np.array_equal(pixels(png), pixels(reference_job[1]))
