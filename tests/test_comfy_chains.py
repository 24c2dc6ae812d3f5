"""Independent chains in one ComfyUI graph (orchestrator/http/comfy_graph.graph_to_jobs): one job per chain, in the graph's
order, shared loaders and prompts; the prompt's /queue and /history shapes and its WebSocket ending
(orchestrator/http/comfy_prompt.py, comfy_shapes.py) over stand-in job records."""
from __future__ import annotations

import json

import pytest

from orchestrator.http.comfy_graph import GraphError, graph_to_job, graph_to_jobs
from orchestrator.http.comfy_nodes import ModelNames
from orchestrator.http import comfy_shapes as shapes
from orchestrator.http.comfy_prompt import PromptView, group
from orchestrator.http.views import JobView
from protocol import messages as m
from tests.comfy_graphs import edited, standard_graph, two_chains

G = standard_graph()


def test_two_seeds_are_two_jobs_in_the_graph_order():
    jobs = graph_to_jobs(two_chains(G, seed=77))
    assert [j.output for j in jobs] == ["9", "29"]
    one, two = (j.spec for j in jobs)
    assert one == graph_to_job(G).spec and two == {**one, "seed": 77}
    assert (jobs[1].nodes["sampler"], jobs[1].nodes["decode"], jobs[1].nodes["save"]) == ("23", "28", "29")
    shared = ("unet", "clip", "vae", "positive", "negative", "latent")
    assert all(jobs[0].nodes[r] == jobs[1].nodes[r] for r in shared)


def test_chains_follow_the_order_of_their_outputs_and_may_differ_in_size_and_prompt():
    g = two_chains(G, steps=3)
    g["24"] = {"inputs": {"text": "another prompt", "clip": ["11", 0]}, "class_type": "CLIPTextEncode"}
    g["25"] = {"inputs": {"width": 64, "height": 128, "batch_size": 1}, "class_type": "EmptySD3LatentImage"}
    g["23"]["inputs"].update(positive=["24", 0], latent_image=["25", 0])
    g = {"29": g.pop("29"), **g}                    # the second chain's output first in the graph
    first, second = graph_to_jobs(g)
    assert first.output == "29" and second.output == "9"
    assert (first.spec["prompt"], first.spec["width"], first.spec["height"], first.spec["steps"]) == (
        "another prompt", 64, 128, 3)
    assert second.spec == graph_to_job(G).spec


def test_one_job_callers_refuse_a_second_chain():
    with pytest.raises(GraphError) as e:
        graph_to_job(two_chains(G))
    assert "29" in e.value.node_errors and "independent chain" in e.value.node_errors["29"]["errors"][0]["details"]


def test_every_chains_problems_in_one_400():
    g = edited(two_chains(G), "23", steps=0)
    g = edited(g, "3", cfg=1000.0)
    with pytest.raises(GraphError) as e:
        graph_to_jobs(g)
    assert set(e.value.node_errors) == {"3", "23"}
    g = edited(two_chains(G), "23", sampler_name="no_such_sampler")
    with pytest.raises(GraphError) as e:
        graph_to_jobs(g)
    assert set(e.value.node_errors) == {"23"}


def test_a_hires_second_pass_is_one_chain_not_two():
    """Two outputs sharing a sampler are one chain: here a second KSampler on the first's upscaled latent, each
    decoded and saved, is one job (or refused as one), never two jobs."""
    g = two_chains(G)
    g["30"] = {"inputs": {"samples": ["3", 0], "upscale_method": "nearest-exact", "scale_by": 1.5},
               "class_type": "LatentUpscaleBy"}
    g["23"]["inputs"]["latent_image"] = ["30", 0]
    try:
        jobs = graph_to_jobs(g)
    except GraphError:
        return                                       # one chain of two images: refused as one job
    assert len(jobs) == 1


def _view(job_id, state, graph, job, k, n, prompt_id=None, error="", stage=""):
    origin = {"api": "comfyui", "client_id": "c", "graph": graph, "nodes": job.nodes, "chain": k, "chains": n}
    if prompt_id:
        origin["prompt_id"] = prompt_id
    return JobView.of(m.JobInfo(job=job_id, state=state, created=1.0 + k, updated=2.0 + k, error=error,
                                error_stage=stage, spec_json=json.dumps(job.spec), origin=json.dumps(origin)))


def test_history_and_messages_of_a_prompt_of_two_chains():
    g = two_chains(G)
    a, b = graph_to_jobs(g)
    one = _view("20260101-000000-aaaaaa", "done", g, a, 0, 2)
    two = _view("20260101-000001-bbbbbb", "done", {}, b, 1, 2, prompt_id=one.id)
    (prompt,) = group([two, one])
    assert prompt.id == one.id and prompt.finished and [p.id for p in prompt.parts] == [one.id, two.id]
    entry = shapes.history_entry(prompt, ModelNames())
    assert entry["prompt"][1] == one.id and entry["prompt"][2] == g and entry["prompt"][4] == ["9", "29"]
    assert entry["outputs"] == {"9": {"images": [{"filename": "image.png", "subfolder": one.id, "type": "output"}]},
                                "29": {"images": [{"filename": "image.png", "subfolder": two.id, "type": "output"}]}}
    assert entry["status"]["status_str"] == "success"
    # the first chain's end is its outputs only; the prompt ends with the last
    first = shapes.end(one, ModelNames())
    assert [k for k, _ in first] == ["executing", "executed"] and first[1][1]["prompt_id"] == one.id
    last = shapes.end(two, ModelNames())
    assert [k for k, _ in last] == ["executing", "executed", "execution_success", "executing"]
    assert all(d["prompt_id"] == one.id for _, d in last) and last[-1][1]["node"] is None
    assert shapes.start(two) == [] and [k for k, _ in shapes.start(one)] == ["execution_start", "execution_cached"]
    # half a prompt has no history yet; a later chain counts the prompt as running
    assert not PromptView((one,)).finished and not PromptView((two,)).finished
    assert PromptView((_view(two.id, "queued", {}, b, 1, 2, prompt_id=one.id),)).running


def test_a_failed_chain_ends_the_prompt_as_comfyui_reports_a_node_error():
    g = two_chains(G)
    a, b = graph_to_jobs(g)
    one = _view("20260101-000000-aaaaaa", "done", g, a, 0, 2)
    own = {n: g[n] for n in b.nodes.values()}      # a later chain keeps the nodes it uses
    two = _view("20260101-000001-bbbbbb", "failed", own, b, 1, 2, prompt_id=one.id, error="boom", stage="executor")
    msgs = shapes.end(two, ModelNames())
    assert [k for k, _ in msgs] == ["execution_error", "executing"]
    assert msgs[0][1]["node_id"] == "23" and msgs[0][1]["node_type"] == "KSampler"
    assert msgs[0][1]["prompt_id"] == one.id and msgs[0][1]["exception_message"] == "boom"
    entry = shapes.history_entry(PromptView((one, two)), ModelNames())
    assert entry["status"]["status_str"] == "error" and entry["status"]["messages"][-1][0] == "execution_error"
    assert list(entry["outputs"]) == ["9"]           # what executed before the error, as ComfyUI keeps it
