"""The stage-process framework: `StageProc` wraps a plain logic object in sockets, handshake, heartbeats and signals.

A stage module is a logic class plus one line, so that every stage gets the same process behaviour:

    class ExecutorLogic:
        def __init__(self, config: PipelineConfig): ...
        def info(self) -> dict: ...                            # optional, goes into READY.info
        def on_branch(self, msg: Branch, ctx: StageContext) -> BranchDone: ...   # one method per served kind
        def on_cancel(self, job: str) -> None: ...              # optional
        def close(self) -> None: ...                            # optional, at shutdown

    if __name__ == "__main__":
        sys.exit(stage_main("executor", ExecutorLogic))

Long handlers call `ctx.check(job)` between units of work (heartbeats answered, CANCEL/SIGTERM seen); a handler that
waits on another stage passes `idle=ctx.keepalive, should_stop=lambda: ctx.stopping` to `LazyPirate.request`.

Two tiers of errors, so that one bad request never costs the stage: ProtocolError / RequestFailed / ArenaError in a
handler → an ERROR reply, and the stage keeps serving; anything else → log, ERROR "internal" to the requester, DYING
to the orchestrator, exit EXIT_FATAL for supervisord to restart the stage. SIGTERM/SIGINT → finish cleanly (sockets
closed, arenas detached), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import psutil
import setproctitle
import zmq

from protocol import messages as m
from protocol.arena import Arena, ArenaError
from protocol.fields import ProtocolError
from protocol.security import served_elsewhere
from protocol.sockets import POLL_SLICE_S, EventPush, Request, Server
from protocol.version import VERSION
from stages.config_digest import record_start
from stages.config import ConfigError, PipelineConfig, load_config

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2  # bad --config: an expected exit in supervisord.conf (exitcodes), the program stays down
SUPERVISOR_STARTSECS = 1.0  # supervisord.conf's startsecs of the stages and the orchestrator
EXIT_FATAL = 1  # the stage broke: supervisord restarts it
# the control requests every stage answers itself, also while a handler works (the rest is work for the logic)
CONTROL_KINDS = frozenset(k.KIND for k in (m.Hello, m.Heartbeat, m.Cancel, m.Shutdown))


class RequestFailed(Exception):
    """Raised by a handler for a valid request it cannot do; becomes an ERROR reply (the stage keeps serving)."""

    def __init__(self, message: str, *, code: str = "failed", field: str = "", retry: bool = False):
        super().__init__(message)
        self.code, self.field, self.retry = code, field, retry


class Interrupted(Exception):
    """Raised by `StageContext.check` when the stage is stopping or the current job was cancelled."""


class StageContext:
    """What a handler may use besides its message: events, keepalive during long work, stop checks, arenas."""

    def __init__(self, proc: "StageProc"):
        self._proc = proc
        self.config = proc.config
        self.stage = proc.stage
        self._arenas: dict[str, Arena] = {}

    @property
    def stopping(self) -> bool:
        return self._proc.stopping

    def emit(self, event: m.Message) -> bool:
        """Send an event (PROGRESS ...) to the orchestrator; False when nobody listens (never blocks)."""
        return self._proc.events.send(event) if self._proc.events is not None else False

    def keepalive(self) -> None:
        """Answer control requests that arrived meanwhile (HEARTBEAT, HELLO, CANCEL, SHUTDOWN); others get `busy`."""
        self._proc.serve_pending()

    def keep_alive_while(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) on a helper thread while this one keeps answering control requests (HEARTBEAT):
        for long set-up work (hashing a pack, reading weights) that does not call keepalive() itself."""
        done = threading.Event()
        box: dict = {}

        def work():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
                box["error"] = e
            finally:
                done.set()
        threading.Thread(target=work, name="keep-alive-work", daemon=True).start()
        while not done.wait(POLL_SLICE_S):
            self.keepalive()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def check(self, job: str | None = None) -> None:
        """keepalive(), then raise Interrupted if the stage is stopping or `job` was cancelled."""
        self.keepalive()
        self.interrupted(job)

    def interrupted(self, job: str | None = None) -> None:
        """Raise Interrupted if the stage is stopping or `job` was cancelled, answering nothing: what a
        keep_alive_while helper thread may call between units of its work (the caller's thread answers)."""
        if self._proc.stopping:
            raise Interrupted("the stage is shutting down")
        if job is not None and job in self._proc.cancelled:
            raise Interrupted(f"job {job} was cancelled")

    def arena(self, name: str) -> Arena:
        """The job arena `name`, attached once per request (detached by the framework when the request ends)."""
        arena = self._arenas.get(name)
        if arena is None:
            arena = self._arenas[name] = Arena.attach(name)
        return arena

    def detach_all(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()


class StageProc:
    """The process around a stage's logic: ROUTER endpoint, READY handshake, heartbeats, dispatch, two error tiers."""

    def __init__(self, stage: str, logic: Any, config: PipelineConfig, *, ctx: zmq.Context | None = None,
                 install_signals: bool = True):
        self.stage, self.logic, self.config = stage, logic, config
        self.ctx = ctx or zmq.Context.instance()
        self.install_signals = install_signals
        self.stopping = False
        self.cancelled: set[str] = set()
        self.current_job: str | None = None
        self.started = time.monotonic()
        self.server: Server | None = None
        self.events: EventPush | None = None
        self.context = StageContext(self)
        self._proc_info = psutil.Process()

    # ---- control replies ----
    def _ready(self, request_id: int | None = None) -> m.Ready:
        info_fn = getattr(self.logic, "info", None)
        info = dict(info_fn()) if info_fn else {}
        kwargs = {} if request_id is None else {"id": request_id}
        return m.Ready(stage=self.stage, pid=os.getpid(), version=VERSION, info=info, **kwargs)

    def _control(self, msg: m.Message) -> m.Message:
        if isinstance(msg, m.Hello):
            return self._ready(msg.id)
        if isinstance(msg, m.Heartbeat):
            return m.reply_to(msg, m.Pong, stage=self.stage, pid=os.getpid(), busy=self.current_job is not None,
                              job=self.current_job, uptime_s=time.monotonic() - self.started,
                              rss_mb=self._proc_info.memory_info().rss / 2**20)
        if isinstance(msg, m.Cancel):
            self.cancelled.add(msg.job)
            on_cancel = getattr(self.logic, "on_cancel", None)
            if on_cancel is not None:
                on_cancel(msg.job)
            return m.reply_to(msg, m.Ok, note=f"job {msg.job} cancelled")
        assert isinstance(msg, m.Shutdown)
        log.info("shutdown requested%s", f": {msg.reason}" if msg.reason else "")
        self.stopping = True
        return m.reply_to(msg, m.Ok, note="shutting down")

    def serve_pending(self) -> None:
        """While a handler works: answer control requests now, tell work requests the stage is busy."""
        while self.server.sock.poll(0, zmq.POLLIN):
            req = self.server.recv(0.0)
            if req is None:
                continue
            if req.error is not None:
                self.server.reply_error(req, req.error)
            elif req.msg.KIND in CONTROL_KINDS:
                self.server.reply(req, self._control(req.msg))
            else:
                self.server.reply(req, m.error_reply(req.msg.id, "busy", f"{self.stage} is working on job "
                                                     f"{self.current_job}", retry=True))

    # ---- one request ----
    def _handle(self, req: Request) -> bool:
        """Answer one request; False when the stage must die (the fatal tier)."""
        msg = req.msg
        if msg.KIND in CONTROL_KINDS:
            self.server.reply(req, self._control(msg))
            return True
        handler = getattr(self.logic, "on_" + msg.KIND.lower(), None)
        if handler is None:
            self.server.reply(req, m.error_reply(msg.id, "unknown_kind", f"{self.stage} does not serve {msg.KIND}",
                                                 field="kind"))
            return True
        self.current_job = getattr(msg, "job", None)
        self.cancelled.discard(self.current_job)   # new work for a cancelled job is its resumption: serve it
        t0 = time.monotonic()
        try:
            reply = self._call(handler, msg)
            self.server.reply(req, reply)  # before detaching: inline replies may still view arena memory
            log.debug("%s %s answered %s in %.3f s", msg.KIND, self.current_job or "", reply.KIND,
                      time.monotonic() - t0)
            return True
        except Exception as e:  # noqa: BLE001 - the fatal tier: say so, then die
            log.exception("%s failed on %s (job %s)", self.stage, msg.KIND, self.current_job)
            self.server.reply(req, m.error_reply(msg.id, "internal", f"{self.stage} failed: {e}"[:2000], retry=True))
            self.die(f"{type(e).__name__} in {msg.KIND}: {e}", job=self.current_job)
            return False
        finally:
            self.context.detach_all()
            self.current_job = None

    def _call(self, handler: Callable, msg: m.Message) -> m.Message:
        """The handler's reply, or an ERROR reply for the errors a request may cause (the stage keeps serving)."""
        try:
            reply = handler(msg, self.context)
        except ProtocolError as e:
            return m.error_reply(msg.id, e)
        except RequestFailed as e:
            return m.error_reply(msg.id, e.code, str(e), field=e.field, retry=e.retry)
        except ArenaError as e:
            return m.error_reply(msg.id, "failed", str(e), field="arena")
        except Interrupted as e:
            return m.error_reply(msg.id, "cancelled", str(e), retry=self.stopping)
        if not isinstance(reply, m.Message) or reply.id != msg.id:
            raise TypeError(f"handler for {msg.KIND} must return a reply with the request's id, got {reply!r}")
        return reply

    def die(self, reason: str, job: str | None = None) -> None:
        """The last word: DYING to the orchestrator (best effort, bounded wait)."""
        if self.events is not None:
            self.events.last_word(m.Dying(stage=self.stage, pid=os.getpid(), reason=reason[:4000], job=job))
            self.events = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.info("%s received %s, stopping", self.stage, signal.Signals(signum).name)
        self.stopping = True

    # ---- the main loop ----
    def run(self) -> int:
        """Serve until SHUTDOWN or SIGTERM (EXIT_OK) or a fatal error (EXIT_FATAL)."""
        if self.install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        cfg, code = self.config, EXIT_OK
        try:
            # 1) bind our endpoint, connect to the orchestrator's event sink, say READY
            endpoint = cfg.endpoint(self.stage)
            curve = cfg.curve_server() if cfg.is_remote(self.stage) else None
            self.server = Server(self.ctx, endpoint, curve=curve, allow_plaintext=cfg.security.allow_plaintext_loopback,
                                 allow_wildcard=cfg.security.allow_wildcard_bind)
            self.events = event_socket(self.ctx, cfg)
            self.events.send(self._ready())
            log.info("%s ready on %s (pid %d, python %s)", self.stage, endpoint, os.getpid(), sys.executable)
            while not self.stopping:
                # 2) wait for the next request in short slices, so signals are seen promptly
                req = self.server.recv(POLL_SLICE_S, should_stop=lambda: self.stopping)
                if req is None:
                    continue
                # 3) a request that does not decode gets an ERROR naming the field; serving goes on
                if req.error is not None:
                    log.warning("bad request: %s", req.error)
                    self.server.reply_error(req, req.error)
                    continue
                # 4) dispatch: control kinds here, work kinds to the logic; 5) reply
                if not self._handle(req):
                    code = EXIT_FATAL
                    break
        except Exception as e:  # noqa: BLE001 - set-up failures are fatal too
            log.exception("%s cannot serve", self.stage)
            self.die(f"{type(e).__name__}: {e}")
            code = EXIT_FATAL
        finally:
            # 6) clean up: logic, arenas, sockets
            close = getattr(self.logic, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("%s: logic.close() failed", self.stage)
            self.context.detach_all()
            if self.server is not None:
                self.server.close()
            if self.events is not None:
                self.events.close()
        log.info("%s exits with %d", self.stage, code)
        return code


def event_socket(ctx: zmq.Context, config: PipelineConfig) -> EventPush:
    """A PUSH socket to the orchestrator's event sink (`endpoints.events`)."""
    return EventPush(ctx, config.endpoint("events"), curve=config.curve_client("events"),
                     allow_plaintext=config.security.allow_plaintext_loopback)


def exit_process(code: int) -> None:
    """End a stage process once stage_main has cleaned up (sockets closed, arenas detached, context terminated),
    skipping the interpreter's final garbage collection: with torch and transformers loaded it took 3-12 s on a busy
    machine, long enough for supervisord's stopwaitsecs to end a clean stop with SIGKILL."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def setup_logging(stage: str, level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr, force=True,
                        format=f"%(asctime)s {stage}[%(process)d] %(levelname)s %(name)s: %(message)s")


def _past_startsecs() -> None:
    """Return only once this process has lived past supervisord's startsecs: supervisord treats any exit before that
    as a failed start (BACKOFF, started again up to startretries times, then FATAL with no exit status), whatever
    `exitcodes` says; after it, an exit in `exitcodes` is EXITED and expected. Not under supervisord
    ($SUPERVISOR_ENABLED unset): at once."""
    if os.environ.get("SUPERVISOR_ENABLED"):
        time.sleep(max(0.0, SUPERVISOR_STARTSECS + 0.5 - _lived_s()))


def _lived_s() -> float:
    """Seconds since this process started, on the boot clock both /proc/self/stat's start time and CLOCK_BOOTTIME
    count in. Not psutil's create_time against time.time(): its boot time is /proc/stat's btime rounded down to the
    second, so a process could look up to a second older than it is and exit inside startsecs after all."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])    # field 22, starttime, counted after comm
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0                                                       # unknown: wait the whole startsecs


def config_exit() -> int:
    """EXIT_CONFIG past supervisord's startsecs, so the program stays down at once with its one log line."""
    _past_startsecs()
    return EXIT_CONFIG


def runs_elsewhere(config: PipelineConfig, stage: str) -> bool:
    """The config reaches `stage` as a client (security.servers names its public key) at a tcp address of another
    machine: that machine runs it. A config that would serve it here is checked as a listener instead, so an unsafe
    one (no keys, a missing key file) is still a config error."""
    return stage in config.security.servers and served_elsewhere(config.endpoint(stage))


def stage_main(stage: str, make_logic: Callable[[PipelineConfig], Any], argv: list[str] | None = None) -> int:
    """Entry point of `python -m stages.NAME --config FILE`: config, logging, process title, logic, serve."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=f"The Anima {stage} stage.")
    parser.add_argument("--config", required=True, help="pipeline config (TOML), e.g. run/pipeline.toml")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="overrides the config")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if runs_elsewhere(config, stage):              # e.g. the executor moved to a bigger host: not here
            print(f"{stage}: endpoints.{stage} = {config.endpoint(stage)} is another machine's address; the {stage} "
                  "runs there, nothing to run here", file=sys.stderr)
            _past_startsecs()              # a deliberate EXITED (exitcodes=0,2), not a failed start (FATAL)
            return 0
        config.check_listener(stage)  # an unsafe or keyless tcp endpoint is a config error, not a crash loop
    except ConfigError as e:
        print(f"{stage}: {e}", file=sys.stderr, flush=True)
        return config_exit()
    setup_logging(stage, args.log_level or config.log_level)
    setproctitle.setproctitle(f"anima-{stage}")
    ctx = zmq.Context()
    try:
        try:
            logic = make_logic(config)
        except ConfigError as e:    # a setting or pack the logic cannot use (a policy this backend cannot run, a
            log.error("%s: %s", stage, e)       # missing pack folder): exit 2, and the orchestrator is told why
            event_socket(ctx, config).last_word(m.Dying(stage=stage, pid=os.getpid(),
                                                        reason=f"cannot start: {e}"[:4000]))
            return config_exit()
        except Exception as e:  # noqa: BLE001 - a stage that cannot start says why, then exits for supervisord
            log.exception("%s: start-up failed", stage)
            event_socket(ctx, config).last_word(m.Dying(stage=stage, pid=os.getpid(),
                                                        reason=f"start-up failed: {type(e).__name__}: {e}"[:4000]))
            return EXIT_FATAL
        record_start(config, stage)      # what it runs with: a later edit of the file is told, not met halfway
        return StageProc(stage, logic, config, ctx=ctx).run()
    finally:
        ctx.term()
