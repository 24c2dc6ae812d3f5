"""ComfyUI's API, the subset a text-to-image client uses (shapes as ComfyUI's server.py answers them):

    POST /prompt {"prompt": API graph, "client_id"}  -> {"prompt_id", "number", "node_errors"} | 400 {"error", "node_errors"}
    GET  /prompt                                     -> {"exec_info": {"queue_remaining"}}
    GET  /queue                                      -> {"queue_running": [item], "queue_pending": [item]}
    POST /queue {"clear": true} | {"delete": [id]}   -> 200: waiting prompts removed (a running one is left alone)
    POST /interrupt [{"prompt_id"}]                  -> 200: the running job is cancelled
    GET  /history[?max_items=N], /history/{id}       -> {prompt_id: {"prompt", "outputs", "status", "meta"}}
    POST /history {"delete": [id]} | {"clear": true} -> 200: accepted; the board's job records stay (prune)
    GET  /view?filename=&subfolder=&type=output      -> the file (image.png, timing.png, report.json of a job)
    POST /upload/image, /upload/mask; GET /view?type=input|temp -> uploaded images (orchestrator/http/uploads.py)
    GET  /system_stats, /object_info[/{class}], /embeddings
    GET  /ws?clientId=                               -> status, execution_start, executing, progress, executed,
                                                        execution_success | execution_error | execution_interrupted;
                                                        a first feature_flags from the client is answered
Every route is also served under /api (as ComfyUI does). The prompt id is the job id; a graph of independent chains
runs as one job per chain, its prompt id the first's (orchestrator/http/comfy_prompt.py).
"""
from __future__ import annotations

import asyncio
import os
import platform
import sys

import psutil
from aiohttp import web

from models.runtime.backends import backend_class
from orchestrator.engine import inputs
from orchestrator.http.comfy_graph import (GraphError, GraphJob, checked_job, field_error, field_nodes, mapped_jobs,
                                          sized_to_image)
from orchestrator.http.comfy_nodes import node_table, object_info
from orchestrator.http import comfy_shapes as shapes
from orchestrator.http import files, uploads
from orchestrator.http.comfy_prompt import group, prompt_parts
from orchestrator.http.common import FRONT, cancel_job, from_daemon, json_response, read_json, refuse, submit_job
from orchestrator.http.link import DaemonDown, DaemonRefused
from orchestrator.http.views import JobView
from orchestrator.engine.job_record import JOB_ID_RE
from protocol import messages as m
from protocol.version import VERSION

COMFY_VERSION = f"anima-npu {VERSION}"      # what system_stats reports as comfyui_version
HISTORY_PAGE = 32               # jobs per STATUS while collecting /history
MAX_HISTORY_ITEMS = 1024


def _no_prompt() -> web.Response:
    err = {"type": "no_prompt", "message": "No prompt provided", "details": "No prompt provided", "extra_info": {}}
    return json_response({"error": err, "node_errors": {}}, 400)


async def post_prompt(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    body = await read_json(request)
    if "prompt" not in body:
        return _no_prompt()
    extra = body.get("extra_data")
    client_id = body.get("client_id")
    if client_id is None and isinstance(extra, dict):
        client_id = extra.get("client_id")
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 128):
        raise refuse(400, "client_id must be a string of at most 128 characters")
    info = await front.tracker.info()
    names = await front.tracker.names()
    try:
        sizes = [(p.width, p.height) for p in info.packs]
        jobs = [checked_job(body["prompt"], await _sized(front, body["prompt"], job, sizes), sizes)
                for job in mapped_jobs(body["prompt"], names=names, sizes=sizes)]
    except GraphError as e:
        return json_response(e.body(), 400)
    subs = []
    for k, job in enumerate(jobs):
        try:
            subs.append(await submit_job(front, job.record, _origin(body["prompt"], jobs, k, client_id, subs)))
        except (DaemonRefused, DaemonDown) as e:
            await _withdraw(front, subs)             # a prompt is queued whole or not at all
            # the daemon's word on a field of the job (a size without a VAE pack, a LoRA it cannot apply: a plain
            # pack, a name that leads out of loras/, a stack over the pack's rank), put on the node that carries it
            if isinstance(e, DaemonRefused) and e.code == "bad_request" and field_nodes(body["prompt"], job,
                                                                                        e.field) is not None:
                return json_response(field_error(body["prompt"], job, e.field, e.message).body(), 400)
            raise from_daemon(e) from None
    return json_response({"prompt_id": subs[0].job, "number": subs[0].position, "node_errors": {}})


async def _sized(front, graph: dict, job: GraphJob, sizes) -> GraphJob:
    """A job from an encoded image at its upload's size (checked against the packs' `sizes`)."""
    if "init_image" not in job.spec:
        return job
    size = await asyncio.to_thread(inputs.upload_size, front.rf.root, job.spec["init_image"])
    return sized_to_image(graph, job, size, sizes) if size else job


def _origin(graph: dict, jobs: list[GraphJob], k: int, client_id, subs) -> dict:
    """What chain `k`'s job keeps of the prompt: the nodes every chain uses (the graph /queue and /history show and
    each PNG holds, as ComfyUI's SaveImage writes the whole prompt), its roles; with several chains its place and the
    prompt's id (the first's job)."""
    used = {n for job in jobs for n in job.nodes.values()}
    origin = {"api": "comfyui", "client_id": client_id, "graph": {n: v for n, v in graph.items() if n in used},
              "nodes": jobs[k].nodes}
    if len(jobs) > 1:
        origin.update(chain=k, chains=len(jobs), **({"prompt_id": subs[0].job} if k else {}))
    return origin


async def _withdraw(front, subs) -> None:
    """Cancel the jobs of a prompt queued before one of its chains was refused (quietly: the client heard a 4xx)."""
    for sub in subs:
        front.tracker.silenced.add(sub.job)
        try:
            await front.link.call(m.Cancel(job=sub.job), m.Ok)
        except (DaemonRefused, DaemonDown):
            pass                                     # ended or unreachable: nothing more to take back


async def get_prompt(request: web.Request) -> web.Response:
    tracker = request.app[FRONT].tracker
    await tracker.fresh()
    return json_response({"exec_info": {"queue_remaining": tracker.queue_remaining()}})


async def get_queue(request: web.Request) -> web.Response:
    tracker = request.app[FRONT].tracker
    active = await tracker.fresh()
    names = await tracker.names()
    prompts = group(active.values())
    return json_response({"queue_running": [shapes.queue_item(p, names) for p in prompts if p.running],
                          "queue_pending": [shapes.queue_item(p, names) for p in prompts if not p.running]})


async def post_queue(request: web.Request) -> web.Response:
    """ComfyUI's queue edits: "clear" (true) removes every waiting prompt, "delete" the waiting prompts it names. As
    ComfyUI's delete_queue_item, only the queue is looked in: a running prompt is left alone (the daemon checks it
    still waits: CANCEL queued_only), an unknown or finished one ignored."""
    front = request.app[FRONT]
    body = await read_json(request)
    wanted = set(_prompt_ids(body, "delete"))
    waiting = [p for p in group((await front.tracker.fresh(0.0)).values()) if not p.running]
    ids = [j.id for p in waiting if body.get("clear") or p.id in wanted for j in p.parts]
    for job_id in dict.fromkeys(ids):
        try:
            await front.link.call(m.Cancel(job=job_id, queued_only=True), m.Ok)
        except DaemonRefused as e:
            if not e.unknown_job:
                raise from_daemon(e) from None
    await front.tracker.fresh(0.0)
    return web.Response(status=200)


async def post_interrupt(request: web.Request) -> web.Response:
    """Cancel the running job (only when it is `prompt_id`, if the body names one)."""
    front = request.app[FRONT]
    want = None
    if request.can_read_body:
        body = await read_json(request)
        want = body.get("prompt_id")
        if want is not None and not isinstance(want, str):
            raise refuse(400, "prompt_id must be a string")
    await front.tracker.fresh(0.0)
    job = front.tracker.running()
    if job is not None and want in (None, job.prompt_id):
        try:
            await cancel_job(front, job.id)
        except DaemonRefused:
            pass                                     # it ended meanwhile: nothing to interrupt
        await front.tracker.end_prompt(job)          # and its chains still to run
    return web.Response(status=200)


def _finished(jobs) -> list[JobView]:
    return [v for v in map(JobView.of, jobs) if v.finished]


def _history(jobs: list[JobView], names) -> dict:
    """The finished prompts among finished jobs (every chain's job listed), oldest first."""
    return {p.id: shapes.history_entry(p, names) for p in group(jobs) if p.finished}


async def get_history(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    text = request.query.get("max_items")
    try:
        max_items = int(text) if text is not None else 64
        if not 1 <= max_items <= MAX_HISTORY_ITEMS:
            raise ValueError
    except ValueError:
        raise refuse(400, f"max_items must be an integer in 1..{MAX_HISTORY_ITEMS}") from None
    out: list[JobView] = []
    async for page in front.link.status_pages(detail=True, limit=HISTORY_PAGE):
        out = _finished(page) + out
        if len({j.prompt_id for j in out}) > max_items:      # one more: the oldest may lack a chain
            break
    names = await front.tracker.names()
    history = _history(out, names)
    return json_response(dict(list(history.items())[-max_items:]))


def _prompt_ids(body: dict, key: str) -> list[str]:
    """body[key] (absent: none) as ComfyUI's list of prompt ids; else a 400 naming the field."""
    ids = body.get(key, [])
    if not isinstance(ids, list) or len(ids) > MAX_HISTORY_ITEMS or not all(isinstance(d, str) for d in ids):
        raise refuse(400, f"{key} must be a list of at most {MAX_HISTORY_ITEMS} prompt ids", field=key)
    return ids


async def post_history(request: web.Request) -> web.Response:
    """ComfyUI's history edits ({"delete": [id]}, {"clear": true}: what SwarmUI sends after it took a prompt's
    images) are accepted and change nothing: the front keeps no history of its own, and a job's record, folder and
    image are the board's, kept until `orchestrator prune` (docs/http.md)."""
    body = await read_json(request)
    _prompt_ids(body, "delete")
    if not isinstance(body.get("clear", False), bool):
        raise refuse(400, "clear must be true or false", field="clear")
    return web.Response(status=200)


async def get_history_item(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    prompt_id = request.match_info["prompt_id"]
    if not JOB_ID_RE.match(prompt_id):
        return json_response({})                      # ComfyUI: an unknown id has no history
    try:
        reply = await front.link.call(m.Status(job=prompt_id, detail=True), m.Jobs)
    except DaemonRefused as e:
        if e.unknown_job:
            return json_response({})
        raise
    first = JobView.of(reply.jobs[0])
    if first.prompt_id != first.id:
        return json_response({})                      # a later chain's job: its prompt has the first's id
    prompt = await prompt_parts(front.link, first)
    names = await front.tracker.names()
    return json_response(_history(list(prompt.parts), names))


async def get_view(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    q = request.query
    if "filename" not in q:
        raise refuse(404, "filename is required")
    if uploads.serves(q.get("type", "output"), q.get("subfolder", "")):
        return await uploads.view(request, q["filename"], q.get("subfolder", ""), q.get("type", "output"))
    try:
        path, ctype = files.resolve(front.rf.jobs, q["filename"], q.get("subfolder", ""), q.get("type", "output"))
        data = await files.read_async(path)
    except files.BadName as e:
        raise refuse(400, str(e)) from None
    except OSError:
        raise refuse(404, "no such file") from None
    return web.Response(body=data, content_type=ctype,
                        headers={"Content-Disposition": f'filename="{path.name}"', "Cache-Control": "no-cache"})


async def get_system_stats(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    mem = psutil.virtual_memory()
    return json_response({
        "system": {"os": os.name, "ram_total": mem.total, "ram_free": mem.available, "comfyui_version": COMFY_VERSION,
                   "python_version": sys.version, "pytorch_version": "", "embedded_python": False, "argv": sys.argv,
                   "machine": platform.machine()},
        "devices": [{"name": f"{front.cfg.backend} executor ({platform.machine()})",
                     "type": backend_class(front.cfg.backend).device, "index": 0, "vram_total": 0, "vram_free": 0,
                     "torch_vram_total": 0, "torch_vram_free": 0}]})


async def get_object_info(request: web.Request) -> web.Response:
    # asked of the daemon each time: a client's liveness check (SwarmUI's) sees a 503 while the daemon is down, and
    # the model lists are the daemon's, never a guess that would take any name
    await request.app[FRONT].tracker.info(fresh=True)
    names = await request.app[FRONT].tracker.names()
    # the loaders' image choices are the input folder's (the node table's are not listed there)
    info = {**object_info(node_table(names)), **uploads.loader_nodes(uploads.input_images(request.app[FRONT]))}
    cls = request.match_info.get("node_class")
    if cls is not None:
        info = {cls: info[cls]} if cls in info else {}
    return json_response(info)


async def get_embeddings(request: web.Request) -> web.Response:
    return json_response([])


async def websocket(request: web.Request) -> web.StreamResponse:
    return await request.app[FRONT].hub.handle(request)


ROUTES = [("POST", "/prompt", post_prompt), ("GET", "/prompt", get_prompt), ("GET", "/queue", get_queue),
          ("POST", "/queue", post_queue),
          ("POST", "/interrupt", post_interrupt), ("GET", "/history", get_history), ("POST", "/history", post_history),
          ("GET", "/history/{prompt_id}", get_history_item), ("GET", "/view", get_view),
          ("GET", "/system_stats", get_system_stats), ("GET", "/object_info", get_object_info),
          ("GET", "/object_info/{node_class}", get_object_info), ("GET", "/embeddings", get_embeddings),
          ("GET", "/ws", websocket)] + uploads.ROUTES


def add_routes(app: web.Application) -> None:
    """Each route at its path and under /api, as ComfyUI serves them."""
    for prefix in ("", "/api"):
        for method, path, handler in ROUTES:
            app.router.add_route(method, prefix + path, handler)

