"""The real supervisord.conf, daemon and HTTP front with the stage logics replaced by tests/orch_doubles.py (no model
math: jobs take well under a second), over fake packs (manifests only) of the sizes a test asks for.

    with Doubles.start(tmp, sizes=[(64, 64), (64, 32)]) as d:
        url = d.http_url()                   # the front listens on a free port (RUN/http.json)
        job = d.submit({"prompt": "a girl", "seed": 3, "steps": 4})
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from models.dit.config import PRESETS, DiTConfig
from models.dit.partition import Geometry, branch_order, resolve
from orchestrator.engine.runfolder import RunFolder, init_run
from orchestrator.engine.supervisor import Supervisor
from protocol import messages as m
from protocol.arena import list_segments, run_prefix
from tests.pipeline_harness import JobLink
from tests.signals import kill_program

BIN = Path(sys.executable).parent
DOUBLES = Path(__file__).resolve().parent / "orch_doubles.py"
SOURCE = {"name": "synthetic.safetensors", "sha256": "ab" * 32}


def fake_pack(d: Path, width: int = 64, height: int = 64) -> Path:
    """A pack manifest (no weights: the doubles never read them) for width x height images, 2 blocks."""
    cfg = PRESETS["tiny"]["dit"].to_dict()
    cfg["blocks"] = 2
    dit, geom = DiTConfig.from_dict(cfg), Geometry.from_resolution(width, height)
    branches = [{"block": b, "kind": s.kind, "onnx": f"onnx/b{b:02d}_{s.kind}.onnx", "sha256": "0" * 64,
                 **resolve(s.kind, dit, geom, "fp32")}          # the shapes its config gives (load_pack checks them)
                for b, s in branch_order(dit)]
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "schema": 1, "kind": "anima-dit-pack", "source": SOURCE, "config": cfg,
        "resolution": {"width": width, "height": height}, "geometry": geom.to_dict(), "dtype": "fp32",
        "host": {"file": "host.safetensors", "sha256": "0" * 64}, "branches": branches}))
    return d


class Doubles(JobLink):
    def __init__(self, root: Path, proc: subprocess.Popen):
        self.root, self.proc = root, proc
        self.rf = RunFolder.resolve(root / "run")
        self.sup = Supervisor(self.rf.supervisor_sock)
        self._client = None

    @classmethod
    def start(cls, root: Path, sizes=((64, 64),), extra_toml: str = "", extra_conf: str = "",
              timing_plot: bool = False, sample_interval_s: float = 0.2) -> "Doubles":
        """`extra_conf`: more supervisord.conf sections (e.g. another [program:...]). timing.png only with
        `timing_plot`: drawing it (a matplotlib child process, ~1.4 s) would be a double job's longest part.
        `sample_interval_s`: the daemon's supervisord/RSS sampling while a request is out (the product's default);
        each sample is an XML-RPC call and a walk of /proc, so a test that reads the teardown record's samples or
        the memory trace of a double's short phases asks for more of them."""
        rf = init_run(root / "run")
        conf = rf.supervisord_conf.read_text()
        for stage in ("encoder", "scheduler", "executor", "vae"):
            conf = conf.replace(f"-m stages.{stage} ", f"{DOUBLES} {stage} ")
        rf.supervisord_conf.write_text(conf + extra_conf)
        packs = [fake_pack(root / f"pack{w}x{h}", w, h) for w, h in sizes]
        more = ", ".join(f'"{p}"' for p in packs[1:])
        rf.pipeline_toml.write_text(f'run_dir = "."\npack_dir = "{packs[0]}"\npacks = [{more}]\nthreads = 1\n'
                                    "[timeouts]\nrequest_s = 2.0\n"
                                    f"[stage.orchestrator]\nsample_interval_s = {sample_interval_s}\n"
                                    "start_timeout_s = 30\n"
                                    'keep_up = "never"\n'
                                    f"stage_retries = 1\ntiming_plot_timeout_s = {120 if timing_plot else 0}\n"
                                    f"[stage.http]\nport = 0\npoll_s = 0.1\n{extra_toml}")
        proc = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(rf.supervisord_conf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        d = cls(root, proc)
        try:
            d._wait_up()
        except BaseException:
            d.stop()
            raise
        return d

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 60
        while not self.rf.supervisor_sock.exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "supervisord did not start"
            time.sleep(0.05)
        self.sup.wait_answering(max(1.0, deadline - time.monotonic()), alive=lambda: self.proc.poll() is None)
        for name in ("orchestrator", "scheduler", "executor", "http"):
            self.sup.wait_state(name, ("RUNNING",), 60)
        while not (self.rf.daemon_sock.exists() and self.rf.http_json.exists()):
            assert time.monotonic() < deadline, f"daemon or front never came up\n{self.logs()}"
            time.sleep(0.05)
        self.wait_front_reaches_daemon(60)

    def wait_front_reaches_daemon(self, timeout_s: float) -> None:
        """Until the front answers /anima/info from the daemon: its link connects a moment after both are up (ZeroMQ
        reconnects on its own interval), and until then a request is answered 503 'daemon not running'."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.http_url() + "anima/info", timeout=10) as r:
                    if "sizes" in json.loads(r.read()):
                        return
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline, f"the front never reached the daemon\n{self.logs()}"
            time.sleep(0.1)

    def http_url(self) -> str:
        return json.loads(self.rf.http_json.read_text())["url"]

    def status(self, **kw) -> m.Jobs:
        return self.client().call(m.Status(**kw), m.Jobs)

    def wait(self, job: str, states=("done", "failed", "cancelled"), timeout_s: float = 60.0, pred=None) -> m.JobInfo:
        """The job's status once its state is one of `states` (and `pred(info)`); a daemon restarting is waited for."""
        from orchestrator.terminal.cli import CliError
        deadline = time.monotonic() + timeout_s
        info = None
        while time.monotonic() < deadline:
            try:
                info = self.status(job=job).jobs[0]
            except CliError:                                   # the daemon restarting
                info = None
            if info is not None and info.state in states and (pred is None or pred(info)):
                return info
            time.sleep(0.05)
        raise AssertionError(f"job {job} never reached {states}: {info}\n{self.logs()}")

    def sigkill(self, program: str) -> int:
        """SIGKILL a program: supervisord brings the daemon back (its jobs resume in place), the daemon retries a
        stage's request. -> the pid killed."""
        if program == "orchestrator":
            self.close_client()
        return kill_program(self.sup, program)

    def flag(self, name: str, value: str | None) -> None:
        """A switch of tests/orch_doubles.py (e.g. double_step_s); None removes it."""
        p = self.rf.root / name
        p.unlink(missing_ok=True) if value is None else p.write_text(value)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.rf.logs.glob("*.log"))

    def stop(self) -> None:
        self.close_client()
        try:
            self.sup.shutdown_in_order(60)
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - tear down whatever state it is in
            self.proc.kill()
            self.proc.wait()
        leaked = list_segments(run_prefix(self.rf.root))
        shutil.rmtree(self.root, ignore_errors=True)
        assert leaked == [], f"shared-memory segments outlived the run: {leaked}"

    def __enter__(self) -> "Doubles":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
