"""A real pipeline for tests and chaos/soak scripts: supervisord + the REAL stages on the tiny bundle, short /tmp run.

    from tests.pipeline_harness import Pipeline, tiny_assets
    bundle, pack = tiny_assets(Path("/tmp/cache"))            # tiny models folder + a 128x128 FP16 pack (idempotent)
    with Pipeline.start(bundle, pack, threads=1) as p:
        job = p.submit({"prompt": "a girl", "seed": 1, "steps": 2})
        info = p.wait(job, ("done", "failed"))
        p.kill("executor")                                   # SIGKILL the program's process (supervisord restarts it)
        assert not p.leftover_segments() and not p.strays()

The run folder lives under /tmp with a short name (unix socket paths must stay < 100 characters). The executor traces
every branch call it serves to RUN/trace.jsonl (`[stage.executor] trace`). Teardown: supervisorctl shutdown (every
program stopped as a group), then SIGKILL to anything of this run still alive; the folder is removed unless `keep`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from orchestrator.engine.runfolder import PROGRAMS, RunFolder, init_run
from orchestrator.engine.supervisor import Supervisor, SupervisorError
from protocol import messages as m
from protocol.prompt import PromptFile
from protocol.arena import list_segments, run_prefix
from tests.signals import kill_program, signal_group, signal_process

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120.0      # supervisord up, scheduler/executor RUNNING, the daemon's socket bound
SHUTDOWN_TIMEOUT_S = 60.0
POLL_S = 0.1
TRACE_FILE = "trace.jsonl"


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on the file `path` while the block runs: the suite's two xdist workers share the session's
    built assets (tests/conftest.py), so what one builds under `cache` the other waits for, then finds there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tiny_assets(cache: Path, resolution: tuple[int, int] = (128, 128), dtype: str = "fp16", shards: int = 1,
                cuts: dict | None = None, lora_rank: int = 0) -> tuple[Path, Path]:
    """(models folder, pack folder) under `cache`: the embedded tiny bundle (seed 0) and its pack (`shards`, `cuts`:
    built with pack --shards N and these cuts; `lora_rank` R > 0: LoRA-ready, pack --lora-rank R); both idempotent,
    and safe from two processes at once (the lock)."""
    from models.setup.models_dir import resolve_models, write_bundle
    from models.packs.pack import build_pack
    models = cache / "models"
    write_bundle("tiny", 0, models)
    dit = resolve_models(models, {}, need=("dit",)).dit
    name = f"pack{resolution[0]}x{resolution[1]}-{dtype}"
    if shards > 1:
        name += f"-s{shards}-" + "-".join(f"{k}{v}" for k, v in sorted((cuts or {}).items()))
    if lora_rank:
        name += f"-lora{lora_rank}"
    pack = cache / name
    with locked(cache / ".tiny-assets.lock"):
        if not (pack / "manifest.json").exists():
            build_pack(dit, pack, resolution, dtype, shards=shards, cuts=cuts, lora_rank=lora_rank)
    return models, pack


# what every branch of a tiny or small test pack fits in, kept resident
RESIDENT_MB = 4096
# [stage.executor] lines for a module's own pipeline whose subject is not the lifecycle: every branch's session kept
# after its first call, as reference_runner keeps them (test_policies_pipeline holds the policies to one latent)
RESIDENT_EXECUTOR = f'policy = "resident"\nresident_mb = {RESIDENT_MB}\n'


def reference_runner(pack, threads: int = 1):
    """The in-process DiTRunner a test's reference sampling runs on: ONNX Runtime, `threads`, every branch resident
    after its first call. A job's references make a few forwards each; on demand every forward makes an ONNX Runtime
    session per branch (the tiny pack's 84: ~1.0 CPU-s per CFG forward against ~0.3 resident). The numbers are the
    on-demand runner's, bitwise: the policy only decides when a session is made."""
    from models.board.policy import Policy
    from models.runtime.dit_runner import DiTRunner
    return DiTRunner(pack, threads=threads, policy=Policy(resident_mb=float(RESIDENT_MB)))


def board_stage_toml(models: Path, cache: Path, resolution: tuple[int, int] = (128, 128),
                     stages: tuple[str, ...] = ("encoder", "vae")) -> str:
    """[stage.encoder] and [stage.vae] tables that run the board's encoder and VAE (ONNX Runtime on the packs of
    `anima-models bundle --target none` from `models`, built under `cache` once): for the modules whose subject is
    the pipeline's machinery (crashes, hangs, power cuts, the CLI, the front), not the torch stages' numbers. On 2
    cores a stage start with torch + transformers costs ~6-11 CPU-s per job, the ONNX one ~1 s; the torch stages
    keep their own pipeline tests (test_e2e_pipeline, test_stage_processes, the img2img/batch/LoRA flows). `stages`:
    the tables wanted (("encoder",): the ONNX encoder beside the torch VAE). No VAE encoder pack: an img2img job needs
    the torch VAE."""
    from models.setup.bundle import read_bundle
    from orchestrator.engine.runfolder import bundle_stage_tables
    bundle, _ = cpu_bundle(models, cache, resolution)
    return bundle_stage_tables(read_bundle(bundle, hashes=False), stages)    # the tables `init --bundle` writes


def cpu_bundle(models: Path, cache: Path, resolution: tuple[int, int] = (128, 128)) -> tuple[Path, str]:
    """`anima-models bundle --models MODELS --resolution WxH --target none` into CACHE/cpu-bundle-WxH, built once
    (under a lock: two workers share it) -> (bundle folder, what the build that made it printed to stderr, kept
    beside it). Read-only."""
    import io
    from models.commands.cli import main as models_main
    bundle = cache / f"cpu-bundle-{resolution[0]}x{resolution[1]}"
    said = bundle.with_name(bundle.name + ".stderr")
    with locked(cache / ".cpu-bundle.lock"):
        if not (bundle / "bundle.json").exists():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = models_main(["bundle", "--models", str(models), "--resolution",
                                  f"{resolution[0]}x{resolution[1]}", "--target", "none", "--out", str(bundle)])
            if rc != 0:
                raise RuntimeError(f"bundle --target none from {models} failed ({rc}):\n{err.getvalue()[-3000:]}")
            said.write_text(err.getvalue())
    return bundle, said.read_text()


def pipeline_toml(pack: Path, models: Path, *, threads: int = 1, branch_timeout_s: float = 20.0,
                  extra: str = "", packs=(), executor: str = "", orchestrator: str = "",
                  timing_plot: bool = False, backend: str = "onnx", stage_retries: int = 3,
                  request_s: float = 5.0, cond_cache_mb: float = 0.0, keep_up: str = "never",
                  start_timeout_s: float = 120.0, http_poll_s: float = 0.2) -> str:
    """The config the harness runs: real stages, the executor's trace on, short timeouts so deaths show quickly; the
    HTTP front on a free port (RUN/http.json says which), so runs side by side never clash. `executor`,
    `orchestrator`: more lines for [stage.executor] (e.g. 'policy = "prefetch+dual_core"') and [stage.orchestrator];
    `extra`: whole tables after [stage.http] (every key is checked: stages/settings.py STAGE_TABLES). The per-job
    timing.png (~1 CPU-s each) only where a test looks at it (`timing_plot`): the suite runs many jobs on 2 cores.
    `backend`: the executor's backend; `stage_retries`: the orchestrator's restarts of a stage per job; `request_s`:
    [timeouts] request_s (a HELLO's wait per attempt, 4 attempts); `cond_cache_mb`: the conditioning cache, off unless
    asked for (the shared pipelines' tests see the encoder run for each job, as they count on: kills mid-encode,
    its timings and RSS); `keep_up`: the encoder and VAE stopped after each use unless asked (orchestrator/engine/keep_up.py;
    the shared pipelines' tests look for them STOPPED after a job); `start_timeout_s`: a stage's start to READY
    (longer for a bench on a busy machine); `http_poll_s`: the front's look at followed jobs (an A1111 call answers
    after the look that sees its job end)."""
    more = "".join(f'"{p}", ' for p in packs)
    return (f'run_dir = "."\npack_dir = "{pack}"\npacks = [{more}]\nmodels_dir = "{models}"\nthreads = {threads}\n'
            f'backend = "{backend}"\n'
            f'[timeouts]\nrequest_s = {request_s}\nretries = 3\n'
            f'[stage.executor]\ntrace = "{TRACE_FILE}"\n{executor}'
            f'[stage.scheduler]\nbranch_timeout_s = {branch_timeout_s}\n'
            f'[stage.orchestrator]\nsample_interval_s = 0.1\nstart_timeout_s = {start_timeout_s}\nstage_retries = {stage_retries}\n'
            f'timing_plot_timeout_s = {120 if timing_plot else 0}\ncond_cache_mb = {cond_cache_mb}\n'
            f'keep_up = "{keep_up}"\n{orchestrator}'
            f'[stage.http]\nport = 0\npoll_s = {http_poll_s}\n{extra}')


class JobLink:
    """A test's link to the daemon of a run folder (`self.rf`; prompts' relative paths from `self.root`): one client
    on its socket, kept until closed."""
    _client = None

    def client(self):
        from orchestrator.terminal.cli import DaemonClient
        if self._client is None:
            self._client = DaemonClient(self.rf, timeout_s=5.0)
        return self._client

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def submit(self, prompt: dict) -> str:
        """Queue a prompt (a dict as in prompt.json) through the daemon's socket; -> job id."""
        sub = self.client().call(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(self.root)), m.Submitted)
        return sub.job


class Pipeline(JobLink):
    """One supervisord with the five real programs over a run folder; helpers to submit, follow, kill and check."""

    def __init__(self, root: Path, proc: subprocess.Popen, keep: bool = False, toml_args: dict | None = None):
        self.root, self.proc, self.keep = root, proc, keep
        self.toml_args = toml_args or {}
        self.rf = RunFolder.resolve(root)
        self.sup = Supervisor(self.rf.supervisor_sock)
        self._client = None

    # ------------------------------------------------------------ start / stop

    @classmethod
    def start(cls, models: Path, pack: Path, *, threads: int = 1, branch_timeout_s: float = 20.0, extra_toml: str = "",
              executor_toml: str = "", orchestrator_toml: str = "", keep: bool = False, packs=(),
              timing_plot: bool = False, backend: str = "onnx", stage_retries: int = 3, request_s: float = 5.0,
              always_on: tuple = ("scheduler", "executor", "orchestrator"), cond_cache_mb: float = 0.0,
              keep_up: str = "never", start_timeout_s: float = 120.0, http_poll_s: float = 0.2) -> "Pipeline":
        """`always_on`: the programs to wait for (not one that runs on another machine, e.g. a remote executor)."""
        root = Path(tempfile.mkdtemp(prefix="anima-e2e-", dir="/tmp"))
        rf = init_run(root, python=sys.executable)
        args = dict(pack=pack, models=models, threads=threads, branch_timeout_s=branch_timeout_s, extra=extra_toml,
                    packs=packs, orchestrator=orchestrator_toml, timing_plot=timing_plot, backend=backend,
                    stage_retries=stage_retries, request_s=request_s, cond_cache_mb=cond_cache_mb, keep_up=keep_up,
                    start_timeout_s=start_timeout_s, http_poll_s=http_poll_s)
        rf.pipeline_toml.write_text(pipeline_toml(executor=executor_toml, **args))
        proc = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(rf.supervisord_conf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        p = cls(root, proc, keep, args)
        try:
            p._wait_up(always_on)
        except BaseException:
            p.stop()
            raise
        return p

    def _wait_up(self, always_on: tuple) -> None:
        """supervisord up, the always-on programs RUNNING (not one that runs on another machine), the daemon bound."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.rf.supervisor_sock.exists():
            self._check_alive(deadline)
        try:
            self.sup.wait_answering(max(1.0, deadline - time.monotonic()), alive=lambda: self.proc.poll() is None)
        except SupervisorError:
            self._check_alive(0.0)
            raise
        for name in always_on:
            self.sup.wait_state(name, ("RUNNING",), max(1.0, deadline - time.monotonic()))
        while not self.rf.daemon_sock.exists():
            self._check_alive(deadline)

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisord exited with {self.proc.returncode}\n{self.logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pipeline did not come up in {START_TIMEOUT_S:.0f} s\n{self.logs()}")
        time.sleep(POLL_S)

    def stop(self) -> list[int]:
        """Every program stopped in supervisord's shutdown order, then supervisord shut down (shutdown_in_order);
        SIGKILL whatever of this run is left. -> pids that had to be killed."""
        self.close_client()
        if self.proc.poll() is None:
            try:
                self.sup.shutdown_in_order(SHUTDOWN_TIMEOUT_S)
                self.proc.wait(SHUTDOWN_TIMEOUT_S)
            except (SupervisorError, OSError, subprocess.TimeoutExpired):
                signal_group(self.proc.pid)
                self.proc.wait(10)
        killed = [p.pid for p in self.strays(include_programs=True)]
        for pid in killed:
            signal_process(pid, missing_ok=True)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return killed

    def stop_clean(self) -> None:
        """stop(), then what every run promises: no process outlived supervisord's shutdown, no segment is left."""
        killed = self.stop()
        assert killed == [], f"processes of the run outlived supervisord's shutdown: {killed}"
        assert self.leftover_segments() == []

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ jobs

    def http_url(self, timeout_s: float = 120.0) -> str:
        """The HTTP front's base URL (it listens on a free port and says which in RUN/http.json)."""
        deadline = time.monotonic() + timeout_s
        while not self.rf.http_json.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the HTTP front never came up\n{self.logs()}")
            time.sleep(POLL_S)
        return json.loads(self.rf.http_json.read_text())["url"]

    def status(self, job: str) -> m.JobInfo | None:
        """The daemon's view of `job`, or None while the daemon does not answer (being restarted)."""
        from orchestrator.terminal.cli import CliError
        try:
            return self.client().call(m.Status(job=job), m.Jobs).jobs[0]
        except CliError:
            self.close_client()
            return None

    def wait(self, job: str, states=("done", "failed", "cancelled"), timeout_s: float = 300.0, pred=None,
             poll_s: float = POLL_S) -> m.JobInfo:
        """Poll until the job is in one of `states` (and `pred(info)` holds); AssertionError with logs at timeout."""
        deadline, info = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            info = self.status(job) or info
            if info is not None and info.state in states and (pred is None or pred(info)):
                return info
            time.sleep(poll_s)
        raise AssertionError(f"job {job} never reached {states} in {timeout_s:.0f} s (last: {info})\n{self.logs()}")

    def job_dir(self, job: str) -> Path:
        return self.rf.jobs / job

    def report(self, job: str) -> dict:
        return json.loads((self.job_dir(job) / "report.json").read_text())

    def trace(self, job: str | None = None) -> list[dict]:
        """The executor's trace lines (every branch call served), optionally of one job."""
        path = self.root / TRACE_FILE
        lines = [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []
        return [t for t in lines if job is None or t["job"] == job]

    # ------------------------------------------------------------ processes

    def pid(self, program: str) -> int:
        return self.sup.info(program).pid

    def kill(self, program: str, sig: int = signal.SIGKILL) -> int:
        """Signal the program's process (not its group: as a crash would); -> the pid signalled."""
        return kill_program(self.sup, program, sig)

    def restart_mid_job(self, job: str, program: str, pred, timeout_s: float):
        """`supervisorctl restart PROGRAM` once the denoising job's progress meets `pred`; the job must end done, on a
        new process of it. -> the job's final status."""
        self.wait(job, ("denoising",), timeout_s, poll_s=0.05,
                  pred=lambda i: i.progress is not None and pred(i.progress))
        old = self.pid(program)
        out = self.supervisorctl("restart", program)
        assert "started" in out, out
        info = self.wait(job, timeout_s=timeout_s)
        assert info.state == "done", f"{info.error_stage}: {info.error}\n{self.logs()}"
        assert self.pid(program) != old
        return info

    def supervisorctl(self, *args: str) -> str:
        r = subprocess.run([str(BIN / "supervisorctl"), "-c", str(self.rf.supervisord_conf), *args],
                           capture_output=True, text=True, timeout=120)
        return r.stdout + r.stderr

    def wait_program(self, program: str, states=("RUNNING",), timeout_s: float = 120.0):
        return self.sup.wait_state(program, states, timeout_s)

    def set_executor(self, executor_toml: str) -> dict:
        """Rewrite [stage.executor] (the trace stays on) and restart the executor with it; -> its READY info."""
        self.rf.pipeline_toml.write_text(pipeline_toml(executor=executor_toml, **self.toml_args))
        out = self.supervisorctl("restart", "executor")
        if "started" not in out:
            raise AssertionError(f"executor did not restart: {out}\n{self.logs()}")
        return self.stage_info("executor")

    def stage_info(self, stage: str, timeout_s: float = START_TIMEOUT_S) -> dict:
        """HELLO to a stage until it answers READY; -> READY.info (an executor's resolved policy, ...)."""
        import zmq
        from protocol.sockets import LazyPirate
        from stages.config import load_config
        endpoint = load_config(self.rf.pipeline_toml).endpoint(stage)
        deadline, ctx = time.monotonic() + timeout_s, zmq.Context()
        try:
            while True:
                with LazyPirate(ctx, endpoint, timeout_s=2.0, retries=0) as link:
                    try:
                        return m.expect(link.request(m.Hello(peer="test", pid=os.getpid(), version="t")),
                                        m.Ready).info
                    except Exception:  # noqa: BLE001 - not up yet: ask again until the deadline
                        if time.monotonic() > deadline:
                            raise
        finally:
            ctx.destroy(linger=0)

    def leftover_segments(self) -> list[str]:
        """/dev/shm segments of this run folder (none may outlive a job)."""
        return list_segments(run_prefix(self.root))

    def strays(self, include_programs: bool = False) -> list[psutil.Process]:
        """Processes of this run that supervisord does not own now: leftovers of killed stages, children a stage
        started. With `include_programs`, supervisord's own programs count too (after shutdown: must be empty)."""
        owned = set() if include_programs else {i.pid for i in self.sup.all_info().values() if i.pid} | {self.proc.pid}
        mark, out = str(self.root), []
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid in owned or p.pid == os.getpid():
                continue
            try:
                if mark in " ".join(p.info["cmdline"] or ()) or p.environ().get("ANIMA_RUN") == mark:
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def stage_children(self) -> list[psutil.Process]:
        """Child processes of the live programs (the onnx backend starts none)."""
        kids = []
        for info in self.sup.all_info().values():
            if info.pid:
                try:
                    kids += psutil.Process(info.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    pass
        return kids

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for p in sorted(self.rf.logs.glob("*.log")):
            try:
                parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
            except OSError:
                pass
        return "\n".join(parts)


__all__ = ["Pipeline", "tiny_assets", "pipeline_toml", "PROGRAMS", "TRACE_FILE"]
