"""The HTTP front over the real daemon and supervisord with stand-in stages (tests/orch_doubles.py: jobs in well under
a second), two fake packs: ComfyUI's WebSocket messages and /history, /queue, /view shapes; several sizes in one run
folder; interrupt; the queue limit; a daemon that is down is 503; STATUS detail/paging and INFO."""
from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import websocket
from PIL import Image

from orchestrator.http.comfy_graph import CANONICAL_IDS
from tests.comfy_graphs import standard_graph
from tests.doubles_harness import SOURCE, Doubles
from tests.signals import signal_process

SIZES = [(64, 64), (64, 32)]
NAMES = {"unet": SOURCE["name"], "clip": "any-te.safetensors", "vae": "any-vae.safetensors"}


@pytest.fixture(scope="module")
def doubles():
    root = Path(tempfile.mkdtemp(prefix="anima-httpd-"))
    d = Doubles.start(root, SIZES)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def d(doubles):
    doubles.flag("double_step_s", None)
    yield doubles


def graph(**kw) -> dict:
    return standard_graph(**{"width": 64, "height": 64, "steps": 3, "names": NAMES, **kw})


IDLE_STATUS = {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}}   # to every client


class Listener:
    """A raw ComfyUI WebSocket client (websocket-client) collecting every message on a thread."""

    def __init__(self, url: str, client_id: str):
        self.ws = websocket.create_connection(url.replace("http://", "ws://") + f"ws?clientId={client_id}",
                                              timeout=60)
        self.messages: list[dict] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            while True:
                self.messages.append(json.loads(self.ws.recv()))
        except Exception:  # noqa: BLE001 - closed
            pass

    def wait(self, pred, timeout_s=60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in list(self.messages):
                if pred(msg):
                    return msg
            time.sleep(0.02)
        raise AssertionError(f"no such message in {timeout_s} s; got {[m['type'] for m in self.messages]}")

    def close(self):
        self.ws.close()


def test_comfy_messages_history_queue_and_view(d):
    url = d.http_url()
    ws = Listener(url, "client-a")
    try:
        first = ws.wait(lambda m: m["type"] == "status")
        assert first["data"] == {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "client-a"}
        d.flag("double_step_s", "0.3")
        g = graph()
        r = requests.post(url + "prompt", json={"prompt": g, "client_id": "client-a"}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        job = body["prompt_id"]
        assert body["node_errors"] == {} and isinstance(body["number"], int)
        # while it runs: /queue holds it with the graph as sent, /prompt counts it
        ws.wait(lambda m: m["type"] == "progress")
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [job] and q["queue_pending"] == []
        number, pid, prompt, extra, outputs = q["queue_running"][0]
        assert prompt == g and extra == {"client_id": "client-a"} and outputs == ["9"]
        assert requests.get(url + "api/prompt", timeout=30).json() == {"exec_info": {"queue_remaining": 1}}
        assert requests.get(url + f"history/{job}", timeout=30).json() == {}      # not finished: no history yet
        end = ws.wait(lambda m: m["type"] == "executing" and m["data"]["node"] is None)
        assert end["data"]["prompt_id"] == job
        # the queue's new count comes last, after the same look's end messages: wait for it before closing
        ws.wait(lambda m: m == IDLE_STATUS)
    finally:
        ws.close()
    seq = [(m["type"], m["data"].get("node")) for m in ws.messages if m["data"].get("prompt_id") == job]
    kinds = [k for k, _ in seq]
    # the order ComfyUI sends them in, with the client's own node ids
    assert kinds[:2] == ["execution_start", "execution_cached"]
    executing = [n for k, n in seq if k == "executing"]
    assert executing == ["6", "3", "8", "9", None], seq
    assert kinds.index("executed") < kinds.index("execution_success") < len(kinds) - 1
    progress = [m["data"] for m in ws.messages if m["type"] == "progress"]
    assert [p["value"] for p in progress] == sorted(p["value"] for p in progress) and progress[-1]["max"] == 3
    assert all(p["node"] == "3" and p["prompt_id"] == job for p in progress)
    executed = next(m["data"] for m in ws.messages if m["type"] == "executed")
    assert executed == {"node": "9", "display_node": "9", "prompt_id": job,
                        "output": {"images": [{"filename": "image.png", "subfolder": job, "type": "output"}]}}
    assert ws.messages[-1] == IDLE_STATUS
    assert any(m["type"] == "anima.progress" and m["data"]["job"] == job for m in ws.messages)
    # history and view, with and without /api
    h = requests.get(url + f"api/history/{job}", timeout=30).json()
    entry = h[job]
    assert entry["prompt"][1] == job and entry["prompt"][2] == g and entry["prompt"][4] == ["9"]
    assert entry["outputs"] == {"9": {"images": [{"filename": "image.png", "subfolder": job, "type": "output"}]}}
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert [m[0] for m in entry["status"]["messages"]] == ["execution_start", "execution_success"]
    assert job in requests.get(url + "history?max_items=5", timeout=30).json()
    img = requests.get(url + "view", params={"filename": "image.png", "subfolder": job, "type": "output"}, timeout=30)
    assert img.status_code == 200 and img.headers["Content-Type"] == "image/png"
    assert img.content == (d.rf.jobs / job / "image.png").read_bytes()


def test_sizes_pick_their_pack(d):
    """A job runs on the pack of its size (the doubles' latent and PNG follow the pack's geometry); a size without a
    pack is refused at submit naming the sizes there are."""
    url = d.http_url()
    info = requests.get(url + "anima/info", timeout=30).json()
    assert info["sizes"] == [[64, 64], [64, 32]]
    jobs = {}
    for w, h in SIZES:
        r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "seed": 1, "steps": 2, "width": w,
                                                    "height": h}, timeout=30)
        assert r.status_code == 200, r.text
        jobs[(w, h)] = r.json()["job"]
    r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "steps": 2}, timeout=30)
    jobs["default"] = r.json()["job"]
    for size, job in jobs.items():
        assert d.wait(job).state == "done"
        w, h = (64, 64) if size == "default" else size
        assert np.load(d.rf.jobs / job / "latent.npy").shape == (16, h // 8, w // 8)
        assert Image.open(d.rf.jobs / job / "image.png").size == (w, h)
    r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "width": 128, "height": 128}, timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "width"
    assert "128x128 has no model pack; the sizes with a pack: 64x64, 64x32" in r.json()["error"]
    g = graph(width=128, height=128)
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 400
    err = r.json()["node_errors"]["5"]["errors"][0]
    assert "128x128 has no model pack" in err["details"] and "64x64, 64x32" in err["details"]


def test_interrupt_and_the_queue_limit(d):
    url = d.http_url()
    d.flag("double_step_s", "5")
    ws = Listener(url, "client-i")
    try:
        job = requests.post(url + "prompt", json={"prompt": graph(), "client_id": "client-i"}, timeout=30).json()
        job = job["prompt_id"]
        ws.wait(lambda m: m["type"] == "progress" and m["data"]["prompt_id"] == job)
        # a second one waits; A1111 progress reports the running one, counted as its own request (one image, one
        # pass), as A1111's state counts only the running request
        queued = requests.post(url + "prompt", json={"prompt": graph(seed=9)}, timeout=30).json()["prompt_id"]
        p = requests.get(url + "sdapi/v1/progress", timeout=30).json()
        assert p["state"]["job"] == job and (p["state"]["job_no"], p["state"]["job_count"]) == (0, 1)
        assert 0 < p["progress"] < 1
        # interrupt names another prompt: nothing happens
        assert requests.post(url + "interrupt", json={"prompt_id": queued}, timeout=30).status_code == 200
        assert d.status(job=job).jobs[0].state == "denoising"
        assert requests.post(url + "interrupt", timeout=30).status_code == 200
        msg = ws.wait(lambda m: m["type"] == "execution_interrupted")
        assert msg["data"]["prompt_id"] == job and msg["data"]["node_id"] == "3"
        assert msg["data"]["node_type"] == "KSampler"
        ws.wait(lambda m: m["type"] == "executing" and m["data"]["node"] is None)
        h = requests.get(url + f"history/{job}", timeout=30).json()[job]
        assert h["status"]["status_str"] == "error" and h["outputs"] == {}
        assert h["status"]["messages"][-1][0] == "execution_interrupted"
        # A1111 interrupt: the queued one is now running and gets cancelled
        d.wait(queued, ("denoising",))
        assert requests.post(url + "sdapi/v1/interrupt", timeout=30).json() == {}
        assert d.wait(queued).state == "cancelled"
    finally:
        ws.close()
        d.flag("double_step_s", None)
    # the queue limit (16 queued or running jobs) holds through the front: 429, nothing more queued
    d.flag("double_step_s", "5")
    try:
        held = [d.submit({"prompt": "hold", "steps": 1, "seed": i}) for i in range(16)]
        r = requests.post(url + "anima/jobs", json={"prompt": "one too many"}, timeout=30)
        assert r.status_code == 429 and "queue is full" in r.json()["error"]
        r = requests.post(url + "prompt", json={"prompt": graph()}, timeout=30)
        assert r.status_code == 429
        assert len(d.status(active=True).jobs) == 16
    finally:
        for job in held:
            requests.post(url + f"anima/jobs/{job}/cancel", timeout=30)
        d.flag("double_step_s", None)
        for job in held:
            d.wait(job)


def test_status_detail_paging_and_info(d):
    """STATUS with detail carries spec and origin; `before`/`limit` page back through the jobs; INFO lists packs."""
    from protocol import messages as m
    jobs = [d.submit({"prompt": f"p{i}", "seed": i, "steps": 1}) for i in range(3)]
    for job in jobs:
        d.wait(job)
    page = d.status(detail=True, limit=2)
    assert [j.job for j in page.jobs] == jobs[1:] and page.more
    older = d.status(detail=True, limit=2, before=jobs[1])
    assert older.jobs[-1].job == jobs[0]
    spec = json.loads(page.jobs[-1].spec_json)
    assert spec["prompt"] == "p2" and spec["width"] == 64 and spec["seed"] == 2
    assert page.jobs[-1].origin == ""                       # submitted by the CLI: no origin
    assert d.status(limit=2).jobs[-1].spec_json == ""       # no detail: no spec
    info = d.client().call(m.Info(), m.Pipeline)
    assert [(p.width, p.height) for p in info.packs] == SIZES and info.packs[0].blocks == 2
    assert info.packs[0].source_name == SOURCE["name"] and info.max_queue == 16


def test_daemon_down_is_503_then_back(d):
    url = d.http_url()
    d.sup.stop("orchestrator")
    # the front answers the queue from its last look for up to poll_s (0.1 s here); a look taken while the daemon
    # was shutting down may still have been answered, so the first 503 is due one poll later
    time.sleep(0.3)
    try:
        for method, path, body in (("GET", "queue", None), ("POST", "prompt", {"prompt": graph()}),
                                   ("GET", "history", None), ("POST", "sdapi/v1/txt2img", {"prompt": "x"}),
                                   ("GET", "anima/jobs", None), ("GET", "object_info", None)):
            t0 = time.monotonic()
            r = requests.request(method, url + path, json=body, timeout=30)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert "daemon" in r.json()["error"] and time.monotonic() - t0 < 10
        assert requests.get(url, timeout=30).status_code == 200      # the page itself is still served
    finally:
        d.sup.start("orchestrator")
    deadline = time.monotonic() + 60
    while requests.get(url + "queue", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert d.sup.info("http").state == "RUNNING"


def test_graph_job_keeps_canonical_ids_for_cli_jobs(d):
    """A job not from ComfyUI shows as the canonical graph (comfy_graph.job_to_graph) in /history."""
    url = d.http_url()
    job = d.submit({"prompt": "from the cli", "seed": 4, "steps": 2})
    d.wait(job)
    entry = requests.get(url + f"history/{job}", timeout=30).json()[job]
    g = entry["prompt"][2]
    assert g[CANONICAL_IDS["positive"]]["inputs"]["text"] == "from the cli"
    assert g[CANONICAL_IDS["sampler"]]["inputs"]["seed"] == 4
    assert entry["outputs"] == {CANONICAL_IDS["save"]: {"images": [{"filename": "image.png", "subfolder": job,
                                                                    "type": "output"}]}}


def test_page_api_keeps_64_bit_seeds(d):
    """The page sends seeds as digits (a JavaScript number holds 53 bits); the daemon gets the exact integer back."""
    url = d.http_url()
    seed = str(2**64 - 1)
    r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "seed": seed, "steps": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["seed"] == seed
    job = r.json()["job"]
    d.wait(job)
    assert json.loads(d.status(job=job, detail=True).jobs[0].spec_json)["seed"] == 2**64 - 1
    listed = requests.get(url + "anima/jobs?limit=1", timeout=30).json()["jobs"][0]
    assert listed["job"] == job and listed["spec"]["seed"] == seed and listed["files"]["image"].endswith(job + "&type=output")
    for bad in ("12a", "-1", "1" * 21):
        r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "seed": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["field"] == "seed", r.text


def test_the_running_job_stays_in_view_behind_big_queued_graphs(d):
    """Four queued graphs whose node title is ~240 KB of emoji (UTF-8 JSON, under the body limit) make the active
    jobs' details larger than one STATUS reply: the front pages through them, so /queue still holds the running job
    and all four queued ones, A1111's progress names the running job, and both interrupts stop it."""
    url = d.http_url()
    d.flag("double_step_s", "3")
    big = []
    try:
        job = requests.post(url + "prompt", json={"prompt": graph(steps=20)}, timeout=30).json()["prompt_id"]
        d.wait(job, ("denoising",))
        for i in range(4):
            g = graph(seed=100 + i)
            g["3"]["_meta"]["title"] = "\U0001F600" * 60_000              # 240,000 bytes of UTF-8
            body = json.dumps({"prompt": g}, ensure_ascii=False).encode()
            r = requests.post(url + "prompt", data=body, headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 200, r.text
            big.append(r.json()["prompt_id"])
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [job]
        assert sorted(i[1] for i in q["queue_pending"]) == sorted(big)
        assert all(i[2]["3"]["_meta"]["title"] == "\U0001F600" * 60_000 for i in q["queue_pending"])
        assert requests.get(url + "sdapi/v1/progress", timeout=30).json()["state"]["job"] == job
        assert requests.post(url + "interrupt", timeout=30).status_code == 200
        assert d.wait(job).state == "cancelled"
        nxt = d.wait(big[0], ("denoising",)).job
        assert requests.post(url + "sdapi/v1/interrupt", timeout=30).json() == {}
        assert d.wait(nxt).state == "cancelled"
    finally:
        for j in big:
            requests.post(url + f"anima/jobs/{j}/cancel", timeout=30)
        d.flag("double_step_s", None)
        for j in big:
            d.wait(j)


def test_queue_delete_and_clear_remove_waiting_prompts_only(d):
    """ComfyUI's POST /queue (was 405): "delete" cancels the named waiting prompts, "clear" every waiting one; the
    running prompt is left alone by both, unknown ids are ignored."""
    url = d.http_url()
    d.flag("double_step_s", "5")
    running = d.submit({"prompt": "hold", "steps": 20, "seed": 1})
    try:
        d.wait(running, ("denoising",))
        a, b, c = (requests.post(url + "prompt", json={"prompt": graph(seed=s)}, timeout=30).json()["prompt_id"]
                   for s in (2, 3, 4))
        r = requests.post(url + "queue", json={"delete": [a, running, "20990101-000000-abcdef", "nonsense"]},
                          timeout=30)
        assert r.status_code == 200, r.text
        assert [d.status(job=j).jobs[0].state for j in (a, running, b, c)] == ["cancelled", "denoising", "queued",
                                                                              "queued"]
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [running] and [i[1] for i in q["queue_pending"]] == [b, c]
        assert requests.post(url + "api/queue", json={"clear": True}, timeout=30).status_code == 200
        assert [d.status(job=j).jobs[0].state for j in (running, b, c)] == ["denoising", "cancelled", "cancelled"]
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [running] and q["queue_pending"] == []
        r = requests.post(url + "queue", json={"delete": running}, timeout=30)
        assert r.status_code == 400 and r.json()["field"] == "delete", r.text
        assert d.status(job=running).jobs[0].state == "denoising"
    finally:
        requests.post(url + f"anima/jobs/{running}/cancel", timeout=30)
        d.flag("double_step_s", None)
        d.wait(running)


def test_a1111_request_ends_when_its_job_is_pruned_meanwhile(d):
    """A txt2img request hung forever when its job ended and was pruned between two looks of the front (the tracker
    dropped the job on the daemon's "no job" and never answered its waiter). Stopping the front (SIGSTOP) makes that
    window certain: the job is cancelled and pruned while it cannot look; the request then ends, 404 naming the job."""
    import signal
    from protocol import messages as m
    url = d.http_url()
    http_pid = json.loads(d.rf.http_json.read_text())["pid"]
    d.flag("double_step_s", "5")
    holder = d.submit({"prompt": "hold the queue", "steps": 20, "seed": 1})
    answer = {}
    try:
        d.wait(holder, ("denoising",))
        t = threading.Thread(target=lambda: answer.update(r=requests.post(
            url + "sdapi/v1/txt2img", json={"prompt": "pruned", "width": 64, "height": 64, "steps": 1}, timeout=300)),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while not (queued := [j for j in d.status(active=True).jobs if j.job != holder]):
            assert time.monotonic() < deadline, "the txt2img job never got queued"
            time.sleep(0.05)
        job = queued[0].job
        signal_process(http_pid, signal.SIGSTOP)
        try:
            d.client().call(m.Cancel(job=job), m.Ok)
            d.client().call(m.Prune(keep=0), m.Jobs)
        finally:
            signal_process(http_pid, signal.SIGCONT)
        t.join(30)
        assert not t.is_alive(), "the txt2img request did not end"
        r = answer["r"]
        # 404 naming the job when the front's next look finds it pruned; 409 when a look the front had sent before
        # it was stopped was answered after the cancel (it saw the job interrupted): either way the request ends
        assert (r.status_code == 404 and job in r.json()["error"]) or \
            (r.status_code == 409 and "interrupted" in r.json()["error"]), r.text
    finally:
        d.client().call(m.Cancel(job=holder), m.Ok)
        d.flag("double_step_s", None)
        d.wait(holder)


def test_lone_surrogates_are_400_naming_the_field(d):
    """JSON's "\\ud800" escape decodes to a lone surrogate: in a prompt, client_id or a node title it reached msgpack
    on the way to the daemon and came back as 500 (UnicodeEncodeError). The front refuses it, naming the field."""
    url = d.http_url()
    g = graph()
    cases = []
    for where, edit in (("prompt.6.inputs.text", lambda b: b["prompt"]["6"]["inputs"].update(text="a \ud800 b")),
                        ("client_id", lambda b: b.update(client_id="\udfff")),
                        ("prompt.3._meta.title", lambda b: b["prompt"]["3"]["_meta"].update(title="\ud83d"))):
        body = {"prompt": json.loads(json.dumps(g))}
        edit(body)
        cases.append(("prompt", body, where))
    cases += [("sdapi/v1/txt2img", {"prompt": "\ud800", "width": 64, "height": 64}, "prompt"),
              ("sdapi/v1/txt2img", {"prompt": "a", "negative_prompt": "x\udc00"}, "negative_prompt"),
              ("anima/jobs", {"prompt": "a", "negative_prompt": "\ud800"}, "negative_prompt"),
              ("anima/jobs", {"prompt": "a", "client_id": "\ud800"}, "client_id")]
    before = d.status(limit=1).jobs
    for path, body, field in cases:
        raw = json.dumps(body)                                 # ASCII JSON with the \\uXXXX escape, as a client sends
        r = requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
        status = 422 if path.startswith("sdapi/") else 400           # A1111's FastAPI: 422 for a bad request
        assert r.status_code == status and r.json()["field"] == field and "surrogate" in r.json()["error"], (path,
                                                                                                          r.text)
    assert d.status(limit=1).jobs == before                    # nothing queued


def test_a1111_reads_its_typed_fields_as_a1111_does(d):
    """`sampler_name: []` became Euler and `send_images: "false"` still sent the image; the A1111 routes mixed 422
    and 400. A1111's request model (pydantic) refuses a list for a string and reads "false" as false; every bad
    request to txt2img is its 422, naming the field."""
    url = d.http_url()
    base = {"prompt": "a girl", "width": 64, "height": 64, "steps": 1, "seed": 5}
    before = d.status(limit=1).jobs
    for body, field in (({**base, "sampler_name": []}, "sampler_name"), ({**base, "sampler_index": 3}, "sampler_index"),
                        ({**base, "scheduler": ["simple"]}, "scheduler"),
                        ({**base, "send_images": "maybe"}, "send_images"), ({**base, "send_images": 2}, "send_images"),
                        ({**base, "steps": "many"}, "steps"), ({**base, "width": 128, "height": 128}, "width")):
        r = requests.post(url + "sdapi/v1/txt2img", json=body, timeout=30)
        assert r.status_code == 422 and r.json()["field"] == field, (body, r.status_code, r.text)
    for raw in (b"prompt=cat", b'["cat"]', b'{"prompt": "x", "cfg_scale": NaN}'):
        r = requests.post(url + "sdapi/v1/txt2img", data=raw, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 422 and r.json()["error"], (raw, r.status_code)
    assert d.status(limit=1).jobs == before                                  # nothing was queued
    for send, images in (("false", 0), ("No", 0), (0, 0), (False, 0), ("yes", 1), (1, 1), ("TRUE", 1)):
        r = requests.post(url + "sdapi/v1/txt2img", json={**base, "send_images": send, "sampler_name": None},
                          timeout=60)
        assert r.status_code == 200 and len(r.json()["images"]) == images, (send, r.status_code, r.text[:200])


def test_samplers_by_every_way_in(d):
    """A webuiapi client left at its defaults (sampler "Euler a", scheduler "automatic") gets its image; A1111 names
    with a scheduler in them, ComfyUI's KSamplerAdvanced and the page's pickers reach the job as ComfyUI's names."""
    import webuiapi
    url = d.http_url()
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    api = webuiapi.WebUIApi(host=host, port=int(port))
    assert (api.default_sampler, api.default_scheduler) == ("Euler a", "automatic")
    names = [s["name"] for s in api.get_samplers()]
    assert "Euler a" in names and "DPM++ 2M SDE" in names and "ER SDE" in names
    assert [s["label"] for s in requests.get(url + "sdapi/v1/schedulers", timeout=30).json()][:3] == \
        ["Automatic", "Uniform", "Karras"]
    r = api.txt2img(prompt="a girl", seed=5, steps=2, width=64, height=64)
    assert r.image.size == (64, 64) and r.info["sampler_name"] == "Euler a"
    assert "Sampler: Euler a, Schedule type: SGM Uniform" in r.info["infotexts"][0]
    spec = json.loads((d.rf.jobs / r.info["extra_generation_params"]["Job"] / "job.json").read_text())["spec"]
    assert (spec["sampler"], spec["scheduler"]) == ("euler_ancestral", "sgm_uniform")
    r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a girl", "seed": 5, "steps": 2, "width": 64,
                                                       "height": 64, "sampler_name": "DPM++ 2M Karras"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "Sampler: DPM++ 2M, Schedule type: Karras" in json.loads(r.json()["info"])["infotexts"][0]
    r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a girl", "sampler_name": "Restart"}, timeout=30)
    assert r.status_code == 422 and "Restart" in r.text and "Euler a" in r.text
    # ComfyUI: KSamplerAdvanced over the whole schedule, er_sde / beta
    g = graph()
    ks = g["3"]["inputs"]
    g["3"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ks["model"], "add_noise": "enable", "noise_seed": 9, "steps": 2, "cfg": 4.0, "sampler_name": "er_sde",
        "scheduler": "beta", "positive": ks["positive"], "negative": ks["negative"],
        "latent_image": ks["latent_image"], "start_at_step": 0, "end_at_step": 10000,
        "return_with_leftover_noise": "disable"}}
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()["prompt_id"]
    assert d.wait(job).state == "done"
    spec = json.loads((d.rf.jobs / job / "job.json").read_text())["spec"]
    assert (spec["sampler"], spec["scheduler"], spec["seed"]) == ("er_sde", "beta", 9)
    g["3"]["inputs"]["start_at_step"] = 2                     # a window that leaves no step to run
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 400 and "start_at_step" in r.text, r.text
    # the page: its pickers, and Spectrum refused by name where it does not apply
    info = requests.get(url + "anima/info", timeout=30).json()
    assert info["defaults"]["sampler"] == "euler" and "karras" in info["schedulers"]
    assert {s["name"]: s["spectrum"] for s in info["samplers"]}["heun"].startswith("Spectrum does not apply")
    r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "steps": 2, "sampler": "heun", "spectrum": True},
                      timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "spectrum" and "'heun'" in r.json()["error"]
    r = requests.post(url + "anima/jobs", json={"prompt": "a girl", "steps": 2, "sampler": "heun",
                                                "scheduler": "kl_optimal", "spectrum": False}, timeout=30)
    assert r.status_code == 200, r.text
    assert d.wait(r.json()["job"]).state == "done"


def test_page_workflow_fields_are_taken_and_refused_by_name(d):
    """/anima/jobs takes prompt.json's init_image, mask, denoise, batch and hires (the page's controls) and a bad value
    of each is a 400 naming the field (the page puts it next to the control); /anima/info gives the hires choices."""
    from models.sampling.latent_ops import IMAGE_SCALE_METHODS, UPSCALE_METHODS
    from protocol.prompt import MAX_BATCH, MAX_HIRES_SCALE
    url = d.http_url()
    info = requests.get(url + "anima/info", timeout=30).json()
    assert info["limits"]["batch"] == MAX_BATCH == 8
    assert MAX_HIRES_SCALE == 4.0 and UPSCALE_METHODS == ("nearest-exact", "bilinear", "area", "bicubic", "bislerp")
    assert info["hires"] == {"methods": {"latent": list(UPSCALE_METHODS), "pixel": list(IMAGE_SCALE_METHODS)},
                             "max_scale": 4.0, "denoise": 0.5,
                             "method": "nearest-exact"}
    base = {"prompt": "a girl", "steps": 2}
    for extra, field in (({"batch": 9}, "batch"), ({"denoise": 0}, "denoise"),
                         ({"init_image": "page/nothing.png [input]"}, "init_image"),
                         ({"init_image": "../../etc/passwd"}, "init_image"),
                         ({"hires": {"scale": 5}}, "hires.scale"),
                         ({"hires": {"scale": 2, "method": "lanczos"}}, "hires.method"),
                         ({"hires": {"scale": 2}}, "hires")):            # 64x64 x 2 = 128x128: no pack
        r = requests.post(url + "anima/jobs", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["field"] == field, (extra, r.text)
    # taken: the job keeps them as the page sent them (before, /anima/jobs refused them as unknown fields)
    r = requests.post(url + "anima/jobs", json={**base, "batch": 2, "hires": None}, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()["job"]
    assert d.wait(job).state == "done"
    assert json.loads((d.rf.jobs / job / "job.json").read_text())["spec"]["batch"] == 2
    listed = requests.get(url + "anima/jobs?limit=1", timeout=30).json()["jobs"][0]
    assert listed["job"] == job and listed["spec"]["batch"] == 2 and set(listed["files"]) >= {"image", "image_1"}


def test_an_a1111_batch_stops_when_its_client_goes(d):
    """A txt2img batch of 4 whose client hangs up while the first image is made: the first job ends as any job does,
    the other three are never queued (before: all 4 ran for nobody)."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(d.http_url())
    d.flag("double_step_s", "1.5")
    body = json.dumps({"prompt": "batch whose client goes", "width": 64, "height": 64, "steps": 1, "seed": 5,
                       "batch_size": 4}).encode()
    before = {j.job for j in d.status().jobs}
    deadline = time.monotonic() + 30
    while requests.get(d.http_url() + "sdapi/v1/progress", timeout=30).status_code != 200:   # the front's link is up
        assert time.monotonic() < deadline, "the front never reached the daemon"
        time.sleep(0.1)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=30) as s:
            s.sendall(b"POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 30
            while not (mine := [j.job for j in d.status().jobs if j.job not in before]):
                assert time.monotonic() < deadline, f"the batch's first job never got queued: {_reply(s)}"
                time.sleep(0.05)
        assert d.wait(mine[0]).state == "done"
        time.sleep(2.0)                        # the front's next look at the request (it would queue image 2 now)
        ours = [j for j in d.status().jobs if j.job not in before]
        assert [j.job for j in ours] == mine, [j.job for j in ours]
    finally:
        d.flag("double_step_s", None)
        for j in d.status(active=True).jobs:
            if j.job not in before:
                requests.post(d.http_url() + f"anima/jobs/{j.job}/cancel", timeout=30)


def _reply(s) -> bytes:
    s.settimeout(1.0)
    try:
        return s.recv(2000)
    except OSError as e:
        return repr(e).encode()


def test_a1111_parameters_echo_what_ran(d):
    """txt2img answered `parameters.sampler_name: "Euler"` whatever ran, and the scheduler in ComfyUI's spelling.
    Now every echoed setting is the job's (job.json: what the daemon ran), in A1111's names: "DPM++ 2M Karras" ran
    as DPM++ 2M with the Karras schedule, a random seed is the seed drawn, the size the one asked."""
    url = d.http_url()
    body = {"prompt": "a girl", "seed": -1, "steps": 2, "cfg_scale": 5.5, "width": 64, "height": 32,
            "sampler_name": "DPM++ 2M Karras", "batch_size": 2}
    r = requests.post(url + "sdapi/v1/txt2img", json=body, timeout=120)
    assert r.status_code == 200, r.text
    params, info = r.json()["parameters"], json.loads(r.json()["info"])
    spec = json.loads((d.rf.jobs / info["extra_generation_params"]["Job"] / "job.json").read_text())["spec"]
    assert (spec["sampler"], spec["scheduler"]) == ("dpmpp_2m", "karras")        # what ran
    assert {k: params[k] for k in ("sampler_name", "scheduler", "steps", "cfg_scale", "seed", "width", "height",
                                   "batch_size")} == {
        "sampler_name": "DPM++ 2M", "scheduler": "Karras", "steps": 2, "cfg_scale": 5.5, "seed": spec["seed"],
        "width": 64, "height": 32, "batch_size": 2}
    assert params["seed"] == info["all_seeds"][0] != -1
    assert "Sampler: DPM++ 2M, Schedule type: Karras" in info["infotexts"][0]      # the PNG's own words agree
    # left to the defaults: the pipeline's sampler and scheduler, as the PNG names them
    r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a girl", "seed": 3, "steps": 1, "width": 64,
                                                       "height": 64}, timeout=60)
    assert r.status_code == 200, r.text
    params, info = r.json()["parameters"], json.loads(r.json()["info"])
    text = info["infotexts"][0]
    assert f"Sampler: {params['sampler_name']}, Schedule type: {params['scheduler']}" in text, (params, text)
    assert (params["steps"], params["cfg_scale"], params["seed"]) == (1, 7.0, 3)


def test_a1111_progress_counts_the_whole_batch(d):
    """A txt2img batch of 2 (two jobs, one after another): /sdapi/v1/progress counts both as one request, job_count 2,
    the second job job_no 1 from half-way on, and `progress` does not start again at 0 for the second image."""
    url = d.http_url()
    d.flag("double_step_s", "0.4")
    looks, done = [], threading.Event()

    def watch():
        while not done.is_set():
            p = requests.get(url + "sdapi/v1/progress", timeout=30).json()
            if p["state"]["job"]:
                looks.append((p["state"]["job"], p["state"]["job_no"], p["state"]["job_count"], p["progress"]))
            time.sleep(0.1)
    t = threading.Thread(target=watch)
    t.start()
    try:
        r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a batch watched", "seed": 4, "steps": 3,
                                                           "width": 64, "height": 64, "batch_size": 2}, timeout=120)
    finally:
        done.set()
        t.join()
        d.flag("double_step_s", None)
    assert r.status_code == 200, r.text
    jobs = json.loads(r.json()["info"])["extra_generation_params"]["Job"]
    assert {c for _, _, c, _ in looks} == {2}, looks
    second = [(n, f) for job, n, _, f in looks if job != jobs]
    assert second and all(n == 1 and f >= 0.5 for n, f in second), looks
    assert [f for *_, f in looks] == sorted(f for *_, f in looks), looks


def test_independent_chains_run_as_one_prompt(d):
    """Two KSampler -> VAEDecode -> SaveImage chains on shared loaders: one prompt id, one job per chain in the
    graph's order; /queue shows one prompt, /history lists every output once both ended; ComfyUI's messages once
    per prompt (start, success, the final executing None), `executed` per output node."""
    from tests.comfy_graphs import two_chains
    url = d.http_url()
    ws = Listener(url, "client-chains")
    try:
        ws.wait(lambda m: m["type"] == "status")
        d.flag("double_step_s", "0.3")
        g = two_chains(graph(), seed=77)
        r = requests.post(url + "prompt", json={"prompt": g, "client_id": "client-chains"}, timeout=30)
        assert r.status_code == 200, r.text
        pid = r.json()["prompt_id"]
        ws.wait(lambda m: m["type"] == "progress" and m["data"]["prompt_id"] == pid)
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [pid] and q["queue_pending"] == []
        assert q["queue_running"][0][2] == g and q["queue_running"][0][4] == ["9", "29"]
        assert requests.get(url + "prompt", timeout=30).json() == {"exec_info": {"queue_remaining": 1}}
        ws.wait(lambda m: m["type"] == "executing" and m["data"]["node"] is None, timeout_s=90)
    finally:
        ws.close()
        d.flag("double_step_s", None)
    jobs = [j for j in d.status(detail=True).jobs if json.loads(j.origin or "{}").get("prompt_id") in (pid,)]
    (second,) = jobs
    assert d.wait(pid).state == "done" and d.wait(second.job).state == "done"
    seeds = [json.loads(d.status(job=j, detail=True).jobs[0].spec_json)["seed"] for j in (pid, second.job)]
    assert seeds == [1234, 77]
    seq = [(m["type"], m["data"].get("node")) for m in ws.messages if m["data"].get("prompt_id") == pid]
    kinds = [k for k, _ in seq]
    assert kinds.count("execution_start") == 1 and kinds.count("execution_success") == 1
    assert [n for k, n in seq if k == "executed"] == ["9", "29"]
    assert kinds.index("execution_success") > max(i for i, k in enumerate(kinds) if k == "executed")
    assert seq[-1] == ("executing", None) and seq.count(("executing", None)) == 1
    assert {m["data"]["node"] for m in ws.messages if m["type"] == "progress"} == {"3", "23"}
    entry = requests.get(url + f"history/{pid}", timeout=30).json()[pid]
    assert entry["outputs"] == {
        "9": {"images": [{"filename": "image.png", "subfolder": pid, "type": "output"}]},
        "29": {"images": [{"filename": "image.png", "subfolder": second.job, "type": "output"}]}}
    assert entry["status"]["status_str"] == "success" and entry["prompt"][4] == ["9", "29"]
    assert requests.get(url + f"history/{second.job}", timeout=30).json() == {}    # not a prompt id
    from PIL import Image
    for job in (pid, second.job):                   # each PNG holds the whole prompt, as ComfyUI's SaveImage writes
        with Image.open(d.rf.jobs / job / "image.png") as im:
            assert json.loads(im.text["prompt"]) == g
    listed = requests.get(url + "history?max_items=3", timeout=30).json()
    assert pid in listed and second.job not in listed


def test_interrupt_and_queue_delete_cover_every_chain(d):
    from tests.comfy_graphs import two_chains
    url = d.http_url()
    d.flag("double_step_s", "5")
    try:
        pid = requests.post(url + "prompt", json={"prompt": two_chains(graph())}, timeout=30).json()["prompt_id"]
        d.wait(pid, ("denoising",))
        # a second prompt of two chains waits whole; deleting it from the queue cancels both its jobs
        waiting = requests.post(url + "prompt", json={"prompt": two_chains(graph(), seed=5)}, timeout=30).json()
        q = requests.get(url + "queue", timeout=30).json()
        assert [i[1] for i in q["queue_running"]] == [pid]
        assert [i[1] for i in q["queue_pending"]] == [waiting["prompt_id"]]
        parts = {j.job: json.loads(j.origin or "{}").get("prompt_id") for j in d.status(active=True, detail=True).jobs}
        later = {p: next(j for j, o in parts.items() if o == p) for p in (pid, waiting["prompt_id"])}
        requests.post(url + "queue", json={"delete": [waiting["prompt_id"]]}, timeout=30)
        assert d.wait(waiting["prompt_id"]).state == "cancelled"
        assert d.wait(later[waiting["prompt_id"]]).state == "cancelled"
        assert d.status(job=pid).jobs[0].state == "denoising"
        # interrupt: the running chain and the one still to run
        assert requests.post(url + "interrupt", json={"prompt_id": pid}, timeout=30).status_code == 200
        assert d.wait(pid).state == "cancelled" and d.wait(later[pid]).state == "cancelled"
        h = requests.get(url + f"history/{pid}", timeout=30).json()[pid]
        assert h["status"]["status_str"] == "error" and h["outputs"] == {}
        assert h["status"]["messages"][-1][0] == "execution_interrupted"
    finally:
        d.flag("double_step_s", None)


def test_image_crop_and_a_later_batch_image_through_the_front(d):
    """LatentFromBatch(-1) of a batch of 4: the job samples image 3's noise (noise_index 3, as ComfyUI's
    prepare_noise with batch_index [3]); ImageCrop after VAEDecode: image.png is decoded.png's box, metadata kept."""
    from PIL import Image
    url = d.http_url()
    g = graph()
    g["5"]["inputs"]["batch_size"] = 4
    g["40"] = {"class_type": "LatentFromBatch", "inputs": {"samples": ["5", 0], "batch_index": -1, "length": 2}}
    g["3"]["inputs"]["latent_image"] = ["40", 0]
    g["30"] = {"class_type": "ImageCrop", "inputs": {"image": ["8", 0], "width": 40, "height": 100, "x": 8, "y": 16}}
    g["9"]["inputs"]["images"] = ["30", 0]
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()["prompt_id"]
    assert d.wait(job).state == "done", d.logs()
    folder = d.rf.jobs / job
    with Image.open(folder / "decoded.png") as full, Image.open(folder / "image.png") as cut:
        assert full.size == (64, 64) and cut.size == (40, 48)
        np.testing.assert_array_equal(np.asarray(cut), np.asarray(full)[16:64, 8:48])
        assert json.loads(cut.text["prompt"]) == g
    runs = [json.loads(line) for line in (d.rf.root / "double_denoises").read_text().splitlines()]
    (mine,) = [r for r in runs if Path(r["job_dir"]).name == job]
    assert (mine["noise_index"], mine["batch_size"], mine["batch_pos"]) == (3, 1, 0)
    entry = requests.get(url + f"history/{job}", timeout=30).json()[job]
    assert entry["outputs"]["9"]["images"] == [{"filename": "image.png", "subfolder": job, "type": "output"}]


def test_a_prompt_of_chains_is_queued_whole_or_not_at_all(d):
    """The queue holds 16 jobs: with 15 held, a graph of two chains gets its first queued and its second refused;
    the first is taken back and the answer is the refusal (429), so no half prompt runs."""
    from tests.comfy_graphs import two_chains
    url = d.http_url()
    d.flag("double_step_s", "5")
    held = []
    try:
        held = [d.submit({"prompt": "hold", "steps": 1, "seed": i}) for i in range(15)]
        before = {j.job for j in d.status().jobs}
        r = requests.post(url + "prompt", json={"prompt": two_chains(graph()), "client_id": "c-whole"}, timeout=30)
        assert r.status_code == 429, r.text
        new = [j for j in d.status().jobs if j.job not in before]
        assert len(new) == 1 and d.wait(new[0].job).state == "cancelled"
        assert len(d.status(active=True).jobs) == 15
    finally:
        for job in held:
            requests.post(url + f"anima/jobs/{job}/cancel", timeout=30)
        d.flag("double_step_s", None)
        for job in held:
            d.wait(job)
