"""The job daemon under a real supervisord (stage logics: the doubles of tests/orch_doubles.py), hardened: output
delivery never follows a planted link and keeps an existing file unless the job says overwrite (the image always
stays in the job folder); `orchestrator prune` removes finished jobs only, through the daemon."""
import json
import time

import zmq

from orchestrator.terminal import cli
from protocol import messages as m
from tests.fuzzing import request_once, submit_frames
from tests.test_orchestrator_flow import _pipeline, _prompt, _status, _wait_state, pipeline  # noqa: F401 - fixtures


def _submit(rf, tmp_path, capsys, **kw) -> str:
    capsys.readouterr()
    rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, **kw))])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out.strip()


def test_delivery_never_follows_a_planted_link(pipeline, tmp_path, capsys):
    """A symlink planted at `<dest>.tmp` must not make the copy overwrite the link's target."""
    rf, sup = pipeline
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    for name in ("y.png.tmp", ".y.png.tmp", "y.png.new"):
        (out / name).symlink_to(victim)
    job = _submit(rf, tmp_path, capsys, output=str(out / "y.png"))
    info = _wait_state(rf, job, capsys, ("done", "failed"))
    assert info["state"] == "done", info
    dest = out / "y.png"
    assert victim.read_text() == "not yours"
    assert not dest.is_symlink() and dest.read_bytes() == (rf.jobs / job / "image.png").read_bytes()
    assert info["image"] == str(dest)
    assert sorted(p.name for p in out.iterdir()) == [".y.png.tmp", "y.png", "y.png.new", "y.png.tmp"]


def test_an_existing_output_is_kept_unless_the_job_says_overwrite(pipeline, tmp_path, capsys):
    """An existing destination was overwritten silently. It is refused at submit (test_prompt_spec); one that appears
    while the job runs is kept at delivery, and the job says where its image is (its own folder)."""
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.3")
    dest = tmp_path / "z.png"
    job = _submit(rf, tmp_path, capsys, output=str(dest), steps=6)
    _wait_state(rf, job, capsys, ("denoising",))
    dest.write_bytes(b"someone else's picture")                 # appears after submit, before delivery
    info = _wait_state(rf, job, capsys, ("done", "failed"), timeout_s=90)
    assert info["state"] == "done", info
    assert dest.read_bytes() == b"someone else's picture"
    kept = rf.jobs / job / "image.png"
    assert info["image"] == str(kept) and kept.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((rf.jobs / job / "report.json").read_text())
    assert report["delivery"]["written"] is False and str(kept) in report["delivery"]["note"]
    history = json.loads((rf.jobs / job / "job.json").read_text())["history"]
    assert "exists" in history[-1][2] and history[-1][0] == "done"
    # with overwrite the same destination is replaced (and a link there is replaced, never written through)
    (rf.root / "double_step_s").write_text("0.02")
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep me")
    dest.unlink()
    dest.symlink_to(victim)
    job2 = _submit(rf, tmp_path, capsys, output=str(dest), overwrite=True)
    info2 = _wait_state(rf, job2, capsys, ("done", "failed"))
    assert info2["state"] == "done" and info2["image"] == str(dest), info2
    assert not dest.is_symlink() and dest.read_bytes() == (rf.jobs / job2 / "image.png").read_bytes()
    assert victim.read_bytes() == b"keep me"


def test_prune_removes_finished_jobs_only(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.02")
    finished = [_submit(rf, tmp_path, capsys) for _ in range(3)]
    for job in finished:
        assert _wait_state(rf, job, capsys, ("done",))["state"] == "done"
    (rf.root / "double_step_s").write_text("0.5")
    running = _submit(rf, tmp_path, capsys, steps=8)
    queued = _submit(rf, tmp_path, capsys, steps=2)
    _wait_state(rf, running, capsys, ("denoising",))
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "prune", "--keep", "0"]) == 0
    out = capsys.readouterr().out
    for job in finished:
        assert f"removed {job}  done" in out and not (rf.jobs / job).exists()
        assert _status(rf, job, capsys) is None                  # the daemon forgot it too
    assert running not in out and queued not in out
    assert (rf.jobs / running / "job.json").exists() and (rf.jobs / queued / "job.json").exists()
    assert _wait_state(rf, running, capsys, ("done",), timeout_s=90)["state"] == "done"
    (rf.root / "double_step_s").write_text("0.02")
    assert _wait_state(rf, queued, capsys, ("done",), timeout_s=90)["state"] == "done"
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "prune", "--older-than", "1d"]) == 0
    assert "0 finished job(s) removed" in capsys.readouterr().err
    time.sleep(1.1)
    assert cli.main(["--run", str(rf.root), "prune", "--older-than", "1s"]) == 0
    out = capsys.readouterr().out
    assert f"removed {running}" in out and f"removed {queued}" in out
    for args, msg in ((["prune"], "needs --keep N or --older-than"), (["prune", "--older-than", "7 days"],
                                                                       "not an age"),
                      (["prune", "--keep", "-1"], "must be 0 or more")):
        assert cli.main(["--run", str(rf.root), *args]) == 2
        assert msg in capsys.readouterr().err


def test_bad_submits_to_an_idle_daemon_get_field_errors_and_it_stays_up(pipeline, tmp_path, capsys):
    """With no job running, a 5,000-digit seed is a field error and the daemon stays up (the same process)."""
    rf, sup = pipeline
    pid = sup.info("orchestrator").pid
    client = cli.DaemonClient(rf)
    try:
        for field, text in (("prompt.seed", '{"prompt": "a", "seed": ' + "1" * 5000 + "}"),
                            ("output", json.dumps({"prompt": "a", "output": "/tmp/" + "n" * 256})),
                            ("prompt", '{"prompt": "a", "negative_prompt": "\\udfff"}')):
            reply = request_once(zmq.Context.instance(), rf.daemon_endpoint, submit_frames(text, str(tmp_path)))
            assert isinstance(reply, m.Error) and reply.code == "bad_request" and reply.field == field, reply
        assert isinstance(client.client.request(m.Status(job=None)), m.Jobs)
    finally:
        client.close()
    assert sup.info("orchestrator").pid == pid
    job = _submit(rf, tmp_path, capsys)
    assert _wait_state(rf, job, capsys, ("done", "failed"))["state"] == "done"


def test_a_wrong_typed_job_record_is_set_aside_and_the_daemon_serves(pipeline, tmp_path, capsys):
    """Valid JSON with `"created": "yesterday"` stopped the daemon at every start (TypeError in recover: a restart
    loop, 503 at the front, the queue stalled). It is set aside: logged, left on disk, named by `orchestrator
    status`; the daemon keeps its pid and runs the next job."""
    import shutil
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.02")
    victim = _submit(rf, tmp_path, capsys)
    assert _wait_state(rf, victim, capsys, ("done",))["state"] == "done"
    path = rf.jobs / victim / "job.json"
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "created": "yesterday"}))
    # and a queued job whose spec its flow refuses: it was the daemon's next job, and the daemon died running it
    queued = victim[:-6] + "0bad00"
    (rf.jobs / queued).mkdir(mode=0o700)
    (rf.jobs / queued / "job.json").write_text(json.dumps({**rec, "id": queued, "state": "queued", "image": None,
                                                          "spec": {**rec["spec"], "steps": 0}}))
    try:
        sup.restart("orchestrator")
        pid = sup.info("orchestrator").pid
        job = _submit(rf, tmp_path, capsys)
        assert _wait_state(rf, job, capsys, ("done",))["state"] == "done"
        capsys.readouterr()
        assert cli.main(["--run", str(rf.root), "status"]) == 0
        lines = capsys.readouterr().out.splitlines()
        line = next(ln for ln in lines if ln.startswith(victim))
        assert "unreadable" in line and str(path) in line and "created" in line, line
        line = next(ln for ln in lines if ln.startswith(queued))
        assert "unreadable" in line and "spec.steps: must be in 1..200, got 0" in line, line
        assert sup.info("orchestrator").pid == pid and path.exists() and (rf.jobs / queued / "job.json").exists()
    finally:
        shutil.rmtree(rf.jobs / victim)
        shutil.rmtree(rf.jobs / queued)
        sup.restart("orchestrator")


def test_prune_counts_every_removed_job(inproc_daemon, tmp_path, capsys):
    """3,000 jobs removed were reported as "256 finished job(s) removed" (the reply lists at most 256). The daemon
    removes a batch per request and says `more`; the CLI asks again and counts them all (the daemon in this process:
    its store and prune are the served ones; no job needs to run)."""
    from tests.inproc import InprocClient
    rf = inproc_daemon.daemon.rf
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path))], connect=inproc_daemon.connect) == 0
    first = capsys.readouterr().out.strip()
    inproc_daemon.shut()
    rec = {**json.loads((rf.jobs / first / "job.json").read_text()), "state": "done"}
    (rf.jobs / first / "job.json").write_text(json.dumps(rec))
    n, t0 = 3000, rec["created"] - 4000.0
    for i in range(n):                                   # finished jobs as the daemon leaves them, older than `first`
        job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t0 + i)) + f"-{i:06x}"
        (rf.jobs / job_id).mkdir(mode=0o700)
        (rf.jobs / job_id / "job.json").write_text(json.dumps({**rec, "id": job_id, "created": t0 + i,
                                                               "updated": t0 + i}))
    before = {p.name for p in rf.jobs.iterdir()}
    with InprocClient.open(rf) as client:             # a daemon started on that folder, as after a restart
        assert cli.main(["--run", str(rf.root), "prune", "--keep", "1"], connect=client.connect) == 0
    out = capsys.readouterr()
    removed = [ln.split()[1] for ln in out.out.splitlines() if ln.startswith("removed ")]
    gone = before - {p.name for p in rf.jobs.iterdir()}
    assert len(removed) == len(set(removed)) == len(gone) == n and set(removed) == gone
    assert f"{n} finished job(s) removed" in out.err, out.err
    assert first not in gone


def test_restart_a_stage_and_follow_a_log(pipeline, tmp_path, capsys):
    """`orchestrator restart executor` gives a new executor process that serves the next job; `logs orchestrator -f`
    shows the log's end, then what the daemon writes after (a job queued), and Ctrl-C ends it with exit 0."""
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path
    rf, sup = pipeline
    old = sup.info("executor").pid
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "restart", "executor"]) == 0
    new = sup.info("executor")
    assert capsys.readouterr().out.strip() == f"executor RUNNING pid {new.pid}" and new.pid not in (0, old)
    job = _submit(rf, tmp_path, capsys)
    assert _wait_state(rf, job, capsys, ("done",))["state"] == "done"
    assert sup.info("executor").pid == new.pid                  # it served the job: no further restart
    follow = subprocess.Popen([str(Path(sys.executable).with_name("orchestrator")), "--run", str(rf.root), "logs",
                               "orchestrator", "-f", "--bytes", "2000"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(f"job {job} -> done" in ln for ln in lines):   # the end of the log first
            assert time.monotonic() < deadline and follow.poll() is None, lines[-5:]
            time.sleep(0.05)
        later = _submit(rf, tmp_path, capsys)
        while not any(f"job {later} queued" in ln for ln in lines):   # then what comes after
            assert time.monotonic() < deadline and follow.poll() is None, lines[-5:]
            time.sleep(0.05)
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0, follow.stderr.read()
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert _wait_state(rf, later, capsys, ("done",))["state"] == "done"
