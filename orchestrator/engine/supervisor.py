"""supervisord control over its XML-RPC interface on the unix socket: start, stop, wait for a state, process info."""
from __future__ import annotations

import http.client
import logging
import socket
import time
import xmlrpc.client
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0          # one XML-RPC call
POLL_INTERVAL_S = 0.1         # while waiting for a process state
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0         # supervisord's own stopwaitsecs escalates to SIGKILL before this
SHUTDOWN_TIMEOUT_S = 180.0    # a whole shutdown: the programs stop one priority group after another (10-30 s each)

# supervisord process states (supervisor.states.ProcessStates)
RUNNING_STATES = ("STARTING", "RUNNING", "STOPPING", "BACKOFF")   # a process may exist (or is about to)
STOPPED_STATES = ("STOPPED", "EXITED", "FATAL")
LIVE_STATES = ("STARTING", "RUNNING", "STOPPING")                 # a pid exists

# supervisor.xmlrpc.Faults codes the client turns into clear errors
FAULT_SHUTDOWN_STATE = 6      # supervisord is shutting down: it answers, but every call is refused
FAULT_BAD_NAME = 10
FAULT_NO_FILE = 20
FAULT_SPAWN_ERROR = 50
FAULT_ABNORMAL_TERMINATION = 40
FAULT_ALREADY_STARTED = 60
FAULT_NOT_RUNNING = 70


class SupervisorError(RuntimeError):
    """supervisord unreachable, an unknown program, a process that would not start or stop in time."""


class ShuttingDown(SupervisorError):
    """supervisord still holds its socket but is shutting down (after `supervisorctl shutdown`, while it stops its
    programs): a new one cannot start on that socket until it has gone."""


@dataclass(frozen=True)
class ProcInfo:
    name: str
    state: str          # statename: STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, UNKNOWN
    pid: int            # 0 when no process
    exitstatus: int
    description: str
    spawnerr: str
    start: float        # unix time of the last start (0 if never)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES and self.pid > 0

    @classmethod
    def from_rpc(cls, d: dict) -> "ProcInfo":
        return cls(name=d.get("name", ""), state=d.get("statename", "UNKNOWN"), pid=int(d.get("pid", 0)),
                   exitstatus=int(d.get("exitstatus", 0)), description=d.get("description", ""),
                   spawnerr=d.get("spawnerr", ""), start=float(d.get("start", 0)))


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class _UnixTransport(xmlrpc.client.Transport):
    """HTTP over supervisord's unix socket, a fresh connection per call, with a timeout."""

    def __init__(self, path: str, timeout: float):
        super().__init__()
        self._path, self._timeout = path, timeout

    def make_connection(self, host):
        return _UnixConnection(self._path, self._timeout)


class Supervisor:
    """A client for one supervisord. Every call opens the socket afresh, so it survives supervisord restarts."""

    def __init__(self, socket_path: str, *, timeout_s: float = RPC_TIMEOUT_S):
        self.socket_path = str(socket_path)
        self._proxy = xmlrpc.client.ServerProxy("http://localhost/RPC2",
                                                transport=_UnixTransport(self.socket_path, timeout_s),
                                                allow_none=True)

    def _call(self, method: str, *args, name: str | None = None):
        fn = self._proxy
        for part in method.split("."):
            fn = getattr(fn, part)
        try:
            return fn(*args)
        except xmlrpc.client.Fault as f:
            what = f"program {name!r}" if name else "supervisord"
            if f.faultCode == FAULT_BAD_NAME:
                raise SupervisorError(f"supervisord has no program {name!r}") from None
            if f.faultCode == FAULT_SHUTDOWN_STATE:
                raise ShuttingDown(f"supervisord on {self.socket_path} is shutting down") from None
            raise SupervisorError(f"{what}: {method} failed: {f.faultString}") from None
        except (OSError, http.client.HTTPException, xmlrpc.client.ProtocolError) as e:
            raise SupervisorError(f"supervisord is not reachable on {self.socket_path}: {e}") from None

    # ------------------------------------------------------------ reading

    def ping(self) -> str:
        """supervisord's own state name (RUNNING when healthy)."""
        return self._call("supervisor.getState")["statename"]

    def wait_answering(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> str:
        """Poll until supervisord answers on its socket (-> its state name). Its socket file is linked in before it
        listens, so a connect in between is refused: the file's existence is not yet an answer. `alive` says whether
        the supervisord being waited for still runs (a start that failed stops the wait at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.ping()
            except SupervisorError:
                if not alive() or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def info(self, name: str) -> ProcInfo:
        return ProcInfo.from_rpc(self._call("supervisor.getProcessInfo", name, name=name))

    def all_info(self) -> dict[str, ProcInfo]:
        return {d["name"]: ProcInfo.from_rpc(d) for d in self._call("supervisor.getAllProcessInfo")}

    def autostarted(self) -> list[str]:
        """The programs supervisord starts by itself (autostart=true), named as `info` takes them."""
        return [c["name"] if c["group"] == c["name"] else f"{c['group']}:{c['name']}"
                for c in self._call("supervisor.getAllConfigInfo") if c.get("autostart")]

    def is_live(self, name: str) -> bool:
        return self.info(name).live

    def tail(self, name: str, offset: int = 0, length: int = 64 * 1024, stderr: bool = False):
        """(text, new offset, overflow) of the program's log, as supervisorctl's `tail -f` reads it."""
        method = "supervisor.tailProcessStderrLog" if stderr else "supervisor.tailProcessStdoutLog"
        return self._call(method, name, offset, length, name=name)

    # ------------------------------------------------------------ control

    def start(self, name: str, *, wait: bool = True, timeout_s: float = START_TIMEOUT_S,
              sleep: Callable[[float], None] = time.sleep) -> ProcInfo:
        """Start a program; with `wait`, return once RUNNING (supervisord's startsecs passed), else raise.
        `sleep` is how to wait between polls (a daemon passes its event pump, so it keeps serving)."""
        try:
            self._call("supervisor.startProcess", name, False, name=name)
        except SupervisorError as e:
            if "ALREADY_STARTED" not in str(e):
                raise
        return self.wait_state(name, ("RUNNING",), timeout_s, sleep=sleep) if wait else self.info(name)

    def stop(self, name: str, *, wait: bool = True, timeout_s: float = STOP_TIMEOUT_S,
             sleep: Callable[[float], None] = time.sleep) -> ProcInfo:
        """Stop a program (SIGTERM to its group, SIGKILL after stopwaitsecs); with `wait`, return once stopped."""
        try:
            self._call("supervisor.stopProcess", name, False, name=name)
        except SupervisorError as e:
            if "NOT_RUNNING" not in str(e):
                raise
        return self.wait_state(name, STOPPED_STATES, timeout_s, sleep=sleep) if wait else self.info(name)

    def signal(self, name: str, sig: str) -> None:
        """Send signal `sig` ("KILL", "CONT", ...) to the program's process (not its group)."""
        self._call("supervisor.signalProcess", name, sig, name=name)

    def restart(self, name: str, *, timeout_s: float = START_TIMEOUT_S) -> ProcInfo:
        self.stop(name)
        return self.start(name, timeout_s=timeout_s)

    def wait_state(self, name: str, states, timeout_s: float, *,
                   sleep: Callable[[float], None] = time.sleep) -> ProcInfo:
        """Poll until the program is in one of `states`; a start that ends FATAL/EXITED/BACKOFF fails at once."""
        states = tuple(states)
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info(name)
            if info.state in states:
                return info
            if "RUNNING" in states and info.state in ("FATAL", "EXITED"):
                raise SupervisorError(f"program {name!r} did not start: {info.state} "
                                      f"({info.spawnerr or info.description}); see its log")
            if time.monotonic() >= deadline:
                raise SupervisorError(f"program {name!r} is {info.state} after {timeout_s:.0f} s; "
                                      f"wanted {'/'.join(states)}")
            sleep(POLL_INTERVAL_S)

    def update(self) -> list[str]:
        """`supervisorctl update`: supervisord rereads its config file; programs it gained are added (and autostarted),
        changed ones are stopped and added again, removed ones are stopped and dropped. -> the programs added."""
        added, changed, removed = self._call("supervisor.reloadConfig")[0]
        for name in changed + removed:
            try:
                self._call("supervisor.stopProcessGroup", name, True, name=name)
            except SupervisorError as e:
                if "NOT_RUNNING" not in str(e):
                    raise
            self._call("supervisor.removeProcessGroup", name, name=name)
        for name in added + changed:
            self._call("supervisor.addProcessGroup", name, name=name)
        return added + changed

    def shutdown(self) -> None:
        """Ask supervisord to stop all programs and exit (it answers at once; `wait_gone` waits for the exit)."""
        self._call("supervisor.shutdown")

    def stop_all(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every program in the order supervisord's own shutdown uses (the highest group priority first: the
        HTTP front, the orchestrator, encoder and VAE, then scheduler and executor), each level waited for at
        POLL_INTERVAL_S. supervisord's shutdown moves to the next level only at its next one-second tick, a second
        or more per level; a `shutdown()` after this has nothing left to stop."""
        deadline = time.monotonic() + timeout_s
        levels: dict[int, dict[str, list[str]]] = {}
        for c in self._call("supervisor.getAllConfigInfo"):
            levels.setdefault(int(c["group_prio"]), {}).setdefault(c["group"], []).append(f"{c['group']}:{c['name']}")
        for prio in sorted(levels, reverse=True):
            for group in levels[prio]:
                self._call("supervisor.stopProcessGroup", group, False, name=group)
            for procs in levels[prio].values():
                for proc in procs:
                    self.wait_state(proc, STOPPED_STATES, max(0.0, deadline - time.monotonic()))

    def shutdown_in_order(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """`stop_all`, then `shutdown`: supervisord is asked to exit even when a program outlasted `timeout_s` (that
        SupervisorError is raised after the request). `wait_gone` waits for the exit."""
        try:
            self.stop_all(timeout_s)
        finally:
            self.shutdown()

    def wait_gone(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Wait until supervisord no longer answers on its socket (a shutdown stops every program first, each within
        its stopwaitsecs). SupervisorError when it still answers after `timeout_s`, or answers as running again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                state = self.ping()
            except ShuttingDown:
                state = None
            except SupervisorError:
                return                                   # the socket is gone or refuses: supervisord has exited
            if state is not None:
                raise SupervisorError(f"supervisord on {self.socket_path} is {state}, not shutting down")
            if time.monotonic() > deadline:
                raise SupervisorError(f"supervisord on {self.socket_path} was still shutting down after "
                                      f"{timeout_s:.0f} s")
            time.sleep(POLL_INTERVAL_S)
