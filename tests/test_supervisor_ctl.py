"""supervisord control through XML-RPC on its unix socket, against a real supervisord in a temporary run folder."""
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.engine.runfolder import (ALWAYS_ON_STAGES, ON_DEMAND_STAGES, PROGRAMS, STAGE_PROGRAMS, TEMPLATE, init_run,
                                    missing_modules, render_supervisord_conf)
from orchestrator.engine.supervisor import Supervisor, SupervisorError

BIN = Path(sys.executable).parent

TINY_CONF = """
[unix_http_server]
file={run}/supervisor.sock
chmod=0700

[supervisord]
logfile={run}/supervisord.log
pidfile={run}/supervisord.pid
childlogdir={run}
directory={run}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{run}/supervisor.sock

[program:sleeper]
command={py} -c "import time; print('sleeper up', flush=True); time.sleep(600)"
autostart=false
autorestart=false
startsecs=0
stopsignal=TERM
stopasgroup=true
killasgroup=true
stdout_logfile={run}/sleeper.log

[program:parent]
command={py} -c "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
autostart=true
autorestart=false
startsecs=0
stopasgroup=true
killasgroup=true
stdout_logfile={run}/parent.log

[program:broken]
command={run}/does-not-exist
autostart=false
startretries=0
startsecs=0
stdout_logfile={run}/broken.log
"""


def _start_supervisord(conf: Path, sock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not sock.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"supervisord exited: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("supervisord did not create its socket")
        time.sleep(0.05)
    Supervisor(sock).wait_answering(max(1.0, deadline - time.monotonic()), alive=lambda: proc.poll() is None)
    return proc


def _stop_supervisord(sup: Supervisor, proc: subprocess.Popen) -> None:
    try:
        sup.shutdown()
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def tmp_path():
    """Our own folder: pytest's basetemp may be pruned by a concurrent pytest session while supervisord uses it."""
    d = Path(tempfile.mkdtemp(prefix="anima-sup-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tiny(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    conf = run / "supervisord.conf"
    conf.write_text(TINY_CONF.format(run=run, py=sys.executable))
    proc = _start_supervisord(conf, run / "supervisor.sock")
    sup = Supervisor(run / "supervisor.sock")
    yield sup, run, conf
    _stop_supervisord(sup, proc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


ORDER_PROGRAM = """
[program:{name}]
command={py} -c "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (open('{log}', 'a').write('{name} '), sys.exit(0))); print('up', flush=True); time.sleep(600)"
priority={prio}
autostart=true
autorestart=false
startsecs=0
stdout_logfile={run}/{name}.log
"""


def test_stop_all_goes_by_priority_without_waiting_for_supervisords_ticks(tmp_path):
    """supervisord's shutdown stops one priority level at a time and moves on at its next one-second tick; stop_all
    keeps its order (the highest priority number first: the front, the orchestrator, then the stages) and moves on as
    soon as a level is down."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    conf = run / "supervisord.conf"
    order = run / "order.txt"
    programs = [("stage", 100), ("daemon", 300), ("front", 400), ("front2", 400)]
    conf.write_text(TINY_CONF.format(run=run, py=sys.executable) + "".join(
        ORDER_PROGRAM.format(name=n, prio=p, py=sys.executable, log=order, run=run) for n, p in programs))
    proc = _start_supervisord(conf, run / "supervisor.sock")
    sup = Supervisor(run / "supervisor.sock")
    try:
        for name, _ in programs:
            sup.wait_state(name, ("RUNNING",), 20)
        # RUNNING comes before the program has set its SIGTERM handler (startsecs=0): wait for its "up" line
        deadline = time.monotonic() + 20
        while not all((run / f"{n}.log").exists() and "up" in (run / f"{n}.log").read_text() for n, _ in programs):
            assert time.monotonic() < deadline, "the programs never said up"
            time.sleep(0.05)
        t0 = time.monotonic()
        sup.stop_all()
        took = time.monotonic() - t0
        said = order.read_text().split()
        assert sorted(said[:2]) == ["front", "front2"] and said[2:] == ["daemon", "stage"], said
        assert all(sup.info(name).state == "STOPPED" for name, _ in programs)
        assert took < 2.0, f"stop_all took {took:.1f} s for three levels"
        sup.shutdown_in_order()                     # nothing left to stop: supervisord exits at once
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            _stop_supervisord(sup, proc)


def test_start_stop_status(tiny):
    sup, run, conf = tiny
    assert sup.ping() == "RUNNING"
    assert stat.S_IMODE((run / "supervisor.sock").stat().st_mode) == 0o700
    assert sup.info("sleeper").state == "STOPPED" and not sup.is_live("sleeper")
    info = sup.start("sleeper", timeout_s=10)
    assert info.state == "RUNNING" and info.pid > 0 and _alive(info.pid)
    assert sup.is_live("sleeper")
    again = sup.start("sleeper")                    # already started: no error, same process
    assert again.pid == info.pid
    deadline = time.monotonic() + 10
    while "sleeper up" not in sup.tail("sleeper")[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    text, offset, _ = sup.tail("sleeper")
    assert "sleeper up" in text and offset > 0
    stopped = sup.stop("sleeper", timeout_s=10)
    assert stopped.state == "STOPPED" and stopped.pid == 0
    deadline = time.monotonic() + 5
    while _alive(info.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(info.pid)
    assert sup.stop("sleeper").state == "STOPPED"   # stopping a stopped program is fine


def test_stop_kills_the_process_group(tiny):
    sup, run, conf = tiny
    info = sup.wait_state("parent", ("RUNNING",), 10)
    import psutil
    deadline = time.monotonic() + 10                 # until it has spawned its child
    while not (children := psutil.Process(info.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert children, "the test program should have a child"
    sup.stop("parent", timeout_s=10)
    psutil.wait_procs(children, timeout=5)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def test_errors_are_clear(tiny, tmp_path):
    sup, run, conf = tiny
    with pytest.raises(SupervisorError, match="no program 'nosuch'"):
        sup.info("nosuch")
    with pytest.raises(SupervisorError, match="broken"):
        sup.start("broken", timeout_s=5)
    dead = Supervisor(tmp_path / "missing.sock", timeout_s=1)
    with pytest.raises(SupervisorError, match="not reachable"):
        dead.ping()


def test_supervisorctl_uses_the_same_socket(tiny):
    sup, run, conf = tiny
    out = subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), "status"], capture_output=True, text=True,
                         timeout=30)
    assert "sleeper" in out.stdout and "STOPPED" in out.stdout and "parent" in out.stdout


def test_real_config_renders_and_runs(tmp_path):
    """The top-level supervisord.conf, rendered for a temp run folder with a stand-in interpreter that just sleeps."""
    fake = tmp_path / "fakepy"
    fake.write_text("#!/bin/sh\necho \"fake stage $*\"\nexec sleep 600\n")
    fake.chmod(0o755)
    rf = init_run(tmp_path / "r", python=str(fake))
    conf_text = rf.supervisord_conf.read_text()
    assert "%(here)s" not in conf_text and str(rf.root) in conf_text
    assert stat.S_IMODE(rf.root.stat().st_mode) == 0o700
    proc = _start_supervisord(rf.supervisord_conf, rf.supervisor_sock)
    sup = Supervisor(rf.supervisor_sock)
    try:
        for name in ("scheduler", "executor", "orchestrator"):
            sup.wait_state(name, ("RUNNING",), 15)
        infos = sup.all_info()
        assert set(infos) == set(PROGRAMS)
        assert infos["encoder"].state == "STOPPED" and infos["vae"].state == "STOPPED"
        assert stat.S_IMODE(rf.supervisor_sock.stat().st_mode) == 0o700
        ctl = [str(BIN / "supervisorctl"), "-c", str(rf.supervisord_conf)]
        out = subprocess.run(ctl + ["status"], capture_output=True, text=True, timeout=30).stdout
        assert all(p in out for p in PROGRAMS)
        pid = infos["executor"].pid
        subprocess.run(ctl + ["restart", "executor"], capture_output=True, text=True, timeout=30, check=True)
        assert sup.info("executor").pid not in (0, pid)
        log = (rf.logs / "executor.log").read_text()
        assert f"-m stages.executor --config {rf.pipeline_toml}" in log
        assert f"-m orchestrator.terminal.cli --run {rf.root} serve" in (rf.logs / "orchestrator.log").read_text()
    finally:
        _stop_supervisord(sup, proc)


def test_render_escapes_percent(tmp_path):
    text = render_supervisord_conf(TEMPLATE.read_text(), tmp_path / "a%b", python="/x/py")
    assert "a%%b" in text and "%(here)s" not in text and "/x/py -m stages.vae" in text


def test_a_run_folder_naming_modules_this_version_lacks_is_refused_before_supervisord_starts(tmp_path):
    """A run folder rendered by a version whose modules were laid out otherwise keeps its supervisord.conf (it is the
    user's): its programs would fail at every start, so `orchestrator start` says so, naming the module, and starts
    nothing; the template's own programs are all there."""
    from orchestrator.ops import run_control
    assert missing_modules(render_supervisord_conf(TEMPLATE.read_text(), tmp_path / "run", python="/x/py")) == []
    rf = init_run(tmp_path / "run")
    conf = rf.root / "supervisord.conf"
    conf.write_text(conf.read_text().replace(" -m orchestrator.http ", " -m orchestrator.gone.http ")
                    .replace(" -m stages.vae ", " -m stages.vae_gone "))
    assert missing_modules(conf.read_text()) == ["stages.vae_gone", "orchestrator.gone.http"]
    with pytest.raises(SupervisorError, match=r"runs python -m stages.vae_gone, orchestrator.gone.http, which this "
                                              r"version does not have .*init --force"):
        run_control.start(rf, timeout_s=5, say=lambda _: None)
    assert not rf.supervisor_sock.exists()


def test_the_on_demand_stages_are_the_ones_supervisord_does_not_autostart():
    import configparser
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(TEMPLATE.read_text())
    autostart = {s.split(":", 1)[1]: conf.getboolean(s, "autostart") for s in conf.sections()
                 if s.startswith("program:")}
    assert set(autostart) == set(PROGRAMS)
    assert {p for p, on in autostart.items() if not on} == set(ON_DEMAND_STAGES) == {"encoder", "vae"}
    assert set(ALWAYS_ON_STAGES) == {"scheduler", "executor"} and all(autostart[s] for s in ALWAYS_ON_STAGES)
    # a stage (and the daemon) outlives startsecs before a config exit (stages.base): it must know the value
    from stages.base import SUPERVISOR_STARTSECS
    assert {p: conf.getfloat(f"program:{p}", "startsecs") for p in STAGE_PROGRAMS + ("orchestrator",)} == \
        {p: SUPERVISOR_STARTSECS for p in STAGE_PROGRAMS + ("orchestrator",)}


def test_wait_answering_outlasts_a_socket_file_that_does_not_listen_yet(tmp_path):
    """supervisord links its socket file in before it listens (supervisor/http.py: bind, link, then postbind's
    listen): a connect in that window is refused. The wait outlasts it; a start that died ends the wait at once."""
    import socket
    import threading
    import xmlrpc.client
    path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))                                    # the file exists, nobody listens
    with pytest.raises(SupervisorError, match="not reachable"):
        Supervisor(path).ping()
    with pytest.raises(SupervisorError, match="not reachable"):
        Supervisor(path).wait_answering(30, alive=lambda: False)

    def listen_late():
        time.sleep(0.3)
        srv.listen(1)
        conn, _ = srv.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            head, body = data.split(b"\r\n\r\n", 1)
            length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
            while len(body) < length:
                body += conn.recv(4096)
            reply = xmlrpc.client.dumps(({"statecode": 1, "statename": "RUNNING"},), methodresponse=True).encode()
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\nContent-Length: %d\r\n\r\n" % len(reply) + reply)
    t = threading.Thread(target=listen_late)
    t.start()
    t0 = time.monotonic()
    try:
        assert Supervisor(path).wait_answering(30) == "RUNNING"
        assert time.monotonic() - t0 >= 0.25
    finally:
        t.join(10)
        srv.close()
