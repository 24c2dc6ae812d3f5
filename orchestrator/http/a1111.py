"""A1111's web UI API, the text-to-image subset (shapes as stable-diffusion-webui's modules/api answers them):

    POST /sdapi/v1/txt2img   {prompt, negative_prompt, seed (-1 random), steps, cfg_scale, width, height,
                              sampler_name, scheduler, ...}  -> {"images": [base64 PNG], "parameters" (the
                              request with what ran: `parameters()`), "info": JSON text}
    GET  /sdapi/v1/progress  -> {"progress", "eta_relative", "state": {...}, "current_image", "textinfo"}: over the
                              whole request (`request_progress`)
    GET  /sdapi/v1/sd-models, /samplers, /schedulers, /scripts, /options
    POST /sdapi/v1/interrupt -> {} (the running job is cancelled)

enable_hr is a hires pass (prompt.json `hires`: the Latent upscalers and the plain Lanczos / Nearest ones, hr_prompt,
hr_negative_prompt, hr_sampler_name, hr_scheduler, Forge's hr_cfg); batch_size x n_iter run as that many jobs,
one after another (a client that goes away: the rest are not queued).
A1111 fields this pipeline cannot honour (styles, scripts, face restoration, tiling, subseeds, setting overrides,
hr_checkpoint_name, the model upscalers) are refused with 422 naming the field unless they hold their default;
sampler_name and scheduler are A1111's names (orchestrator/http/a1111_names.py: "Euler a", "DPM++ 2M Karras", "Karras"
...), run as ComfyUI runs them; sampler internals (eta, s_churn, s_tmin, s_tmax, s_noise: ComfyUI's defaults are used)
and unknown fields are ignored, as A1111 ignores unknown fields. `<lora:NAME:S>` tags in the prompt
(models/lora/a1111.py) are cut out of the text and become the job's LoRAs (names under MODELS/loras/, checked at
submit), as A1111's extra networks do.
Extension: "spectrum": true|false (omitted: on where the sampler allows it).

Every refusal of the request itself is 422, as A1111's FastAPI answers any validation error (a body that is not
JSON or not an object, an ill-typed or out-of-range field, a size without a pack). Its typed fields are read as its
pydantic model reads them: `sampler_name`, `sampler_index`, `scheduler` a string or null (a list is refused, not
taken for the default); `send_images` a bool, 0/1, or one of pydantic's bool words ("false", "no", "off", "0", ...).
"""
from __future__ import annotations

import base64
import io
import json
import logging
import math
import time

from aiohttp import web

from models.lora import LoraError
from models.lora.a1111 import split_lora_tags
from models.dit.partition import KINDS, branch_index
from models.sampling.bounds import CFG, STEPS
from models.sampling.sampler import DEFAULT_SAMPLER, DEFAULT_SCHEDULER
from orchestrator.http.a1111_names import (AUTOMATIC, A1111NameError, resolve, sampler_label, samplers_list,
                                      scheduler_label, schedulers_list)
from orchestrator.http import files
from orchestrator.http.common import (FRONT, BadRequest, cancel_job, from_daemon, json_response, read_json, refuse,
                                      submit_job)
from orchestrator.http.link import DaemonRefused
from orchestrator.http.tracker import JobGone
from orchestrator.http.views import JobView
from protocol.prompt import MAX_HIRES_SCALE
from protocol.version import VERSION

log = logging.getLogger(__name__)

# field -> (the values that mean "not used", what any other value asks for that this pipeline does not do)
MUST_BE = {"restore_faces": ((False, None), "face restoration is not run here"),
           "tiling": ((False, None), "tiling is not run here"),
           "subseed_strength": ((0, 0.0), "variation seeds (subseeds) are not run here"),
           "styles": (([], None), "saved styles are not kept here: put their words in the prompt"),
           "script_name": ((None, ""), "scripts are not run here"),
           "script_args": (([], None), "scripts are not run here"),
           "alwayson_scripts": (({}, None), "scripts and extensions are not run here"),
           "override_settings": (({}, None), "setting overrides are not taken here"),
           "seed_resize_from_h": ((0, -1), "seed resize is not run here"),
           "seed_resize_from_w": ((0, -1), "seed resize is not run here"),
           "refiner_checkpoint": ((None, ""), "a refiner is not run here"),
           "init_images": ((None, []), "an image to start from goes to /sdapi/v1/img2img"),
           "hr_checkpoint_name": ((None, "", "Use same checkpoint"), "the hires pass runs the same checkpoint here")}


def _bad(field: str, message: str):
    return refuse(422, f"{field}: {message}", field=field, detail=message)


def _number(body: dict, field: str, default, *, integer: bool, low, high):
    v = body.get(field, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(field, f"must be a number, got {type(v).__name__} {v!r}"[:200])
    if integer:
        if v != int(v):
            raise _bad(field, f"must be a whole number, got {v}")
        v = int(v)
    if not low <= v <= high:                       # prompt.json's words for a value out of range
        raise _bad(field, f"must be in {low}..{high}, got {v}" if integer else
                   f"must be in [{float(low)}, {float(high)}], got {float(v)}")
    return v


# pydantic's lax bool (A1111's request model): these words, in any case, besides true/false and the integers 0/1
BOOL_WORDS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
              "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def _bool(body: dict, field: str, default: bool) -> bool:
    v = body.get(field, default)
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in BOOL_WORDS:
        return BOOL_WORDS[v.lower()]
    raise _bad(field, f"must be true or false, got {type(v).__name__} {v!r}"[:200])


def _name(body: dict, field: str):
    """A string field of A1111's model that may be null ("" and null both mean its default)."""
    v = body.get(field)
    if v is not None and not isinstance(v, str):
        raise _bad(field, f"must be a string, got {type(v).__name__}")
    return v or None


def _text(body: dict, field: str) -> str:
    v = body.get(field, "")
    if not isinstance(v, str):
        raise _bad(field, f"must be a string, got {type(v).__name__}")
    return v


MAX_BATCH_SIZE = MAX_N_ITER = 8     # A1111's UI sliders go to 8 (batch) and 100 (count); a board job is minutes


# A1111's latent hires upscalers (modules/shared: latent_upscale_modes) that are ComfyUI's methods too; its default
# (hr_upscaler null) is "Latent"; the antialiased ones, "Latent (nearest)" and the model upscalers (ESRGAN, R-ESRGAN,
# SwinIR, LDSR, ScuNET, DAT ...) and "None" are not done here
A1111_LATENT_MODES = {"Latent": "bilinear", "Latent (bicubic)": "bicubic", "Latent (nearest-exact)": "nearest-exact"}
# and its plain pixel upscalers (modules/upscaler.py UpscalerLanczos, UpscalerNearest: Pillow's filters), run as
# ComfyUI's ImageScale with that method on the decoded first image (prompt.json hires.space "pixel")
A1111_PIXEL_MODES = {"Lanczos": "lanczos", "Nearest": "nearest-exact"}
SAME_SAMPLER, SAME_SCHEDULER = "Use same sampler", "Use same scheduler"      # A1111's UI values for "the first's"


def hires_of(body: dict, spec: dict) -> dict | None:
    """A1111's hires fields -> prompt.json's `hires` (None without enable_hr): the second size as A1111 computes
    it (int(width * hr_scale), or hr_resize_x/y), its upscaler, hr_second_pass_steps, denoising_strength (0.75),
    and the second pass's own hr_prompt / hr_negative_prompt, hr_sampler_name / hr_scheduler, Forge's hr_cfg."""
    if not _bool(body, "enable_hr", False):
        return None
    width, height = spec["width"], spec["height"]
    mode = _name(body, "hr_upscaler") or "Latent"
    if mode not in A1111_LATENT_MODES and mode not in A1111_PIXEL_MODES:
        raise _bad("hr_upscaler", f"{mode!r} is not supported here; one of "
                                  f"{', '.join([*A1111_LATENT_MODES, *A1111_PIXEL_MODES])}")
    rx = _number(body, "hr_resize_x", 0, integer=True, low=0, high=16384)
    ry = _number(body, "hr_resize_y", 0, integer=True, low=0, high=16384)
    if (rx == 0) != (ry == 0) or rx * height != ry * width:
        raise _bad("hr_resize_x", f"{rx}x{ry}: give both hr_resize_x and hr_resize_y in the first pass's aspect "
                                  f"({width}x{height}), or neither and hr_scale")
    if rx == 0:
        scale = _number(body, "hr_scale", 2.0, integer=False, low=1.0, high=MAX_HIRES_SCALE)
        rx, ry = int(width * scale), int(height * scale)
    pixel = mode in A1111_PIXEL_MODES
    return {"width": rx, "height": ry, "space": "pixel" if pixel else "latent",
            "method": (A1111_PIXEL_MODES if pixel else A1111_LATENT_MODES)[mode],
            "steps": _number(body, "hr_second_pass_steps", 0, integer=True, low=0, high=STEPS.hi),
            "denoise": float(_number(body, "denoising_strength", 0.75, integer=False, low=0.01, high=1.0)),
            **_hires_own(body, spec)}


def _hires_own(body: dict, spec: dict) -> dict:
    """The second pass's own settings of an enable_hr request, only where they differ from the first pass's (as
    A1111 reads them: an empty hr_prompt is the prompt; "Use same sampler" / null the first's sampler)."""
    own = {}
    for field, key in (("hr_prompt", "prompt"), ("hr_negative_prompt", "negative_prompt")):
        text = _text(body, field)
        if key == "prompt" and text:             # its LoRA tags: the first prompt's LoRAs serve both passes
            try:
                text, tags = split_lora_tags(text)
            except LoraError as e:
                raise _bad(field, str(e)) from None
            if tags:
                raise _bad(field, "LoRA tags of the second pass's own are not supported here; the prompt's LoRAs "
                                  "apply to both passes")
        if text and text != spec[key]:
            own[key] = text
    sampler = None if _name(body, "hr_sampler_name") in (None, SAME_SAMPLER) else _name(body, "hr_sampler_name")
    scheduler = None if _name(body, "hr_scheduler") in (None, SAME_SCHEDULER) else _name(body, "hr_scheduler")
    if sampler is not None or scheduler is not None:
        first = _name(body, "sampler_name") or _name(body, "sampler_index") or "Euler"
        try:
            hs, hsch = resolve(sampler or first, scheduler or AUTOMATIC)
        except A1111NameError as e:
            raise _bad("hr_" + e.field, str(e)) from None
        if scheduler is None and hsch == DEFAULT_SCHEDULER:     # none of its own, none in the sampler's name
            hsch = spec.get("scheduler")                        # ("DPM++ 2M Karras"): the first pass's
        own.update({k: v for k, v in (("sampler", hs), ("scheduler", hsch)) if v is not None and v != spec.get(k)})
    if body.get("hr_cfg") is not None:          # Forge's field (A1111 has none): the second pass's CFG scale
        cfg = float(_number(body, "hr_cfg", spec.get("cfg", 7.0), integer=False, low=CFG.lo, high=CFG.hi))
        if cfg != spec.get("cfg"):
            own["cfg"] = cfg
    return own


def image_count(body: dict) -> int:
    """batch_size x n_iter: the images a txt2img request asks for (each its own job, seeds seed, seed+1, ...)."""
    return (_number(body, "batch_size", 1, integer=True, low=1, high=MAX_BATCH_SIZE)
            * _number(body, "n_iter", 1, integer=True, low=1, high=MAX_N_ITER))


def to_spec(body: dict, size: tuple = (512, 512), *, recorded: bool = False) -> dict:
    """A txt2img request -> a prompt.json object (submit_job checks it as the prompt record, the daemon resolves it
    against its packs); `size`: the width and height a request without them gets (the default pack's: A1111's 512
    may have no pack here); batch_size / n_iter (image_count) and enable_hr (hires_of) are the caller's to read.
    `recorded`: the pack of the job's size records its model's sampling settings, so steps, cfg_scale and the sampler
    the request leaves out are left to the daemon to fill from it (else A1111's defaults: 20 steps, cfg 7, Euler)."""
    for field, (ok, why) in MUST_BE.items():
        if field in body and body[field] not in ok:
            raise _bad(field, f"{body[field]!r}"[:80] + f" is not supported ({why}; only {ok[0]!r})")
    try:                             # A1111's <lora:NAME:S> tags leave the text and become the job's LoRAs
        prompt, tags = split_lora_tags(_text(body, "prompt"))
    except LoraError as e:
        raise _bad("prompt", str(e)) from None
    spec = {"prompt": prompt, "negative_prompt": _text(body, "negative_prompt"),
            "steps": _number(body, "steps", 20, integer=True, low=STEPS.lo, high=STEPS.hi),
            "cfg": float(_number(body, "cfg_scale", 7.0, integer=False, low=CFG.lo, high=CFG.hi)),
            "width": _number(body, "width", size[0], integer=True, low=16, high=16384),
            "height": _number(body, "height", size[1], integer=True, low=16, high=16384)}
    seed = _number(body, "seed", -1, integer=True, low=-1, high=2**64 - 1)
    if seed != -1:
        spec["seed"] = seed
    named = _name(body, "sampler_name") or _name(body, "sampler_index")
    sampler = named or "Euler"
    scheduler = _name(body, "scheduler") or AUTOMATIC
    try:
        spec["sampler"], spec["scheduler"] = resolve(sampler, scheduler)
    except A1111NameError as e:
        raise _bad(e.field, str(e)) from None
    if recorded:                      # what the request leaves out is the pack's (models/packs/sampling.py)
        for field, key in (("steps", "steps"), ("cfg_scale", "cfg")):
            if field not in body:
                del spec[key]
        if not named:
            del spec["sampler"]
        if not named and scheduler == AUTOMATIC:
            del spec["scheduler"]
    if "spectrum" in body:
        if not isinstance(body["spectrum"], bool):
            raise _bad("spectrum", "must be true or false")
        spec["spectrum"] = body["spectrum"]
    if tags:
        spec["loras"] = [{"name": t.name, "strength": t.strength, "clip_strength": t.clip_strength} for t in tags]
    _bool(body, "send_images", True)                  # checked before anything is queued
    return spec


def _unprocessable(e: BadRequest) -> BadRequest:
    """A1111's status for a request it cannot take (FastAPI: 422); others (413, 408, 429, 503 ...) stay."""
    return BadRequest(422, e.body) if e.status == 400 else e


def _info(job: JobView, png: bytes, model: str) -> dict:
    s = job.spec
    infotext = _infotext(png)
    return {"prompt": s["prompt"], "all_prompts": [s["prompt"]], "negative_prompt": s.get("negative_prompt", ""),
            "all_negative_prompts": [s.get("negative_prompt", "")], "seed": s["seed"], "all_seeds": [s["seed"]],
            "subseed": -1, "all_subseeds": [-1], "subseed_strength": 0, "width": s["width"], "height": s["height"],
            "sampler_name": sampler_label(s.get("sampler", DEFAULT_SAMPLER)),
            "scheduler": scheduler_label(s.get("scheduler", DEFAULT_SCHEDULER)), "cfg_scale": s["cfg"],
            "steps": s["steps"],
            "batch_size": 1, "restore_faces": False, "face_restoration_model": None, "sd_model_name": model,
            "sd_model_hash": None, "seed_resize_from_w": -1, "seed_resize_from_h": -1,
            "denoising_strength": s.get("denoise", 1.0) if s.get("init_image") else 0,
            "extra_generation_params": {"Spectrum": bool((s.get("spectrum") or {}).get("enabled", False)),
                                        "Job": job.id},
            "index_of_first_image": 0, "infotexts": [infotext], "styles": [],
            "job_timestamp": time.strftime("%Y%m%d%H%M%S", time.localtime(job.info.created)), "clip_skip": 1,
            "is_using_inpainting_conditioning": False, "version": f"anima-npu {VERSION}"}


def parameters(body: dict, job: JobView) -> dict:
    """A1111's `parameters`: the request as it came (A1111 echoes its request model), with what the job ran in place
    of its settings, in A1111's names ("DPM++ 2M Karras" ran as sampler "DPM++ 2M", scheduler "Karras"); a hires
    pass's sampler and scheduler too. The images of an img2img request are left out."""
    s = job.spec
    sampler, scheduler = s.get("sampler", DEFAULT_SAMPLER), s.get("scheduler", DEFAULT_SCHEDULER)
    out = {k: v for k, v in body.items() if k not in ("init_images", "mask")}
    out.update({"prompt": body.get("prompt", s["prompt"]), "negative_prompt": s.get("negative_prompt", ""),
                "seed": s["seed"], "steps": s["steps"], "cfg_scale": s["cfg"], "width": s["width"],
                "height": s["height"], "sampler_name": sampler_label(sampler), "scheduler": scheduler_label(scheduler),
                "batch_size": int(body.get("batch_size", 1)), "n_iter": int(body.get("n_iter", 1))})
    hires = s.get("hires")
    if isinstance(hires, dict):
        out.update({"hr_sampler_name": sampler_label(hires.get("sampler") or sampler),
                    "hr_scheduler": scheduler_label(hires.get("scheduler") or scheduler)})
    return out


def _infotext(png: bytes) -> str:
    from PIL import Image
    with Image.open(io.BytesIO(png)) as im:
        return im.text.get("parameters", "") if hasattr(im, "text") else ""


def _batch_info(info: dict, jobs: list, pngs: list, batch_size: int) -> dict:
    """A1111's info for every image of the request: each its seed (seed + its index), its infotext."""
    n = len(jobs)
    return {**info, "all_prompts": info["all_prompts"] * n, "all_negative_prompts": info["all_negative_prompts"] * n,
            "all_seeds": [j.spec["seed"] for j in jobs], "all_subseeds": [-1] * n, "batch_size": batch_size,
            "infotexts": [_infotext(p) for p in pngs]}


async def run_job(front, spec: dict, image: int = 1, images: int = 1):
    """Queue `spec` and wait for its end (a client that goes away leaves the job running) -> (job, PNG bytes), or
    (the JobFailed answer, None); the daemon's refusal of a field is 422 as every A1111 validation error. The origin
    keeps the job's `image` of the request's `images` (what /progress counts the request by)."""
    try:
        sub = await submit_job(front, spec, {"api": "a1111", "image": image, "images": images})
    except BadRequest as e:
        raise _unprocessable(e) from None
    except DaemonRefused as e:                       # the daemon's word on a field (e.g. a size without a pack)
        raise _unprocessable(from_daemon(e)) from None
    try:
        job = await front.tracker.wait(sub.job)
    except JobGone as e:
        raise refuse(404, str(e), job=sub.job) from None
    if job.state == "cancelled":
        raise refuse(409, f"job {job.id} was interrupted", job=job.id)
    if job.state != "done":
        return json_response({"error": "JobFailed", "detail": f"job {job.id} failed: {job.info.error_stage}: "
                              f"{job.info.error}", "job": job.id}, 500), None
    path, _ = files.resolve(front.rf.jobs, "image.png", job.id)
    return job, await files.read_async(path)


async def run_jobs(front, spec: dict, count: int, finish=None, request: web.Request | None = None):
    """batch_size x n_iter images, each its own job, one after another: A1111 numbers a request's seeds seed, seed+1,
    ... (across n_iter too; a random seed is drawn by the first job) -> (jobs, PNGs), or (the first failure's answer,
    None). `finish(png)`: what is done to each image before it is answered (img2img's paste-back). Once `request`'s
    client has gone, the rest of the batch is not queued (as A1111's interrupt ends a batch; the job under way ends
    as any job does, its image kept)."""
    jobs, pngs = [], []
    for k in range(count):
        if k and request is not None and request.transport is None:      # aiohttp drops it when the client goes
            log.info("A1111 batch: the client went away after %d of %d images; the rest are not queued", k, count)
            return json_response({"error": "Interrupted", "detail": f"the client went away: {count - k} of "
                                  f"{count} images not queued"}, 409), None
        one = spec if k == 0 else {**spec, "seed": (jobs[0].spec["seed"] + k) % 2**64}
        job, png = await run_job(front, one, k + 1, count)
        if png is None:
            return job, None
        jobs.append(job)
        pngs.append(png if finish is None else await finish(png))
    return jobs, pngs


async def txt2img(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    try:
        body = await read_json(request)
        sizes = (await front.tracker.names()).sizes
        size = sizes[0] if sizes else (512, 512)
        recorded = {(p.width, p.height) for p in (await front.tracker.info()).packs if p.sampling is not None}
        asked = (body.get("width", size[0]), body.get("height", size[1]))
        spec = to_spec(body, size, recorded=asked in recorded)
        count = image_count(body)
        hires = hires_of(body, spec)
        if hires is not None:
            spec["hires"] = hires
    except BadRequest as e:
        raise _unprocessable(e) from None
    jobs, pngs = await run_jobs(front, spec, count, request=request)
    if pngs is None:
        return jobs
    job, png = jobs[0], pngs[0]
    names = await front.tracker.names()
    info = _batch_info(_info(job, png, names.unet[0] if names.unet else ""), jobs, pngs,
                       int(body.get("batch_size", 1)))
    params = parameters(body, job)
    images = [base64.b64encode(p).decode() for p in pngs] if _bool(body, "send_images", True) else []
    return json_response({"images": images, "parameters": params, "info": json.dumps(info)})


def _request_place(job: JobView) -> tuple[int, int]:
    """The job's image of its A1111 request and the request's images, as run_jobs wrote them in the origin; (1, 1) for
    a job from elsewhere (one job is the whole request)."""
    o = job.origin
    k, n = o.get("image"), o.get("images")
    if o.get("api") == "a1111" and type(k) is int and type(n) is int and 1 <= k <= n:
        return k, n
    return 1, 1


def request_progress(job: JobView, blocks: int | None) -> tuple[float, int, int, int, int]:
    """Where the running job stands in the whole A1111 request, counted as A1111's shared.state counts it: each image's
    sampling pass is one of job_count jobs (the first passes of a job's images, then their hires passes), job_no the
    running one (0-based), sampling_step/sampling_steps within it, progress the request's fraction done.
    -> (progress, job_no, job_count, sampling_step, sampling_steps)."""
    k, n = _request_place(job)
    where, p = job.info.denoise_pass, job.info.progress
    images = where.images if where is not None else max(1, int(job.spec.get("batch") or 1))
    per_job = images * (2 if job.spec.get("hires") else 1)
    # encoding, and denoising before its first branch reports: the job's first pass not begun. Both count 0 so the
    # fraction never falls back when the first step's first branches (a few thousandths) arrive.
    unit, within, step, steps = 0, 0.0, 0, 0
    if job.state == "decoding":
        unit, within = per_job - 1, 1.0                # every pass done (the cap keeps it under 1)
    elif job.state == "denoising":
        unit = 0 if where is None else (images if where.name == "hires" else 0) + where.image - 1
        within = 0.0
        if p is not None:
            branches = (branch_index(p.block, p.branch) + 1) / (len(KINDS) * (blocks or p.blocks or 1))
            within, step, steps = (p.step - 1 + branches) / p.steps, p.step, p.steps
    job_no, job_count = (k - 1) * per_job + unit, n * per_job
    return min(0.99, (job_no + within) / job_count), job_no, job_count, step, steps


async def progress(request: web.Request) -> web.Response:
    tracker = request.app[FRONT].tracker
    await tracker.fresh()
    job = tracker.running()
    frac, eta, job_no, job_count, step, steps, text = 0.0, 0.0, 0, 0, 0, 0, None
    if job is not None:
        text = f"{job.id}: {job.state}"
        frac, job_no, job_count, step, steps = request_progress(job, tracker.blocks_of(job))
        if job.state == "denoising" and job.info.progress is not None:
            eta = job.info.progress.eta_s or 0.0
    created = job.info.created if job is not None else time.time()
    state = {"skipped": False, "interrupted": False, "stopping_generation": False,
             "job": job.id if job is not None else "", "job_count": job_count,
             "job_timestamp": time.strftime("%Y%m%d%H%M%S", time.localtime(created)), "job_no": job_no,
             "sampling_step": step, "sampling_steps": steps}
    return json_response({"progress": round(frac, 4), "eta_relative": round(eta, 1), "state": state,
                          "current_image": None, "textinfo": text, "current_task": job.id if job else None})


async def interrupt(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    await front.tracker.fresh(0.0)
    job = front.tracker.running()
    if job is not None:
        try:
            await cancel_job(front, job.id)
        except DaemonRefused:
            pass
    return json_response({})


async def sd_models(request: web.Request) -> web.Response:
    info = await request.app[FRONT].tracker.info()
    seen, out = set(), []
    for p in info.packs:
        if p.source_sha256 in seen:
            continue
        seen.add(p.source_sha256)
        name = p.source_name or "anima"
        out.append({"title": f"{name} [{p.source_sha256[:10]}]", "model_name": name.rsplit(".", 1)[0],
                    "hash": p.source_sha256[:10], "sha256": p.source_sha256, "filename": name, "config": None})
    return json_response(out)


async def options(request: web.Request) -> web.Response:
    models = json.loads((await sd_models(request)).text)
    return json_response({"sd_model_checkpoint": models[0]["title"] if models else "",
                          "sd_checkpoint_hash": models[0]["sha256"] if models else ""})


async def samplers(request: web.Request) -> web.Response:
    return json_response(samplers_list())


async def schedulers(request: web.Request) -> web.Response:
    return json_response(schedulers_list())


async def scripts(request: web.Request) -> web.Response:
    return json_response({"txt2img": [], "img2img": []})


ROUTES = [("POST", "/txt2img", txt2img), ("GET", "/progress", progress), ("POST", "/interrupt", interrupt),
          ("GET", "/sd-models", sd_models), ("GET", "/samplers", samplers), ("GET", "/schedulers", schedulers),
          ("GET", "/scripts", scripts), ("GET", "/options", options)]


def add_routes(app: web.Application) -> None:
    for method, path, handler in ROUTES:
        app.router.add_route(method, "/sdapi/v1" + path, handler)
