"""Issue 42: "the prompt is checked once per way in". A request through each way in (prompt.json by the CLI, a
ComfyUI graph on POST /prompt, A1111's txt2img and img2img, the page's form on /anima/jobs) runs the prompt record's
rules (protocol/prompt.py, PromptFile.__post_init__) once at its way in and once where the daemon decodes the SUBMIT
(its own way in: the record arrives over a socket from any client), and never again up to the job's PlanRunner; it
was 10 to 13 times (docs/plan.md "Ways in").

No pipeline: the daemon of a run folder in this process (tests/inproc.py) on a manifest-only pack; the HTTP front's
app on aiohttp's test server with a link that hands each request to that daemon through the wire codec, as
DaemonClient.in_process does. A job is followed up to its PlanRunner's plan (no stage runs)."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import protocol.prompt as prompt_module
from orchestrator.engine.daemon_client import DaemonClient
from orchestrator.engine.plan.run import PlanRunner
from tests.comfy_graphs import standard_graph
from tests.doubles_harness import SOURCE


class Checks:
    """Every run of the prompt record's rules, each noted as the daemon's (under the wire codec's decode) or not."""

    def __init__(self, monkeypatch):
        self.at: list[str] = []
        rules = prompt_module._check_conds           # the first rule PromptFile.__post_init__ runs, once per run

        def counted(record):
            decoding = any(f.name == "decode" and f.filename.endswith("protocol/codec.py")
                           for f in traceback.extract_stack())
            self.at.append("daemon" if decoding else "way in")
            return rules(record)
        monkeypatch.setattr(prompt_module, "_check_conds", counted)


class DaemonDouble:
    """The front's daemon link over the in-process daemon: each request and reply through the wire codec."""

    timeout_s = 5.0

    def __init__(self, daemon):
        self.client = DaemonClient.in_process(daemon)

    async def call(self, msg, cls, timeout_s=None):
        return self.client.call(msg, cls)

    async def status_pages(self, **kw):
        return
        yield                                       # no pages: nothing active

    async def close(self):
        pass


def _front(daemon, root: Path):
    """The front's app state over the daemon; an A1111 request stops waiting once its job is queued."""
    from orchestrator.http.app import make_front
    from orchestrator.http.settings import HttpSettings
    from orchestrator.http.tracker import JobGone
    (root / "models" / "loras").mkdir(parents=True)
    cfg = SimpleNamespace(run_dir=Path(daemon.rf.root), models_dir=root / "models", backend="cpu",
                          path=root / "p.toml")
    front = make_front(cfg, HttpSettings(), None)
    front.link = front.tracker.link = DaemonDouble(daemon)

    async def queued(job, *a, **k):
        raise JobGone(f"job {job}: queued; this test follows it no further")
    front.tracker.wait = queued
    return front


def _post(front, path: str, body: dict) -> tuple[int, str]:
    from aiohttp.test_utils import TestClient, TestServer
    from orchestrator.http.app import build_app

    async def go():
        async with TestClient(TestServer(build_app(front))) as client:
            r = await client.post(path, json=body)
            return r.status, await r.text()
    return asyncio.run(go())


def _png_b64() -> str:
    out = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def _graph() -> dict:
    names = {"unet": SOURCE["name"], "clip": "any-te.safetensors", "vae": "any-vae.safetensors"}
    return standard_graph(width=64, height=64, steps=3, names=names)


def _image_graph() -> dict:
    """The graph from an upload (LoadImage -> VAEEncode): the front sizes its job to the image before its check."""
    g = _graph()
    del g["5"]
    g["3"]["inputs"].update(denoise=0.6, latent_image=["21", 0])
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "init.png [input]"}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["13", 0]}}
    return g


HTTP_WAYS = {
    "comfyui-graph": ("/prompt", lambda: {"prompt": _graph()}, 200),
    "comfyui-image-graph": ("/prompt", lambda: {"prompt": _image_graph()}, 200),
    "a1111-txt2img": ("/sdapi/v1/txt2img", lambda: {"prompt": "a cat", "steps": 3, "width": 64, "height": 64}, 404),
    "a1111-img2img": ("/sdapi/v1/img2img", lambda: {"prompt": "a cat", "steps": 3, "width": 64, "height": 64,
                                                   "init_images": [_png_b64()], "denoising_strength": 0.6}, 404),
    "page-form": ("/anima/jobs", lambda: {"prompt": "a cat", "steps": 3, "seed": "5"}, 200),
}


def _to_the_runner(daemon) -> PlanRunner:
    """The queued job taken as the daemon's loop takes it, up to its PlanRunner and plan (no stage is started)."""
    job = daemon.store.next_job()
    assert job is not None and job.state == "queued"
    runner = PlanRunner(daemon, job)
    assert runner.plan.steps and runner.spec.steps == 3
    return runner


@pytest.mark.parametrize("way", sorted(HTTP_WAYS))
def test_an_http_way_in_checks_the_prompt_once_and_the_daemon_once(inproc_daemon, tmp_path, monkeypatch, way):
    path, body, status = HTTP_WAYS[way]
    daemon = inproc_daemon.daemon
    front = _front(daemon, tmp_path / "front")
    (Path(daemon.rf.root) / "input").mkdir(exist_ok=True)
    (Path(daemon.rf.root) / "input" / "init.png").write_bytes(base64.b64decode(_png_b64()))
    body = body()
    checks = Checks(monkeypatch)
    got, text = _post(front, path, body)
    assert got == status, text                    # A1111's 404: the stand-in wait, after the job was queued
    runner = _to_the_runner(daemon)
    assert runner.img2img == (way in ("comfyui-image-graph", "a1111-img2img"))
    assert checks.at == ["way in", "daemon"], (len(checks.at), checks.at)


def test_prompt_json_by_the_cli_is_checked_once_and_by_the_daemon_once(inproc_daemon, tmp_path, monkeypatch):
    from orchestrator.terminal import cli
    daemon = inproc_daemon.daemon
    f = tmp_path / "prompt.json"
    f.write_text(json.dumps({"prompt": "a cat", "steps": 3, "seed": 3}))
    checks = Checks(monkeypatch)
    assert cli.main(["--run", str(daemon.rf.root), "submit", str(f)], connect=inproc_daemon.connect) == 0
    _to_the_runner(daemon)
    assert checks.at == ["way in", "daemon"], (len(checks.at), checks.at)


def test_a_job_read_back_from_disk_is_checked_once_more(inproc_daemon, tmp_path, monkeypatch):
    """job.json read by a daemon that did not write it (a restart) is a way in of its own: its spec is checked when
    read, and that once."""
    from orchestrator.engine import job_record
    from orchestrator.engine.jobs import JobStore
    from orchestrator.terminal import cli
    daemon = inproc_daemon.daemon
    f = tmp_path / "prompt.json"
    f.write_text(json.dumps({"prompt": "a dog", "steps": 3, "seed": 4}))
    assert cli.main(["--run", str(daemon.rf.root), "submit", str(f)], connect=inproc_daemon.connect) == 0
    monkeypatch.setattr(job_record, "_checked", type(job_record._checked)())     # a new process: nothing known
    checks = Checks(monkeypatch)
    daemon.store = JobStore(daemon.rf.root, cached=True)
    _to_the_runner(daemon)
    assert checks.at == ["way in"], (len(checks.at), checks.at)


def test_the_daemon_still_checks_what_the_packs_recorded_settings_change():
    """The daemon's resolve builds the spec without re-running the record's rules; the ones that read steps, sampler
    and scheduler run on what the pack's record filled in (protocol.prompt.check_sampled)."""
    from orchestrator.engine.prompt_spec import PromptError, prompt_record, resolve_prompt
    heun = {"steps": 8, "cfg": 1.0, "sampler": "heun", "scheduler": "simple"}
    with pytest.raises(PromptError, match=r"field 'spectrum': .*heun"):
        resolve_prompt(prompt_record({"prompt": "a", "spectrum": True}), resolution=[(64, 64)],
                       sampling={(64, 64): heun})
    with pytest.raises(PromptError, match=r"field 'start_step': start_at_step 8 leaves no step of the 8-step"):
        resolve_prompt(prompt_record({"prompt": "a", "start_step": 8}), resolution=[(64, 64)],
                       sampling={(64, 64): heun})
    ok = resolve_prompt(prompt_record({"prompt": "a", "start_step": 8, "steps": 12}), resolution=[(64, 64)],
                        sampling={(64, 64): heun})
    assert (ok.steps, ok.sampler, ok.width, ok.height) == (12, "heun", 64, 64)


def test_a_settled_record_keeps_its_types_and_bounds_and_skips_only_its_rules():
    """Record.settled (models/base/schema.py): what resolve_prompt builds the spec with. Types and bounds are msgspec's
    decode and still hold; only `__post_init__`'s rules (here: a positive text must not be empty) are not run."""
    from protocol.prompt import PromptError, PromptSpec
    with pytest.raises(PromptError, match=r"field 'steps': must be in 1..200, got 0"):
        PromptSpec.settled({"prompt": "a", "steps": 0})
    with pytest.raises(PromptError, match=r"field 'prompt': must not be empty"):
        PromptSpec(prompt="")
    assert PromptSpec.settled({"prompt": ""}).prompt == ""
    assert PromptSpec(prompt="a").seed == 0                  # after a settled build, the rules run again as ever
