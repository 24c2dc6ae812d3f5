"""Scheduler and executor as real processes (ZeroMQ + shared memory) vs the in-process denoise: bitwise equal."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from models.sampling.denoise import denoise, make_sampler, start_or_resume
from models.sampling.spectrum import SpectrumSettings
from models.packs.pack import load_pack
from protocol import messages as m
from protocol.arena import Arena, list_segments, reap, run_prefix, segment_name
from protocol.sockets import EventPull, LazyPirate
from stages.config import load_config
from tests.pipeline_harness import reference_runner
from tests.signals import signal_group

ROOT = Path(__file__).resolve().parents[1]
THREADS = 1


@pytest.fixture(scope="module")
def pack128(pipeline_assets):
    """The session's 128x128 FP16 pack of the tiny DiT (the pack build_pack makes from tiny_dit, built once per run)."""
    return pipeline_assets[1]


def _start(stage: str, cfg: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{stage}", "--config", str(cfg)], cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _hello(ctx, endpoint: str, timeout_s: float = 60.0) -> m.Ready:
    deadline = time.monotonic() + timeout_s
    while True:
        with LazyPirate(ctx, endpoint, timeout_s=2.0, retries=0) as link:
            try:
                return m.expect(link.request(m.Hello(peer="test", pid=os.getpid(), version="t")), m.Ready)
            except Exception:
                if time.monotonic() > deadline:
                    raise


@contextlib.contextmanager
def _stages(pack128, policy: str, logs: Path):
    """Run folder + config + executor and scheduler processes; yields (config, ctx, procs, logs); kills them after."""
    run = Path(f"/tmp/anima-sp-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    (run / "sock").mkdir(parents=True)
    cfg = run / "pipeline.toml"
    cfg.write_text(f'run_dir = "{run}"\npack_dir = "{pack128}"\nthreads = {THREADS}\n'
                   f'[timeouts]\nrequest_s = 30.0\nretries = 5\n[stage.executor]\npolicy = "{policy}"\n')
    config = load_config(cfg)
    ctx = zmq.Context()
    procs = {s: _start(s, cfg, logs / f"{s}.log") for s in ("executor", "scheduler")}
    try:
        ready = {s: _hello(ctx, config.endpoint(s)) for s in procs}
        assert ready["executor"].info["policy"] == policy
        yield config, ctx, procs, logs
    finally:
        for p in procs.values():
            if p.poll() is None:
                signal_group(p.pid)
            p.wait(10)
        ctx.destroy(linger=0)
        reap(run_prefix(run), keep=set())                       # a test killed mid-job must not leak its arena
        for f in (run / "sock").iterdir():
            f.unlink()
        (run / "sock").rmdir()
        shutil.rmtree(run / "stages", ignore_errors=True)     # each stage's record of its config (RUN/stages/)
        for f in run.glob("pipeline*.toml"):                   # and a test's own variant of it
            f.unlink()
        run.rmdir()


@pytest.fixture
def pipeline(tmp_path, pack128):
    """_stages (on-demand) for one test."""
    with _stages(pack128, "on-demand", tmp_path) as stages:
        yield stages


@pytest.fixture(scope="module")
def shared(pack128, tmp_path_factory):
    """_stages (on-demand) for the tests of this module that run jobs one after another on the same two processes,
    as the orchestrator does (a stage serves job after job): two process starts for the module, not two per test.
    A test that kills a stage starts its successor here (procs), as supervisord would."""
    with _stages(pack128, "on-demand", tmp_path_factory.mktemp("sp-logs")) as stages:
        yield stages


def _contexts(pack):
    rng = np.random.default_rng(7)
    shape = (pack.geometry.text_tokens, pack.config.context_dim)
    cond = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    uncond = np.zeros(shape, np.float32)
    uncond[:3] = rng.standard_normal((3, shape[1])).astype(np.float32) * 0.5
    return cond, uncond


def _arena_size(pack) -> int:
    g, c = pack.geometry, pack.config
    L, D, S, Dc = g.tokens, c.width, g.text_tokens, c.context_dim
    size = 2 * S * Dc * 4 + c.latent_channels * g.latent_h * g.latent_w * 4 + (4 * L * D + 2 * S * Dc + L * c.head_dim) * 4
    return size + 2**20


def _denoise_msg(config, pack, arena, job_dir: Path, job: str, spectrum: bool, steps: int, cond, uncond):
    """The orchestrator's part: contexts and latent slots in `arena`, the DENOISE naming them. -> (msg, latent slot)."""
    job_dir.mkdir(parents=True, exist_ok=True)                  # the orchestrator makes the job folder
    g, c = pack.geometry, pack.config
    dc, du = arena.alloc("cond", "f32", cond.shape), arena.alloc("uncond", "f32", uncond.shape)
    arena.write(dc, cond)
    arena.write(du, uncond)
    dl = arena.alloc("latent", "f32", (c.latent_channels, g.latent_h, g.latent_w))
    start = -(-arena.slots.cursor // 64) * 64
    params = m.DenoiseParams(seed=42, steps=steps, cfg=4.0, width=g.width, height=g.height,
                             spectrum=m.SpectrumSettings(enabled=spectrum))
    msg = m.Denoise(job=job, job_dir=str(job_dir), pack_dir=str(pack.dir), arena=arena.name, params=params,
                    cond=dc, uncond=du, latent=dl, scratch=m.Region(offset=start, nbytes=arena.size - start),
                    executor=config.endpoint("executor"))
    return msg, dl


def _run_job(config, ctx, pack, job_dir: Path, job: str, spectrum: bool, steps: int, kill=None, contexts=None,
             expect=m.Denoised):
    """Act as the orchestrator: arena, contexts (changed by `contexts(cond, uncond)` when given), DENOISE; `kill(procs)`
    may run mid-job. -> (latent, the reply: `expect`, cond, uncond)."""
    cond, uncond = _contexts(pack)
    if contexts is not None:
        cond, uncond = contexts(cond, uncond)
    with Arena.create(segment_name(config.run_dir, job), _arena_size(pack)) as arena:
        msg, dl = _denoise_msg(config, pack, arena, job_dir, job, spectrum, steps, cond, uncond)
        with LazyPirate(ctx, config.endpoint("scheduler"), timeout_s=300.0, retries=3) as link:
            if kill is not None:
                kill()
            reply = link.request(msg)
            assert isinstance(reply, expect), reply
        return arena.read(dl), reply, cond, uncond


_REFERENCES: dict = {}       # (spectrum, steps, contexts' digest) -> in-process result: the module's jobs repeat one


def _in_process(pack, cond, uncond, spectrum: bool, steps: int):
    """The in-process denoise of the same job (a DiTRunner, same pack, seed and threads), computed once per job here."""
    key = (spectrum, steps, hashlib.sha256(cond.tobytes() + uncond.tobytes()).hexdigest())
    if key not in _REFERENCES:
        runner = reference_runner(pack, threads=THREADS)
        sampler = make_sampler(steps, 4.0, "sgm_uniform", SpectrumSettings(enabled=spectrum))
        g, c = pack.geometry, pack.config
        state = start_or_resume(sampler, 42, (c.latent_channels, g.latent_h, g.latent_w))
        try:
            _REFERENCES[key] = denoise(runner, sampler, state, cond, uncond)
        finally:
            runner.close()
    return _REFERENCES[key]


@pytest.mark.parametrize("spectrum,steps", [(True, 6), (False, 2)])
def test_pipeline_latent_equals_in_process(shared, pack128, tmp_path, spectrum, steps):
    config, ctx, procs, logs = shared
    pack = load_pack(pack128)
    latent, reply, cond, uncond = _run_job(config, ctx, pack, tmp_path / "job", f"jobA{steps}", spectrum, steps)
    ref = _in_process(pack, cond, uncond, spectrum, steps)
    assert ref.forecast or not spectrum                         # 6 steps with Spectrum: step 5 is forecast
    assert list(reply.computed_steps) == ref.computed
    assert list(reply.forecast_steps) == ref.forecast
    assert reply.branch_calls == 3 * pack.config.blocks * len(ref.computed)
    assert all(b.calls == pack.config.blocks * len(ref.computed) for b in reply.branches.values())
    np.testing.assert_array_equal(latent, ref.latent)           # bitwise: same host ops, same ORT graphs/threads
    assert (tmp_path / "job" / "sampler_state.safetensors").exists()
    assert not list_segments(run_prefix(config.run_dir))


def _progress_of(msg, job: str) -> bool:
    return isinstance(msg, m.Progress) and msg.job == job


def test_executor_restart_mid_job_gives_same_latent(shared, pack128, tmp_path):
    """SIGKILL the executor while the job runs; a new one comes up (as supervisord would start it); same latent.

    Whether the scheduler counts a resend depends on where the kill lands (a call in flight is resent; a request sent
    after the death waits in ZeroMQ's queue for the new executor), so the test checks the kill came before the reply
    (the job really crossed the restart), not the resend count."""
    config, ctx, procs, logs = shared
    pack = load_pack(pack128)

    events = EventPull(ctx, config.endpoint("events"))     # the scheduler's PROGRESS: one per branch call done
    killed_at = []

    def kill_later():
        import threading

        def go():
            deadline = time.monotonic() + 120
            # the job is under way: 167 of 168 calls to go (the shared scheduler's events of the module's earlier
            # jobs, queued while nothing listened, come first)
            while not _progress_of(events.recv(1.0), "jobB"):
                assert time.monotonic() < deadline, "no PROGRESS from the scheduler"
            signal_group(procs["executor"].pid)
            killed_at.append(time.monotonic())
            procs["executor"].wait(10)
            procs["executor"] = _start("executor", config.path, logs / "executor2.log")
        threading.Thread(target=go, daemon=True).start()

    try:
        latent, reply, cond, uncond = _run_job(config, ctx, pack, tmp_path / "job", "jobB", False, 2,
                                               kill=kill_later)
        replied_at = time.monotonic()
    finally:
        events.close()
    ref = _in_process(pack, cond, uncond, False, 2)
    assert killed_at and killed_at[0] < replied_at, "the job ended before the executor was killed"
    np.testing.assert_array_equal(latent, ref.latent)


def test_a_non_finite_context_is_an_error_reply_and_the_scheduler_serves_on(shared, pack128, tmp_path):
    """A context with Inf (the encoder's float32 cast of a weight like 1e39) made the scheduler raise and exit 1; the
    flow took it for a stage death and retried 4 times. It is an ERROR reply naming the context; the same process then
    runs the next job."""
    config, ctx, procs, logs = shared
    pack = load_pack(pack128)
    pid = procs["scheduler"].pid
    for field in ("cond", "uncond"):
        def poison(c, u, field=field):
            (c if field == "cond" else u)[5, 7] = np.inf
            return c, u
        reply = _run_job(config, ctx, pack, tmp_path / f"bad-{field}", f"bad{field}", False, 2, contexts=poison,
                         expect=m.Error)[1]
        assert reply.code == "failed" and reply.field == field and not reply.retry, reply
        assert "NaN/Inf" in reply.message and procs["scheduler"].poll() is None
    latent, reply, cond, uncond = _run_job(config, ctx, pack, tmp_path / "job", "jobOK", False, 2)
    np.testing.assert_array_equal(latent, _in_process(pack, cond, uncond, False, 2).latent)
    assert procs["scheduler"].pid == pid and procs["scheduler"].poll() is None


def test_prefetch_policy_gives_the_same_latent(shared, pack128, tmp_path):
    """The executor loads the next branch while the current one runs; results stay bitwise identical. The shared
    executor is replaced by one started on the config with `policy = "prefetch"` (as an edit of pipeline.toml and a
    restart of the executor would); the scheduler goes on as it is."""
    config, ctx, procs, logs = shared
    cfg = config.path.with_name("pipeline-prefetch.toml")
    cfg.write_text(config.path.read_text().replace('policy = "on-demand"', 'policy = "prefetch"'))
    signal_group(procs["executor"].pid)
    procs["executor"].wait(10)
    procs["executor"] = _start("executor", cfg, logs / "executor-prefetch.log")
    assert _hello(ctx, config.endpoint("executor")).info["policy"] == "prefetch"
    pack = load_pack(pack128)
    latent, reply, cond, uncond = _run_job(config, ctx, pack, tmp_path / "job", "jobC", False, 2)
    ref = _in_process(pack, cond, uncond, False, 2)
    assert reply.branch_calls == 3 * pack.config.blocks * 2
    np.testing.assert_array_equal(latent, ref.latent)


def test_the_scheduler_answers_heartbeats_and_stops_while_it_waits_for_the_executor(shared, pack128, tmp_path):
    """A DENOISE starts with a HELLO to the executor. With the executor down, that wait (request_s per attempt, here
    30 s x 6) answered no heartbeat (the orchestrator saw the scheduler silent, then a flood of late PONGs) and no
    SIGTERM. Now the scheduler answers while it waits, and stops when told. Last in the module: it ends the shared
    stages."""
    config, ctx, procs, _ = shared
    pack = load_pack(pack128)
    signal_group(procs["executor"].pid)
    procs["executor"].wait(10)
    with Arena.create(segment_name(config.run_dir, "jobH"), _arena_size(pack)) as arena:
        msg, _ = _denoise_msg(config, pack, arena, tmp_path / "job", "jobH", False, 2, *_contexts(pack))
        with LazyPirate(ctx, config.endpoint("scheduler"), timeout_s=60.0, retries=0) as link:
            link.send(msg)
            time.sleep(1.0)                                     # the scheduler is in its HELLO to the executor
            with LazyPirate(ctx, config.endpoint("scheduler"), timeout_s=3.0, retries=1) as hb:
                pong = m.expect(hb.request(m.Heartbeat(peer="test")), m.Pong, "scheduler")
            assert pong.busy and pong.job == "jobH", pong
            t0 = time.monotonic()
            procs["scheduler"].send_signal(signal.SIGTERM)
            procs["scheduler"].wait(timeout=30)
            assert time.monotonic() - t0 < 10
