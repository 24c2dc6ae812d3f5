"""The front as one of SwarmUI's ComfyUI backends (issue 44): tests/swarm_client.py sends what SwarmUI's
ComfyUIAPIAbstractBackend sends — object_info for its model lists, a reused `ws?clientId=` socket opened with
`feature_flags`, POST /prompt with client_id, the message loop to `executing` null, GET history/{id}, GET view,
POST history {"delete"}, and for a cancel POST queue {"delete"}, POST interrupt {prompt_id} — against fronts over
the real daemon and supervisord with stand-in stages (tests/orch_doubles.py: the image is a function of the seed and
the init image, each job well under a second). Three fronts behind SwarmUI's multi-backend dispatch: 12 jobs spread,
one front killed mid-job, its job retried on another, each image equal to its seed's made by another front alone."""
from __future__ import annotations

import io
import json
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.comfy_graphs import edited, standard_graph
from tests.doubles_harness import SOURCE, Doubles
from tests.swarm_client import Dispatcher, SwarmComfy
from tests.signals import signal_process

NAMES = {"unet": SOURCE["name"], "clip": "any-te.safetensors", "vae": "any-vae.safetensors"}
FRONTS = 3


@pytest.fixture(scope="module")
def fronts():
    """Three run folders, each with its supervisord, daemon, stand-in stages and front on a free loopback port."""
    roots = [Path(tempfile.mkdtemp(prefix=f"anima-swarm{i}-")) for i in range(FRONTS)]
    with ThreadPoolExecutor(FRONTS) as pool:
        started = list(pool.map(lambda r: _start(r), roots))
    try:
        assert all(isinstance(d, Doubles) for d in started), started
        yield started
    finally:
        for d in started:
            if isinstance(d, Doubles):
                d.stop()
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def _start(root: Path):
    try:
        return Doubles.start(root, [(64, 64)])
    except Exception as e:  # noqa: BLE001 - reported by the fixture, the others still stopped
        return e


def graph(seed: int, **kw) -> dict:
    return standard_graph(**{"width": 64, "height": 64, "steps": 3, "names": NAMES, "seed": seed, **kw})


def img2img_graph(image: str, seed: int = 5) -> dict:
    """The standard graph with its empty latent replaced by LoadImage "20" -> VAEEncode "21", denoise 0.6."""
    g = edited(graph(seed), "3", denoise=0.6)
    del g["5"]
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": image}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    g["3"]["inputs"]["latent_image"] = ["21", 0]
    return g


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_swarm_client_runs_txt2img_and_img2img(fronts):
    d = fronts[0]
    d.flag("double_step_s", None)
    c = SwarmComfy(d.http_url().rstrip("/"))
    try:
        c.load_value_set()
        assert c.models["Stable-Diffusion"] == [SOURCE["name"]]
        assert {"UNETLoader", "CLIPLoader", "VAELoader", "KSampler", "SaveImage", "LoadImage"} <= c.node_types
        [png] = c.generate(graph(7))
        assert c.server_flags is not None and c.server_flags["supports_preview_metadata"] is False
        kinds = [k for k, _ in c.messages]
        assert kinds[0] == "execution_start" and kinds[-1] == "executing" and c.messages[-1][1]["node"] is None
        assert {"execution_cached", "executed", "execution_success"} <= set(kinds), kinds
        executed = next(data for k, data in c.messages if k == "executed")
        assert executed["node"] == "9" and executed["output"]["images"][0]["filename"] == "image.png"
        assert c.previews == 0                      # none asked for: ComfyUI sends them only with a preview method
        assert pixels(png).shape == (64, 64, 3)
        # img2img as SwarmUI does it without its custom nodes: the init image uploaded with overwrite "true"
        init = np.zeros((64, 64, 3), np.uint8)
        init[:, 32:] = 200
        name = c.upload(_png(init), "init_image_sui_backend_0_1.png")
        assert name == "init_image_sui_backend_0_1.png"
        [png2] = c.generate(img2img_graph(name))
        assert "execution_success" in [k for k, _ in c.messages]
        assert not np.array_equal(pixels(png2), pixels(c.generate(graph(5))[0]))   # the init image mattered
        for bad, field in (({"delete": "x"}, "delete"), ({"clear": "yes"}, "clear")):
            r = c._post_text("history", bad)
            assert r.status_code == 400 and r.json()["field"] == field, r.text
        # the same socket, reused, for another job (SwarmUI keeps sockets in ReusableSockets)
        assert len(c.generate(graph(8))) == 1
    finally:
        c.close()


def test_swarm_cancel_deletes_queue_item_interrupts_by_id_and_deletes_history(fronts):
    d = fronts[0]
    d.flag("double_step_s", "0.3")
    c = SwarmComfy(d.http_url().rstrip("/"))
    try:
        prompt_id = c.submit(graph(11, steps=20))
        c.follow(prompt_id, on_start=lambda: c.interrupt(prompt_id))
        kinds = [k for k, _ in c.messages]
        assert "execution_interrupted" in kinds and kinds[-1] == "executing", kinds
        assert c.images(prompt_id) == []            # history: no outputs; its delete is still a 200
        assert d.status(job=prompt_id).jobs[0].state == "cancelled"
    finally:
        d.flag("double_step_s", None)
        c.close()


def _running_on(d: Doubles) -> bool:
    return any(j.state in ("encoding", "denoising", "decoding") for j in d.status(active=True).jobs)


def _wait_images(c: SwarmComfy, prompt_id: str, timeout_s: float = 60.0) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while not c._http("GET", f"history/{prompt_id}").json():
        assert time.monotonic() < deadline, f"{prompt_id} never finished"
        time.sleep(0.05)
    return c.images(prompt_id)


def test_three_fronts_behind_a_dispatcher_one_killed_mid_job(fronts):
    """12 jobs spread over three fronts; front 1's front process is killed while it runs a job: that job is retried
    on another and every image equals the same seed's image made by another front on its own."""
    seeds = list(range(100, 112))
    urls = [d.http_url().rstrip("/") for d in fronts]
    victim = fronts[1]
    pid = json.loads(victim.rf.http_json.read_text())["pid"]

    def kill_mid_job():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _running_on(victim):
            time.sleep(0.02)
        signal_process(pid)
    killer = threading.Thread(target=kill_mid_job)
    killer.start()
    disp = Dispatcher(urls, timeout_s=60)
    results = disp.run({s: graph(s) for s in seeds})
    killer.join(60)
    assert list(disp.failed) == [urls[1]] and 1 <= len(disp.retried) <= disp.usages, (disp.failed, disp.retried)
    by_front = {u: sum(1 for url, _ in results.values() if url == u) for u in urls}
    assert sum(by_front.values()) == 12 and by_front[urls[0]] > 0 and by_front[urls[2]] > 0, by_front
    # the reference: each seed's job made by one front on its own, another front than the one that made it in the
    # dispatch (front 1 answers again at a new address: supervisord restarted its killed front); queued at once
    refs = [SwarmComfy(d.http_url().rstrip("/")) for d in fronts]
    try:
        ids = {s: (refs[(urls.index(results[s][0]) + 1) % FRONTS], None) for s in seeds}
        ids = {s: (c, c.submit(graph(s))) for s, (c, _) in ids.items()}
        for s in seeds:
            url, images = results[s]
            c, prompt_id = ids[s]
            assert len(images) == 1 and c.url != url
            assert np.array_equal(pixels(images[0]), pixels(_wait_images(c, prompt_id)[0])), (s, url, c.url)
    finally:
        for c in refs:
            c.close()


def _said(ws, seconds: float) -> list[dict]:
    """Every message a socket gets within `seconds` (a `status` of the queue may come at any time)."""
    import websocket
    out, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ws.settimeout(left)
        try:
            out.append(json.loads(ws.recv()))
        except websocket.WebSocketTimeoutException:
            break
    return out


def test_feature_flags_are_answered_only_as_the_first_message(fronts):
    """ComfyUI's server.py: only a client's first JSON message, if it is feature_flags, is answered (with the
    server's flags); text that is not JSON does not count; anything else a client says is ignored and the socket
    stays open."""
    import websocket
    ws_url = fronts[0].http_url().replace("http://", "ws://") + "ws?clientId="
    late = websocket.create_connection(ws_url + "late", timeout=5)
    first = websocket.create_connection(ws_url + "first", timeout=5)
    flags = json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
    try:
        late.send(json.dumps({"type": "hello", "data": {}}))
        late.send(flags)
        first.send("not json {")
        first.send(flags)
        answers = [msg for msg in _said(first, 2.0) if msg["type"] == "feature_flags"]
        assert [a["data"]["max_upload_size"] for a in answers] == [32 * 2**20], answers
        assert "feature_flags" not in [msg["type"] for msg in _said(late, 1.0)] and late.connected
    finally:
        late.close()
        first.close()
