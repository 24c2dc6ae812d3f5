"""`orchestrator start` / `orchestrator stop`: supervisord for a run folder, started or stopped, and waited for.

    orchestrator start [--timeout 120]   # supervisord -c RUN/supervisord.conf; back once it answers, every program it
                                         # starts by itself (scheduler, executor, the daemon, the HTTP front) is
                                         # RUNNING and the daemon answers
    orchestrator stop [--timeout 180]    # every program stopped in supervisord's order, then supervisord; back once
                                         # its process has exited and its socket is gone

Why they wait: `supervisorctl shutdown` returns as soon as supervisord has taken the request, and supervisord then
stops its programs (each within its stopwaitsecs) still holding its socket, so a `supervisord -c` started meanwhile
fails ("Another program is already listening on a port that one of our HTTP servers is configured to use"). A start
while one is shutting down waits for it to exit first. Past the timeout either says what it was waiting for (exit 1).
"""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from orchestrator.engine.daemon_probe import daemon_answers
from orchestrator.engine.runfolder import RunFolder, missing_modules
from orchestrator.engine.supervisor import POLL_INTERVAL_S, SHUTDOWN_TIMEOUT_S, ShuttingDown, Supervisor, SupervisorError

START_TIMEOUT_S = 120.0     # supervisord up, its programs past their startsecs, the daemon answering
STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S
SPAWN_TIMEOUT_S = 60.0      # `supervisord -c` itself: it reads its config and binds its socket, then daemonizes
DAEMON = "orchestrator"     # the job daemon's program


def supervisord_state(sup: Supervisor) -> str:
    """"running", "shutting down" (it still holds its socket while it stops its programs) or "absent"."""
    try:
        sup.ping()
        return "running"
    except ShuttingDown:
        return "shutting down"
    except (SupervisorError, OSError):
        return "absent"


def supervisord_pid(rf: RunFolder) -> int | None:
    """The pid in supervisord's pidfile ([supervisord] pidfile of the run folder's supervisord.conf) while that
    process runs; None when there is no pidfile or it names no running process (supervisord removes it at exit)."""
    conf = rf.supervisord_conf
    parser = configparser.RawConfigParser(strict=False, inline_comment_prefixes=(";",))
    try:
        parser.read(conf)
        path = parser.get("supervisord", "pidfile", fallback=None)
        if not path:
            return None
        path = path.replace("%(here)s", str(conf.parent)).replace("%%", "%")
        pid = int(Path(path).read_text().strip())
    except (OSError, ValueError, configparser.Error):
        return None
    return pid if _running(pid) else None


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie, exited but not yet reaped by its parent, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):           # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _wait_exited(rf: RunFolder, sup: Supervisor, pid: int | None, deadline: float, timeout_s: float) -> None:
    """Until supervisord's process `pid` has exited and nothing answers on its socket; then the socket file is gone
    (supervisord removes it at exit; one left by a killed supervisord is removed here)."""
    while True:
        state = supervisord_state(sup)
        if state == "absent" and (pid is None or not _running(pid)):
            break
        if time.monotonic() > deadline:
            who = f"supervisord (pid {pid})" if pid and _running(pid) else "supervisord"
            raise SupervisorError(f"{who} for {rf.root} is still {'up' if state == 'absent' else state} after "
                                  f"{timeout_s:.0f} s (its programs stop one after another, each within its "
                                  f"stopwaitsecs; log: {rf.logs / 'supervisord.log'}); `orchestrator stop` again "
                                  "waits on")
        time.sleep(POLL_INTERVAL_S)
    rf.supervisor_sock.unlink(missing_ok=True)


def stop(rf: RunFolder, timeout_s: float = STOP_TIMEOUT_S, say: Callable[[str], None] = print) -> bool:
    """Every program stopped in supervisord's shutdown order, then supervisord; back once its process has exited and
    its socket is gone. -> whether one was running (or shutting down)."""
    deadline = time.monotonic() + timeout_s
    sup = Supervisor(rf.supervisor_sock)
    state, pid = supervisord_state(sup), supervisord_pid(rf)
    if state == "absent" and pid is None:
        _wait_exited(rf, sup, None, deadline, timeout_s)          # a socket file left by a killed one goes
        say(f"supervisord is not running for {rf.root}")
        return False
    if state == "running":
        say(f"stopping supervisord (pid {pid}) for {rf.root}: every program, in supervisord's order")
        try:
            sup.shutdown_in_order(max(0.0, deadline - time.monotonic()))
        except ShuttingDown:                    # someone else's shutdown meanwhile: wait for that one
            pass
        except SupervisorError as e:            # a program outlasted the timeout; supervisord was still asked to go
            raise SupervisorError(f"supervisord (pid {pid}) for {rf.root} is still shutting down after "
                                  f"{timeout_s:.0f} s ({e}); `orchestrator stop` again waits on") from None
    else:
        why = "shutting down" if state == "shutting down" else "not answering on its socket"
        say(f"supervisord (pid {pid}) for {rf.root} is {why}: waiting for it to exit")
    _wait_exited(rf, sup, pid, deadline, timeout_s)
    say(f"supervisord stopped ({rf.root}; its socket is gone)")
    return True


def _spawn(rf: RunFolder) -> None:
    """`supervisord -c RUN/supervisord.conf` from this environment; it returns once supervisord has bound its
    socket and gone to the background (a socket still in use, a bad config: its own message, exit 1)."""
    conf = rf.supervisord_conf
    cmd = [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S, cwd=rf.root)
    except subprocess.TimeoutExpired:
        raise SupervisorError(f"supervisord -c {conf} did not go to the background in {SPAWN_TIMEOUT_S:.0f} s") \
            from None
    if r.returncode != 0:
        raise SupervisorError(f"supervisord -c {conf} did not start (exit {r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()}")


def wait_up(rf: RunFolder, sup: Supervisor, deadline: float, optional: tuple[str, ...] = ()) -> list:
    """Until every program supervisord starts by itself is RUNNING (a start that ends FATAL/EXITED fails at once,
    naming it; one of `optional` is only reported in its state) and the job daemon answers. -> their ProcInfo."""
    infos = []
    for name in sup.autostarted():
        try:
            infos.append(sup.wait_state(name, ("RUNNING",), max(0.0, deadline - time.monotonic())))
        except SupervisorError as e:
            if name in optional:
                infos.append(sup.info(name))
                continue
            raise SupervisorError(f"{e} (orchestrator --run {rf.root} logs {name}; supervisord itself is up: "
                                  "orchestrator stop)") from None
    if any(i.name == DAEMON for i in infos):
        while not daemon_answers(rf):
            if time.monotonic() > deadline:
                raise SupervisorError(f"the orchestrator daemon is RUNNING but does not answer on {rf.daemon_sock} "
                                      f"(orchestrator --run {rf.root} logs orchestrator)")
            time.sleep(POLL_INTERVAL_S)
    return infos


def start(rf: RunFolder, timeout_s: float = START_TIMEOUT_S, say: Callable[[str], None] = print,
          optional: tuple[str, ...] = ()) -> bool:
    """supervisord for the run folder, started unless it runs (one shutting down is waited for first); back once
    its programs are up (`wait_up`; `optional` ones may have failed). -> whether it was started now."""
    deadline = time.monotonic() + timeout_s
    if not rf.supervisord_conf.is_file():
        raise SupervisorError(f"no {rf.supervisord_conf}: create the run folder first (orchestrator --run {rf.root} "
                              "init ...)")
    gone = missing_modules(rf.supervisord_conf.read_text())
    if gone:
        raise SupervisorError(f"{rf.supervisord_conf} runs python -m {', '.join(gone)}, which this version does not "
                              f"have (the run folder was made by an older one): write it again with `orchestrator "
                              f"--run {rf.root} init --force` and the run folder's packs (the old file is kept beside "
                              "it), or edit its command= lines")
    sup = Supervisor(rf.supervisor_sock)
    state = supervisord_state(sup)
    if state == "shutting down":
        pid = supervisord_pid(rf)
        say(f"supervisord (pid {pid}) for {rf.root} is shutting down: waiting for it to exit")
        _wait_exited(rf, sup, pid, deadline, timeout_s)
        state = "absent"
    if state == "running":
        say(f"supervisord is already running for {rf.root}")
    else:
        say(f"starting supervisord -c {rf.supervisord_conf}")
        _spawn(rf)
    infos = wait_up(rf, sup, deadline, optional)
    say(f"supervisord running (pid {supervisord_pid(rf)}) for {rf.root}: "
        + ", ".join(f"{i.name} {i.state}" for i in infos))
    return state != "running"
