"""Crash survival on the real pipeline (tests/pipeline_harness.py): bench/chaos.py's trials at CI size (one SIGKILL
of each per-job stage (encoder, VAE) at a seeded random moment of a 2-step tiny txt2img job, and one in each other job
kind (img2img, latent and pixel hires, batch) of the stage whose recovery is that kind's own: done, every latent and
image bitwise as undisturbed, no segment, no orphan); a job that fails after bounded retries names the stage and last
error and finishes after `orchestrator resume JOB` with the same latent; the run folder and its sockets are private."""
from __future__ import annotations

import contextlib
import io
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos import Chaos, summary_line  # noqa: E402
from bench.chaos_jobs import hires_size  # noqa: E402
from models.sampling.denoise import STATE_FILE  # noqa: E402
from orchestrator.terminal import cli  # noqa: E402
from tests.pipeline_harness import Pipeline, board_stage_toml, tiny_assets  # noqa: E402

pytestmark = pytest.mark.slow

# 2 steps (both computed): a scheduler killed in step 2 resumes from the state of step 1
CI_PROMPT = {"prompt": "1girl, chaos", "negative_prompt": "lowres", "seed": 77, "steps": 2, "cfg": 4.0}
CI_SEED = 6                  # base seed of the kill moments (bench/chaos.py --seed)
JOB_TIMEOUT_S = 900.0
# a killed executor is seen by heartbeats and resent to at once; only a silent one is waited for this long (a tiny
# branch takes milliseconds, an ONNX executor's restart a second or two)
BRANCH_TIMEOUT_S = 10.0
REQUEST_S = 2.0              # [timeouts] request_s: a restarted stage answers HELLO within a second or two
# the other job kinds, one trial each (CI time), at the stage whose recovery is that kind's own: the VAE encoding the
# init image, a scheduler in the second pass's DENOISE, the orchestrator across the pixel path's decode/encode, an
# executor in a batch. The split kind (chained samplers) is bench/chaos.py's: its kills inside and between the two
# windows are tests/test_hires_flow.py's, its real-stage result tests/test_img2img_pipeline.py's
KIND_STAGES = {"img2img": "vae", "hires_latent": "scheduler", "hires_pixel": "orchestrator", "batch": "executor"}


@pytest.fixture(scope="module")
def pipe(pipeline_assets):
    models, pack = pipeline_assets
    hires_pack = tiny_assets(pack.parent, hires_size())[1]         # the hires kinds' second pass (160x160)
    # the board's ONNX encoder; the torch VAE, which encodes too (img2img, the pixel hires path; the board bundle has
    # no VAE encoder pack)
    stages = board_stage_toml(models, pack.parent, stages=("encoder",))
    # one restart per job is all a trial needs (one kill each); the bounded-retries test then gives up after two
    # attempts instead of four: the first waits out the scheduler's resends to a silent executor (BRANCH_TIMEOUT_S),
    # the second its HELLO to the executor (4 x REQUEST_S)
    p = Pipeline.start(models, pack, threads=1, stage_retries=1, branch_timeout_s=BRANCH_TIMEOUT_S,
                       request_s=REQUEST_S, extra_toml=stages, packs=(hires_pack,))
    try:
        yield p
    finally:
        p.stop_clean()


@pytest.fixture(scope="module")
def chaos(pipe):
    c = Chaos(pipe, seed=CI_SEED, prompt=CI_PROMPT)
    c.baseline()
    return c


def test_run_folder_and_sockets_are_private(pipe):
    rf = pipe.rf
    for d in (rf.root, rf.root / "sock", rf.logs, rf.jobs):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    want = {"supervisor.sock", "orchestrator.sock", "scheduler.sock", "executor.sock"}
    deadline = time.monotonic() + 120        # the stages bind after their imports: RUNNING in supervisord is earlier
    while True:
        socks = [rf.supervisor_sock] + sorted((rf.root / "sock").iterdir())
        if {s.name for s in socks} >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s.name for s in socks} >= want
    for s in socks:
        st = s.stat()
        assert stat.S_ISSOCK(st.st_mode), s
        assert stat.S_IMODE(st.st_mode) == 0o700, (s, oct(st.st_mode))


# txt2img's own trials: the programs started per job, at a drawn moment of their life (start-up included). The
# always-on ones (scheduler, executor, orchestrator) are killed mid-txt2img-job by
# tests/test_e2e_pipeline.py::test_every_program_sigkilled_once_mid_job (scheduler and executor at branch calls of
# the denoise, the orchestrator mid-denoise: done, the latent bitwise the in-process one, no segment, stray or child
# left) and at a drawn branch call / moment here in the other kinds (KIND_STAGES: the scheduler in hires_latent, the
# executor in batch, the orchestrator in hires_pixel; every result bitwise the undisturbed job's)
TXT2IMG_STAGES = ("encoder", "vae")


@pytest.mark.parametrize("stage", TXT2IMG_STAGES)
def test_sigkill_at_a_random_moment(chaos, stage):
    t = chaos.trial(stage, 0)
    print("\n" + t.line())
    assert t.killed_pid > 0 and t.moment, t
    assert t.survived, f"{t.line()}\n{chaos.pipe.logs()}"
    assert t.identical, "the final latent differs from the undisturbed run"
    assert t.shm_leaked == [] and t.orphans == [], t.line()
    assert summary_line([t]) == "survived=1/1 identical=1/1 shm_leaked=0 orphans=0"


@pytest.mark.parametrize("kind, stage", sorted(KIND_STAGES.items()))
def test_sigkill_in_every_job_kind(chaos, kind, stage):
    t = chaos.trial(stage, 0, kind)
    print("\n" + t.line())
    assert t.killed_pid > 0 and t.moment, t
    assert t.survived, f"{t.line()}\n{chaos.pipe.logs()}"
    assert t.identical, f"not bitwise the undisturbed {kind} job: {t.differs}"
    assert t.shm_leaked == [] and t.orphans == [], t.line()
    assert len(chaos.bases[kind].outputs) >= 2 + (kind == "batch") * 2 + kind.startswith("hires")


def _cli(pipe, *args) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli.main(["--run", str(pipe.root), *args])
    return rc, buf.getvalue()


def test_bounded_retries_then_resume(chaos):
    """The executor stays down: the scheduler gives up after its resends, the orchestrator after its retries; the
    job fails naming the stage and the last error, its folder keeps the step state, and `resume` finishes it."""
    pipe = chaos.pipe
    job = pipe.submit(CI_PROMPT)
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,
              pred=lambda i: i.progress is not None and i.progress.step >= 2)
    # over XML-RPC, not a supervisorctl process: under load its start-up alone could outlast the last step
    assert pipe.sup.stop("executor").state == "STOPPED"
    try:
        info = pipe.wait(job, ("failed", "done"), JOB_TIMEOUT_S)
        assert info.state == "failed", "the job finished without an executor?"
        assert info.error_stage == "scheduler", info
        assert "gave up after" in info.error and "executor" in info.error, info.error
        rc, out = _cli(pipe, "status", job)
        assert rc == 0 and "failed" in out and "executor" in out, out
        assert (pipe.job_dir(job) / STATE_FILE).exists() and (pipe.job_dir(job) / "cond.npy").exists()
        assert pipe.leftover_segments() == []
    finally:
        assert "started" in pipe.supervisorctl("start", "executor")
    rc, out = _cli(pipe, "resume", job)
    assert rc == 0, out
    info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    assert pipe.report(job)["resumed_from"] >= 1              # from the step state, not from scratch
    np.testing.assert_array_equal(np.load(pipe.job_dir(job) / "latent.npy"), chaos.base.latent)
    assert pipe.leftover_segments() == [] and pipe.strays() == [] and pipe.stage_children() == []
