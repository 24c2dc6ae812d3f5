"""Request parsing and error answers shared by the APIs: every refusal is a 4xx JSON body with a message."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from orchestrator.http.comfy_graph import prompt_detail
from orchestrator.http.link import DaemonDown, DaemonRefused

MAX_JSON_DEPTH = 32
SUBMIT_GRACE_S = 2.0         # a SUBMIT's answer is waited for this long past the answer_by it carries


class BadRequest(Exception):
    """A request refused with `status` (4xx) and a JSON `body`."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        super().__init__(body.get("error") if isinstance(body.get("error"), str) else str(body))
        self.status, self.body, self.headers = status, body, headers or {}


def refuse(status: int, message: str, *, headers: dict | None = None, **extra) -> BadRequest:
    """`headers`: the answer's own (Retry-After on a 503 that passes)."""
    return BadRequest(status, {"error": message, **extra}, headers)


def _walk(obj, limit: int) -> tuple[int, str | None]:
    """(depth, the dotted path of the first string or key that is not text) of a parsed JSON value. JSON's \\ud800
    escapes decode to lone surrogates, which no UTF-8 encoder (msgpack on the way to the daemon) accepts."""
    stack, deepest = [(obj, 1, "")], 0
    while stack:
        o, d, path = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest, None
        if isinstance(o, str):
            if not _encodable(o):
                return deepest, path
        elif isinstance(o, dict):
            for k, v in o.items():
                where = f"{path}.{k}" if path else k
                if not _encodable(k):
                    return deepest, where
                stack.append((v, d + 1, where))
        elif isinstance(o, list):
            stack += [(v, d + 1, f"{path}[{i}]") for i, v in enumerate(o)]
    return deepest, None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request, *, kind: type = dict):
    """The body as JSON of type `kind`; 400 for anything else, naming the field of a string that is not text (size
    is capped by the app: 413)."""
    limit_s = request.app[FRONT].settings.body_timeout_s     # aiohttp bounds headers and idle time, not a body
    try:
        raw = await asyncio.wait_for(request.read(), limit_s)
    except asyncio.TimeoutError:
        raise refuse(408, f"the body did not arrive within {limit_s:g} s (stage.http.body_timeout_s)") from None
    if not raw:
        raise refuse(400, "the request has no body; send a JSON object")
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise refuse(400, f"the body is not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise refuse(400, "the JSON is nested too deeply") from None
    except ValueError as e:
        raise refuse(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, kind):
        raise refuse(400, f"the body must be a JSON {'object' if kind is dict else kind.__name__}")
    depth, not_text = _walk(obj, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise refuse(400, f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    if not_text is not None:
        field = not_text.encode("utf-8", "backslashreplace").decode()[:200]
        raise refuse(400, f"{field}: holds a lone surrogate (a \\ud800-style escape without its pair), which is not "
                          "text", field=field)
    return obj


def from_daemon(e: Exception) -> BadRequest:
    """A daemon refusal or silence as an HTTP answer: bad_request 400 (with the field), a full queue 429, an unknown
    job 404, another refusal 409; no daemon 503."""
    if isinstance(e, DaemonDown):
        return refuse(503, str(e))
    assert isinstance(e, DaemonRefused)
    if e.code == "bad_request":                  # the daemon speaks of prompt.json; this request sent none
        detail = prompt_detail(e.message, e.field)
        return refuse(400, f"{e.field}: {detail}" if e.field and detail != e.message else detail, field=e.field)
    if e.code == "busy":
        return refuse(429, e.message)
    if e.unknown_job:
        return refuse(404, e.message)
    return refuse(409, e.message)


def json_response(body, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: json.dumps(o, ensure_ascii=False))


# ---------------------------------------------------------------- the front's parts, as handlers reach them

FRONT = web.AppKey("front", object)          # orchestrator.http.app.Front


async def submit_job(front, spec, origin: dict):
    """Queue a prompt.json object through the daemon as the prompt record (it resolves it against its packs and
    decides); the job is followed so its end is announced. -> SUBMITTED. `spec`: the object, checked here (this way
    in's one check), or a record a front already checked (a graph's, comfy_graph.checked_job). A record that does not
    hold is refused as the daemon refuses one (DaemonRefused, bad_request, the field named), so every front words
    it one way."""
    from orchestrator.engine.prompt_spec import PromptError, PromptFile, prompt_record
    from protocol import messages as m
    try:
        prompt = spec if isinstance(spec, PromptFile) else prompt_record(spec)
    except PromptError as e:
        raise DaemonRefused(m.error_reply(0, "bad_request", str(e), field=e.field)) from None
    origin_json = json.dumps(origin, ensure_ascii=False)
    if len(origin_json) > m.MAX_ORIGIN_CHARS:
        raise refuse(413, f"the request is too large to keep with the job ({len(origin_json)} characters of JSON; "
                          f"the limit is {m.MAX_ORIGIN_CHARS})")
    # the daemon queues only what it decides by answer_by; the answer is waited for SUBMIT_GRACE_S longer, so a job
    # is queued only when the client hears so (a 503 after answer_by means nothing was queued)
    wait_s = front.link.timeout_s
    sub = await front.link.call(m.Submit(prompt=prompt, base_dir=str(front.rf.root), origin=origin_json,
                                         answer_by=time.time() + wait_s), m.Submitted,
                                timeout_s=wait_s + SUBMIT_GRACE_S)
    front.tracker.follow(sub.job)
    try:
        await front.tracker.refresh()            # /queue and a new WebSocket's `status` count it from now on
    except (DaemonDown, DaemonRefused):          # the job is queued; the next look will see it
        pass
    return sub


async def cancel_job(front, job_id: str) -> str:
    from protocol import messages as m
    return (await front.link.call(m.Cancel(job=job_id), m.Ok)).note
