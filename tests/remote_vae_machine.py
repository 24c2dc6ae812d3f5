"""Remote stage machines for tests: the VAE machine of examples/remote-vae and the executor host of
examples/remote-executor: key files, the stage's config, its own supervisord running the real `python -m stages.NAME`
(on the other 'host' of tests/remote_net.py), and the board side's config.

    vae = RemoteVae(net, models_dir)      # a private folder under /tmp (pytest's basetemp may be pruned meanwhile)
    vae.start(); ready = vae.wait_ready(ctx); ...; vae.close()
    ex = RemoteExecutor(net, pack_dir)    # the same for the executor, with its own copy of the pack
"""
from __future__ import annotations

import os
import shutil
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
from tests.signals import signal_group

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "remote-vae"
EXAMPLE_ENDPOINT = '"tcp://10.0.0.2:5560"'
START_TIMEOUT_S = 90.0   # a stage process importing torch on 2 busy cores
KILL_WAIT_S = 10.0       # for SIGKILLed processes to be gone


def hello() -> m.Hello:
    return m.Hello(peer="test", pid=os.getpid(), version="t")


def from_example(name: str, dest: Path, substitutions: dict[str, str], example: Path = EXAMPLE) -> Path:
    """examples/remote-*/NAME with each substitution made exactly once (so the example and the test stay in step)."""
    text = (example / name).read_text()
    for old, new in substitutions.items():
        assert text.count(old) == 1, f"{example / name}: expected {old!r} once"
        text = text.replace(old, new)
    path = dest / name
    path.write_text(text)
    return path


class RemoteStage:
    """A stage machine as examples/remote-STAGE describes it (its STAGE.toml, key files, its own supervisord running
    the stage), and the board side's config made from pipeline-remote-STAGE.toml. Subclasses set up the folder."""
    stage = "vae"
    example = EXAMPLE
    example_endpoint = EXAMPLE_ENDPOINT

    def __init__(self, net: RemoteNet, prefix: str, stage_subs: dict[str, str]):
        self.net = net
        self.folder = folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        keys = folder / "keys"
        for name in (self.stage, "board", "stranger", "impostor"):
            write_keypair(keys, name)
        self.port = net.free_port()
        self.endpoint = f"tcp://{net.server_addr}:{self.port}"
        (folder / "run").mkdir(mode=0o700)
        self.stage_toml = from_example(f"{self.stage}.toml", folder,
                                       {self.example_endpoint: f'"{self.endpoint}"', **stage_subs}, self.example)
        board = from_example(f"pipeline-remote-{self.stage}.toml", folder, {self.example_endpoint: f'"{self.endpoint}"',
                                                                           "request_s = 5.0": "request_s = 3.0",
                                                                           "retries = 3": "retries = 8"}, self.example)
        self.board = load_config(board)
        self.conf = from_example("supervisord.conf", folder, {"%(here)s/../../.venv/bin/python": sys.executable,
                                                              "directory=%(here)s/../..": f"directory={ROOT}"},
                                 self.example)
        self.log = folder / "run" / f"{self.stage}.log"
        self.supervisord: subprocess.Popen | None = None
        self.groups: set[int] = set()  # process groups of every stage process seen, for teardown

    def write(self, name: str, text: str) -> Path:
        path = self.folder / name
        path.write_text("\n".join(line.strip() for line in text.strip().splitlines()) + "\n")
        return path

    def keys(self, name: str) -> tuple[bytes, bytes]:
        return read_keypair(self.folder / "keys" / f"{name}.key_secret")

    def run_stage(self, config: Path, **kw) -> subprocess.Popen:
        """`python -m stages.STAGE --config CONFIG` on the machine, directly (not under supervisord)."""
        return subprocess.Popen(self.net.wrap([sys.executable, "-m", f"stages.{self.stage}", "--config", str(config)]),
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
            signal_group(self.supervisord.pid)
        self.supervisord.wait(10)
        for group in self.groups:
            signal_group(group)
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
        return LazyPirate(ctx, self.endpoint, peer=self.stage, curve=self.board.curve_client(self.stage),
                          **{"timeout_s": t.request_s, "retries": t.retries, **kw})

    def wait_ready(self, ctx: zmq.Context) -> m.Ready:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.supervisord.poll() is not None:
                raise AssertionError(f"supervisord exited with {self.supervisord.returncode}: {self._logs()}")
            try:
                with self.link(ctx, timeout_s=2.0, retries=0) as link:
                    ready = m.expect(link.request(hello()), m.Ready, self.stage)
                    self.stage_pid(ready)
                    return ready
            except Exception:  # noqa: BLE001 - not up yet (a refusal would show in the log below)
                if time.monotonic() > deadline:
                    raise AssertionError(f"no READY in {START_TIMEOUT_S} s: {self._logs()}")

    def _logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (self.folder / "sd.err", self.log,
                                                                           self.folder / "run" / "supervisord.log")
                         if p.exists())


class RemoteVae(RemoteStage):
    """The VAE machine of examples/remote-vae, with a copy of the models folder's VAE file."""

    def __init__(self, net: RemoteNet, models_dir: Path):
        super().__init__(net, "anima-rvae-", {"threads = 8": "threads = 1"})
        self.vae_toml = self.stage_toml
        bundle = self.folder / "models"                    # a copy of the VAE file: the stage reads it at every start
        shutil.copytree(Path(models_dir) / "vae", bundle / "vae")


class RemoteExecutor(RemoteStage):
    """The executor host of examples/remote-executor, with its own copy of the board's pack."""
    stage = "executor"
    example = ROOT / "examples" / "remote-executor"
    example_endpoint = '"tcp://10.0.0.3:5561"'

    def __init__(self, net: RemoteNet, pack_dir: Path, policy: str = "resident+prefetch", resident_mb: int = 64):
        super().__init__(net, "anima-rexe-", {"threads = 8": "threads = 1",
                                               'policy = "resident+prefetch"': f'policy = "{policy}"',
                                               "resident_mb = 12000": f'resident_mb = {resident_mb}\ntrace = "trace.jsonl"'})
        self.trace = self.folder / "trace.jsonl"          # one line per branch call this host served
        shutil.copytree(pack_dir, self.folder / "pack")   # the host's own copy (the board checks its id)


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


