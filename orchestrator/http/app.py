"""The aiohttp application: the front's parts, the middlewares every request passes, the routes of both APIs and the
page, and serving it until SIGTERM."""
from __future__ import annotations

import asyncio
import base64
import binascii
import fcntl
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import urllib.parse
from dataclasses import dataclass

from aiohttp import web

from models.base.durable import atomic_write
from orchestrator.http import a1111, comfy, img2img, page
from orchestrator.http.common import FRONT, BadRequest, from_daemon, json_response
from orchestrator.http.hub import Hub
from orchestrator.http.link import DaemonDown, DaemonLink, DaemonRefused
from orchestrator.http.settings import HttpSettings
from orchestrator.http.tracker import Tracker
from orchestrator.engine.loras import LoraListing
from orchestrator.engine.runfolder import RunFolder
from protocol.security import WILDCARD_HOSTS

log = logging.getLogger(__name__)

OPEN_PATHS = ("/", "/favicon.ico")          # served without a token: static content only, no data
TOKEN_COOKIE = "anima_token"                # the page keeps the token here (SameSite=Strict) for <img> and /ws
PAGE_CSP = ("default-src 'self'; img-src 'self' data:; connect-src 'self' ws: wss:; style-src 'self'; "
            "script-src 'self'; frame-ancestors 'none'")


@dataclass
class Front:
    cfg: object                 # stages.config.PipelineConfig
    rf: RunFolder
    settings: HttpSettings
    token: str | None
    link: DaemonLink
    hub: Hub
    tracker: Tracker


def make_front(cfg, settings: HttpSettings, token: str | None) -> Front:
    rf = RunFolder(cfg.run_dir.resolve())
    link = DaemonLink(rf.daemon_endpoint, settings.request_timeout_s)
    # ComfyUI's server flags, less what this front does not do: it sends no previews (binary frames) at all
    hub = Hub({"supports_preview_metadata": False, "max_upload_size": settings.max_upload_bytes})
    loras = LoraListing(cfg.models_dir)         # the LoRA list as the folder is now, not as it was at start
    return Front(cfg, rf, settings, token, link, hub, Tracker(link, hub, settings.poll_s, loras))


# ---------------------------------------------------------------- middlewares


def _error(status: int, message: str, **extra) -> web.Response:
    return json_response({"error": message, **extra}, status)


@web.middleware
async def answers(request: web.Request, handler):
    """Every refusal as JSON with a message; a daemon that is down is 503; a bug is a 500 without a traceback."""
    try:
        return await handler(request)
    except BadRequest as e:
        answer = json_response(e.body, e.status)
        answer.headers.update(e.headers)
        return answer
    except (DaemonDown, DaemonRefused) as e:
        b = from_daemon(e)
        return json_response(b.body, b.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - one bad request must not take the front down
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error ({type(e).__name__}); see the http log")


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})    # names that mean this machine to a browser


def host_name(host_header: str) -> str:
    """The name of a Host header value: port and an IPv6 literal's brackets off, lower case, no trailing dot."""
    h = host_header.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.partition(":")[0]
    return h.rstrip(".")


def allowed_hosts(host: str) -> frozenset[str]:
    """Host names a request may name besides IP literals: loopback names, the configured host, and this machine's own
    names when it listens on every interface (a LAN client may use them)."""
    names = set(LOOPBACK_NAMES) | {host_name(host)}
    if host in WILDCARD_HOSTS:
        names |= {host_name(n) for n in (socket.gethostname(), socket.getfqdn(), socket.gethostname() + ".local")}
    return frozenset(names)


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_check(allowed: frozenset[str]):
    """DNS rebinding: a page of evil.example whose name is made to resolve to 127.0.0.1 reaches this front with
    `Host: evil.example` (and a matching Origin, so the origin check passes). Only names in `allowed` (and IP
    literals, which no DNS answer can rebind; `*.localhost`, which never leaves the machine) are served; others 421."""
    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Host")
        if given is not None:
            name = host_name(given)
            if not (name in allowed or name.endswith(".localhost") or _is_ip_literal(name)):
                return _error(421, f"Host {given[:100]!r} is not a name of this server (DNS rebinding?); use "
                                   f"127.0.0.1 or localhost, or the configured [stage.http] host")
        return await handler(request)
    return check


@web.middleware
async def same_origin(request: web.Request, handler):
    """A browser page of another site must not drive this one (ComfyUI's origin check): an Origin header has to name
    this host."""
    origin = request.headers.get("Origin")
    if origin is not None:
        o = urllib.parse.urlsplit(origin)
        if o.netloc.lower() != request.host.lower():
            return _error(403, f"cross-origin request from {origin!r} refused")
    return await handler(request)


def _token_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    kind, _, value = auth.partition(" ")
    if kind.lower() == "bearer":
        return value.strip()
    if kind.lower() == "basic":                 # ComfyUI and A1111 clients know HTTP Basic: the token is the password
        try:
            return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    cookie = request.cookies.get(TOKEN_COOKIE)
    return urllib.parse.unquote(cookie) if cookie is not None else None


def authenticate(token: str):
    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path in OPEN_PATHS or request.path.startswith("/static/"):
            return await handler(request)
        given = _token_of(request)
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            return _error(401, "this server needs a token: Authorization: Bearer <token>")
        return await handler(request)
    return auth


@web.middleware
async def headers(request: web.Request, handler):
    resp = await handler(request)
    if not resp.prepared:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        if request.path == "/" or request.path.startswith("/static/"):
            resp.headers.setdefault("Content-Security-Policy", PAGE_CSP)
        if resp.status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="anima"'
    return resp


def build_app(front: Front) -> web.Application:
    middlewares = [headers, answers, host_check(allowed_hosts(front.settings.host)), same_origin] + (
        [authenticate(front.token)] if front.token else [])
    app = web.Application(client_max_size=front.settings.max_body_bytes, middlewares=middlewares)
    app[FRONT] = front
    comfy.add_routes(app)
    a1111.add_routes(app)
    img2img.add_routes(app)
    page.add_routes(app)
    return app


# ---------------------------------------------------------------- serving


class FrontBusy(Exception):
    """Another front serves this run folder (it holds RUN/http.json's lock): the message says where."""


def claim_run(rf: RunFolder) -> int:
    """The run folder's one front: an exclusive lock on RUN/http.lock, held (by the returned descriptor) while this
    process lives. A second front would overwrite the first one's RUN/http.json, then delete it on its exit."""
    fd = os.open(rf.root / "http.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            where = json.loads(rf.http_json.read_text())
            where = f"{where['url']} (pid {where['pid']})"
        except (OSError, ValueError, KeyError, TypeError):
            where = "(starting)"
        raise FrontBusy(f"another HTTP front serves {rf.root}: {where}") from None
    return fd


def _release(front: Front, fd: int) -> None:
    """RUN/http.json goes with the front that wrote it (it is ours: we hold the lock), then the lock."""
    try:
        front.rf.http_json.unlink()
    except OSError:
        pass
    os.close(fd)


async def serve(front: Front) -> None:
    """Claim the run folder, bind, say where (RUN/http.json and one log line), serve until SIGTERM/SIGINT. FrontBusy
    when another front serves the run folder, OSError when it cannot bind."""
    stop = asyncio.Event()                      # first: a SIGTERM once RUN/http.json says "up" is a clean stop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lock = claim_run(front.rf)
    try:
        await _serve(front, stop)
    finally:
        _release(front, lock)


async def _serve(front: Front, stop: asyncio.Event) -> None:
    app = build_app(front)
    runner = web.AppRunner(app, access_log_format='%a "%r" %s %b %Tfs',
                            keepalive_timeout=front.settings.idle_timeout_s)   # aiohttp >= 3.14.4 arms it at connect
    await runner.setup()
    try:
        site = web.TCPSite(runner, front.settings.host, front.settings.port, reuse_address=True)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    url = f"http://{front.settings.display_host}:{port}/"
    await front.link.start()
    front.tracker.start()
    atomic_write(front.rf.http_json, json.dumps({"url": url, "host": front.settings.host, "port": port,
                                                 "pid": os.getpid(), "token": front.token is not None}), mode=0o600)
    log.info("serving %s: the page at /, ComfyUI's API (/prompt, /history, /view, /ws ...), A1111's at /sdapi/v1",
             url)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await front.tracker.stop()
        await front.hub.close()
        await runner.cleanup()
        await front.link.close()
