"""The CLI a user meets first (issue 44, item 6), on the real supervisord, daemon and CLI with stand-in stages
(tests/doubles_harness.py): `generate --batch` prints every image's path, `status JOB` shows the job in detail and
reads the job folder when the daemon does not answer, and `orchestrator stop` then `start` at once succeeds (stop
waits until supervisord has exited and its socket is gone; `supervisorctl shutdown` returns before)."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.terminal import cli
from orchestrator.engine.daemon_probe import daemon_answers
from orchestrator.ops.run_control import supervisord_pid
from orchestrator.engine.supervisor import Supervisor
from tests.doubles_harness import Doubles
from tests.test_demo import SLOW_STOP, SLOW_STOP_S


@pytest.fixture(scope="module")
def d():
    """One pipeline of doubles for the module, with a program that takes SLOW_STOP_S to stop (a shutdown that lasts,
    as the real stages' do). Stopped by `orchestrator stop`: the last test leaves a supervisord `start` began."""
    root = Path(tempfile.mkdtemp(prefix="anima-cli-"))
    d = Doubles.start(root, extra_conf=SLOW_STOP)
    try:
        yield d
    finally:
        d.close_client()
        try:
            cli.main(["--run", str(d.rf.root), "stop"])
        finally:
            d.stop()
            shutil.rmtree(root, ignore_errors=True)


def run(d, *argv) -> int:
    return cli.main(["--run", str(d.rf.root), *argv])


def test_generate_batch_prints_every_image_path_the_first_first(d, tmp_path, capsys):
    assert run(d, "generate", "a girl", "--seed", "5", "--steps", "2", "--batch", "3", "-o", str(tmp_path)) == 0
    out, err = capsys.readouterr()
    job = err.split("job ", 1)[1].split()[0]
    want = [str(tmp_path / f"{job}.png"), str(tmp_path / f"{job}_1.png"), str(tmp_path / f"{job}_2.png")]
    assert out.splitlines() == want and all(Path(p).is_file() for p in want)
    report = json.loads((d.rf.jobs / job / "report.json").read_text())      # the paths the job delivered
    assert [i["image"] for i in report["images"]] == want
    assert run(d, "generate", "a girl", "--seed", "5", "--steps", "2", "--batch", "2", "--json") == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["image"] == obj["images"][0] and [Path(p).name for p in obj["images"]] == ["image.png", "image_1.png"]


def _status(d, job, capsys) -> tuple[list[str], str]:
    assert run(d, "status", job) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), err


def test_status_job_shows_its_detail_also_when_the_daemon_is_down(d, capsys):
    assert run(d, "generate", "1girl, silver hair", "--negative", "worst quality", "--seed", "9", "--steps", "3",
               "--cfg", "5", "--sampler", "euler_ancestral", "--scheduler", "karras", "--batch", "2") == 0
    job = capsys.readouterr().err.split("job ", 1)[1].split()[0]
    lines, err = _status(d, job, capsys)
    text = "\n".join(lines)
    jd = d.rf.jobs / job
    assert lines[0] == f"job {job}"
    for want in ("state:     done", "prompt:    1girl, silver hair", "negative:  worst quality",
                 "size:      64x64, batch 2",
                 "sampling:  3 steps, cfg 5.0, sampler euler_ancestral, scheduler karras, spectrum on",
                 "seed:      9", f"image 1:   {jd / 'image.png'}", f"image 2:   {jd / 'image_1.png'}",
                 f"report:    {jd / 'report.json'}"):
        assert f"  {want}" in lines, (want, text)
    timings = next(line for line in lines if line.startswith("  timings:"))
    assert "job " in timings and "denoising" in timings and timings.endswith("measured"), timings
    assert err == ""

    d.sup.stop("orchestrator")              # the daemon down, its job folders there
    try:
        offline, err = _status(d, job, capsys)
        assert "the orchestrator daemon does not answer" in err and str(jd) in err and "job.json" in err
        assert offline == lines              # the same detail, read from job.json and report.json
        assert run(d, "status", "20200101-000000-abcdef") == 1
        err = capsys.readouterr().err
        assert "not running" in err and "no job 20200101-000000-abcdef" in err and "Traceback" not in err
    finally:
        d.sup.start("orchestrator")
        deadline = time.monotonic() + 30
        while not daemon_answers(d.rf):
            assert time.monotonic() < deadline, d.logs()


def test_status_job_of_a_queued_job_read_from_its_folder(inproc_daemon, capsys):
    """No pipeline at all (the daemon in this process, no job runs): the folder is all there is."""
    rf = inproc_daemon.daemon.rf
    argv = ["--run", str(rf.root)]
    prompt = rf.root / "p.json"
    prompt.write_text(json.dumps({"prompt": "a cat", "seed": 3, "steps": 4}))
    assert cli.main([*argv, "submit", str(prompt)], connect=inproc_daemon.connect) == 0
    job = capsys.readouterr().out.strip()
    assert cli.main([*argv, "status", job], connect=inproc_daemon.connect) == 0
    live = capsys.readouterr().out.splitlines()
    assert "  state:     queued (0 ahead)" in live and "  prompt:    a cat" in live
    assert cli.main([*argv, "status", job]) == 0                  # over the socket: nobody listens
    out, err = capsys.readouterr()
    assert "does not answer" in err
    assert "  state:     queued (0 ahead)" in out.splitlines() and "  seed:      3" in out.splitlines()
    assert cli.main([*argv, "status", job, "--json"]) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert info["job"] == job and info["state"] == "queued" and json.loads(info["spec_json"])["prompt"] == "a cat"


def test_stop_then_start_at_once(d, capsys):
    """`orchestrator stop` returns once supervisord has exited (its pid gone, its socket removed), after the slow
    program's SLOW_STOP_S; `start` right after starts a new one and returns with the stages and the daemon up. A
    stop that outlasts --timeout says so (exit 1) and leaves the shutdown going; a stop again waits for it."""
    sup = Supervisor(d.rf.supervisor_sock)
    old = supervisord_pid(d.rf)
    assert old == sup._call("supervisor.getPID")
    t0 = time.monotonic()
    assert run(d, "stop", "--timeout", "1") == 1
    err = capsys.readouterr().err
    assert "orchestrator stop: error: supervisord" in err and "after 1 s" in err and "Traceback" not in err
    assert run(d, "stop") == 0
    assert "is shutting down: waiting for it to exit" in capsys.readouterr().out
    assert time.monotonic() - t0 >= SLOW_STOP_S - 0.5
    assert d.proc.poll() is not None and not d.rf.supervisor_sock.exists() and supervisord_pid(d.rf) is None
    assert run(d, "start") == 0                                    # at once
    out = capsys.readouterr().out
    assert "starting supervisord" in out
    for program in ("scheduler", "executor", "orchestrator", "http", "slowstop"):
        assert f"{program} RUNNING" in out, out
    new = sup._call("supervisor.getPID")
    assert new != old and supervisord_pid(d.rf) == new and daemon_answers(d.rf)
    assert run(d, "start") == 0 and "already running" in capsys.readouterr().out


def test_status_job_of_a_running_job_shows_its_progress(tmp_path, capsys):
    """A job the daemon is denoising: its detail carries the follow loop's progress line."""
    from orchestrator.engine.runfolder import init_run
    from protocol import messages as m
    spec = {"prompt": "a cat", "negative_prompt": "", "seed": 3, "steps": 10, "cfg": 4.0, "width": 64, "height": 64,
            "sampler": "euler", "scheduler": "simple", "spectrum": {"enabled": False}, "batch": 1}
    info = m.JobInfo(job="20260101-000000-abcdef", state="denoising", created=1.0, updated=2.0,
                     spec_json=json.dumps(spec), progress=m.Progress(job="20260101-000000-abcdef", step=3, steps=10, block=12, branch="cross",
                                         elapsed_s=20.0))

    class Daemon:
        def call(self, msg, expect):
            assert isinstance(msg, m.Status) and msg.detail and msg.job == info.job
            return m.Jobs(jobs=(info,))

        def close(self):
            pass
    rf = init_run(tmp_path / "run")
    assert cli.main(["--run", str(rf.root), "status", info.job], connect=lambda _rf: Daemon()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  state:     denoising" and lines[2].startswith("  progress:  [") and "step 3/10" in lines[2]
    assert "  sampling:  10 steps, cfg 4.0, sampler euler, scheduler simple, spectrum off" in lines
