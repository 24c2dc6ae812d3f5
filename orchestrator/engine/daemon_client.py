"""The job daemon's client: `call(msg, expect)` sends a request through a transport and reads its reply one way.

The transports: the daemon's ipc socket with Lazy Pirate retries (`DaemonClient.socket`: the CLI, the demo, the
test harnesses) and a `Daemon` in this process (`DaemonClient.in_process`: no socket; tests/inproc.py). The HTTP
front's asyncio DEALER (orchestrator.http.link.DaemonLink), many requests in flight, reads its replies with the
same `read_reply`. A reply is the expected message, or DaemonRefused (the daemon's ERROR, its words kept), or
DaemonDown (no answer in time, not running, or an answer of another kind); each caller words those its own way
through `errors` (the CLI: CliError with its exit status)."""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Callable

from protocol import messages as m

DAEMON_TIMEOUT_S = 5.0      # one CLI -> daemon request
DAEMON_START_WAIT_S = 60.0  # a daemon supervisord is starting gets this long to bind its socket


class DaemonDown(Exception):
    """The daemon did not take the request or did not answer in time."""


class DaemonRefused(Exception):
    """The daemon answered with an ERROR: `code`, `field`, `message` as it said them."""

    def __init__(self, reply: m.Error):
        super().__init__(reply.message)
        self.code, self.field, self.message, self.retry = reply.code, reply.field, reply.message, reply.retry

    @property
    def unknown_job(self) -> bool:
        return self.code == "failed" and self.message.startswith("no job ")


def read_reply(reply: m.Message, expect: type[m.Message], request_kind: str) -> m.Message:
    """The one reading of a daemon reply: `reply` if it is an `expect`; DaemonRefused for an ERROR; DaemonDown for
    any other kind (a daemon answering `request_kind` with something else is not one this client can talk to)."""
    if isinstance(reply, m.Error):
        raise DaemonRefused(reply)
    if not isinstance(reply, expect):
        raise DaemonDown(f"the orchestrator daemon answered {request_kind} with {reply.KIND}")
    return reply


def _as_is(e: Exception) -> Exception:
    return e


class DaemonClient:
    """One daemon client over `send` (a request -> its reply); `errors` turns DaemonDown/DaemonRefused into the
    exception its caller raises (as they are by default)."""

    def __init__(self, send: Callable[[m.Message], m.Message], close: Callable[[], None] = lambda: None,
                 errors: Callable[[Exception], Exception] = _as_is):
        self._send, self._close, self._errors = send, close, errors
        self.client = None             # socket(): the raw Lazy Pirate (a request sent as it is, its reply not read)

    def call(self, msg: m.Message, expect: type[m.Message]) -> m.Message:
        try:
            return read_reply(self._send(msg), expect, msg.KIND)
        except (DaemonDown, DaemonRefused) as e:
            raise self._errors(e) from None

    def close(self) -> None:
        self._close()

    @classmethod
    def socket(cls, rf, timeout_s: float = DAEMON_TIMEOUT_S, errors=_as_is) -> DaemonClient:
        """The daemon supervisord runs for run folder `rf`, over its ipc socket (one retry: SUBMIT is deduplicated
        by request id). A missing socket, or one nobody listens on, fails at once with how to start the daemon,
        unless supervisord is starting it (then its socket is waited for)."""
        import zmq
        from protocol.sockets import LazyPirate, PeerUnavailable
        ctx = zmq.Context()
        link = LazyPirate(ctx, rf.daemon_endpoint, peer="orchestrator daemon", timeout_s=timeout_s, retries=1)

        def send(msg):
            if not rf.daemon_sock.exists() and not _daemon_coming(rf):
                raise DaemonDown(f"the orchestrator daemon is not answering: no socket {rf.daemon_sock}; "
                                 f"{_start_hint(rf)}")
            if not _listening(rf.daemon_sock) and not _daemon_coming(rf):
                # a socket file left by a daemon that stopped: a request would wait out its retries for nobody
                raise DaemonDown(f"the orchestrator daemon is not running (nothing listens on {rf.daemon_sock}); "
                                 f"{_start_hint(rf)}")
            try:
                return link.request(msg)
            except PeerUnavailable:
                raise DaemonDown(f"the orchestrator daemon is not answering on {rf.daemon_endpoint}; is "
                                 f"supervisord up? (supervisorctl -c {rf.supervisord_conf} status)") from None

        def close():
            link.close()
            ctx.term()
        client = cls(send, close, errors)
        client.client = link
        return client

    @classmethod
    def in_process(cls, daemon, errors=_as_is) -> DaemonClient:
        """Requests handed to `daemon.handle` in this process (no socket, no stages: no job runs). Every request and
        reply goes through the wire codec, as over the socket: a message that would not encode fails here too."""
        from protocol.codec import decode, encode

        def send(msg):
            return decode(encode(daemon.handle(decode(encode(msg)))))     # defer=False: a LoRA check is waited for
        return cls(send, errors=errors)


def _start_hint(rf) -> str:
    conf = rf.supervisord_conf
    start = f"orchestrator --run {rf.root} start (supervisord -c {conf}, waited for)"
    if conf.is_file():
        return f"start it with: {start}"
    return (f"{rf.root} is not a run folder yet: orchestrator --run {rf.root} init --bundle BUNDLE, "
            f"then {start}")


def _daemon_coming(rf) -> bool:
    """supervisord is starting the daemon (just launched): wait for its socket instead of failing."""
    from orchestrator.engine.supervisor import Supervisor, SupervisorError
    deadline = time.monotonic() + DAEMON_START_WAIT_S
    while time.monotonic() < deadline:
        try:
            state = Supervisor(rf.supervisor_sock, timeout_s=2.0).info("orchestrator").state
        except SupervisorError:
            return False
        if state not in ("STARTING", "RUNNING", "BACKOFF"):
            return False
        if rf.daemon_sock.exists():
            return True
        time.sleep(0.2)
    return False


def _listening(path: Path) -> bool:
    """Something accepts connections on the unix socket `path` (ZeroMQ's ipc:// is one); a refused connect is a
    socket file its process left behind."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:                  # anything else (a busy backlog, permissions): let the request say what it is
        return True
    finally:
        s.close()
