"""Drives models/rknn/worker.py in the rknn-toolkit2 virtual environment: start, JSON-line requests, timeouts, death."""
from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from models.base.install import default_toolkit_venv

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")
DEFAULT_VENV = default_toolkit_venv()      # the checkout's .venv-rknn, or beside this environment (models/base/install.py)
VENV_ENV = "ANIMA_RKNN_VENV"              # overrides the default toolkit environment
HELLO_TIMEOUT_S = 120.0                   # a cold start imports nothing yet, but the interpreter may be slow
REQUEST_TIMEOUT_S = 3600.0                # one full-size build takes seconds to minutes; this only catches hangs


class ToolkitError(RuntimeError):
    """The toolkit environment is missing, the worker died, or a request failed; the message says which."""


def toolkit_python(venv=None) -> Path:
    """The interpreter of the rknn-toolkit2 environment (argument, $ANIMA_RKNN_VENV, or DEFAULT_VENV), as an absolute
    path: the worker starts in a scratch folder, where a relative one names nothing (not resolved: a venv's python
    is a link, and following it would leave the venv)."""
    v = Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV)
    py = v.absolute() / "bin" / "python"
    if not py.exists():
        raise ToolkitError(f"rknn-toolkit2 environment {v} not found (no {py}); create it with `make rknn-venv` "
                           "(scripts/rknn_venv.sh) or pass --toolkit-venv")
    return py


def describe_exit(code: Optional[int]) -> str:
    """Popen return code -> words: -11 / 139 are a segmentation fault."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit {128 - code})"
    if code > 128:
        try:
            return f"exit {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit {code}"


class ToolkitWorker:
    """One worker process; `request(op, **fields)` -> reply dict. Use as a context manager or call close()."""

    def __init__(self, venv=None, env: Optional[dict] = None):
        self.python = toolkit_python(venv)
        e = dict(os.environ)
        for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):   # the main environment's paths must not leak in
            e.pop(k, None)
        e.update(env or {})
        # the toolkit drops check*.onnx files into its working directory: give it a scratch one
        self.scratch = tempfile.mkdtemp(prefix="anima-rknn-")
        self.proc = subprocess.Popen([str(self.python), "-u", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=e, cwd=self.scratch,
                                     start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self._lock = threading.Lock()            # one request at a time on the pipe
        # ru_maxrss once exited (os.wait4); note Linux counts the forking parent's RSS in it, so per-request peaks
        # come from the worker's own VmHWM (reset per request) instead
        self.max_rss_kb = 0
        try:
            hello = self.request("hello", timeout=HELLO_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.toolkit_version = hello["toolkit"]
        self.pid = hello["pid"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def alive(self) -> bool:
        """Non-blocking check that also reaps (with rusage) a worker that has exited."""
        if self.proc.returncode is not None:
            return False
        try:
            pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
        except ChildProcessError:
            return self.proc.poll() is None
        if pid == 0:
            return True
        self.max_rss_kb = int(ru.ru_maxrss)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return False

    def _readline(self, timeout: float) -> Optional[bytes]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not self._sel.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:                  # EOF: the worker died
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _reap(self) -> Optional[int]:
        """Wait for the exited worker and keep its peak RSS (ru_maxrss, KiB on Linux)."""
        if self.proc.returncode is None:
            try:
                _, status, ru = os.wait4(self.proc.pid, 0)
                self.max_rss_kb = int(ru.ru_maxrss)
                self.proc.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.proc.wait()
        return self.proc.returncode

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **fields) -> dict:
        """Send one request; -> the reply (ok True). Raises ToolkitError on a failed reply, a dead worker or a hang."""
        with self._lock:
            return self._request(op, timeout, fields)

    def _request(self, op: str, timeout: float, fields: dict) -> dict:
        if not self.alive:
            raise ToolkitError(f"rknn worker is not running ({describe_exit(self._reap())})")
        try:
            self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass                           # reported below as a dead worker
        line = self._readline(timeout)
        if line is None:
            self.kill()
            raise ToolkitError(f"rknn worker: {op} did not answer within {timeout:.0f} s; killed")
        if not line:
            code = self._reap()
            raise ToolkitError(f"rknn worker died during {op}: {describe_exit(code)}", code)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise ToolkitError(reply.get("error") or f"{op} failed")
        return reply

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self._reap()

    def close(self) -> None:
        """Ask the worker to quit; kill it if it does not within a few seconds."""
        if self.alive:
            try:
                self.request("quit", timeout=10.0)
            except ToolkitError:
                pass
        deadline = time.monotonic() + 10.0
        while self.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        self._reap()
        self._sel.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
