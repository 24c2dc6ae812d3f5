"""The web page at `/` (plain HTML/JS/CSS from static/, no build step) and the small JSON API it uses:

    GET  /anima/info                 sizes with packs (default first), defaults, limits, the LoRAs (MODELS/loras/)
    GET  /anima/jobs?before=&limit=  the newest jobs with their prompt, settings, state and file links (`more`)
    POST /anima/jobs                 {prompt, negative_prompt, seed (digits)|null, steps, cfg, width, height,
                                      sampler, scheduler, spectrum, cache, loras, batch, hires, and from an upload
                                      (/upload/image) init_image, denoise, resize_mode, mask, grow_mask_by;
                                      client_id} -> {"job", "seed", "position", "text"}
Seeds travel as strings of digits here: 64-bit seeds do not fit a JavaScript number.
    POST /anima/estimate             the same form body -> the job's MODELLED board seconds (orchestrator/engine/estimate.py:
                                      {"job_s", "encode_s", "denoise_s", "decode_s", "calls", "passes", "notes",
                                      "line", ...}); checked by the daemon as a submit is, nothing queued
    POST /anima/jobs/{job}/cancel    -> {"note"}
    GET  /anima/jobs/{job}/timing    the job's timing panels as data (orchestrator.engine.timing_plot.plot_data of its
                                      report.json, with the plot's colours): the page draws them at the screen's width
    GET  /favicon.ico                the page's icon (static/icon.svg)
Live progress comes over /ws (`anima.progress`, `anima.job`, and ComfyUI's messages for the page's own jobs).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from aiohttp import web

from models.sampling.bounds import CFG, STEPS
from models.sampling.sampler import DEFAULT_SAMPLER, DEFAULT_SCHEDULER, SAMPLERS, SCHEDULER_NAMES, spectrum_refusal
from models.sampling.latent_ops import IMAGE_SCALE_METHODS, UPSCALE_METHODS
from models.sampling.step_cache import NODE_NAMES as CACHE_NODES, CacheSettings
from models.lora.choice import MAX_LORAS
from orchestrator.http import files
from orchestrator.http.common import FRONT, cancel_job, json_response, read_json, refuse, submit_job
from orchestrator.http.link import DaemonRefused
from orchestrator.http.views import JobView
from orchestrator.engine.job_record import JOB_ID_RE
from orchestrator.engine.progress_text import phase_text
from orchestrator.engine.prompt_spec import DEFAULT_CFG, DEFAULT_STEPS, MAX_PROMPT_CHARS
from protocol.prompt import MAX_BATCH, MAX_HIRES_SCALE, HiresSettings
from protocol import messages as m

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "cfg", "width", "height", "sampler", "scheduler",
               "spectrum", "cache", "loras", "batch", "hires",
               "init_image", "denoise", "resize_mode", "mask", "mask_channel", "grow_mask_by")
MAX_PAGE = 48
# the hires controls: the upscale methods by space the flow runs (the latent ones; prompt.json's "pixel" space is
# listed here once the flow runs it), the scale bounds and the second pass's default denoise, from prompt.json's record
HIRES_CHOICES = {"methods": {"latent": list(UPSCALE_METHODS), "pixel": list(IMAGE_SCALE_METHODS)},
                 "max_scale": MAX_HIRES_SCALE,
                 "denoise": HiresSettings().denoise, "method": HiresSettings().method}


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def info(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    pipe = await front.tracker.info()
    return json_response({
        "sizes": [[p.width, p.height] for p in pipe.packs], "blocks": {f"{p.width}x{p.height}": p.blocks
                                                                       for p in pipe.packs},
        "defaults": {"steps": DEFAULT_STEPS, "cfg": DEFAULT_CFG, "spectrum": True, "sampler": DEFAULT_SAMPLER,
                     "scheduler": DEFAULT_SCHEDULER},
        # per size, the settings its pack records for its model (models/packs/sampling.py): the form takes them
        "sampling": {f"{p.width}x{p.height}": p.sampling.to_dict() for p in pipe.packs if p.sampling is not None},
        "limits": {"steps": STEPS.hi, "cfg": CFG.hi, "prompt_chars": MAX_PROMPT_CHARS, "loras": MAX_LORAS,
                   "batch": MAX_BATCH},
        "least": {"steps": STEPS.lo, "cfg": CFG.lo},          # the form's minimums (models/sampling/bounds.py)
        "hires": HIRES_CHOICES,
        # the pickers: every sampler with its model calls per step and why Spectrum does not fit it (None: it does)
        "samplers": [{"name": s.name, "nfe": s.nfe, "spectrum": spectrum_refusal(s.name)} for s in SAMPLERS.values()],
        "schedulers": list(SCHEDULER_NAMES),
        # the step caches the page offers (ComfyUI's EasyCache and LazyCache, their defaults): prompt.json's `cache`
        "caches": [{"kind": k, "name": n, **CacheSettings(kind=k).to_dict()} for k, n in CACHE_NODES.items()],
        "max_queue": pipe.max_queue, "version": pipe.version,
        "model": next((p.source_name for p in pipe.packs if p.source_name), ""), "loras": list((await front.tracker.names()).lora),
        "lora_ranks": {f"{p.width}x{p.height}": p.lora_rank for p in pipe.packs}})


def job_json(front, job: JobView, blocks: int | None = None) -> dict:
    """A job for the page: its settings, state, progress and the URLs of its files (those that exist)."""
    urls = {}
    for name in files.ALLOWED:
        try:
            path, _ = files.resolve(front.rf.jobs, name, job.id)
        except (files.BadName, OSError):
            continue
        if os.path.isfile(path):
            urls[name.split(".")[0]] = f"/view?filename={name}&subfolder={job.id}&type=output"
    spec = {k: job.spec.get(k) for k in PAGE_FIELDS if k in job.spec}
    if "seed" in spec:
        spec["seed"] = str(spec["seed"])                 # 64-bit seeds do not fit a JavaScript number
    if isinstance(spec.get("spectrum"), dict):
        spec["spectrum"] = bool(spec["spectrum"].get("enabled"))
    return {"job": job.id, "state": job.state, "created": job.info.created, "updated": job.info.updated,
            "api": job.api, "error_stage": job.info.error_stage, "error": job.info.error, "spec": spec,
            "progress": job.progress_fields(blocks), "files": urls}


async def list_jobs(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    before = request.query.get("before") or None
    if before is not None and not JOB_ID_RE.match(before):
        raise refuse(400, "before must be a job id")
    try:
        limit = int(request.query.get("limit", "24"))
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError
    except ValueError:
        raise refuse(400, f"limit must be an integer in 1..{MAX_PAGE}") from None
    reply = await front.link.call(m.Status(detail=True, before=before, limit=limit), m.Jobs)
    jobs = [JobView.of(i) for i in reversed(reply.jobs)]                      # newest first
    return json_response({"jobs": [job_json(front, j, front.tracker.blocks_of(j)) for j in jobs],
                          "more": reply.more})


async def form_body(request: web.Request) -> tuple:
    """(the page's form as a prompt.json object, its client_id): unknown fields refused, the seed's digits read."""
    body = await read_json(request)
    client_id = body.pop("client_id", None)
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 128):
        raise refuse(400, "client_id must be a string of at most 128 characters", field="client_id")
    unknown = sorted(set(body) - set(PAGE_FIELDS))
    if unknown:
        raise refuse(400, f"unknown field(s) {unknown}; allowed: {', '.join(PAGE_FIELDS)}", field=unknown[0])
    seed = body.get("seed")
    if isinstance(seed, str):                            # the page sends digits: a JavaScript number loses bits
        if not (seed.isascii() and seed.isdigit() and len(seed) <= 20):
            raise refuse(400, "seed must be a whole number", field="seed")
        body["seed"] = int(seed)
    return body, client_id


async def post_job(request: web.Request) -> web.Response:
    """The page's form: a prompt.json object (the daemon validates it: errors name the field) plus client_id."""
    front = request.app[FRONT]
    body, client_id = await form_body(request)
    sub = await submit_job(front, body, {"api": "page", "client_id": client_id})
    queued = m.JobInfo(job=sub.job, state="queued", created=0.0, updated=0.0, position=sub.position)
    return json_response({"job": sub.job, "seed": str(sub.seed), "position": sub.position,
                          "text": phase_text(queued)})


async def post_estimate(request: web.Request) -> web.Response:
    """The form priced on the board model by the daemon (checked as a submit is; nothing queued): modelled seconds
    and the `estimate ...` line."""
    from orchestrator.engine.prompt_spec import PromptError, prompt_record
    front = request.app[FRONT]
    body, _ = await form_body(request)
    try:
        prompt = prompt_record(body)
    except PromptError as e:
        raise DaemonRefused(m.error_reply(0, "bad_request", str(e), field=e.field)) from None
    reply = await front.link.call(m.EstimateJob(prompt=prompt, base_dir=str(front.rf.root)), m.Estimated)
    from orchestrator.engine.estimate import Estimate
    est = Estimate.from_dict(json.loads(reply.estimate))
    return json_response({**est.to_dict(), "line": est.line()})


async def timing(request: web.Request) -> web.Response:
    """The job's timing panels as data, for the page's report view (drawn there at the screen's width; timing.png is
    the daemon's fixed-width picture of the same data)."""
    from orchestrator.engine.timing_plot import plot_data, series_colours
    front = request.app[FRONT]
    job = request.match_info["job"]
    if not JOB_ID_RE.match(job):
        raise refuse(400, "not a job id")
    try:
        path, _ = files.resolve(front.rf.jobs, "report.json", job)
        report = json.loads(await files.read_async(path))
        data = plot_data(report)
    except OSError:
        raise refuse(404, f"job {job} has no report.json (yet)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise refuse(404, f"job {job}'s report.json cannot be read: {e}"[:300]) from None
    return json_response({**data, "colours": series_colours(data)})


async def favicon(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "icon.svg", headers={"Content-Type": "image/svg+xml",
                                                               "Cache-Control": "max-age=86400"})


async def post_cancel(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    job = request.match_info["job"]
    if not JOB_ID_RE.match(job):
        raise refuse(400, "not a job id")
    return json_response({"note": await cancel_job(front, job)})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False, show_index=False)
    app.router.add_get("/anima/info", info)
    app.router.add_get("/anima/jobs", list_jobs)
    app.router.add_post("/anima/jobs", post_job)
    app.router.add_post("/anima/jobs/{job}/cancel", post_cancel)
    app.router.add_get("/anima/jobs/{job}/timing", timing)
    app.router.add_post("/anima/estimate", post_estimate)
