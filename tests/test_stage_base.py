"""StageProc: handshake, heartbeats while busy, error replies that keep serving, DYING + exit codes, SIGTERM, config."""

import faulthandler
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from protocol import codec
from protocol import messages as m
from protocol.arena import Arena, reap, run_prefix, segment_name
from protocol.sockets import EventPull, LazyPirate, make_socket
from protocol.tensors import TensorDesc
from stages.base import EXIT_CONFIG, EXIT_FATAL, EXIT_OK, RequestFailed, StageProc
from stages.config import ConfigError, load_config, parse_config

TIMEOUT_S = 30


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(90, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("st")
    yield d
    assert reap(run_prefix(d), keep=set()) == []


class EchoLogic:
    """A plain logic object, as real stages have: ENCODE copies cond into uncond inside the job arena."""

    def __init__(self):
        self.cancelled = []
        self.started = threading.Event()           # a "slow" request is being served

    def info(self):
        return {"backend": "echo"}

    def on_encode(self, msg, ctx):
        if msg.prompt == "refuse":
            raise RequestFailed("prompt refused", field="prompt")
        if msg.prompt == "slow":
            self.started.set()
            while True:
                time.sleep(0.02)
                ctx.check(msg.job)
        arena = ctx.arena(msg.arena)
        arena.write(msg.uncond, arena.read(msg.cond) + 1)
        self.arenas_seen = len(ctx._arenas)
        return m.reply_to(msg, m.Encoded, job=msg.job, cond=msg.cond, uncond=msg.uncond, tokens_cond=3,
                          tokens_uncond=0)

    def on_cancel(self, job):
        self.cancelled.append(job)


def _config(run_dir, **extra):
    return parse_config({"run_dir": str(run_dir), **extra}, Path(run_dir) / "pipeline.toml")


def test_served_stage_handshake_errors_busy_cancel_and_arena(ctx, run_dir):
    cfg = _config(run_dir)
    events = EventPull(ctx, cfg.endpoint("events"))
    logic = EchoLogic()
    proc = StageProc("encoder", logic, cfg, ctx=ctx, install_signals=False)
    t = threading.Thread(target=proc.run, daemon=True)
    t.start()
    lp = LazyPirate(ctx, cfg.endpoint("encoder"), timeout_s=5, retries=0)
    raw = make_socket(ctx, zmq.REQ, cfg.endpoint("encoder"), bind=False)
    arena = Arena.create(segment_name(run_dir, "j1"), 1 << 16)
    try:
        ready = events.recv(5.0)
        assert isinstance(ready, m.Ready) and ready.stage == "encoder" and ready.info == {"backend": "echo"}
        hello = m.Hello(peer="test", pid=1, version="0")
        assert m.expect(lp.request(hello), m.Ready).id == hello.id
        pong = m.expect(lp.request(m.Heartbeat(peer="test")), m.Pong)
        assert pong.busy is False and pong.rss_mb > 1
        # a malformed request gets an ERROR naming the field, and the stage keeps serving
        head = codec.encode(m.Encode(id=42, job="j1", prompt="x"))[0]
        bad = head.replace(b"\xa2j1", b"\xa2j/")  # job "j/" is not an identifier
        raw.send_multipart([bad])
        assert raw.poll(5000)
        err = codec.decode(raw.recv_multipart())
        assert isinstance(err, m.Error) and (err.code, err.field, err.id) == ("bad_request", "job", 42)
        err = lp.request(m.Encode(job="j1", prompt="refuse"))
        assert isinstance(err, m.Error) and (err.code, err.field) == ("failed", "prompt")
        err = lp.request(m.Decode(job="j1", latent=TensorDesc("f32", (4,), frame=1), inline=(bytes(16),)))
        assert isinstance(err, m.Error) and err.code == "unknown_kind"
        # a real request through the job arena; the framework detaches after it
        cond = arena.alloc("cond", "f32", (2, 3))
        uncond = arena.alloc("uncond", "f32", (2, 3))
        arena.write(cond, np.arange(6, dtype=np.float32).reshape(2, 3))
        done = m.expect(lp.request(m.Encode(job="j1", prompt="x", arena=arena.name, cond=cond, uncond=uncond)),
                        m.Encoded)
        assert done.tokens_cond == 3 and logic.arenas_seen == 1
        deadline = time.monotonic() + 5  # the reply leaves first, then the arena is detached
        while proc.context._arenas and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.context._arenas == {}
        np.testing.assert_array_equal(arena.read(uncond), np.arange(1, 7, dtype=np.float32).reshape(2, 3))
        # a long request: heartbeats answered (busy), other work refused, CANCEL ends it with an ERROR reply
        slow = {}
        ts = threading.Thread(target=lambda: slow.setdefault(
            "r", LazyPirate(ctx, cfg.endpoint("encoder"), timeout_s=10, retries=0).request(
                m.Encode(job="j2", prompt="slow"))), daemon=True)
        ts.start()
        assert logic.started.wait(10), "the slow request never began"
        pong = m.expect(lp.request(m.Heartbeat(peer="test")), m.Pong)
        assert pong.busy is True and pong.job == "j2"
        busy = lp.request(m.Encode(job="j3", prompt="x"))
        assert isinstance(busy, m.Error) and busy.code == "busy" and busy.retry
        assert isinstance(lp.request(m.Cancel(job="j2")), m.Ok)
        ts.join(10)
        assert isinstance(slow["r"], m.Error) and slow["r"].code == "cancelled" and logic.cancelled == ["j2"]
        # SHUTDOWN: OK, then the loop ends with EXIT_OK
        assert isinstance(lp.request(m.Shutdown(reason="test")), m.Ok)
        t.join(10)
        assert not t.is_alive()
    finally:
        arena.close()
        raw.close()
        lp.close()
        events.close()


STAGE_SCRIPT = """
    import sys, time
    from protocol import messages as m
    from stages.base import stage_main

    class Logic:
        def __init__(self, config):
            if config.stage_settings("encoder").get("dit") == "fail-start":
                raise RuntimeError("no weights here")
        def on_encode(self, msg, ctx):
            if msg.prompt == "boom":
                raise RuntimeError("boom")
            while True:  # "slow": until SIGTERM
                time.sleep(0.02)
                ctx.check(msg.job)

    sys.exit(stage_main("encoder", Logic))
"""


def _wait_busy(ctx, endpoint: str, job: str, timeout_s: float = TIMEOUT_S) -> None:
    """Until the stage at `endpoint` answers a HEARTBEAT busy with `job` (heartbeats are served during a request)."""
    deadline = time.monotonic() + timeout_s
    with LazyPirate(ctx, endpoint, timeout_s=5, retries=0) as hb:
        while True:
            pong = m.expect(hb.request(m.Heartbeat(peer="test")), m.Pong)
            if pong.busy and pong.job == job:
                return
            assert time.monotonic() < deadline, f"the stage never became busy with {job}: {pong}"
            time.sleep(0.02)


def _start(tmp_path, run_dir, extra: str = "") -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "stage_echo.py"
    script.write_text(textwrap.dedent(STAGE_SCRIPT))
    conf = tmp_path / "pipeline.toml"
    conf.write_text(f'run_dir = "{run_dir}"\nlog_level = "debug"\n{extra}')
    return subprocess.Popen([sys.executable, str(script), "--config", str(conf)], stderr=subprocess.PIPE,
                            text=True), conf


def test_stage_process_ready_title_fatal_error_dying_and_exit_code(ctx, tmp_path, run_dir):
    p, conf = _start(tmp_path, run_dir)
    cfg = load_config(conf)
    events = EventPull(ctx, cfg.endpoint("events"))
    try:
        ready = events.recv(TIMEOUT_S)
        assert isinstance(ready, m.Ready) and ready.pid == p.pid
        assert "anima-encoder" in " ".join(psutil.Process(p.pid).cmdline())
        with LazyPirate(ctx, cfg.endpoint("encoder"), timeout_s=10, retries=0) as lp:
            err = lp.request(m.Encode(job="j1", prompt="boom"))
        assert isinstance(err, m.Error) and err.code == "internal" and "boom" in err.message
        dying = events.recv(10)
        assert isinstance(dying, m.Dying) and dying.job == "j1" and "RuntimeError" in dying.reason
        assert p.wait(TIMEOUT_S) == EXIT_FATAL
    finally:
        p.kill()
        p.communicate()
        events.close()


def test_stage_process_sigterm_mid_request_exits_cleanly(ctx, tmp_path, run_dir):
    p, conf = _start(tmp_path, run_dir)
    cfg = load_config(conf)
    events = EventPull(ctx, cfg.endpoint("events"))
    try:
        assert isinstance(events.recv(TIMEOUT_S), m.Ready)
        reply = {}
        with LazyPirate(ctx, cfg.endpoint("encoder"), timeout_s=10, retries=0) as lp:
            t = threading.Thread(target=lambda: reply.setdefault("r", lp.request(m.Encode(job="j", prompt="slow"))))
            t.start()
            _wait_busy(ctx, cfg.endpoint("encoder"), "j")         # mid-request: the stage says so in its PONG
            p.send_signal(signal.SIGTERM)
            t.join(15)
        assert isinstance(reply["r"], m.Error) and reply["r"].code == "cancelled" and reply["r"].retry
        assert p.wait(TIMEOUT_S) == EXIT_OK
        assert "exits with 0" in p.communicate()[1]
    finally:
        p.kill()
        events.close()


def test_start_up_failure_says_dying_and_bad_config_exits_2(ctx, tmp_path, run_dir):
    p, conf = _start(tmp_path, run_dir, '[stage.encoder]\ndit = "fail-start"\n')
    events = EventPull(ctx, load_config(conf).endpoint("events"))
    try:
        dying = events.recv(TIMEOUT_S)
        assert isinstance(dying, m.Dying) and "start-up failed" in dying.reason and "no weights" in dying.reason
        assert p.wait(TIMEOUT_S) == EXIT_FATAL
    finally:
        p.kill()
        p.communicate()
        events.close()
    conf.write_text('threads = "two"\n')
    out = subprocess.run([sys.executable, str(tmp_path / "stage_echo.py"), "--config", str(conf)],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == EXIT_CONFIG and "threads: expected int" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("text,words", [
    ("threads = 0", "threads: 0 is out of range"),
    ("threads = true", "threads: expected int"),
    ("colour = 1", "unknown key(s) ['colour']"),
    ("log_level = 'loud'", "log_level: 'loud' is not one of"),
    ("[endpoints]\nexecutor = 'http://x'", "endpoints.executor: "),
    ("[endpoints]\nnpu = 'ipc:///tmp/a'", "endpoints: unknown stage(s) ['npu']"),
    ("[endpoints]\nvae = 'ipc://rel.sock'", "endpoints.vae: "),
    ("[timeouts]\nrequest_s = -1", "timeouts.request_s"),
    ("[timeouts]\nwait = 1", "timeouts: unknown key(s)"),
    ("[security]\nallowed_clients = [1]", "security.allowed_clients[0]"),
    ("[security]\nservers = {npu = 'k'}", "security.servers.npu"),
    ("[stage]\nnpu = {}", "stage.npu"),
    ("[stage.executor]\npolicy = 'fastest'", "stage.executor.policy: policy 'fastest': unknown term 'fastest'"),
    ("[stage.executor]\npolicy = 'resident'", "stage.executor.policy: policy 'resident': 'resident' needs resident_mb"),
    ("[stage.executor]\npolicy = 'interleave+dual_core'", "stage.executor.policy: interleave and dual_core do not"),
    ("[stage.executor]\npolicy = 7", "stage.executor.policy: expected string or dict, got int"),
    ("[stage.executor]\ndual_core = true", "stage.executor.dual_core: dual_core is a lifecycle policy now"),
    ("[stage.executor]\nresident_mb = -1", "stage.executor.resident_mb: -1.0 is out of range"),
    ("[stage.encoder]\nbackend = 'onnx'", "stage.encoder.pack: backend \"onnx\" needs the encoder pack folder"),
    ("[stage.encoder]\nbackend = 'tf'", "stage.encoder.backend: 'tf' is not one of torch, onnx"),
    ("[stage.orchestrator]\nhang_timeout_s = -5", "stage.orchestrator.hang_timeout_s: -5.0 is out of range"),
    ("[stage.executor]\npolicyy = 'prefetch'", "stage.executor.policyy: unknown setting; known: policy"),
    ("[stage.executor]\nthreads = true", "stage.executor.threads: expected integer, got bool"),
    ("[stage.executor]\ndual_core = 1", "stage.executor.dual_core: expected boolean"),
    ("[stage.executor]\ndual_masks = ['0']", "stage.executor.dual_masks: expected 2..2 items, got 1"),
    ("[stage.executor]\ncore_mask = '7'", "stage.executor.core_mask: choose one of auto"),
    ("[stage.executor]\ntrace = ''", "stage.executor.trace: expected 1..4096 characters"),
    ("[stage.scheduler]\nbranch_timeout_s = '10'", "stage.scheduler.branch_timeout_s: expected float, got str"),
    ("[stage.scheduler]\nbranch_timeout_s = inf", "stage.scheduler.branch_timeout_s: inf is out of range"),
    ("[stage.vae]\nmin_stride_fraction = nan", "stage.vae.min_stride_fraction: NaN"),
    ("[stage.vae]\ntile_min = 64\ntile_max = 32", "stage.vae.tile_min: tile_min must not exceed tile_max"),
    ("[stage.encoder]\nvae = 'x'", "stage.encoder.vae: unknown setting"),
    ("[stage.vae]\nbackend = 'tpu'", "stage.vae.backend: 'tpu' is not one of torch, onnx, rknn-sim, rknn"),
    ("[stage.vae]\nbackend = 'onnx'", "stage.vae.vae_pack: backend 'onnx' decodes a VAE pack; set vae_pack"),
    ("[stage.vae]\nbackend = 'onnx'\nvae_pack = []", "stage.vae.vae_pack: expected a VAE pack folder, or a list"),
    ("[stage.vae]\nvae_pack = ['a', 3]", "stage.vae.vae_pack: items must be string, got 3"),
    ("[stage.vae]\nvae_pack = 5", "stage.vae.vae_pack: expected string or array, got int"),
    ("[stage.vae]\ncore_mask = 'npu9'", "stage.vae.core_mask: choose one of auto"),
    ("[stage.vae]\nlite = 'fake'", "stage.vae.lite: 'fake' is not one of real, standin"),
    ("[stage.vae]\ntime_scale = 2.0", "stage.vae.time_scale: unknown setting"),      # torch declares nothing
    ("[stage.executor]\ntime_scale = 2.0", "stage.executor.time_scale: unknown setting"),   # onnx neither
    ("[stage.orchestrator]\nmax_queue = 0", "stage.orchestrator.max_queue: 0 is out of range [1, 10000]"),
    ("stage = 3", "stage: expected dict"),
    ("run_dir = [", "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, text, words):
    conf = tmp_path / "pipeline.toml"
    conf.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(conf)
    assert words in str(e.value) and str(conf) in str(e.value)


def test_config_defaults_and_relative_paths(tmp_path):
    conf = tmp_path / "pipeline.toml"
    conf.write_text('run_dir = "run"\npack_dir = "bundle/pack"\n[endpoints]\nvae = "tcp://127.0.0.1:5560"\n'
                    '[security]\nallow_plaintext_loopback = true\n[stage.executor]\npolicy = "on-demand"\n')
    cfg = load_config(conf)
    assert cfg.run_dir == tmp_path / "run" and cfg.pack_dir == tmp_path / "bundle" / "pack"
    assert cfg.endpoint("executor") == f"ipc://{tmp_path}/run/sock/executor.sock"
    assert cfg.is_remote("vae") and not cfg.is_remote("executor")
    assert cfg.curve_client("vae") is None and cfg.curve_server() is None
    assert cfg.stage_settings("executor") == {"policy": "on-demand"} and cfg.backend == "onnx"
    assert cfg.stage_settings("scheduler") == {"branch_timeout_s": 600.0}      # defaults from the table's record (STAGE_TABLES)
    conf.write_text('[stage.scheduler]\nbranch_timeout_s = 20\n[stage.vae]\ntile_max = 64\n')
    cfg = load_config(conf)
    assert cfg.stage_settings("scheduler") == {"branch_timeout_s": 20.0}
    assert type(cfg.stage_settings("scheduler")["branch_timeout_s"]) is float
    assert cfg.stage_settings("vae") == {"backend": "torch", "max_latent": 512, "tile_min": 16, "tile_max": 64,
                                         "min_stride_fraction": 0.25}
    conf.write_text('[stage.vae]\nbackend = "rknn"\nvae_pack = ["p256", "p512"]\ncore_mask = "0_1"\nlite = "standin"\n'
                    '[stage.encoder]\nbackend = "onnx"\npack = "enc"\n')
    cfg = load_config(conf)
    assert cfg.stage_settings("vae")["vae_pack"] == ["p256", "p512"] and cfg.stage_settings("vae")["lite"] == "standin"
    assert cfg.stage_settings("encoder") == {"backend": "onnx", "pack": "enc"}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


class _PacedBackend:
    """A backend that declares settings of its own (as a board-modelling backend does: SETTINGS names them)."""
    SETTINGS = ("time_scale", "board_ram_gb", "board_model", "hook")

    def __init__(self, threads=None, core_mask="auto", time_scale: float = 1.0, board_ram_gb: int = 8,
                 board_model: str = "full", hook=None):
        pass


def test_a_backends_declared_settings_pass_typed_by_its_constructor(tmp_path, monkeypatch):
    """STAGE_TABLES cannot know a backend's own keys: the backend's SETTINGS lets them through for the executor (the
    top-level backend) and the VAE stage (its own backend), typed by the constructor's defaults; other backends still
    refuse them."""
    import models.runtime.backends as sb
    real_class, real_names = sb.backend_class, sb.backend_names
    monkeypatch.setattr(sb, "backend_names", lambda: sorted([*real_names(), "paced"]))
    monkeypatch.setattr(sb, "backend_class", lambda n: _PacedBackend if n == "paced" else real_class(n))
    conf = tmp_path / "pipeline.toml"
    conf.write_text('backend = "paced"\n[stage.executor]\ntime_scale = 2\nboard_ram_gb = 16\nboard_model = "lite"\n'
                    'hook = [1, "x"]\ncore_mask = "0"\n')
    cfg = load_config(conf)
    assert cfg.stage_settings("executor") == {"policy": "auto", "time_scale": 2.0, "board_ram_gb": 16,
                                              "board_model": "lite", "hook": [1, "x"], "core_mask": "0"}
    assert type(cfg.stage_settings("executor")["time_scale"]) is float
    for text, words in (('backend = "paced"\n[stage.executor]\nboard_ram_gb = "8"', "board_ram_gb: expected integer"),
                        ('backend = "paced"\n[stage.executor]\ntime_scale = nan', "time_scale: NaN"),
                        ('backend = "paced"\n[stage.executor]\nboard_mode = "x"', "board_mode: unknown setting"),
                        ('backend = "onnx"\n[stage.executor]\ntime_scale = 2', "time_scale: unknown setting")):
        conf.write_text(text + "\n")
        with pytest.raises(ConfigError, match=words):
            load_config(conf)
    conf.write_text('[stage.vae]\nbackend = "onnx"\nvae_pack = "p"\ntime_scale = 2\n')
    with pytest.raises(ConfigError, match="stage.vae.time_scale: unknown setting"):
        load_config(conf)


@pytest.mark.parametrize("program,table,words", [
    ("executor", "[stage.executor]\npolicy = 'fastest'", "stage.executor.policy: policy 'fastest': unknown term"),
    ("scheduler", "[stage.scheduler]\nbranch_timeout = 5", "stage.scheduler.branch_timeout: unknown setting"),
    ("vae", "[stage.vae]\ntile_max = 100000", "stage.vae.tile_max: 100000 is out of range"),
    ("encoder", "[stage.encoder]\nthreads = 'all'", "stage.encoder.threads: expected integer"),
    ("orchestrator", "[stage.orchestrator]\nstage_retries = -1", "stage.orchestrator.stage_retries: -1 is out"),
    # a policy the backend cannot run is known only once the logic has the backend class; it, and an unknown backend,
    # must still be exit 2 (a bad config) and not a crash that supervisord restarts; 'rknn-sim' is a name
    ("executor", "backend = 'rknn-sim'\n[stage.executor]\npolicy = 'dual_core'",
     "stage.executor.policy: policy 'dual_core': backend 'rknn-sim' cannot run two contexts"),
    ("executor", "backend = 'tpu'", "backend: 'tpu' is not one of board-sim, onnx, rknn, rknn-sim"),
])
def test_real_programs_exit_2_naming_file_and_key_on_a_bad_stage_setting(tmp_path, program, table, words):
    """Every [stage.*] key is checked when the config is read: exit 2 (supervisord leaves the program down) with one
    line naming the file and key (not an exit 1 from the logic, which supervisord would restart)."""
    conf = tmp_path / "pipeline.toml"
    conf.write_text(f'run_dir = "{tmp_path}"\n{table}\n')
    cmd = ([sys.executable, "-m", "orchestrator.terminal.cli", "--run", str(tmp_path), "serve", "--config", str(conf)]
           if program == "orchestrator" else [sys.executable, "-m", f"stages.{program}", "--config", str(conf)])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert words in out.stderr and str(conf) in out.stderr and "Traceback" not in out.stderr, out.stderr
