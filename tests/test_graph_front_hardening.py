"""Issue 30, the graph front: ComfyUI graphs that loop are a 400 with node_errors naming the loop, in milliseconds
(every walk of a graph is bounded); the daemon's LoRA refusals over /prompt are node_errors on the loader node, and
no HTTP message starts with "prompt.json:"; the LoRA list follows MODELS/loras/ as it is now; an A1111 LoRA tag
leaves no whitespace of its own in the prompt.

No pipeline: graph_to_job runs in a forked child with a deadline (a loop must fail the test, not hang it); the front's
handlers run on aiohttp's test server with a stand-in daemon link."""
from __future__ import annotations

import copy
import multiprocessing
import time

import pytest

from orchestrator.comfy_graph import GraphError, ModelNames, graph_to_job
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
