"""The HTTP front's safety: loopback by default, another address only with a token (else exit 2 with one line, and
supervisord does not restart it in a loop), the token checked on every data route, /view confined to the jobs' own
files, and a daemon that is not there answered with 503 at once."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from orchestrator.http import files
from orchestrator.engine.runfolder import TEMPLATE, render_supervisord_conf
from orchestrator.engine.supervisor import Supervisor

PY = sys.executable
TOKEN = "0123456789abcdef0123456789abcdef"


def _run_folder(tmp_path: Path, http: str = "port = 0\n") -> Path:
    run = tmp_path / "run"
    (run / "jobs").mkdir(parents=True, mode=0o700)
    os.chmod(run, 0o700)
    (run / "pipeline.toml").write_text(f'run_dir = "."\n[stage.http]\n{http}')
    return run


def _front(run: Path, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PY, "-m", "orchestrator.http", "--config", str(run / "pipeline.toml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while not (run / "http.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the front did not start: {proc.stdout.read()}")
        time.sleep(0.05)
    return proc, json.loads((run / "http.json").read_text())["url"]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


@pytest.mark.parametrize("http,says", [
    ('host = "0.0.0.0"\nport = 0\n', "is not a loopback address: listening there needs a token"),
    ('port = 0\ntoken_file = "missing.token"\n', "cannot read it"),
    ('port = 0\ntoken_file = "open.token"\n', "chmod 600"),
    ('port = 0\ntoken_file = "short.token"\n', "at least 16 characters"),
    ('port = "8188"\n', "stage.http.port: expected int"),
    ('port = 0\nhots = "x"\n', "stage.http.hots: unknown setting"),
])
def test_refuses_to_start_with_one_line(tmp_path, http, says):
    run = _run_folder(tmp_path, http)
    (run / "open.token").write_text(TOKEN)
    os.chmod(run / "open.token", 0o644)
    (run / "short.token").write_text("abc")
    os.chmod(run / "short.token", 0o600)
    r = subprocess.run([PY, "-m", "orchestrator.http", "--config", str(run / "pipeline.toml")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anima-http: ") and says in lines[0], lines
    assert not (run / "http.json").exists()


def test_a_port_in_use_is_one_line_too(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = _run_folder(tmp_path, f"port = {port}\n")
        r = subprocess.run([PY, "-m", "orchestrator.http", "--config", str(run / "pipeline.toml")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"anima-http: cannot listen on 127.0.0.1:{port}: ")


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in (run / "logs").glob("*.log"))


def test_supervisord_does_not_restart_a_refused_front(tmp_path):
    """The [program:http] section as supervisord.conf has it: a refused config is EXITED with status 2 after one start
    (it exits past startsecs, as the stages do: it was FATAL only when its imports took less than startsecs)."""
    run = _run_folder(tmp_path, 'host = "0.0.0.0"\n')
    conf = render_supervisord_conf(TEMPLATE.read_text(), run, python=PY)
    keep = [s for s in conf.split("\n[") if s.split("]")[0] in ("unix_http_server", "supervisord",
                                                                "rpcinterface:supervisor", "supervisorctl",
                                                                "program:http")]
    (run / "logs").mkdir()
    (run / "sv.conf").write_text("[" + "\n[".join(keep).replace(f"directory={TEMPLATE.parent}",
                                                          f"directory={Path(__file__).resolve().parents[1]}"))
    proc = subprocess.Popen([str(Path(PY).parent / "supervisord"), "-n", "-c", str(run / "sv.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sup = Supervisor(run / "supervisor.sock")
        deadline = time.monotonic() + 60
        while True:
            try:
                if sup.info("http").state in ("EXITED", "FATAL", "BACKOFF"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            assert time.monotonic() < deadline, f"the refused front never stopped\n{_logs(run)}"
            time.sleep(0.1)
        time.sleep(3)                                   # no later restart either
        log = (run / "logs" / "supervisord.log").read_text()
        info = sup.info("http")
        assert (info.state, info.exitstatus) == ("EXITED", 2), (info, log)
        assert log.count("spawned: 'http'") == 1, log
        http_log = (run / "logs" / "http.log").read_text()
        assert "not a loopback address" in http_log, http_log
    finally:
        try:
            Supervisor(run / "supervisor.sock").shutdown()
            proc.wait(30)
        except Exception:  # noqa: BLE001
            proc.kill()
            proc.wait()


def test_no_daemon_is_503_at_once_and_sigterm_stops_cleanly(tmp_path):
    run = _run_folder(tmp_path)
    proc, url = _front(run)
    try:
        for method, path in (("GET", "queue"), ("POST", "prompt"), ("GET", "object_info"), ("GET", "anima/info"),
                             ("GET", "sdapi/v1/progress"), ("GET", "history")):
            t0 = time.monotonic()
            r = requests.request(method, url + path, json={"prompt": {}} if method == "POST" else None, timeout=30)
            # object_info too: it is a ComfyUI client's liveness check (SwarmUI's), and with no daemon nothing runs
            assert r.status_code == 503 and "daemon" in r.json()["error"], (path, r.text)
            assert time.monotonic() - t0 < 3
        page = requests.get(url, timeout=30)
        assert page.status_code == 200 and "<title>Anima</title>" in page.text
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert requests.get(url + "static/app.js", timeout=30).status_code == 200
    finally:
        assert _stop(proc) == 0
    assert not (run / "http.json").exists()


def test_token_guards_every_data_route(tmp_path):
    run = _run_folder(tmp_path, 'host = "0.0.0.0"\nport = 0\ntoken_file = "http.token"\n')
    (run / "http.token").write_text(TOKEN + "\n")
    os.chmod(run / "http.token", 0o600)
    proc, url = _front(run)
    url = url.replace("0.0.0.0", "127.0.0.1")
    try:
        for path in ("queue", "history", "view?filename=image.png", "sdapi/v1/progress", "anima/jobs", "ws"):
            r = requests.get(url + path, timeout=30)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), (path, r.text)
        assert requests.get(url + "queue", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
        ok = [requests.get(url + "queue", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30),
              requests.get(url + "queue", auth=("anyone", TOKEN), timeout=30),      # HTTP Basic: token as password
              requests.get(url + "queue", cookies={"anima_token": TOKEN}, timeout=30)]
        assert [r.status_code for r in ok] == [503, 503, 503]                       # past the guard; no daemon
        assert requests.get(url, timeout=30).status_code == 200                      # the page itself is open
        bad = base64.b64encode(b"no-colon").decode()
        assert requests.get(url + "queue", headers={"Authorization": f"Basic {bad}"}, timeout=30).status_code == 401
    finally:
        assert _stop(proc) == 0


def test_view_serves_only_a_jobs_own_files(tmp_path):
    jobs = tmp_path / "jobs"
    job = "20260101-120000-a1b2c3"
    (jobs / job).mkdir(parents=True)
    (jobs / job / "image.png").write_bytes(b"png")
    (jobs / job / "job.json").write_text("{}")
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    path, ctype = files.resolve(jobs, "image.png", job)
    assert files.read(path) == b"png" and ctype == "image/png"
    for name, sub, kind in (("../secret.png", job, "output"), ("/etc/passwd", job, "output"), (".x", job, "output"),
                            ("image.png", "..", "output"), ("image.png", "", "output"), ("image.png", job, "temp"),
                            ("a\\b", job, "output")):
        with pytest.raises(files.BadName):
            files.resolve(jobs, name, sub, kind)
    with pytest.raises(FileNotFoundError):
        files.resolve(jobs, "job.json", job)                   # not a file /view serves
    # links out of the jobs folder are never followed: a job folder that is a link, a file that is a link
    other = "20260101-120000-ffffff"
    (jobs / other).symlink_to(tmp_path)
    with pytest.raises(FileNotFoundError):
        files.resolve(jobs, "image.png", other)
    third = "20260101-120000-eeeeee"
    (jobs / third).mkdir()
    (jobs / third / "image.png").symlink_to(secret)
    with pytest.raises(FileNotFoundError):
        files.resolve(jobs, "image.png", third)
    with pytest.raises(OSError):
        files.read(jobs / third / "image.png")                 # O_NOFOLLOW, even when asked directly


def test_host_names_other_than_this_server_are_refused(tmp_path):
    """DNS rebinding: `Host: evil.example` with `Origin: http://evil.example` passed the same-origin check on the
    default loopback front without a token. Only this server's names (loopback names, IP literals, the configured
    host; on every interface also the machine's own name) pass the guard (no daemon here: 503 past it)."""
    run = _run_folder(tmp_path)
    proc, url = _front(run)
    port = url.rstrip("/").rsplit(":", 1)[1]
    try:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example"):
            for path in ("queue", "", "ws", "sdapi/v1/progress"):
                r = requests.get(url + path, headers={"Host": host, "Origin": f"http://{host}"}, timeout=30)
                assert r.status_code == 421 and "Host" in r.json()["error"], (host, path, r.status_code)
            r = requests.post(url + "prompt", json={"prompt": {}}, headers={"Host": host, "Origin": f"http://{host}"},
                              timeout=30)
            assert r.status_code == 421, (host, r.status_code)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}", "app.localhost",
                     "10.1.2.3"):
            r = requests.get(url + "queue", headers={"Host": host}, timeout=30)
            assert r.status_code == 503, (host, r.status_code, r.text)
    finally:
        assert _stop(proc) == 0
    run = _run_folder(tmp_path / "lan", 'host = "0.0.0.0"\nport = 0\ntoken_file = "http.token"\n')
    (run / "http.token").write_text(TOKEN + "\n")
    os.chmod(run / "http.token", 0o600)
    proc, url = _front(run)
    url = url.replace("0.0.0.0", "127.0.0.1")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for host, status in ((socket.gethostname(), 503), ("192.168.1.20:8188", 503), ("evil.example", 421)):
            r = requests.get(url + "queue", headers={"Host": host, **auth}, timeout=30)
            assert r.status_code == status, (host, r.status_code, r.text)
    finally:
        assert _stop(proc) == 0


def test_a_fifo_in_a_job_folder_does_not_freeze_the_front(tmp_path):
    """A FIFO planted as a job's image.png froze the whole front: /view opened it on the event loop, and open() of a
    FIFO waits for a writer. It is refused at once (404), and the front keeps answering meanwhile."""
    run = _run_folder(tmp_path)
    job = "20260101-120000-a1b2c3"
    (run / "jobs" / job).mkdir(mode=0o700)
    os.mkfifo(run / "jobs" / job / "image.png")
    proc, url = _front(run)
    try:
        got = {}
        t = threading.Thread(target=lambda: got.update(view=requests.get(
            url + "view", params={"filename": "image.png", "subfolder": job, "type": "output"}, timeout=60)),
            daemon=True)
        t.start()
        t.join(15)
        assert not t.is_alive() and got["view"].status_code == 404, "/view of a FIFO did not answer"
        assert requests.get(url, timeout=15).status_code == 200
    except BaseException:
        proc.kill()                                  # a frozen front does not answer SIGTERM either
        proc.wait()
        raise
    assert _stop(proc) == 0


def _closed_within(port: int, deadline_s: float, send=None, every_s: float = 5.0) -> bytes:
    """Connect, send `send` a byte at a time every `every_s` (or nothing), and read until the front closes the
    connection; -> what it answered. AssertionError when it is still open after `deadline_s`."""
    s = socket.create_connection(("127.0.0.1", port))
    got = b""
    t_end = time.monotonic() + deadline_s
    try:
        for i in range(10**6):
            s.settimeout(max(0.1, min(every_s, t_end - time.monotonic())))
            try:
                data = s.recv(65536)
                if not data:
                    return got
                got += data
            except socket.timeout:
                pass
            except ConnectionResetError:
                return got
            assert time.monotonic() < t_end, f"still open after {deadline_s:.0f} s; got {got[:200]!r}"
            if send is not None and i < len(send):
                try:
                    s.send(send[i:i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    return got
    finally:
        s.close()


def test_the_connection_timeouts_default_well_below_the_reported_hold():
    """Reported: a half-sent header and a silent connection held a socket >= 100 s (aiohttp's default: an hour)."""
    from stages.settings import HttpSettings as Record
    assert Record().idle_timeout_s == 15.0 and Record().body_timeout_s == 30.0


def test_slow_and_silent_connections_are_closed(tmp_path):
    """A half-sent header (a byte every 5 s) and a silent connection stayed open for aiohttp's default hour, an idle
    keep-alive connection too, and a body sent a byte at a time held its handler: headers and idle time are bounded
    (idle_timeout_s), a body by body_timeout_s (408), and the configured values are the ones that act (the body's 408
    names its limit). The defaults are these settings' defaults (the test above), not a second path: waiting them out
    here would only add half a minute."""
    body_limit = 6
    http = f"port = 0\nidle_timeout_s = 4\nbody_timeout_s = {body_limit}\n"
    run = _run_folder(tmp_path, http)
    proc, url = _front(run)
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    header = b"GET /queue HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    body_head = (b"POST /prompt HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    results = {}

    def probe(name, send=None):
        try:
            results[name] = _closed_within(port, 90.0, send)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[name] = e

    def keep_alive_idle():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(90)
        got, t_end = b"", time.monotonic() + 90
        try:
            while time.monotonic() < t_end:
                data = s.recv(65536)
                if not data:
                    results["idle"] = got
                    return
                got += data
            results["idle"] = AssertionError("an idle keep-alive connection stayed open")
        except BaseException as e:  # noqa: BLE001
            results["idle"] = e
        finally:
            s.close()

    try:
        s = socket.create_connection(("127.0.0.1", port))       # the body: headers at once, then a byte at a time
        s.sendall(body_head)
        threads = [threading.Thread(target=probe, args=("silent",)),
                   threading.Thread(target=probe, args=("header", header)),
                   threading.Thread(target=keep_alive_idle)]
        for t in threads:
            t.start()
        got, t_end = b"", time.monotonic() + 90
        s.settimeout(5.0)
        while b"\r\n\r\n" not in got:
            assert time.monotonic() < t_end, "a body sent a byte at a time held its request open"
            try:
                got += s.recv(65536)
            except socket.timeout:
                s.send(b" ")
        s.close()
        assert got.startswith(b"HTTP/1.1 408") and f"within {body_limit} s".encode() in got, got[:300]
        for t in threads:
            t.join(100)
        assert results["silent"] == b"" and results["header"] == b"", results
        assert isinstance(results["idle"], bytes) and results["idle"].startswith(b"HTTP/1.1 200"), results
    finally:
        assert _stop(proc) == 0


def test_a_second_front_on_the_run_folder_leaves_the_first_ones_file(tmp_path):
    """A second front on the same run folder (port 0 binds anywhere) overwrote RUN/http.json, then deleted it when
    it stopped: the first front, still serving, could no longer be found. The second one exits 2 naming the first."""
    run = _run_folder(tmp_path)
    first, url = _front(run)
    try:
        written = (run / "http.json").read_text()
        second = subprocess.run([PY, "-m", "orchestrator.http", "--config", str(run / "pipeline.toml")],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and url in second.stderr and str(first.pid) in second.stderr, second.stderr
        assert (run / "http.json").read_text() == written
        assert requests.get(url, timeout=15).status_code == 200
    finally:
        assert _stop(first) == 0
    assert not (run / "http.json").exists()
    again, url = _front(run)                     # the lock went with the first front: a new one starts
    assert _stop(again) == 0
