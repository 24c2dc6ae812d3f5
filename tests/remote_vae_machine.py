"""The remote VAE machine of examples/remote-vae, for tests: its key files, vae.toml, its own supervisord running the
real `python -m stages.vae` (on the other 'host' of tests/remote_net.py), and the board side's config.

    vae = RemoteVae(net, models_dir)      # a private folder under /tmp (pytest's basetemp may be pruned meanwhile)
    vae.start(); ready = vae.wait_ready(ctx); ...; vae.close()
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

from protocol import messages as m
from protocol.security import read_keypair, write_keypair
from protocol.sockets import LazyPirate
from remote_net import RemoteNet
from stages.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "remote-vae"
EXAMPLE_ENDPOINT = '"tcp://10.0.0.2:5560"'
START_TIMEOUT_S = 90.0   # a stage process importing torch on 2 busy cores
KILL_WAIT_S = 10.0       # for SIGKILLed processes to be gone


def hello() -> m.Hello:
    return m.Hello(peer="test", pid=os.getpid(), version="t")


def from_example(name: str, dest: Path, substitutions: dict[str, str]) -> Path:
    """examples/remote-vae/NAME with each substitution made exactly once (so the example and the test stay in step)."""
    text = (EXAMPLE / name).read_text()
    for old, new in substitutions.items():
        assert text.count(old) == 1, f"{EXAMPLE / name}: expected {old!r} once"
        text = text.replace(old, new)
    path = dest / name
    path.write_text(text)
    return path


class RemoteVae:
    """The VAE machine as examples/remote-vae describes it (its vae.toml, key files, its own supervisord running the
    stage), and the board side's config made from pipeline-remote-vae.toml."""

    def __init__(self, net: RemoteNet, models_dir: Path):
        self.net = net
        self.folder = folder = Path(tempfile.mkdtemp(prefix="anima-rvae-", dir="/tmp"))
        bundle = folder / "models"                         # a copy of the VAE file: the stage reads it at every start
        shutil.copytree(Path(models_dir) / "vae", bundle / "vae")
        keys = folder / "keys"
        for name in ("vae", "board", "stranger", "impostor"):
            write_keypair(keys, name)
        self.port = net.free_port()
        self.endpoint = f"tcp://{net.server_addr}:{self.port}"
        (folder / "run").mkdir(mode=0o700)
        self.vae_toml = from_example("vae.toml", folder, {EXAMPLE_ENDPOINT: f'"{self.endpoint}"',
                                                          "threads = 8": "threads = 1"})
        board = from_example("pipeline-remote-vae.toml", folder, {EXAMPLE_ENDPOINT: f'"{self.endpoint}"',
                                                                  "request_s = 5.0": "request_s = 3.0",
                                                                  "retries = 3": "retries = 8"})
        self.board = load_config(board)
        self.conf = from_example("supervisord.conf", folder, {"%(here)s/../../.venv/bin/python": sys.executable,
                                                              "directory=%(here)s/../..": f"directory={ROOT}"})
        self.log = folder / "run" / "vae.log"
        self.supervisord: subprocess.Popen | None = None
        self.groups: set[int] = set()  # process groups of every stage process seen, for teardown

    def write(self, name: str, text: str) -> Path:
        path = self.folder / name
        path.write_text("\n".join(line.strip() for line in text.strip().splitlines()) + "\n")
        return path

    def keys(self, name: str) -> tuple[bytes, bytes]:
        return read_keypair(self.folder / "keys" / f"{name}.key_secret")

    def run_stage(self, config: Path, **kw) -> subprocess.Popen:
        """`python -m stages.vae --config CONFIG` on the VAE machine, directly (not under supervisord)."""
        return subprocess.Popen(self.net.wrap([sys.executable, "-m", "stages.vae", "--config", str(config)]),
                                cwd=ROOT, start_new_session=True, **kw)

    def start(self) -> None:
        """The VAE machine's supervisord (foreground), which starts the stage."""
        supervisord = str(Path(sys.executable).with_name("supervisord"))
        self.supervisord = subprocess.Popen(self.net.wrap([supervisord, "-n", "-c", str(self.conf)]), cwd=self.folder,
                                            stdout=subprocess.DEVNULL, stderr=open(self.folder / "sd.err", "ab"),
                                            start_new_session=True)

    def stage_pid(self, ready: m.Ready) -> int:
        self.groups.add(os.getpgid(ready.pid))
        return ready.pid

    def kill(self) -> None:
        """SIGKILL supervisord first (nothing restarts after), then every stage process group it ran."""
        if self.supervisord is None:
            return
        try:
            self.groups.update(os.getpgid(c.pid) for c in psutil.Process(self.supervisord.pid).children(recursive=True))
        except (psutil.Error, ProcessLookupError):
            pass
        if self.supervisord.poll() is None:
            os.killpg(self.supervisord.pid, signal.SIGKILL)
        self.supervisord.wait(10)
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_WAIT_S                 # SIGKILL is delivered asynchronously
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)

    def leftovers(self) -> list[int]:
        """Live processes of the groups this machine ran (supervisord's and every stage's)."""
        groups = self.groups | ({self.supervisord.pid} if self.supervisord is not None else set())
        return [p.pid for p in psutil.process_iter() if pgid(p.pid) in groups and alive(p.pid)]

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def link(self, ctx: zmq.Context, **kw) -> LazyPirate:
        """The board side's client, built from its pipeline config like the orchestrator does."""
        t = self.board.timeouts
        return LazyPirate(ctx, self.endpoint, peer="vae", curve=self.board.curve_client("vae"),
                          **{"timeout_s": t.request_s, "retries": t.retries, **kw})

    def wait_ready(self, ctx: zmq.Context) -> m.Ready:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.supervisord.poll() is not None:
                raise AssertionError(f"supervisord exited with {self.supervisord.returncode}: {self._logs()}")
            try:
                with self.link(ctx, timeout_s=2.0, retries=0) as link:
                    ready = m.expect(link.request(hello()), m.Ready, "vae")
                    self.stage_pid(ready)
                    return ready
            except Exception:  # noqa: BLE001 - not up yet (a refusal would show in the log below)
                if time.monotonic() > deadline:
                    raise AssertionError(f"no READY in {START_TIMEOUT_S} s: {self._logs()}")

    def _logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (self.folder / "sd.err", self.log,
                                                                           self.folder / "run" / "supervisord.log")
                         if p.exists())


def alive(pid: int) -> bool:
    """A live process (zombies waiting for a reaper do not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


