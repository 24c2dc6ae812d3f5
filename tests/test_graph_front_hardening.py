"""Issue 30, the graph front: ComfyUI graphs that loop are a 400 with node_errors naming the loop, in milliseconds
(every walk of a graph is bounded); the daemon's LoRA refusals over /prompt are node_errors on the loader node, and
no HTTP message starts with "prompt.json:"; the LoRA list follows MODELS/loras/ as it is now; an A1111 LoRA tag
leaves no whitespace of its own in the prompt.

No pipeline: graph_to_job runs in a forked child with a deadline (a loop must fail the test, not hang it); the front's
handlers run on aiohttp's test server with a stand-in daemon link."""
from __future__ import annotations

import asyncio
import copy
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from models.lora.a1111 import LoraTag, split_lora_tags
from models.setup.models_dir import list_loras
from orchestrator.http.comfy_graph import GraphError, ModelNames, graph_to_job
from orchestrator.engine.prompt_spec import PromptError
from protocol import messages as m
from protocol.version import VERSION
from tests.comfy_graphs import TINY_NAMES, standard_graph

LORAS = ("a.safetensors", "b.safetensors")
NAMES = ModelNames(unet=(TINY_NAMES["unet"],), clip=(TINY_NAMES["clip"],), vae=(TINY_NAMES["vae"],), lora=LORAS)
SIZES = [(128, 128)]
DEADLINE_S = 5.0


# ---------------------------------------------------------------- graph_to_job with a deadline


def _translate(conn, graph, names, sizes):
    t0 = time.monotonic()
    try:
        job = graph_to_job(graph, names=names, sizes=sizes)
        conn.send(("job", job.spec, time.monotonic() - t0))
    except GraphError as e:
        conn.send(("refused", e.body(), time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001 - any other end is the test's failure, named
        conn.send(("crashed", f"{type(e).__name__}: {e}", time.monotonic() - t0))


def translate(graph, names=NAMES, sizes=SIZES):
    """graph_to_job in a forked child: (outcome, body or spec, seconds); AssertionError when it does not end in time."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_translate, args=(child, graph, names, sizes), daemon=True)
    p.start()
    child.close()
    try:
        if not parent.poll(DEADLINE_S):
            raise AssertionError(f"graph_to_job did not answer within {DEADLINE_S:g} s (a graph walk that loops)")
        return parent.recv()
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)


def _lora_graph():
    """The standard graph with LoraLoader 20 (model and CLIP) then LoraLoaderModelOnly 21 in the model's chain."""
    g = standard_graph()
    g["20"] = {"inputs": {"lora_name": "a.safetensors", "strength_model": 0.8, "strength_clip": 1.0,
                          "model": ["12", 0], "clip": ["11", 0]}, "class_type": "LoraLoader"}
    g["21"] = {"inputs": {"lora_name": "b.safetensors", "strength_model": 0.5, "model": ["20", 0]},
               "class_type": "LoraLoaderModelOnly"}
    g["15"]["inputs"]["model"] = ["21", 0]
    g["6"]["inputs"]["clip"] = g["7"]["inputs"]["clip"] = ["20", 1]
    return g


def _self_link():
    g = standard_graph()
    g["15"]["inputs"]["model"] = ["15", 0]
    return g, {"15"}


def _two_loaders():
    g = _lora_graph()
    g["21"]["inputs"]["model"] = ["22", 0]
    g["22"] = {"inputs": {"lora_name": "a.safetensors", "strength_model": 1.0, "model": ["21", 0]},
               "class_type": "LoraLoaderModelOnly"}
    return g, {"21", "22"}


def _clip_of_itself():
    g = _lora_graph()
    g["20"]["inputs"]["clip"] = ["20", 1]
    return g, {"20"}


def _long_loop():
    """A loop through the shift node and both loaders (15 -> 21 -> 20 -> 15)."""
    g = _lora_graph()
    g["20"]["inputs"]["model"] = ["15", 0]
    return g, {"15", "20", "21"}


@pytest.mark.parametrize("shape", [_self_link, _two_loaders, _clip_of_itself, _long_loop],
                         ids=["self-link", "two-loaders", "clip-of-itself", "three-node-loop"])
def test_graph_cycles_are_node_errors_in_milliseconds(shape):
    graph, loop = shape()
    outcome, body, seconds = translate(graph)
    assert outcome == "refused", (outcome, body)
    assert seconds < 1.0
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert set(body["node_errors"]) == loop
    for node in loop:
        entry = body["node_errors"][node]
        assert entry["class_type"] == graph[node]["class_type"] and entry["dependent_outputs"] == ["9"]
        (err,) = [e for e in entry["errors"] if e["type"] == "dependency_cycle"]
        assert all(n in err["details"] for n in loop), err       # the message names the loop's nodes
        assert sorted(err["extra_info"]["cycle"]) == sorted(loop)


def test_deep_chains_are_bounded_not_a_recursion_error():
    """The longest chain the node limit allows walks without recursion trouble; a longer one is refused by count."""
    g = standard_graph()
    prev = "12"
    for i in range(100, 100 + 54):                  # 10 nodes + 54 loaders = 64, the limit
        g[str(i)] = {"inputs": {"lora_name": "a.safetensors", "strength_model": 0.1, "model": [prev, 0]},
                     "class_type": "LoraLoaderModelOnly"}
        prev = str(i)
    g["15"]["inputs"]["model"] = [prev, 0]
    outcome, body, seconds = translate(g)
    assert outcome == "refused" and seconds < 1.0, (outcome, body)
    assert "at most 8" in body["error"]["details"]           # the job's LoRA count, not a walk that broke
    deeper = copy.deepcopy(g)
    for i in range(200, 5200):
        deeper[str(i)] = {"inputs": {"shift": 3.0, "model": [str(i - 1) if i > 200 else prev, 0]},
                          "class_type": "ModelSamplingAuraFlow"}
    deeper["15"]["inputs"]["model"] = ["5199", 0]
    outcome, body, _ = translate(deeper)
    assert outcome == "refused" and body["error"]["type"] == "invalid_prompt", (outcome, body)


# ---------------------------------------------------------------- the front's handlers, a stand-in daemon


class FakeLink:
    """The daemon as the front sees it: INFO lists MODELS/loras/ as it is at each call (the daemon's RunLoras does);
    SUBMIT queues, or answers `refusal` (an ERROR) when one is set; a job's STATUS has no answer."""

    timeout_s = 5.0                              # DaemonLink's request_timeout_s
    sizes = ((128, 128),)                        # the packs INFO lists

    def __init__(self, models_dir: Path):
        self.models_dir, self.refusal, self.submitted = models_dir, None, []

    async def call(self, msg, cls, timeout_s=None):
        from orchestrator.http.link import DaemonDown, DaemonRefused
        if isinstance(msg, m.Info):
            packs = tuple(m.PackRef(width=w, height=h, dir=f"/packs/{w}", dtype="f16", blocks=2,
                                    source_name=TINY_NAMES["unet"], source_sha256="0" * 64, lora_rank=16)
                          for w, h in self.sizes)
            return m.Pipeline(id=msg.id, packs=packs, models={"text_encoder": TINY_NAMES["clip"],
                                                                "vae": TINY_NAMES["vae"]},
                              max_queue=8, version=VERSION, loras=tuple(list_loras(self.models_dir)))
        if isinstance(msg, m.Submit):
            if self.refusal is not None:
                raise DaemonRefused(self.refusal)
            self.submitted.append(msg)
            return m.Submitted(id=msg.id, job=f"job{len(self.submitted)}", seed=1, position=0)
        if isinstance(msg, m.Status):               # how a queued job is doing: not this test's concern
            raise DaemonDown("no answer")
        raise AssertionError(f"unexpected {type(msg).__name__}")

    async def status_pages(self, **kw):
        return
        yield                                       # an async generator of no pages: nothing is active

    async def close(self):
        pass


def _daemon_refusal(field: str, detail: str) -> m.Error:
    """The daemon's ERROR for a LoRA it refuses at submit (orchestrator/engine/daemon.py: LoraRefused -> PromptError)."""
    return m.error_reply(1, "bad_request", str(PromptError(field, detail)), field=field)


class Front:
    """The front's app over a FakeLink, on aiohttp's test server; `request` runs one request and gives
    (status, JSON body)."""

    def __init__(self, root: Path):
        from orchestrator.http.app import build_app, make_front
        from orchestrator.http.settings import HttpSettings
        self.models = root / "models"
        (self.models / "loras").mkdir(parents=True)
        for name in LORAS:
            (self.models / "loras" / name).write_bytes(b"x")
        cfg = SimpleNamespace(run_dir=root / "run", models_dir=self.models, backend="cpu", path=root / "p.toml")
        self.front = make_front(cfg, HttpSettings(), None)
        self.link = FakeLink(self.models)
        self.front.link = self.front.tracker.link = self.link
        self.build_app = build_app

    def request(self, method: str, path: str, body=None) -> tuple[int, dict]:
        return self.requests([(method, path, body)])[0]

    def requests(self, calls) -> list[tuple[int, dict]]:
        """Several requests on one server (`method` a callable: called between two requests)."""
        from aiohttp.test_utils import TestClient, TestServer

        async def go():
            out = []
            async with TestClient(TestServer(self.build_app(self.front))) as client:      # an app per loop
                for method, path, body in calls:
                    if callable(method):
                        method()
                        continue
                    resp = await client.request(method, path, json=body)
                    out.append((resp.status, await resp.json()))
            return out
        return asyncio.run(go())


@pytest.fixture
def front(tmp_path):
    f = Front(tmp_path)
    yield f
    f.front.link = None


def _two_lora_graph():
    g = _lora_graph()
    g["3"]["inputs"]["steps"] = 2
    return g


@pytest.mark.parametrize("field, detail, nodes", [
    ("loras[0]", "model pack /packs/128 (128x128) takes no LoRA (lora_rank 0); build a LoRA-ready pack", ["20"]),
    ("loras[1].name", "LoRA 'b.safetensors': resolves to /elsewhere/b.safetensors, outside loras/", ["21"]),
    ("loras", "the LoRAs' stacked rank 48 is over the pack's 16", ["20", "21"]),
], ids=["plain-pack", "symlinked-name", "rank-over-the-pack"])
def test_lora_refusals_over_prompt_are_node_errors_on_the_loader(front, field, detail, nodes):
    front.link.refusal = _daemon_refusal(field, detail)
    status, body = front.request("POST", "/prompt", {"prompt": _two_lora_graph()})
    assert status == 400, body
    assert set(body) == {"error", "node_errors"}, body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert sorted(body["node_errors"]) == nodes
    for node in nodes:
        entry = body["node_errors"][node]
        assert entry["class_type"].startswith("LoraLoader") and entry["dependent_outputs"] == ["9"]
        (err,) = entry["errors"]
        assert err["type"] == "custom_validation_failed" and err["extra_info"]["input_name"] == "lora_name"
        assert detail in err["details"] and "prompt.json" not in err["details"], err
    assert "prompt.json" not in body["error"]["details"]
    assert front.link.submitted == []


def test_daemon_field_refusals_name_no_prompt_json(front):
    """The daemon's word on a plain field over /prompt (on its node) and over A1111 (422): no "prompt.json:" text."""
    front.link.refusal = _daemon_refusal("width", "128x128 has a model pack but no VAE pack")
    status, body = front.request("POST", "/prompt", {"prompt": standard_graph()})
    assert status == 400 and list(body["node_errors"]) == ["5"], body
    (err,) = body["node_errors"]["5"]["errors"]
    assert "no VAE pack" in err["details"] and "prompt.json" not in err["details"], err
    front.link.refusal = _daemon_refusal("loras[0].name", "LoRA 'gone': no such file in loras/")
    status, body = front.request("POST", "/sdapi/v1/txt2img", {"prompt": "1girl <lora:gone:0.8>", "width": 128,
                                                               "height": 128, "steps": 2})
    assert status == 422, body
    assert body["field"] == "loras[0].name" and "no such file" in body["error"], body
    assert not body["error"].startswith("prompt.json"), body


def test_the_lora_list_follows_the_folder(front):
    """A LoRA added to MODELS/loras/ after the front started is in /object_info and taken by a graph at once."""
    loras = front.models / "loras"
    g = _two_lora_graph()
    g["21"]["inputs"]["lora_name"] = "sub/new.safetensors"

    def add():
        (loras / "sub").mkdir()
        (loras / "sub" / "new.safetensors").write_bytes(b"x")

    def remove():
        (loras / "a.safetensors").unlink()

    choices = "/object_info/LoraLoaderModelOnly"
    first, refused, listed, taken, gone = front.requests([
        ("GET", choices, None), ("POST", "/prompt", {"prompt": g}), (add, None, None),
        ("GET", choices, None), ("POST", "/prompt", {"prompt": g}), (remove, None, None),
        ("POST", "/prompt", {"prompt": g})])
    lora_names = lambda b: b["LoraLoaderModelOnly"]["input"]["required"]["lora_name"][0]  # noqa: E731
    assert lora_names(first[1]) == list(LORAS)
    assert refused[0] == 400 and "value_not_in_list" in str(refused[1])
    assert lora_names(listed[1]) == ["a.safetensors", "b.safetensors", "sub/new.safetensors"]
    assert taken[0] == 200, taken
    assert gone[0] == 400 and list(gone[1]["node_errors"]) == ["20"], gone       # a.safetensors went


def test_lora_listing_lists_again_only_when_a_folder_changed(tmp_path, monkeypatch):
    """The front's and the daemon's LoRA list (orchestrator.engine.loras.LoraListing): the folders' mtimes are the key; a
    folder changed within FRESH_S is listed again at every look until it settles (a coarse mtime clock)."""
    import orchestrator.engine.loras as lo
    calls = []
    monkeypatch.setattr(lo, "list_loras", lambda d: calls.append(d) or list_loras(d))
    loras = tmp_path / "loras"
    (loras / "sub").mkdir(parents=True)
    (loras / "a.safetensors").write_bytes(b"x")

    def settle(age_s: float):
        for d in (loras, loras / "sub"):
            os.utime(d, (time.time() - age_s, time.time() - age_s))

    listing = lo.LoraListing(tmp_path)
    assert listing.names() == ["a.safetensors"] and listing.names() == ["a.safetensors"]
    assert len(calls) == 2                                  # just written: not trusted yet
    settle(3600)
    listing.names(), listing.names(), listing.names()
    assert len(calls) == 3                                  # settled: listed once, then the cache
    (loras / "sub" / "b.safetensors").write_bytes(b"x")     # a folder under loras/ changed
    settle(1800)
    assert listing.names() == ["a.safetensors", "sub/b.safetensors"] and len(calls) == 4
    assert lo.LoraListing(tmp_path / "none").names() == [] and lo.LoraListing(None).names() == []


# ---------------------------------------------------------------- A1111 tags


@pytest.mark.parametrize("text, want", [
    ("1girl <lora:style:0.8>", "1girl"),
    ("<lora:style:0.8> 1girl", "1girl"),
    ("1girl <lora:style:0.8> smile", "1girl smile"),
    ("1girl, <lora:style:0.8>, smile", "1girl, , smile"),          # A1111: what is around the tag stays
    ("1girl,<lora:style:0.8>smile", "1girl,smile"),
    ("1girl <lora:style:0.8> <lora:b:0.5>", "1girl"),
    ("1girl\n<lora:style:0.8>\nsmile", "1girl\nsmile"),
    ("1girl  <lora:style :0.8>", "1girl"),
])
def test_a1111_tags_leave_no_whitespace_of_their_own(text, want):
    """`1girl <lora:style:0.8>` is the prompt `1girl` (with --lora style:0.8), not `1girl ` (a Qwen token more)."""
    out, tags = split_lora_tags(text)
    assert out == want
    assert tags[0] == LoraTag("style", 0.8, 0.8)
