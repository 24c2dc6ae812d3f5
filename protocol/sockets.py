"""ZeroMQ helpers: socket options, a Lazy Pirate client, a ROUTER server, event sockets (security: protocol.security)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol.fields import ProtocolError
from protocol.messages import Message, error_reply
# re-exported: callers may import the security names from here too
from protocol.security import (IPC_PATH_MAX_CHARS, ZAP_DOMAIN, CurveClient, CurveServer, EndpointError,  # noqa: F401
                               check_bind, check_security, ipc_endpoint, ipc_path, is_loopback, parse_endpoint,
                               read_keypair, start_authenticator, write_keypair)

log = logging.getLogger(__name__)

HWM_MESSAGES = 64  # queued messages per socket and direction before sends block/drop
REQUEST_TIMEOUT_S = 5.0  # Lazy Pirate: wait this long for a reply before reconnecting
REQUEST_RETRIES = 3  # Lazy Pirate: resends after the first try before giving up
POLL_SLICE_S = 0.1  # longest uninterrupted poll: stop flags and idle callbacks run at least this often
LAST_WORD_LINGER_S = 0.5  # how long a DYING event may linger in the queue when its socket closes
_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class PeerUnavailable(Exception):
    """No reply after every Lazy Pirate attempt."""


class PeerRefused(PeerUnavailable):
    """The peer refused the connection's security handshake (unknown CURVE key, plaintext vs CURVE)."""


def configure(sock: zmq.Socket, *, max_msg_bytes: int = codec.MAX_FRAME_BYTES) -> zmq.Socket:
    """Options every socket gets: LINGER 0, bounded high-water marks, a maximum inbound frame size."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    return sock


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, curve: Any = None,
                allow_plaintext: bool = False, options: dict[int, int] | None = None,
                before_connect: Callable[[zmq.Socket], None] | None = None,
                allow_wildcard: bool = False) -> zmq.Socket:
    """A configured socket bound or connected to `endpoint`, with CURVE set up when given (tcp).

    `options` are set, and `before_connect(sock)` runs (e.g. to attach a monitor), before bind/connect. A bind to every
    interface (`tcp://*`, 0.0.0.0) needs `allow_wildcard`."""
    check_security(endpoint, curve, allow_plaintext)
    if bind:
        check_bind(endpoint, allow_wildcard)
    sock = configure(ctx.socket(kind))
    try:
        for opt, value in (options or {}).items():
            sock.setsockopt(opt, value)
        if isinstance(curve, CurveServer):
            sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        elif isinstance(curve, CurveClient):
            sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
            sock.curve_serverkey = curve.server_public
        if before_connect is not None:
            before_connect(sock)
        if bind:
            transport, address = parse_endpoint(endpoint)
            if transport == "ipc":
                os.makedirs(os.path.dirname(address), mode=0o700, exist_ok=True)
            # owner only from the moment the file exists (a chmod after bind leaves a window where it is not),
            # whatever the umask (supervisord -n does not apply its own)
            old_umask = os.umask(0o077) if transport == "ipc" else None
            try:
                sock.bind(endpoint)
            finally:
                if old_umask is not None:
                    os.umask(old_umask)
            if transport == "ipc":
                os.chmod(address, 0o700)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


def _poll(sock: zmq.Socket, timeout_s: float, *, should_stop: Callable[[], bool] | None = None,
          idle: Callable[[], None] | None = None, wake: tuple = ()) -> bool:
    """Wait for input in short slices, running `idle` and honouring `should_stop` between them. Input on a `wake`
    socket (one that `idle` serves) runs `idle` at once instead of at the end of the slice; `should_stop` still runs
    once a slice at most."""
    if timeout_s <= 0:
        return bool(sock.poll(0, zmq.POLLIN))
    poller = zmq.Poller()
    for s in (sock, *(wake if idle is not None else ())):     # input nothing serves would wake the wait in a loop
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + POLL_SLICE_S
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return False
        ready = dict(poller.poll(int(min(left, max(0.0, next_check - now)) * 1000) or 1))
        if sock in ready:
            return True
        if idle is not None:
            idle()
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + POLL_SLICE_S
            if should_stop is not None and should_stop():
                return False


class LazyPirate:
    """Reliable request/reply over REQ: timeout, close, reconnect, resend (attempt + 1); bounded, then PeerUnavailable.

    Requests must be idempotent (they are, by design: arena inputs stay unchanged until the reply is applied).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, *, peer: str = "", timeout_s: float = REQUEST_TIMEOUT_S,
                 retries: int = REQUEST_RETRIES, curve: CurveClient | None = None, allow_plaintext: bool = False):
        self.ctx, self.endpoint, self.peer = ctx, endpoint, peer or endpoint
        self.timeout_s, self.retries, self.curve, self.allow_plaintext = timeout_s, retries, curve, allow_plaintext
        self.resends = 0  # total over this client's life
        self.sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        check_security(endpoint, curve, allow_plaintext)

    def _connect(self) -> zmq.Socket:
        if self.sock is None:
            watch = self.endpoint.startswith("tcp://")  # watch the handshake: a refusal deserves a clear error
            self.sock = make_socket(self.ctx, zmq.REQ, self.endpoint, bind=False, curve=self.curve,
                                    allow_plaintext=self.allow_plaintext, before_connect=self._watch if watch else None)
        return self.sock

    def _watch(self, sock: zmq.Socket) -> None:
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)

    def _refused(self) -> tuple[str, bool] | None:
        """(why the handshake failed, whether that is final), seen on the monitor, or None. An allow-list refusal or a
        plaintext/CURVE mismatch is final; a handshake cut off without detail is a wrong server key or a peer that died
        mid-handshake (a restarting stage), so it is resent like a timeout."""
        why = None
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "the server refused this client's CURVE key (not in its allow-list)", True
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return "the security handshake failed (CURVE vs plaintext mismatch between client and server)", True
            why = ("the security handshake failed (is security.servers.NAME the server's public key?) "
                   "or the peer died during it"), False
        return why

    def close(self) -> None:
        if self.sock is not None:
            if self._monitor is not None:
                self.sock.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            self.sock.close(0)
            self.sock = None

    def send(self, msg: Message) -> None:
        """Send `msg` (its first attempt) without waiting: the caller works meanwhile, then calls
        `request(msg, sent=True)`, which waits for the reply and resends on timeout as usual."""
        self._connect().send_multipart(codec.encode(msg), copy=False)

    def request(self, msg: Message, *, timeout_s: float | None = None, retries: int | None = None,
                should_stop: Callable[[], bool] | None = None, idle: Callable[[], None] | None = None,
                sent: bool = False, wake: tuple = ()) -> Message:
        """Send `msg` and return the reply (an ERROR reply is returned, not raised; see messages.expect).
        sent: the first attempt already went out through `send(msg)`; wake: sockets `idle` serves, whose input
        runs it at once (a daemon answers its clients while it waits on a stage)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        tries = 1 + (self.retries if retries is None else retries)
        has_attempt = "attempt" in msg.__struct_fields__
        handshake_failed = 0  # attempts that ended in a handshake failure
        for attempt in range(1, tries + 1):
            if has_attempt:
                msg = msg.replace(attempt=attempt)
            sock = self._connect()
            try:
                if not (sent and attempt == 1):
                    sock.send_multipart(codec.encode(msg), copy=False)
                got = _poll(sock, timeout_s, should_stop=should_stop, idle=idle, wake=wake)
                reply = codec.decode(sock.recv_multipart(copy=False)) if got else None
            except BaseException:
                # whatever ends the wait early (an exception from `idle`/`should_stop`, a bad reply, a signal) leaves
                # the REQ socket between send and receive, where the next send fails with "Operation cannot be
                # accomplished in current state": drop it, the next request starts on a fresh one
                self.close()
                raise
            if reply is not None:
                if reply.id != msg.id:
                    self.close()
                    raise ProtocolError("id", f"{self.peer} answered request {msg.id} with id {reply.id}")
                return reply
            refused = self._refused()
            self.close()  # the REQ socket is stuck after a lost reply: drop it, a new one starts clean
            if refused:
                handshake_failed += 1
                if refused[1] or handshake_failed == tries:
                    raise PeerRefused(f"{self.peer} ({self.endpoint}): {refused[0]}")
            if should_stop is not None and should_stop():
                raise PeerUnavailable(f"request {msg.KIND} to {self.peer} abandoned: stopping")
            if attempt < tries:
                self.resends += 1
                log.warning("no reply from %s to %s in %.1f s (attempt %d/%d), reconnecting and resending",
                            self.peer, msg.KIND, timeout_s, attempt, tries)
        raise PeerUnavailable(f"no reply from {self.peer} ({self.endpoint}) to {msg.KIND} after {tries} attempt(s) "
                              f"of {timeout_s:.1f} s")

    def __enter__(self) -> "LazyPirate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclasses.dataclass
class Request:
    """One received request: the routing envelope, and either the decoded message or why it failed to decode."""

    envelope: list[Any]
    msg: Message | None
    error: ProtocolError | None
    request_id: int


class _Bound:
    """A bound socket with the CURVE authenticator that guards it (tcp): both started together, stopped together."""

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, *, curve: CurveServer | None,
                 allow_plaintext: bool, **socket_kw: Any):
        self.endpoint = endpoint
        self.auth = start_authenticator(ctx, curve) if curve is not None else None
        try:
            self.sock = make_socket(ctx, kind, endpoint, bind=True, curve=curve, allow_plaintext=allow_plaintext,
                                    **socket_kw)
        except BaseException:
            if self.auth is not None:
                self.auth.stop()
            raise

    def close(self) -> None:
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


class Server(_Bound):
    """A ROUTER bound to a stage endpoint. ROUTER_MANDATORY makes a reply to a vanished (restarted) peer an error we
    log instead of a silent drop; ROUTER_HANDOVER lets a reconnecting peer with the same identity take over."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, curve: CurveServer | None = None,
                 allow_plaintext: bool = False, allow_wildcard: bool = False):
        super().__init__(ctx, zmq.ROUTER, endpoint, curve=curve, allow_plaintext=allow_plaintext,
                         options={zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}, allow_wildcard=allow_wildcard)

    def recv(self, timeout_s: float, *, should_stop: Callable[[], bool] | None = None) -> Request | None:
        """The next request, or None on timeout/stop. Undecodable requests come back with `error` set."""
        if not _poll(self.sock, timeout_s, should_stop=should_stop):
            return None
        frames = self.sock.recv_multipart(copy=False)
        # [identity, b"", frame0, ...]: REQ peers add the empty delimiter; DEALER peers must send it too
        if len(frames) < 3 or frames[1].bytes != b"":
            log.warning("dropped a request without the empty delimiter frame (%d frames)", len(frames))
            return None
        envelope, body = frames[:2], frames[2:]
        try:
            return Request(envelope, codec.decode(body), None, 0)
        except ProtocolError as e:
            return Request(envelope, None, e, codec.peek_id(body[0]))

    def reply(self, req: Request, msg: Message) -> bool:
        """Send `msg` back along `req`'s envelope; False (logged) when the peer is gone or its queue is full."""
        try:
            self.sock.send_multipart([*req.envelope, *codec.encode(msg)], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("reply %s dropped: the peer's queue is full", msg.KIND)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.warning("reply %s dropped: the requester is gone (restarted?); it will resend", msg.KIND)
        return False

    def reply_error(self, req: Request, error: ProtocolError) -> bool:
        return self.reply(req, error_reply(req.request_id, error))


def serve(server: Server, handle: Callable[[Message], Message], *, should_stop: Callable[[], bool],
          poll_s: float = POLL_SLICE_S) -> None:
    """A plain poll loop: decode, `handle(msg) -> reply`, answer; bad requests get an ERROR reply and serving goes on."""
    while not should_stop():
        req = server.recv(poll_s, should_stop=should_stop)
        if req is None:
            continue
        if req.error is not None:
            server.reply_error(req, req.error)
            continue
        try:
            reply = handle(req.msg)
        except ProtocolError as e:
            reply = error_reply(req.msg.id, e)
        server.reply(req, reply)


class EventPush:
    """Stage → orchestrator events (READY, PROGRESS, DYING) over PUSH. Never blocks: while the orchestrator is away,
    up to HWM_MESSAGES events wait for it (READY at start-up included); beyond that they are dropped (logged)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, curve: CurveClient | None = None,
                 allow_plaintext: bool = False):
        self.sock = make_socket(ctx, zmq.PUSH, endpoint, bind=False, curve=curve, allow_plaintext=allow_plaintext)

    def send(self, msg: Message) -> bool:
        try:
            self.sock.send_multipart(codec.encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.debug("event %s dropped: the orchestrator is not reading", msg.KIND)
            return False

    def last_word(self, msg: Message, wait_s: float = LAST_WORD_LINGER_S) -> bool:
        """Send `msg` and close, letting it linger up to `wait_s` so it leaves before the process exits."""
        sent = self.send(msg)
        self.sock.close(int(wait_s * 1000))
        return sent

    def close(self) -> None:
        self.sock.close(0)


class EventPull(_Bound):
    """The orchestrator's event sink (PULL, bound). Malformed events are logged and skipped."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, curve: CurveServer | None = None,
                 allow_plaintext: bool = False):
        super().__init__(ctx, zmq.PULL, endpoint, curve=curve, allow_plaintext=allow_plaintext)

    def recv(self, timeout_s: float) -> Message | None:
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart(copy=False)
        try:
            return codec.decode(frames)
        except ProtocolError as e:
            log.warning("malformed event skipped: %s", e)
            return None
